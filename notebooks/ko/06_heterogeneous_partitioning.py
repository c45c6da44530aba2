# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 실습 06: 이기종 분할(heterogeneous partitioning): 레이아웃을 계획한 뒤 실행하기
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - A100 + A10 혼합 클러스터에서 GPT의 모든 텐서/파이프라인/데이터 분할(tensor/pipeline/data split),
#   마이크로배치(micro-batch), 노드 순서(node order), 불균등 레이어 분할(uneven layer partition)을
#   탐색하고([FASOP](https://github.com/AvatarHwang/FASOP)이 푸는 문제, Hwang et al., HPDC '24) 순위표(ranked table)를
#   읽습니다;
# - 클러스터 구성(cluster composition)에 따라 시간과 비용을 맞바꾸는 관계를 파레토 차트(Pareto chart)에서 따져 봅니다;
# - 선택한 레이아웃의 파이프라인 스케줄(pipeline schedule)을 그립니다;
# - 계획한 레이아웃을 에뮬레이션된 이기종 클러스터(heterogeneous cluster)에서 실행(launch)하고, 측정한 스텝을 추정치와
#   비교합니다.

# %% tags=["parameters"]
backend = "local"           # "slurm" launches on the (local) Slurm's emulated a100 + a10 nodes
cluster = "a100-a10-hetero"  # 1 node x 4 A100-40GB + 7 nodes x 4 A10, FASOP's mixed cluster
model = "gpt2-xl"
global_batch = 64
max_nodes = 3               # the Pareto sweep: 0..max_nodes nodes of each GPU type (FASOP's chart: 8)
launch_iterations = 6

# %%
from labkit.diagrams import show
from labkit.estimate import estimate
from labkit.estimate.views import compare_measured
from labkit.answer_key import check
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.logs.derive import steady_state
from labkit.messages import say
from labkit.plan.inputs import Constraints
from labkit.plan.pareto import sweep
from labkit.plan.search import search
from labkit.plan.views import pareto_figure, ranked_table, schedule_figure
from labkit.paths import runs_dir
from labkit.spec import load_spec

# %% [markdown]
# 먼저 FASOP의 질문입니다. GPT-2 XL에는 트랜스포머 레이어(transformer layer)가 48개 있습니다. 이를 스테이지(stage)
# 8개짜리 파이프라인에, 이 클러스터의 노드마다 스테이지 하나씩 올립니다: A100 노드 하나, A10 노드 일곱. 균등하게 나누면
# 스테이지마다 6개씩입니다. A100-40GB의 fp16 최대 성능(peak)은 312 TFLOP/s, A10은 125입니다. 어느 스테이지도 다른
# 스테이지를 기다리게 하지 않으려면 A100 스테이지가 레이어를 몇 개 맡아야 할까요? 6.1에서 탐색을 마친 뒤 답합니다.

# %% tags=["prediction"]
my_partition = {"layers on the A100 stage": ...}  # a number, 0 to 48

# %% [markdown]
# ## 6.1 탐색
#
# 플래너(planner)는 노드의 GPU 수까지의 텐서 크기, 그에 따라 남는 파이프라인 크기와 데이터 크기, 마이크로배치, 가상
# 스테이지(virtual stage), 재계산(recompute)과 분산 옵티마이저(distributed optimizer), 그리고 대칭인 것을 하나로 본 노드
# 순서를 열거합니다. 각 구성마다 스테이지별 레이어 분할을 정확히 구하고(속도가 서로 다른 스테이지들에 대한 min-max),
# `labkit.estimate`로 스텝의 비용을 매깁니다: 메모리에 들어가지 않는 구성은 버리지 않고 표시해 둡니다.

# %%
base = load_spec({"name": f"{model}-on-{cluster}", "model": {"preset": model}, "precision": "fp16",
                  "batch": {"micro": 1, "global": global_batch}, "cluster": cluster})
plan = search(base, top=10)
print(say("lab06.search_summary", evaluated=plan.configs_evaluated, pruned=plan.configs_pruned,
          seconds=plan.search_seconds))
ranked_table(plan, top=10)

# %% [markdown]
# FASOP의 Megatron-LM 스크립트는 `PARTITION="0-11-8-8-8-8-5-0"` (PP 8, DP 4)을 실행해 A10 32개에서 스텝당 1.4 s를
# 측정했습니다(로그의 20~50번째 반복에서 1.37~1.42 s이며, 10번째의 4.5 s는 아직 예열 중입니다). 위의 행들은
# 인터리브(interleaved) 방식(스테이지당 `vp`개의 모델 청크(chunk), 실습 07의 가상 스테이지(virtual stage))이라 분할이
# 균등하고, 상당수는 A100 노드가 파이프라인의 어디에 놓이는지만 다릅니다. FASOP의 질문은 평범한 파이프라인에 관한 것입니다: 노드당 하나씩 스테이지 8개, 인터리빙 없음. 이를 고정하고
# 같은 탐색을 해 봅니다:

# %%
one_per_node = search(base, constraints=Constraints(pipeline=8, virtual_stages=1, tensor=1), top=5)
matched = one_per_node.best
a100_stage = next(i for i, gpu in enumerate(matched.placement) if gpu.startswith("A100"))
print(say("lab06.stage_times", partition="-".join(map(str, matched.partition)), placement=" ".join(matched.placement),
          times=", ".join(f"{1e3 * t:.1f}" for t in matched.stage_times_s)))
prediction_table(my_partition, estimated={"layers on the A100 stage": matched.partition[a100_stage]}, measured={})

# %% [markdown]
# A100 스테이지는 어느 A10 스테이지보다도 많은 레이어를 맡습니다. 이 마이크로배치에서의 레이어당 속도(A10의 약 1.4배로,
# 최대 성능의 비보다 한참 낮습니다: 시퀀스를 한 번에 하나씩 처리하면 A100의 상당 부분이 놉니다)에 맞춘 것으로, 그 결과
# 모든 스테이지가 가장 느린 스테이지와 거의 같은 시간이 걸립니다.

# %% tags=["check-claim"]
assert matched.partition[a100_stage] > max(n for i, n in enumerate(matched.partition) if i != a100_stage), matched

# %% [markdown]
# **처음부터 구현하기.** FASOP의 분할기(partitioner)는 min-max 문제를 풉니다: 가장 느린 스테이지가 가능한 한 빨라지도록
# 각 스테이지의 레이어를 고릅니다. GPU마다 측정한 레이어당 순전파(forward) 시간(labkit에 함께 들어 있는 FASOP의
# 프로파일(profile))이 있으면, 한 스테이지의 순전파와 역전파(backward)에는 그 레이어들의 시간에 $1 + 2$를 곱한 만큼이
# 걸리고(역전파 비용은 순전파의 약 두 배), 첫 스테이지에는 임베딩(embedding)이, 마지막 스테이지에는 출력 레이어(output
# layer)가 더해집니다. 스테이지에 대한 동적 계획법(dynamic programming)으로 모든 $k$에 대해 처음 $k$개 레이어의 최적
# 분할을 구합니다:

# %%
from labkit.estimate.profiles import find_profile


def stage_s(profile, layers, first, last):
    forward = layers * profile.layers_s[0] + (profile.embedding_s if first else 0) + (profile.output_s if last else 0)
    return forward * (1 + profile.backward_factor)


def min_max_partition(profiles, layers):
    """(the slowest stage's seconds, layers per stage) over the stages' profiles, in pipeline order."""
    last = len(profiles) - 1
    best = {k: (stage_s(profiles[0], k, True, last == 0), [k]) for k in range(layers + 1)}
    for i, profile in enumerate(profiles[1:], start=1):
        best = {k: min((max(best[k - n][0], stage_s(profile, n, False, i == last)), best[k - n][1] + [n])
                       for n in range(k + 1))
                for k in range(layers + 1)}
    return best[layers]


profiles = {gpu: find_profile(model, gpu, 1) for gpu in set(matched.placement)}
slowest_s, mine = min_max_partition([profiles[gpu] for gpu in matched.placement], matched.spec.model.num_layers)
print(say("lab06.from_scratch", mine="-".join(map(str, mine)), mine_ms=1e3 * slowest_s,
          planner="-".join(map(str, matched.partition)), planner_ms=1e3 * max(matched.stage_times_s)))
assert mine[a100_stage] == matched.partition[a100_stage]
assert abs(slowest_s - max(matched.stage_times_s)) < 0.02 * slowest_s

# %% [markdown]
# 두 분할이 다른 곳에서는 둘이 동점입니다: 여러 분할의 가장 느린 스테이지 시간이 같고, 플래너는 스텝 전체의
# 추정치(스테이지 사이의 전송(send), 버블(bubble))로 동점을 가르는데, 처음부터 구현한 버전은 이 부분을 빼놓습니다.
#
# ## 6.2 시간이냐 비용이냐: 클러스터 구성에 대한 파레토 프런트(Pareto front)
#
# A100 노드와 A10 노드의 구성마다 가장 좋은 레이아웃의 스텝당 시간과 가격을 구합니다. 어떤 구성보다 더 빠르면서 더 싼
# 구성이 없을 때 그 구성은 **파레토 프런트(Pareto front)** 위에 있습니다. 프런트를 따라가면 시간을 아끼는 데 돈이 듭니다.

# %%
compositions = sweep(base, "A100-40GB", "A10", max_nodes=max_nodes)
pareto_figure(compositions).show()

# %%
compositions[compositions["pareto"]][["cluster", "estimated_s", "price_per_step", "tp", "dp", "pp", "mbs"]]

# %% [markdown]
# ## 6.3 선택한 레이아웃의 파이프라인
#
# (인터리브하지 않은) 파이프라인을 쓰는 최선의 레이아웃입니다: 마이크로배치 하나에 대한 각 스테이지의 순전파와 역전파를,
# 스테이지 사이의 전송과 함께 1F1B 순서로 보여 줍니다. 플래너가 이 행의 시간을 잴 때 쓴 바로 그 스케줄이므로, 마지막
# 막대는 이 행의 파이프라인 시간에서 끝납니다. 가장 느린 스테이지가 속도를 정하고, 양 끝에서 점점 늘고 주는 구간이
# 버블입니다. (일반적인 그림, 즉 1F1B와 인터리브 스케줄을 나란히 놓은 그림은 아래에 있습니다.)

# %%
pipelined = next(r for r in plan.rows if r.pp > 1 and r.virtual_stages == 1 and not r.oom)
print(say("lab06.best_pipelined", tp=pipelined.tp, dp=pipelined.dp, pp=pipelined.pp, mbs=pipelined.mbs,
          partition="-".join(map(str, pipelined.partition)), step_s=pipelined.estimated_s,
          pipeline_s=pipelined.pipeline_s))
schedule_figure(pipelined.pipeline,
                stage_labels=[f"stage {i} ({g})" for i, g in enumerate(pipelined.spec.stage_gpus)]).show()

# %%
show("pipeline_schedules")

# %% [markdown]
# ## 6.4 계획한 레이아웃을 실행하고 측정하기
#
# 진짜 GPT-2 XL에는 진짜 GPU가 필요합니다. 여기서 전체 흐름을 보기 위해, 같은 종류의 클러스터에서 떼어 낸 노드 2개(A100
# 노드 하나, A10 노드 하나, 각각 프로세스 하나)에 작은 GPT(폭 256인 레이어 4개, 토큰 256개)를 계획하고, 최선의 2단
# 파이프라인을 골라 실행합니다: `backend = "slurm"`이면 로컬 Slurm의 에뮬레이션된 a100, a10 노드에서, 그렇지 않으면 로컬
# 프로세스 두 개로 실행합니다. `Constraints`는 스펙(spec)이 고정하는 것(여기서는 파이프라인 스테이지 2개)은 그대로 두고
# 나머지를 탐색합니다. `labkit plan SPEC`이 스펙 파일에 적힌 필드로 하는 것과 같습니다.

# %% [markdown]
# 먼저 예상해 보세요: 아래 작은 모델의 2단 파이프라인은 이 머신의 CPU에서 프로세스 두 개로 실행됩니다. 반복(iteration)당
# 몇 초가 걸릴까요? 6.4의 끝에서 추정치, 측정치와 나란히 놓아 봅니다.

# %% tags=["prediction"]
my_prediction = {"pipeline here, s per iteration": ...}  # a number

# %%
small = load_spec({"name": "planned-small", "batch": {"micro": 1, "global": 8}, "recompute": "none",
                   "model": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 256,
                             "vocab_size": 1024},
                   "train": {"iters": launch_iterations, "log_interval": 1},
                   "cluster": {"nodes": [{"gpu": "A100-40GB", "count": 1, "gpus_per_node": 1},
                                         {"gpu": "A10", "count": 1, "gpus_per_node": 1}]}})
small_plan = search(small, constraints=Constraints(pipeline=2, virtual_stages=1))
# A stage without transformer layers would leave its GPU idle (the table's `idle GPUs`): launch a sound layout.
row = next(r for r in small_plan.rows if r.idle_gpus == 0 and not r.oom)
spec = load_spec(row.spec.to_dict())
print(say("lab06.launching", partition=spec.partition_string, gpus=spec.stage_gpus))
job = backend_named(backend).submit(spec)
state = job.wait(progress=False)
assert str(state) == "COMPLETED", job.cause()

# %% [markdown]
# 에뮬레이션된 노드는 CPU 프로세스로 학습하므로, 여기서 의미 있는 비교는 같은 레이아웃을 이 머신의 CPU에서 추정한 값과의
# 비교입니다. 카탈로그(catalog)의 CPU 속도는 임시로 넣어 둔 값(placeholder)이므로 먼저 측정합니다:
# `profile_model`(`labkit profile --model SPEC`이 실행하는 것)은 학습 때처럼 두 번째 프로세스를 옆에 둔 채 이 머신에서
# 모델 순전파의 레이어별 시간을 재고, 추정은 그 시간으로 파이프라인을 구성합니다. 실제 클러스터에서는
# `row.estimated_s`와 바로 비교하세요.

# %%
from labkit.plan.profiler import profile_model

_, cpu_profile = profile_model(spec, micro_batch=spec.batch.micro, precision=spec.precision, repeats=8,
                               path=runs_dir() / "profiles" / "planned-small_cpu_tp1.json")
measured = steady_state(job.result().iterations).iteration_ms / 1000
on_cpu = estimate(spec.replace(cluster={"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}),
                  profiles={("cpu", 1): cpu_profile})
print(say("lab06.layer_forward", source=on_cpu.stage_sources[0], ms=1000 * cpu_profile.layers_s[0]))
compare_measured(on_cpu.iteration_time_s, measured)

# %%
prediction_table(my_prediction, estimated={"pipeline here, s per iteration": on_cpu.iteration_time_s},
                 measured={"pipeline here, s per iteration": measured})

# %% tags=["check-claim"]
assert 0.4 < on_cpu.iteration_time_s / measured < 1.5, (on_cpu.iteration_time_s, measured)

# %% [markdown]
# 추정이 얼마나 맞는지는 머신이 그 밖에 무엇을 하고 있는지에 달려 있습니다: 레이어 프로파일과 실행은 서로 다른 시점에
# 측정되고, 다른 작업과 함께 쓰는 머신에서는 둘 중 어느 쪽이든 느려질 수 있습니다(바쁜 순간에 잰 프로파일이면 추정이
# 높게 나옵니다). CPU에서는 GPU의 비동기 실행이라면 가려졌을 레이어 바깥의 호스트 시간도 추정에 더합니다: 모델
# 청크(chunk)와 마이크로배치 하나마다 1.5 ms(절반은 순전파에, 절반은 역전파에), 스텝마다 7.5 ms이며, 이는
# `benchmarks/bench_host_overhead.py`가 잰 머신의 값입니다(다른 CPU는 호스트 코드를 그 CPU의 속도로 실행합니다).
# 레이어 하나가 15 ms이면 이는 스텝의 작은 몫이지만, `tiny` 프리셋(preset)의 2 ms짜리 레이어라면 대부분을 차지합니다.
# 다른 작업과 함께 쓰인 머신에서 `benchmarks/bench_plan_closed_loop.py`는 이 모델의 레이아웃 14개를 매번 프로파일을
# 다시 잰 뒤 세 번씩, 세 차례 실행했습니다: 추정은 중앙값으로 5~6%, 많아야 17% 빗나가며(대부분의 레이아웃은 여전히
# 낮게 나옵니다), 레이아웃을 측정과 대략 같은 순서로 줄 세웁니다(Spearman 순위 상관계수 0.88, 0.75, 0.61, 1이면 같은
# 순서이고 0이면 관계가 없습니다): 가장 느린 레이아웃은 가장 빠른 것보다 40% 오래 걸리고, 바쁜 머신에서는 한
# 레이아웃의 실행끼리도 최대 45% 차이 납니다. 위와 같이 바쁜 머신에서 한 번 실행한 결과는 크게 빗나갈 수 있습니다.
#
# 두 프로세스는 이 한 호스트에서 실행되므로 코어를 나누어 씁니다: 로컬 백엔드(backend)는 각 프로세스에 제
# 몫(`OMP_NUM_THREADS` = 코어 수 / 프로세스 수)을 주는데, Slurm 노드가 자기 코어를 그 노드의 프로세스들에 나누어 주는
# 것과 같습니다. 대신 각 프로세스에 코어를 전부
# 주면(`spec.replace(**{"job.env": {"OMP_NUM_THREADS": str(os.cpu_count())}})`) 두 프로세스의 스레드가 같은 코어를 두고
# 다투어, 스텝이 몇 배나 오래 걸립니다.

# %% [markdown]
# ## 연습 문제
#
# **연습 문제 1.** 6.1의 순위표에서 가장 빠른 레이아웃은 파이프라인 스테이지를 몇 개 사용합니까?

# %%
answer_1 = ...

# %%
check("06.1", answer_1, plan=plan)

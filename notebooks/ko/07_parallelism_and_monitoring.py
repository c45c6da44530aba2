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
# # 실습 07: 3D 병렬화(3D parallelism)와 모니터링: 세 가지 레이아웃, 각각의 로그, 한 번의 실패, 대시보드
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - 같은 모델과 배치(batch)를 두 노드(node)에 세 가지 방식, 곧 데이터 병렬화(data parallelism), 텐서 병렬화(tensor
#   parallelism), 파이프라인 병렬화(pipeline parallelism)로 나누고, 각 방식이 메모리, 시간, 통신에서 치르는 비용을 예측하기
# - 파이프라인의 1F1B 스케줄(schedule)과 그 버블(bubble)을 그리기
# - 작업(job)을 노드별 로그와 모니터(monitor, [FASOP의 Megatron-LM 스크립트](https://github.com/AvatarHwang/FASOP)의
#   `get_result.sh`)로 따라가며, 각 노드가 보고하는 자신의 레이아웃(layout)이 스펙(spec)과 일치하는지 확인하기
# - 프로파일러(profiler)에서 각 병렬 그룹(parallel group: tp, pp, dp)의 통신을 찾기
# - 일부러 실패하게 만든 작업으로, 작업이 왜 실패했는지 로그에서 알아내기
# - 실행 대시보드(run dashboard)에서 실행(run)과 보기(view)를 고르기

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
gpu = "cpu"              # the GPU of each node ("A100-80GB" on a cluster)
nodes = 2                # one GPU (process) per node: every layout below uses 2 ranks
iterations = 6
log_interval = 1
bad_data_path = "/nonexistent/corpus_text_document"  # the deliberately failing job trains on this

# %%
from labkit.diagrams import pipeline_schedule, show
from labkit.estimate import bubble_fraction, estimate
from labkit.estimate.compare import compare
from labkit.answer_key import check
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.report import format_report, report, widget
from labkit.jobs.sweep import Sweep, profiled
from labkit.messages import say
from labkit.paths import example, runs_dir
from labkit.jobs import dashboard
from labkit.logs.views import comparison_table, timer_breakdown_figure
from labkit.plan.views import schedule_figure
from labkit.profiling import trace
from labkit.profiling import views as profile_views
from labkit.spec import load_spec

# %% [markdown]
# ## 7.1 하나의 모델, 세 가지 레이아웃
#
# 랭크(rank)는 노드마다 하나씩 두 개이고, 글로벌 배치(global batch)는 8, 마이크로배치(micro-batch)는 2입니다.
# - **dp2** (데이터 병렬): 각 랭크가 모델 전체와 배치의 절반을 가집니다. 그래디언트(gradient)는 all-reduce로 합칩니다.
# - **tp2** (텐서 병렬): 각 랭크가 모든 가중치 행렬의 절반을 가집니다. 활성값(activation)은 모든 레이어(layer) 안에서
#   순전파(forward)에 두 번, 역전파(backward)에 두 번 all-reduce됩니다.
# - **pp2** (파이프라인 병렬): 각 랭크가 두 레이어 중 하나를 가집니다(여기에 임베딩 또는 출력층이 더해집니다). 스테이지(stage)
#   사이에서는 마이크로배치 단위로 활성값이 앞으로, 그래디언트가 뒤로 오갑니다.
#
# 추정(estimate)을 보기 전에 먼저 예측해 보세요. 랭크당 가중치 바이트가 가장 적은 레이아웃은 무엇이고, 여기서 가장 빨리
# 도는 레이아웃은 무엇일까요?

# %% tags=["prediction"]
my_prediction = {
    "fewest weights per rank": ...,  # "dp2", "tp2" or "pp2"
    "fastest here": ...,
}

# %%
base = load_spec(example(spec_file)).replace(**{
    "train.iters": iterations, "train.log_interval": log_interval,
    "cluster": {"nodes": [{"gpu": gpu, "count": nodes, "gpus_per_node": 1}]}})
layouts = {"dp2": {}, "tp2": {"parallel.tensor": 2}, "pp2": {"parallel.pipeline": 2}}
specs = {name: base.replace(**changes) for name, changes in layouts.items()}
compare(specs)[["tp", "pp", "dp", "num_micro_batches", "iteration_ms", "weights_mib", "activations_mib",
                "total_mib"]].round(3)

# %% [markdown]
# 텐서 병렬화와 파이프라인 병렬화는 각 랭크가 가지는 가중치를 절반으로 줄이지만, 데이터 병렬화는 배치 말고는 아무것도 줄이지
# 않습니다. 통신이 가장 잦은 레이아웃은 어느 것일까요? 7.5 전에 예측해 보세요.
#
# ## 7.2 파이프라인 스케줄
#
# 스테이지가 2개이고 반복(iteration)마다 마이크로배치가 4개일 때, 1F1B에서는 스테이지 0이 스테이지 1이 시작할 수 있을
# 때까지 순전파를 실행하고, 그 뒤로는 각 스테이지가 순전파 하나와 역전파 하나를 번갈아 실행합니다. 양 끝에서 놀고 있는
# 구간이 버블입니다. 스테이지가 $p$개, 마이크로배치가 $m$개이면 각 스테이지에서 마이크로배치 $p - 1$개 분량의 순전파와
# 역전파에 해당합니다. Narayanan et al.(SC21, arXiv:2104.04473, section 2.2.1)은 이를 $(p - 1) / m$, 곧 버블 시간을
# 이상적인(버블 없는) 시간으로 나눈 값으로 씁니다. 버블을 포함한 반복 전체에서 차지하는 비율로 보면 $(p - 1) / (m + p - 1)$이며,
# 아래에 출력되는 값이 이것입니다. $m \gg p$이면 두 값은 거의 같아집니다.

# %%
pp = specs["pp2"]
est = estimate(pp)
schedule_figure(est.pipeline, title=f"pp2: 1F1B over {pp.num_micro_batches} micro-batches (as estimated)").show()
print(say("lab07.bubble", share=bubble_fraction(pipeline_schedule(pp.parallel.pipeline, pp.num_micro_batches))))

# %% [markdown]
# 마이크로배치가 많을수록 버블이 줄어듭니다. 인터리브 스케줄(interleaved schedule)은 스테이지마다 모델 청크(chunk)를 여러 개
# (Megatron의 가상 스테이지(virtual stage), `parallel.virtual_stages`) 두어, 메시지가 늘어나는 대가로 버블을 더 줄입니다:

# %%
show("pipeline_schedules")

# %% [markdown]
# ## 7.3 세 레이아웃과 실패할 작업 하나를 제출하기
#
# 세 레이아웃은 함께 학습되며, 각각 첫 번째 랭크에서 한 반복 동안 프로파일링됩니다. 네 번째 작업은 존재하지 않는 데이터
# 경로를 가리킵니다. 로그만 보고도 알아볼 수 있어야 하는 실수입니다.

# %%
jobs = backend_named(backend)
sweep = Sweep.submit(jobs, {name: profiled(spec, max(1, iterations - 1)) for name, spec in specs.items()},
                     prefix="lab07")
broken = jobs.submit(base.replace(name="lab07-bad-data", data={"mock": False, "path": bad_data_path},
                                  cluster={"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 1}]}))
sweep.jobs["pp2"]

# %% [markdown]
# 모니터(FASOP의 `get_result.sh`와 같은 역할)는 각 노드의 마지막 몇 줄, 각 노드가 출력한 작업 정보를 스펙과 대조한 결과,
# 지금까지의 반복 시간을 보여 줍니다. 작업이 끝날 때까지 계속 새로 고칩니다.

# %% tags=["nbval-ignore-output", "widgets"]
widget(sweep.jobs["pp2"])

# %%
states = sweep.wait()
print({name: str(state) for name, state in states.items()})

# %% [markdown]
# ## 7.4 노드별 로그
#
# 모든 노드는 `LOGDIR/JOBID/NODE.out`, `.err`, `.gpu`(GPU 샘플, `nvidia-smi`가 있는 경우)를 씁니다:

# %%
for node, files in sweep.jobs["pp2"].node_logs().items():
    print(f"{node}: {', '.join(sorted(path.name for path in files.values()))}")

# %% [markdown]
# 끝난 파이프라인 실행에 대한 모니터의 보고서입니다. 각 노드의 마지막 몇 줄(노드 1이 마지막 스테이지를 맡으므로 로그는 그
# 타이머(timer) 출력으로 끝납니다), 각 노드가 보고한 레이아웃과 스펙의 대조, 그리고 반복 시간이 나옵니다.

# %%
print(format_report(report(sweep.jobs["pp2"], lines=3), color=False))

# %% [markdown]
# ## 7.5 레이아웃 나란히 비교하기: 측정값
#
# 여기서는 모든 "노드"가 이 머신의 코어를 다른 실행들과 나눠 쓰므로, 시간이 클러스터에서만큼 많은 것을 말해 주지는 않습니다.
# 메모리와 통신 패턴은 레이아웃 고유의 것입니다.

# %%
comparison_table(sweep.logs, baseline="dp2", specs=sweep.specs)[
    ["iteration_ms", "speedup", "num_micro_batches", "max_allocated_mb"]]

# %% [markdown]
# 여러분의 예측을 추정값, 측정값과 나란히 놓아 봅니다(CPU에서 로그의 메모리 줄은 프로세스 전체의 값이므로, 랭크당 가중치는
# 추정값에서만 가져옵니다):

# %%
estimated, measured = compare(specs), comparison_table(sweep.logs, specs=sweep.specs)
prediction_table(my_prediction, estimated={
    "fewest weights per rank": " or ".join(estimated.index[estimated["weights_mib"] == estimated["weights_mib"].min()]),
    "fastest here": estimated["iteration_ms"].idxmin()}, measured={"fastest here": measured["iteration_ms"].idxmin()})

# %%
timer_breakdown_figure(sweep.logs).show()

# %% [markdown]
# ## 7.6 병렬 그룹별 통신
#
# 프로파일러는 각 집합 통신(collective)을 호출한 Megatron 코드로부터 그 그룹의 이름을 알아냅니다. 모든 레이아웃이
# megatron-core의 코드 경로 전체를 실행하므로, 랭크가 하나뿐인 그룹의 호출도 보입니다(바로 반환됩니다). 프로파일한 반복 하나에서,
# 랭크당 마이크로배치 $m$개와 레이어 $L$개일 때:
# - `dp`: 반복마다 한 번인 그래디언트 all-reduce입니다. DDP는 tiny 모델의 그래디언트를 버킷(bucket) 하나에 두고, 마지막
#   마이크로배치의 역전파가 끝나면 한 번의 호출로 all-reduce합니다(`finish_grad_sync`). dp2의 나머지 `dp` 호출 두 개는
#   labkit의 드라이버가 로그를 위해 all-reduce하는 숫자 하나씩입니다. 데이터 병렬 랭크들에 대해 평균한 손실, 그리고 어느
#   랭크의 손실이 NaN인지입니다. 트레이스는 이 둘의 그룹을 기록하지 않으므로 labkit은 레이아웃으로부터 그룹 이름을 붙입니다.
#   dp2에서는 `dp`, tp2에서는 `tp`입니다.
# - `tp`: megatron-core의 어휘 병렬(vocab-parallel) 교차 엔트로피는 마이크로배치마다 토큰당 숫자 세 개(가장 큰 로짓, 정답의
#   로짓, 지수의 합)를 텐서 그룹에서 all-reduce합니다. dp2의 `tp` 호출 $3m = 6$개가 이것이며, 랭크 하나짜리 텐서 그룹에서
#   일어납니다. tp2는 레이어의 호출을 더합니다. 각 마이크로배치의 순전파에서 행 병렬(row-parallel) 선형 레이어마다(어텐션의 출력
#   프로젝션과 MLP의 두 번째 선형 레이어, 레이어당 2개) 하나와 임베딩에 하나, 역전파에서 열 병렬(column-parallel) 선형 레이어마다(QKV와
#   MLP의 첫 번째 선형 레이어) 하나와 출력 레이어에 하나입니다. $L = 2$, $m = 4$에서 $(4L + 2 + 3)m + 2 = 54$번이며, 2는 로그의 숫자
#   두 개입니다.
# - `model`: 클리핑(`--clip-grad`)을 위한 그래디언트 노름입니다. 스텝 전에 제곱 노름을 모델 병렬 그룹(텐서 x 파이프라인
#   랭크, dp2에서는 랭크 하나)에서 all-reduce합니다.
# - `pp`와 `embedding`(pp2): 스테이지 사이에서 보내고 받는 것, 그리고 공유된(tied) 임베딩의 그래디언트를 첫 스테이지와 마지막
#   스테이지 사이에서 all-reduce하는 것입니다.
# - `world`: Megatron의 타이머가 (min, max)를 출력하려고, 기록하는 반복마다 한 번씩 모든 랭크의 시간을 모으는 것입니다. 이
#   머신에서는 이 줄이 가장 큰 경우가 많은데, 호출이 가장 느린 랭크가 도착할 때까지 거기서 기다리기 때문입니다. 이 대기는
#   통신이 아니며, 어느 병렬 그룹의 트래픽도 아닙니다.

# %%
groups = {}
for name, spec in sweep.specs.items():
    groups[name] = trace.communication_by_group(sweep.traces(name), tensor=spec.parallel.tensor,
                                                pipeline=spec.parallel.pipeline)
    print(f"{name}:\n{groups[name].round(3).to_string(index=False)}\n")
tp_row = groups["tp2"].set_index("group").loc["tp"]
print(say("lab07.tp_all_reduce", ms=tp_row["time_ms"] / tp_row["calls"]))

# %% tags=["check-claim"]
assert {"dp", "world"} <= set(groups["dp2"]["group"]) and "tp" in set(groups["tp2"]["group"]), groups
assert "pp" in set(groups["pp2"]["group"]), groups["pp2"]
calls = {name: dict(zip(table["group"], table["calls"])) for name, table in groups.items()}  # rank 0's
layers, m = base.model.num_layers, sweep.specs["tp2"].num_micro_batches
assert calls["dp2"]["dp"] == 3 and calls["dp2"]["tp"] == 3 * sweep.specs["dp2"].num_micro_batches, calls
assert calls["tp2"]["tp"] == (4 * layers + 2 + 3) * m + 2, calls

# %%
tp2 = sweep.specs["tp2"]
profile_views.communication_group_figure(sweep.traces("tp2"), tensor=tp2.parallel.tensor).show()

# %% [markdown]
# 여기서는 대개 tp2가 가장 느린데, 추정은 dp2와 1 ms 정도밖에 차이 나지 않는다고 봅니다. tp2의 랭크들은 위의 모든
# all-reduce에서, 곧 다음 연산이 합을 기다리는 순전파와 역전파 안에서 만납니다. dp2의 랭크들은 역전파가 끝난 뒤 몇 번만
# 만납니다. 추정은 tp2의 all-reduce 하나하나를, 코어에 gloo 프로세스 두 개만 있을 때 잰 값으로 매깁니다
# (`labkit/data/gpus.yaml`의 `cpu` 항목: `message_latency_s` 0.1 ms와 `intra_node_gbps` 11, 레이어 하나의 활성값에 약 0.1 ms).
# 여기서는 세 실행의 랭크 여섯 개가 이 머신의 코어를 나눠 쓰므로, all-reduce에 먼저 도착한 랭크는 상대 랭크가 다시 스케줄될
# 때까지 기다리며, 그때마다 1 ms 이상이 걸립니다(위에 출력한 줄). NVLink가 있는 GPU에서는 이런 all-reduce가 마이크로초 단위로
# 끝나므로, 노드 안의 텐서 병렬화는 비용이 크지 않습니다.

# %% [markdown]
# ## 7.7 왜 실패했을까?
#
# 모니터는 실패한 작업의 로그에서 흔한 원인, 곧 메모리 부족(out of memory), NaN 손실(loss), NCCL/gloo 오류, 시간 제한(time
# limit), 취소, 잘못된 데이터 경로, 노드 장애를 찾아내고, 그 원인이 드러난 줄을 짚어 줍니다.

# %%
state = broken.wait(progress=False)
print(f"{broken.record.run_id}: {state}")
print(say("lab07.cause", cause=broken.cause()))

# %%
print(format_report(report(broken, lines=3), color=False))

# %% [markdown]
# ## 7.8 실행 대시보드 (선택 사항)
#
# 위의 모든 실행은 실행 인덱스(run index)에 들어 있습니다(`labkit runs`로도 목록을 볼 수 있습니다). 대시보드에서는 실행과
# 보기(손실, 반복 시간, 타이머, 랭크별 메모리, 랭크별 타임라인, 비교 표)를 고르며, 고른 실행이 아직 돌고 있으면 계속 새로
# 고칩니다. 보기 하나하나는 평범한 함수이며, 여기서는 이 실습의 세 레이아웃을 비교하는 보기입니다:

# %%
chosen = [job.record.run_id for job in sweep.jobs.values()]
dashboard.view("comparison table", *dashboard.load_runs(chosen, runs_dir()))[
    ["iteration_ms", "num_micro_batches", "max_allocated_mb"]]

# %% tags=["nbval-ignore-output", "widgets"]
board = dashboard.Dashboard(root=runs_dir()).show()
board.runs.value = tuple(chosen)

# %% [markdown]
# ## 7.9 텐서 병렬화와 파이프라인 병렬화를 처음부터 구현하기 (과제)
#
# 위 레이아웃들의 바탕에 있는 두 아이디어를 각각 열 줄 남짓으로 구현하고, 드라이버(driver)의 랭크들이 그러듯이 이 머신의
# gloo 위에서 두 프로세스로 실행합니다. 그리고 각각을 같은 프로세스 안에서 같은 일을 하는 megatron-core와 비교해 확인합니다.
#
# **열 병렬(column-parallel) 선형층 다음 행 병렬(row-parallel) 선형층** (Megatron의 MLP, Shoeybi et al. arXiv:1909.08053):
# 첫 번째 가중치는 출력 행 방향으로 나뉘므로, 각 랭크는 통신 없이 은닉 활성값(hidden activation) 중 자기 몫을 계산합니다. 두
# 번째 가중치는 이에 맞춰 입력 열 방향으로 나뉘므로, 각 랭크는 부분 출력을 계산하고 all-reduce 한 번으로 이를 합칩니다. 폭이
# 얼마이든 순전파마다 all-reduce는 한 번입니다.

# %%
import multiprocessing
import os
import tempfile

import torch
import torch.distributed as dist


def mlp_from_scratch(rank, world, x, w1, w2):
    w1_mine = w1.chunk(world, dim=0)[rank]  # column-parallel: my share of the hidden units
    w2_mine = w2.chunk(world, dim=1)[rank]  # row-parallel: the same share of the inputs
    hidden_mine = x @ w1_mine.t()           # no communication
    partial = hidden_mine @ w2_mine.t()     # my hidden units' contribution to every output
    dist.all_reduce(partial)                # the one all-reduce: the sum over ranks
    return partial, (w1_mine, w2_mine)


# %% [markdown]
# **1F1B** (Narayanan et al. SC21, arXiv:2104.04473): 스테이지 $p$개 중 스테이지 $i$는 파이프라인을 채우려고 순전파를
# $p - i - 1$번 실행한 뒤, 순전파 하나와 역전파 하나를 번갈아 실행하고, 끝으로 아직 남은 역전파를 모두 처리합니다.


# %%
def one_f_one_b(stage, stages, micro_batches):
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", k) for k in range(warmup)]
    for k in range(micro_batches - warmup):
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", k) for k in range(micro_batches - warmup, micro_batches)]


print(one_f_one_b(0, 2, 4))


# %% [markdown]
# 확인 방법: 두 프로세스가 하나의 gloo 그룹에 참여합니다. 각 프로세스는 처음부터 구현한 MLP를 실행한 다음, 같은
# 샤드(shard)를 가진 megatron-core의 `ColumnParallelLinear`와 `RowParallelLinear`를 실행합니다. 이어서 두 파이프라인
# 스테이지에 걸쳐 megatron-core의 1F1B 스케줄을 실행하면서, 각 순전파는 시작할 때, 각 역전파는 스테이지를 지나갈 때 기록합니다.

# %%
def check_against_megatron(rank, world, store, micro_batches, results):
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # as labkit's tensor-parallel jobs set it (megatron-core asks)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from labkit.train import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)  # every rank draws the same full weights and input
    x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    mine, (w1_mine, w2_mine) = mlp_from_scratch(rank, world, x, w1, w2)

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the random stream megatron-core initialises shards from
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=world, tensor_model_parallel_size=world,
                               cuda_graph_scope=[])
    column = tensor_parallel.ColumnParallelLinear(8, 16, config=config, init_method=lambda w: None, bias=False,
                                                  gather_output=False)
    row = tensor_parallel.RowParallelLinear(16, 8, config=config, init_method=lambda w: None, bias=False,
                                            input_is_parallel=True, skip_bias_add=False)
    with torch.no_grad():
        column.weight.copy_(w1_mine)
        row.weight.copy_(w2_mine)
    megatron, _ = row(column(x)[0])
    tensor_ok = torch.allclose(mine, megatron) and torch.allclose(mine, x @ w1.t() @ w2.t(), atol=1e-5)

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    order = []

    class NoteBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, k):
            ctx.k = k
            return out.clone()

        @staticmethod
        def backward(ctx, grad):
            order.append(("B", ctx.k))
            return grad, None

    class Stage(torch.nn.Linear):  # what megatron-core's schedule asks of a model chunk
        model_type = ModelType.encoder_or_decoder
        config = TransformerConfig(num_layers=world, hidden_size=4, num_attention_heads=1, cuda_graph_scope=[],
                                   pipeline_model_parallel_size=world, pipeline_dtype=torch.float32)

        def set_input_tensor(self, tensor):  # the activations the previous stage sent
            self.received = tensor[0] if isinstance(tensor, list) else tensor

    stage, started = Stage(4, 4), iter(range(micro_batches))

    def forward_step(data_iterator, model):
        k = next(started)
        order.append(("F", k))
        out = model(torch.randn(1, 1, 4) if rank == 0 else model.received)
        return NoteBackward.apply(out, k), lambda out: (out.square().mean(), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=None, model=[stage],
                                num_microbatches=micro_batches, seq_length=1, micro_batch_size=1, forward_only=False)
    results.put((rank, tensor_ok, order))
    dist.destroy_process_group()


fork = multiprocessing.get_context("fork")  # the ranks start as copies of this notebook's process
results, store = fork.Queue(), tempfile.mkdtemp() + "/group"
ranks = [fork.Process(target=check_against_megatron, args=(rank, 2, store, 4, results)) for rank in range(2)]
for process in ranks:
    process.start()
checked = {rank: (tensor_ok, order) for rank, tensor_ok, order in (results.get(timeout=120) for _ in ranks)}
for process in ranks:
    process.join()
for rank, (tensor_ok, order) in sorted(checked.items()):
    assert tensor_ok and order == one_f_one_b(rank, 2, 4), (rank, order)
    print(say("lab07.rank_checked", rank=rank, order=order))

# %% [markdown]
# ## 연습 문제
#
# **연습 문제 1.** GPU 4개짜리 노드 2개에서 텐서 병렬 크기가 2, 파이프라인 병렬 크기가 2이면, 데이터 병렬 크기(data-parallel
# size)는 얼마입니까?

# %%
answer_1 = ...

# %%
eight = base.replace(**{"parallel.tensor": 2, "parallel.pipeline": 2,
                        "cluster": {"nodes": [{"gpu": gpu, "count": 2, "gpus_per_node": 4}]}})
check("07.1", answer_1, spec=eight)

# %% [markdown]
# **연습 문제 2 (과제).** 매 반복의 끝에서 그래디언트 all-reduce가 일어나는 병렬 그룹은 어느 것입니까? `"tp"`, `"pp"`, `"dp"` 중
# 하나로 답하세요.

# %%
answer_2 = ...

# %%
check("07.2", answer_2)

# %% [markdown]
# **연습 문제 3 (과제).** 파이프라인 스테이지 8개, 마이크로배치 16개일 때 1F1B 버블은 반복의 얼마를 차지합니까? (SC21의 버블 대 이상
# 시간 비율이 아니라, 반복 전체에 대한 0과 1 사이의 비율입니다. 위 그림은 스테이지 4개와 마이크로배치 8개를 그렸습니다.)

# %%
answer_3 = ...

# %%
check("07.3", answer_3)

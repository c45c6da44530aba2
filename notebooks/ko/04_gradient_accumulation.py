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
# # 실습 04: 그래디언트 누적(gradient accumulation): 같은 마이크로배치로 더 큰 글로벌 배치를
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - Megatron이 글로벌 배치(global batch)를 마이크로배치(micro-batch)로 나누는 방식을 설명합니다: 글로벌 = 마이크로 x
#   데이터 병렬(data parallel) x 마이크로배치 수이며, 그 개수를 로그에서 다시 읽어
#   냅니다(`setting number of micro-batches to constant N`);
# - 마이크로배치를 더 많이 누적하는 비용을 예측한 뒤 측정합니다: 반복(iteration)당 시간은 늘고, 초당 샘플 수는 조금
#   늘며(옵티마이저 스텝(optimizer step)을 함께 쓰므로), 메모리는 마이크로배치 하나 분량 그대로입니다;
# - 누적이 같은 스텝을 계산한다는 것을 보입니다: 글로벌 배치 8을 크기 2의 마이크로배치 4개로 계산해도, fp32에서는 크기
#   8의 마이크로배치 하나와 같은 손실(loss)이 나옵니다.
#
# 이 실습은 NVIDIA DLI 워크숍 *Model Parallelism: Building and Deploying Large Neural Networks*의 4.3절에 해당합니다:
# `MICRO_BATCH_SIZE`는 그대로 두고 `GLOBAL_BATCH_SIZE`를 키웁니다.

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
gpu = "cpu"              # the GPU of the one-GPU runs below ("A100-80GB" on a cluster)
iterations = 10
log_interval = 1
micro_batch = 2
global_batches = [2, 8, 16]   # at micro_batch: 1, 4 and 8 micro-batches per iteration
large_micro_batch = 8         # one micro-batch holding the same samples as global_batches[1]

# %%
from labkit.estimate.compare import compare
from labkit.answer_key import check
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.sweep import NO_DROPOUT, Sweep, profiled, with_flags
from labkit.messages import say
from labkit.paths import example, shipped_corpus
from labkit.logs.losses import loss_table
from labkit.logs.views import comparison_table, iteration_time_figure, loss_figure
from labkit.profiling import views as profile_views
from labkit.spec import load_spec

# %% [markdown]
# ## 4.1 글로벌 배치에서 마이크로배치로
#
# 각 데이터 병렬 랭크(rank)는 `global / (micro x data parallel)`개의 마이크로배치에 대해 순전파(forward)와
# 역전파(backward)를 실행하면서 그래디언트를 더해 나가고, 그다음 모든 랭크가 그 합을 리듀스(reduce)한 뒤 옵티마이저
# 스텝을 한 번 밟습니다. 누적의 효과만 따로 보기 위해, 여기의 실행은 모두 GPU 하나(데이터 병렬 1)에서 fp32로,
# 드롭아웃(dropout) 없이 돌립니다(같은 샘플이 같은 수치를 내도록).

# %%
base = with_flags(load_spec(example(spec_file)).replace(**{
    "train.iters": iterations, "train.log_interval": log_interval, "precision": "fp32", "batch.micro": micro_batch,
    "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 1}]}}, data=shipped_corpus()), *NO_DROPOUT)
specs = {f"micro {micro_batch} x {global_batch // micro_batch}": base.replace(**{"batch.global": global_batch})
         for global_batch in global_batches}
equivalent = f"micro {micro_batch} x {global_batches[1] // micro_batch}"
specs[f"micro {large_micro_batch} x 1"] = base.replace(
    **{"batch.micro": large_micro_batch, "batch.global": global_batches[1]})
for name, spec in specs.items():
    print(say("lab04.batch_layout", name=name, global_batch=spec.batch.global_, micro=spec.batch.micro,
              data_parallel=spec.data_parallel, micro_batches=spec.num_micro_batches))

# %% [markdown]
# ## 4.2 예측하기
#
# 추정치를 보기 전에 먼저 여러분의 예상을 적어 보세요: 마이크로배치가 가장 많은 실행의 반복 한 번은 마이크로배치가
# 하나인 실행보다 몇 배 오래 걸릴까요? 그리고 반복마다 같은 샘플을 보는 두 실행(작은 마이크로배치 여러 개, 또는 큰
# 마이크로배치 하나) 가운데 *이 머신에서* 초당 더 많은 샘플을 처리하는 쪽은 어느 것일까요?

# %% tags=["prediction"]
my_prediction = {
    "time, most micro-batches / one": ...,  # a number, e.g. 3.5
    "more samples per second here": ...,    # one of the run names printed above
}

# %% [markdown]
# 추정(estimate)은 이렇습니다: 시간은 마이크로배치 수에 따라 늘고, 초당 샘플 수는 조금 늘며(옵티마이저 스텝 한 번이 더
# 많은 샘플을 맡으므로), 활성값 메모리(activation memory)는 전혀 늘지 않습니다: 각 마이크로배치의 활성값은 다음
# 마이크로배치가 시작되기 전에 그 마이크로배치의 역전파에서 해제됩니다. 메모리가 더 필요한 것은 큰 마이크로배치 하나로
# 돌리는 실행뿐입니다.

# %%
compare(specs)[["global_batch", "micro_batch", "num_micro_batches", "iteration_ms", "samples_per_s",
                "activations_mib", "total_mib"]].round(3)

# %% [markdown]
# ## 4.3 실행하기
#
# 하나씩 차례로 실행합니다: 이 머신의 코어를 함께 쓰는 실행들은 그 순간 다른 실행이 무엇을 하느냐에 따라 서로를 느리게
# 만들고, 그 영향은 누적 자체의 비용보다 큽니다. 그러면 반복당 시간은 이웃 실행을 재는 꼴이 됩니다. 반복마다 같은 8개
# 샘플을 보는 두 실행은 메모리를 살펴보기 위해 한 반복 동안 프로파일링(profiling)합니다.

# %%
profile_at = max(1, iterations - 1)
to_profile = (equivalent, f"micro {large_micro_batch} x 1")
jobs = backend_named(backend)
submitted = {}
for name, spec in specs.items():
    one = Sweep.submit(jobs, {name: profiled(spec, profile_at) if name in to_profile else spec}, prefix="lab04")
    print(f"{name}: {one.wait()[name]}")
    submitted.update(one.jobs)
sweep = Sweep(submitted)

# %% [markdown]
# ## 4.4 마이크로배치 수와 처리량(throughput)
#
# `num_micro_batches`는 각 실행의 로그에 찍힌 값입니다(`setting number of micro-batches to constant N`, 워크숍에서
# grep으로 찾던 바로 그 줄).

# %%
comparison_table(sweep.logs, specs=sweep.specs)[
    ["global_batch_size", "num_micro_batches", "iteration_ms", "samples_per_s", "speedup"]]

# %% [markdown]
# 여러분의 예상을 추정치, 측정치와 나란히 놓아 봅니다:

# %%
fewest, most = (f"micro {micro_batch} x {g // micro_batch}" for g in (global_batches[0], global_batches[-1]))
estimated, measured = compare(specs), comparison_table(sweep.logs, specs=sweep.specs)
pair = [equivalent, f"micro {large_micro_batch} x 1"]
prediction_table(my_prediction, estimated={
    "time, most micro-batches / one": estimated.loc[most, "iteration_ms"] / estimated.loc[fewest, "iteration_ms"],
    "more samples per second here": max(pair, key=lambda name: estimated.loc[name, "samples_per_s"])}, measured={
    "time, most micro-batches / one": measured.loc[most, "iteration_ms"] / measured.loc[fewest, "iteration_ms"],
    "more samples per second here": max(pair, key=lambda name: measured.loc[name, "samples_per_s"])})

# %%
iteration_time_figure(sweep.logs).show()

# %% [markdown]
# 추정에서는 반복당 시간이 마이크로배치 수에 거의 비례해 늘고, 초당 샘플 수도 늘어납니다: 옵티마이저 스텝과 그 밖의
# 반복당 비용을 더 많은 샘플이 나누어 지기 때문입니다(4.2의 예측). 공유 CPU에서는 측정된 증가 폭이 실행할 때마다 머신의
# 부하에 따라 달라지므로(위 표는 이번 실행의 값입니다) 이 실습에서는 특정 수치를 요구하지 않습니다. 클러스터에서는
# 실행마다 GPU를 따로 쓰므로 측정이 추정을 따라갑니다.
#
# GPU에서는 크기 8의 마이크로배치 하나가 크기 2의 마이크로배치 넷보다 빠릅니다: 행렬이 클수록 텐서 코어(tensor core)가
# 더 바쁘게 돌기 때문입니다. CPU에서는 둘의 순서가 머신에 따라 달라집니다: 모든 연산자(operator)가 호출마다 치르는 고정
# 비용을 네 번이 아니라 한 번만 치르는 점은 크기 8 쪽에 유리하지만, 그만큼 캐시(cache)에는 덜 들어가고, 공유 머신에서는
# 그 순간의 부하가 두 효과를 모두 압도합니다(위 표는 이번 실행의 값이며, 조용한 실행에서도 어느 쪽이든 앞선 적이
# 있습니다). 이는 누적의 성질이 아니라 하드웨어의 성질입니다: 실제로 학습할 GPU에서 비교해 보세요.

# %% [markdown]
# ## 4.5 메모리: 한 번에 마이크로배치 하나
#
# 워크숍의 메모리 트레이스(memory trace)에서는 마이크로배치 4개를 누적할 때 스텝마다 메모리가 네 번 오르내렸습니다.
# 프로파일링한 반복에서도 마찬가지입니다: `micro 2 x 4`에서는 작은 봉우리(peak) 네 개가, `micro 8 x 1`에서는 네 배 높은
# 봉우리 하나가 보입니다.

# %%
traces = {name: sweep.traces(name)[0] for name in to_profile}
profile_views.memory_figure(traces).show()

# %%
profile_views.comparison_table(traces)[["run", "step_ms", "peak_growth_mb", "saved_mb"]].round(3)

# %% [markdown]
# ## 4.6 같은 스텝, 두 가지 계산
#
# 같은 시드(seed)와 같은 샘플로, 드롭아웃 없이 돌리면 크기 2의 마이크로배치 4개와 크기 8의 마이크로배치 1개는 같은
# 그래디언트를 계산합니다(Megatron은 손실을 마이크로배치에 걸쳐 평균합니다). 따라서 매 반복의 가중치와 손실도 같고, 다른
# 것은 부동소수점(floating-point) 덧셈의 순서뿐입니다.

# %%
losses = loss_table({name: sweep.logs[name] for name in to_profile})
losses

# %% tags=["check-claim"]
assert losses["spread"].max() < 1e-3, losses  # the same step, up to the order of additions

# %%
print(say("lab04.loss_spread", iterations=len(losses), spread=losses["spread"].max()))
loss_figure({name: sweep.logs[name] for name in to_profile}).show()

# %% [markdown]
# ## 4.7 누적을 처음부터 구현하기 (과제)
#
# `batch.global` / `batch.micro` 뒤에 있는 루프를 열두 줄 남짓으로 구현합니다: 각 마이크로배치의 손실을 마이크로배치
# 수로 나누고, 그 그래디언트를 앞서 쌓인 그래디언트에 더합니다. 데이터 병렬에서는 마지막 마이크로배치를 뺀 모든
# 마이크로배치에서 그래디언트의 올리듀스(all-reduce)를 건너뛰므로(`no_sync`), 한 스텝이 마이크로배치를 몇 개 누적하든
# 올리듀스 비용은 한 번만 치릅니다. 가중치에 건 훅(hook)이 역전파마다 그 역전파가 `no_sync` 안에서 실행되었는지를
# 기록합니다.

# %%
import contextlib

import torch

inside_no_sync, synced = [False], []


@contextlib.contextmanager
def no_sync():  # what DistributedDataParallel.no_sync does: hold the all-reduce back while inside
    inside_no_sync[0] = True
    yield
    inside_no_sync[0] = False


def accumulate(model, micro_batches):
    model.zero_grad()
    for i, (xs, ys) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else no_sync():
            loss = torch.nn.functional.mse_loss(model(xs), ys) / len(micro_batches)
            loss.backward()


# %% [markdown]
# 이 구현을 megatron-core 자체의 파이프라인 스테이지(pipeline stage) 하나짜리 스케줄(`forward_backward_no_pipelining`,
# 파이프라인 크기 1에서 드라이버가 실행하는 것)에 같은 `no_sync`를 넘겨 돌린 결과와, 그리고 배치 전체에 대한 역전파 한
# 번의 결과와 대조해 확인합니다.

# %%
import tempfile

import torch.distributed as dist
from labkit.train import cpu_compat

if not torch.cuda.is_available():
    cpu_compat.apply()
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

if not dist.is_initialized():  # a group of one process, so that megatron-core's schedule can run in this notebook
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/group", rank=0, world_size=1)
if not parallel_state.model_parallel_is_initialized():
    parallel_state.initialize_model_parallel(1, 1)


class Regression(torch.nn.Linear):  # the attributes megatron-core's schedule asks a model for
    model_type = ModelType.encoder_or_decoder
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, no_sync_func=no_sync,
                               cuda_graph_scope=[])  # no CUDA graphs (0.16's default names a deprecated scope)

    def set_input_tensor(self, tensor):  # a first pipeline stage receives no activations
        pass


torch.manual_seed(0)
model = Regression(16, 1)
model.weight.register_hook(lambda grad: synced.append(not inside_no_sync[0]))
inputs, targets = torch.randn(8, 16), torch.randn(8, 1)
micro_batches = list(zip(inputs.split(2), targets.split(2)))

accumulate(model, micro_batches)
mine, my_syncs = [p.grad.clone() for p in model.parameters()], synced[:]
synced.clear()
model.zero_grad()


def forward_step(data_iterator, model):
    xs, ys = next(data_iterator)
    return model(xs), lambda out: (torch.nn.functional.mse_loss(out, ys), {})


get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
                            num_microbatches=len(micro_batches), seq_length=1, micro_batch_size=2, forward_only=False)
megatron = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
torch.nn.functional.mse_loss(model(inputs), targets).backward()
assert all(torch.allclose(a, b) and torch.allclose(a, p.grad) for a, b, p in zip(mine, megatron, model.parameters()))
assert my_syncs == synced[:len(micro_batches)] == [False, False, False, True]
print(say("lab04.syncs", mine=my_syncs, megatron=synced[:len(micro_batches)]))

# %% [markdown]
# ## 연습 문제
#
# **연습 문제 1.** 워크숍 4.3절의 실행: 노드 2개에 노드당 GPU 2개, 데이터 병렬만 사용, 마이크로배치 4, 글로벌 배치 64. 이
# 실행의 스펙(spec)을 `base`에서 만들어 보세요(`batch.micro`, `batch.global`, 그리고 `gpu`가 2개씩인 노드 2개로 된
# `cluster`를 설정합니다). GPU마다 마이크로배치를 몇 개씩 누적합니까?

# %%
answer_1 = ...

# %%
check("04.1", answer_1)

# %% [markdown]
# **연습 문제 2 (과제).** 글로벌 배치가 16일 때, 10번 반복한 실행은 샘플을 몇 개 소비했습니까(로그의 `consumed samples`)?

# %%
answer_2 = ...

# %%
check("04.2", answer_2)

# %% [markdown]
# **연습 문제 3 (과제).** 마이크로배치 크기를 고정하면, 누적하는 마이크로배치 수에 따라 늘어나는 것은 무엇입니까?
# `"activation memory"` 또는 `"time per iteration"`으로 답하세요.

# %%
answer_3 = ...

# %%
check("04.3", answer_3)

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
# # 실습 09: 데이터 병렬화(data parallelism)와 ZeRO: 모델 상태(model state)의 어느 바이트를 누가 가지는가
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - ZeRO의 각 단계(stage)가 데이터 병렬(data-parallel) 랭크(rank)들에 무엇을 샤딩(sharding)하는지, 곧 1단계는 옵티마이저
#   상태(optimizer state)를, 2단계는 그래디언트(gradient)까지, 3단계는 파라미터(parameter)까지 나눈다는 것을
#   설명하고(Rajbhandari et al., [arXiv:1910.02054](https://arxiv.org/abs/1910.02054)), 각 단계에서 랭크당 바이트를
#   예측하기
# - 데이터 병렬화의 그래디언트 all-reduce와, ZeRO-1의 reduce-scatter, 샤딩된 갱신(sharded update), all-gather를 두 gloo
#   프로세스에서 처음부터 구현하고, 둘 다 전체 배치(batch)를 처리하는 프로세스 하나와 같은 스텝(step)을 밟는다는 것을
#   보이기
# - 작은 GPT를 0~3단계(`optimizer.zero_stage`)로 실행하고, 손실(loss)이 일치하는지, 각 랭크가 추정(estimate)대로의
#   바이트를 가지는지 확인하기
# - 시퀀스 병렬화(sequence parallelism, Korthikanti et al., [arXiv:2205.05198](https://arxiv.org/abs/2205.05198))가 텐서
#   병렬(tensor parallel) 2에서 무엇을 아끼는지, 그리고 이 머신에서는 왜 그것을 보여 줄 수 없는지 설명하기

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
gpu = "cpu"              # the GPU of each rank ("A100-80GB" on a cluster)
data_parallel = 2        # ranks, one per GPU (process)
iterations = 3

# %%
import multiprocessing
import warnings

import pandas as pd
import torch
import torch.distributed as dist

from labkit.answer_key import check
from labkit.estimate.memory import activation_bytes_per_layer, bytes_per_param, model_state_bytes
from labkit.estimate.params import Shape
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.sweep import Sweep
from labkit.logs.losses import loss_table
from labkit.messages import say
from labkit.net import free_port
from labkit.paths import example
from labkit.spec import load_spec
from labkit.train.model_state import measure_model_state

# %% [markdown]
# ## 9.1 예측: 랭크당 모델 상태
#
# 일반적인 데이터 병렬화는 모델 상태 전체, 곧 가중치(weight), 그 그래디언트, 옵티마이저의 상태(Adam의 두 모멘트(moment),
# 그리고 16비트 학습이라면 fp32 마스터 가중치(master weight)도)를 모든 랭크에 한 벌씩 둡니다. ZeRO는 이를 $N_d$개의
# 데이터 병렬 랭크에 나눠 두며, 단계가 하나 올라갈 때마다 한 조각씩 더 나눕니다. 그 계산 방식은 실습 02와 같습니다.
# 파라미터당 $2 + 2 + K$바이트, 곧 16비트 가중치와 그래디언트에 혼합 정밀도 Adam 상태 $K = 12$바이트(fp32 마스터
# 가중치와 두 모멘트)이므로, 복제하면 $16$, 1단계는 $2 + 2 + 12/N_d$, 2단계는 $2 + 14/N_d$, 3단계는 $16/N_d$입니다.
#
# 스펙은 단계를 `optimizer.zero_stage`로 정하고, labkit의 드라이버(driver)는 각 단계를 다음처럼 실행합니다.
#
# | 단계 | 실행 방식 | 스텝 사이에 각 랭크가 가진 것 |
# |---|---|---|
# | 0 | megatron-core의 `DistributedDataParallel` | 전부 |
# | 1 | megatron-core의 분산 옵티마이저(distributed optimizer, `--use-distributed-optimizer`) | 온전한 가중치와 그래디언트, 옵티마이저 상태의 $1/N_d$ |
# | 2 | megatron-core를 거친 PyTorch FSDP2, 어떤 유닛도 순전파나 역전파 뒤에 다시 샤딩하지 않고(`reshard_after_forward=False`, `set_reshard_after_backward(False)`), 스텝마다 갱신된 조각을 all-gather | 온전한 가중치, 그래디언트와 옵티마이저 상태의 $1/N_d$ |
# | 3 | PyTorch FSDP2, 각 유닛을 순전파와 역전파 뒤에 다시 샤딩 | 모든 것의 $1/N_d$ |
#
# (Megatron-LM 자체의 `pretrain_gpt.py`, 곧 `job.entrypoint: megatron-lm`은 2단계와 3단계를 Megatron-FSDP로 실행합니다.)
#
# 아래 실행들은 `tiny` GPT(FSDP2가 요구하므로 임베딩(embedding)을 공유하지 않는(untied) 것)를 Adam과 fp32로(파라미터당
# 가중치 4바이트, 그래디언트 4바이트, 모멘트 8바이트), 데이터 병렬 랭크 2개에서 돌립니다. 모든 단계가 같은 수치를 보도록
# 드롭아웃(dropout)은 끕니다.

# %%
base = load_spec(example(spec_file)).replace(**{
    "train.iters": iterations, "train.log_interval": 1, "precision": "fp32",
    "model.untie_embeddings": True, "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
    "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": data_parallel}]}})
stages = {f"zero{stage}": base.replace(**{"optimizer.zero_stage": stage}) for stage in range(4)}
params = model_state_bytes(Shape.of(base.model), [base.model.num_layers], precision="fp32").weights // 4
print(say("lab09.parameters", params=params, data_parallel=base.data_parallel))

# %% [markdown]
# 먼저 여러분의 예측입니다. 각 단계에서 랭크 하나가 가지는 가중치 + 그래디언트 + 옵티마이저 상태의 바이트 수를 적어
# 보세요.

# %% tags=["prediction"]
my_prediction = {
    "zero0 bytes per rank": ...,  # a number of bytes
    "zero1 bytes per rank": ...,
    "zero2 bytes per rank": ...,
    "zero3 bytes per rank": ...,
}

# %% [markdown]
# 아이디어(`bytes_per_param`, ZeRO의 계산 방식)와 드라이버가 실행하는 것의 바이트(`model_state_bytes`, 추정기(estimator)가
# 쓰는 것)를 나란히 봅니다. 0단계와 1단계는 megatron-core의 버퍼(buffer)로, 분산 옵티마이저가 버킷(bucket)을 정렬하느라
# 붙이는 패딩(padding)까지 셉니다(이 크기에서는 패딩이 없습니다). 2단계와 3단계는 FSDP2의 조각으로, 각 파라미터의
# 행(row)을 랭크들에 나눈 것이며, 2단계에서는 그 옆에 모아 둔 온전한 가중치를 더합니다. 레이어(layer)가 계산하는 동안에만
# 있는 것(3단계에서 모은 레이어, 샤딩되지 않은 그래디언트)은 스텝 사이에 유지되지 않으므로 아래 열에서는 뺍니다.

# %%
def held_estimate(spec):
    state = model_state_bytes(Shape.of(spec.model), [spec.model.num_layers], data_parallel=spec.data_parallel,
                              precision="fp32", zero_stage=spec.optimizer.zero_stage)
    return (state.weights - state.weights_working, state.gradients - state.gradients_working, state.optimizer)


estimated = pd.DataFrame({name: {
    "bytes per parameter (ZeRO)": sum(bytes_per_param("fp32", spec.data_parallel,
                                                      zero_stage=spec.optimizer.zero_stage)),
    "ZeRO's idea": params * sum(bytes_per_param("fp32", spec.data_parallel, zero_stage=spec.optimizer.zero_stage)),
    "estimate": sum(held_estimate(spec))} for name, spec in stages.items()}).T
estimated

# %% [markdown]
# ## 9.2 데이터 병렬화와 ZeRO-1을 처음부터 구현하기
#
# 랭크 두 개가 각자 배치의 절반에 대한 그래디언트를 계산합니다. **데이터 병렬화**는 그래디언트를 all-reduce하므로(그리고
# 평균을 내므로), 모든 랭크가 자기가 가진 가중치와 옵티마이저 상태의 온전한 사본으로 같은 스텝을 밟습니다. **ZeRO-1**은
# 대신 reduce-scatter합니다. 랭크 $r$은 자기 몫인 $1/N_d$ 조각(slice)의 평균 그래디언트만 받아, 자기 혼자 보관하는
# 옵티마이저 상태로 그 조각을 갱신하고, all-gather가 갱신된 조각들을 다시 하나로 모읍니다. 오가는 바이트는
# 같고(reduce-scatter와 all-gather는 all-reduce를 둘로 자른 것입니다), 각 랭크는 옵티마이저 상태의 절반만 보관합니다.
# 여기서 옵티마이저는 모멘텀(momentum)을 쓰는 SGD이며, 가중치 8개짜리 평탄한 벡터(flat vector) 하나를 갱신합니다.

# %%
def step_from_scratch(rank, world, sharded, weights, state, inputs, targets, lr=0.1, beta=0.9):
    """One step of SGD with momentum; `state` is the momentum this rank keeps: all of it, or (ZeRO-1) its slice."""
    xs, ys = inputs.chunk(world)[rank], targets.chunk(world)[rank]  # my share of the batch
    w = weights.clone().requires_grad_()
    torch.nn.functional.mse_loss(xs @ w, ys).backward()
    if not sharded:  # data parallelism: every rank gets the whole averaged gradient
        grad = w.grad / world
        dist.all_reduce(grad)
        state = beta * state + grad
        return weights - lr * state, state
    grad = torch.empty(len(weights) // world)
    dist.reduce_scatter_tensor(grad, w.grad / world)  # ZeRO-1: my slice of the averaged gradient
    state = beta * state + grad                        # the optimizer state of my slice only
    updated = weights.chunk(world)[rank] - lr * state
    gathered = torch.empty_like(weights)
    dist.all_gather_into_tensor(gathered, updated)     # everyone's updated slice, back to whole weights
    return gathered, state


def two_steps(rank, world, sharded):
    torch.manual_seed(0)  # every rank draws the same weights and batch
    weights, inputs, targets = torch.randn(8), torch.randn(16, 8), torch.randn(16)
    state = torch.zeros(8 // world if sharded else 8)
    for _ in range(2):  # two steps, so that the momentum counts
        weights, state = step_from_scratch(rank, world, sharded, weights, state, inputs, targets)
    return weights.tolist(), state.numel()  # plain numbers: the rank's tensors end with its process


def rank_main(rank, world, port, results):
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames these collectives; same calls
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results.put((rank, {"dp": two_steps(rank, world, False), "zero1": two_steps(rank, world, True)}))
    dist.destroy_process_group()


fork = multiprocessing.get_context("fork")  # the ranks start as copies of this notebook's process
results, port = fork.Queue(), free_port()
ranks = [fork.Process(target=rank_main, args=(rank, 2, port, results)) for rank in range(2)]
for process in ranks:
    process.start()
done = dict(results.get(timeout=120) for _ in ranks)
for process in ranks:
    process.join()

# %% [markdown]
# 확인 방법: 전체 배치를 처리하는 프로세스 하나(모든 집합 통신(collective)이 항등 연산(identity)이 되는, 크기 1의
# 그룹)로 같은 두 스텝을 밟습니다.

# %%
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
alone, _ = two_steps(0, 1, False)
dist.destroy_process_group()
for rank, out in sorted(done.items()):
    for name, (updated, kept) in out.items():
        assert torch.allclose(torch.tensor(updated), torch.tensor(alone), atol=1e-6), (rank, name, updated, alone)
        print(say("lab09.rank_state", rank=rank, name=name, kept=kept))

# %% [markdown]
# megatron-core에서도 같은 아이디어가 돌아갑니다. 분산 옵티마이저가 켜져 있으면(`use_distributed_optimizer`)
# `DistributedDataParallel`이 그래디언트 버킷을 reduce-scatter하고, `DistributedOptimizer`가 자기 몫의 조각으로 스텝을
# 밟은 뒤 파라미터를 all-gather합니다. ZeRO-2는 여기에 더해 자기 몫이 아닌 조각의 그래디언트를 해제합니다. ZeRO-3은 모든
# 레이어의 파라미터를 그 레이어의 순전파(forward)와 역전파(backward) 직전에 모으고, 끝나면 해제합니다.
#
# ## 9.3 labkit의 드라이버에서 0~3단계 실행하기
#
# 네 단계가 함께 학습됩니다. 그동안 `measure_model_state`가 gloo 프로세스 두 개를 더 띄워 단계마다 드라이버의 모델과
# 옵티마이저를 만들고, 옵티마이저 스텝을 한 번 밟은 뒤 각 랭크가 가진 바이트를 셉니다.

# %%
sweep = Sweep.submit(backend_named(backend), stages, prefix="lab09")
held = dict(zip(stages, measure_model_state(stages.values())))  # [rank] -> (weights, gradients, optimizer)
states = sweep.wait()
print({name: str(state) for name, state in states.items()})

# %% [markdown]
# 샤딩은 모델 상태가 놓이는 곳을 바꿀 뿐 계산은 바꾸지 않습니다. 같은 데이터에서 손실은 fp32 반올림(rounding) 오차
# 안에서 일치합니다(리덕션(reduction)이 다른 순서로 더하기 때문입니다).

# %%
losses = loss_table({name: sweep.logs[name] for name in stages})
losses

# %% tags=["check-claim"]
assert len(losses) == iterations and (losses["spread"] / losses["zero0"]).max() < 1e-4, losses

# %% [markdown]
# 각 랭크의 바이트를 측정한 값과 추정값을 나란히 놓습니다(여기서는 두 랭크가 같은 양을 가지며, 표는 더 많이 가진 쪽을
# 보여 줍니다):

# %%
memory = pd.DataFrame({name: dict(zip(("weights", "gradients", "optimizer"), max(ranks, key=sum)))
                       for name, ranks in held.items()}).T
memory["measured"] = memory.sum(axis=1)
memory["estimate"] = estimated["estimate"]
memory["ZeRO's idea"] = estimated["ZeRO's idea"]
memory

# %% tags=["check-claim"]
for name in stages:  # exact: megatron-core's buffers, and FSDP2's shards padded to whole rows
    assert abs(memory.loc[name, "measured"] / memory.loc[name, "estimate"] - 1) < 0.02, memory
# stage 2 holds the whole weights that stage 3 shards; the gradients and the optimizer state alike
assert memory.loc["zero2", "weights"] - memory.loc["zero3", "weights"] == 4 * params, memory
assert (memory.loc["zero2", ["gradients", "optimizer"]] == memory.loc["zero3", ["gradients", "optimizer"]]).all()
print(say("lab09.state_bytes", stage="zero2", measured=memory.loc["zero2", "measured"],
          estimated=memory.loc["zero2", "estimate"]))
print(say("lab09.state_bytes", stage="zero3", measured=memory.loc["zero3", "measured"],
          estimated=memory.loc["zero3", "estimate"]))

# %% [markdown]
# 1단계는 옵티마이저 상태를, 2단계는 그래디언트까지, 3단계는 모든 것을 절반으로 줄입니다. 2단계는 ZeRO의 아이디어보다
# FSDP2 자체의 가중치 조각 $4P/N_d$바이트만큼 더 가집니다. 옵티마이저는 그 조각을 갱신하고, 드라이버는 모두의 조각에서
# 온전한 가중치를 모읍니다. 혼합 정밀도에서는 그 fp32 조각이 ZeRO가 $K$에 세는 마스터 사본이지만, fp32에서는 두 번째
# 사본입니다. 그래서 랭크 2개의 fp32에서는 2단계가 1단계만큼 가집니다. 그래디언트의 절반 $2P$바이트를 아끼고, 그 조각에
# 같은 만큼을 쓰기 때문입니다. 랭크가 더 많거나 혼합 정밀도라면 더 적게 가집니다. 여러분의 예측을 같은 단계의 추정값,
# 측정값과 나란히 놓아 봅니다:

# %%
prediction_table(my_prediction,
                 estimated={f"{name} bytes per rank": int(memory.loc[name, "estimate"]) for name in stages},
                 measured={f"{name} bytes per rank": int(memory.loc[name, "measured"]) for name in stages})

# %% [markdown]
# ## 9.4 시퀀스 병렬화 (선택 사항)
#
# 텐서 병렬화(tensor parallelism)는 어텐션(attention)과 MLP를 $t$개 랭크에 나누지만, 그 사이의 레이어 정규화(layer
# norm)와 드롭아웃은 모든 랭크에서 활성값(activation) 전체에 대해 실행됩니다. 시퀀스 병렬화(Korthikanti et al.,
# arXiv:2205.05198)는 이 부분을 대신 시퀀스 방향으로 나누어, 각 all-reduce를 reduce-scatter와 all-gather로 바꿉니다.
# 트래픽(traffic)은 같고, 모든 활성값이 $t$로 나뉩니다. 논문의 Table 2는 시퀀스 $s$, 마이크로배치(micro-batch) $b$, 은닉
# 크기(hidden size) $h$, 헤드(head) $a$개, 16비트일 때 레이어당 바이트를 시퀀스 병렬화 없이 $sbh(10 + 24/t + 5as/(ht))$,
# 있으면 $sbh(34 + 5as/h)/t$로 줍니다.
#
# 이 머신에서는 이를 보여 줄 수 없습니다. megatron-core의 시퀀스 병렬화에는 GPU 위의 Transformer Engine 레이어가
# 필요하고(labkit은 CPU 실행에서 `parallel.sequence_parallel`을 거부합니다), CPU에서 드라이버가 출력하는 메모리 줄은
# 라이브러리까지 포함한 프로세스 전체의 최고치라서 작은 모델의 활성값은 그 옆에서 묻혀 버립니다. 그래서 추정값만 봅니다.
# GPU에서 bf16으로 텐서 병렬 2를 쓰는 작은 GPT, 그리고 논문의 모델 중 하나로 텐서 병렬 8을 쓰는 GPT-3 175B입니다.
# 후자에서는 시퀀스 병렬화가 모델이 메모리에 들어가는지를 좌우합니다:

# %%
gpt3 = load_spec({"model": {"num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96, "seq_length": 2048,
                            "vocab_size": 51200}})
rows = {}
for name, (spec, tensor) in {"tiny, tp 2": (base, 2), "GPT-3 175B, tp 8": (gpt3, 8)}.items():
    per_layer = {on: activation_bytes_per_layer(Shape.of(spec.model), 1, tensor=tensor, sequence_parallel=on)
                 for on in (False, True)}
    rows[name] = {"sp off (MiB per layer)": per_layer[False] / 2 ** 20,
                  "sp on (MiB per layer)": per_layer[True] / 2 ** 20, "saved": 1 - per_layer[True] / per_layer[False]}
pd.DataFrame(rows).T.round(3)

# %% [markdown]
# 시퀀스 병렬화는 텐서 병렬화가 모든 랭크에 온전히 남겨 두는 $10\,sbh$를 나눕니다. 텐서 병렬 2에서는 레이어의 작은
# 부분이지만, 8에서는 큰 부분입니다. 트래픽을 늘리지 않으므로, GPU에서 텐서 병렬화를 쓰는 곳이라면 이것을 꺼 둘 이유가
# 거의 없습니다. labkit의 플래너(planner)도 이것을 탐색합니다(`parallel.sequence_parallel`).

# ## 연습 문제
#
# **연습 문제 1.** 혼합 정밀도(mixed precision) Adam에 대한 ZeRO의 계산은 파라미터당 2 + 2 + 12 = 16바이트입니다. 데이터 병렬
# GPU 64개로 3단계를 쓰면, 각 GPU는 파라미터당 몇 바이트를 가집니까?

# %%
answer_1 = ...

# %%
check("09.1", answer_1)

# %% [markdown]
# **연습 문제 2 (과제).** ZeRO 논문 Figure 1의 모델은 파라미터 75억(7.5 billion) 개, 혼합 정밀도 Adam, 데이터 병렬 GPU 64개입니다.
# 2단계에서 각 GPU는 모델 상태를 몇 GB($10^9$바이트) 가집니까?

# %%
answer_2 = ...

# %%
check("09.2", answer_2)

# %% [markdown]
# **연습 문제 3 (과제).** 텐서 병렬 8의 GPT-3 175B($s = 2048$, $b = 1$, $h = 12288$, $a = 96$)에서 시퀀스 병렬화는 레이어의 활성값을
# 몇 배 줄입니까? (Table 2에서 시퀀스 병렬화가 없을 때의 값을 있을 때의 값으로 나눈 비율)

# %%
answer_3 = ...

# %%
check("09.3", answer_3)

# %% [markdown]
# **연습 문제 4 (과제).** Megatron의 정밀도 인식 옵티마이저(precision-aware optimizer, `optimizer.precision_aware`,
# Transformer Engine의 FusedAdam)는 bf16 학습의 fp32 마스터 가중치를 bf16에 없는 하위 16비트만으로(파라미터당 2바이트)
# 보관하고, Adam의 두 모멘트를 bf16으로 저장할 수 있습니다. bf16 모멘트, fp32 그래디언트, 데이터 병렬 GPU 8개에 걸친
# 분산 옵티마이저(distributed optimizer)에서 GPU 하나는 파라미터당 몇 바이트를 가집니까?

# %%
answer_4 = ...

# %%
check("09.4", answer_4)

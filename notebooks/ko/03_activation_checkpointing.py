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
# # 실습 03: 활성값 체크포인팅(activation checkpointing): 아낀 메모리, 치른 시간
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - Megatron의 각 재계산(recompute) 모드가 역전파(backward pass)를 위해 무엇을 보관하는지 설명합니다: `uniform` 또는
#   `block` 방식의 `full`, `selective`, 또는 재계산 없음.
# - 각 모드가 아끼는 활성값(activation) 메모리와 다시 수행하는 순전파(forward pass) 작업량을 레이어(layer)별로 예측합니다.
# - 둘 다 측정합니다: 순전파가 역전파를 위해 남겨 두는 메모리(프로파일러(profiler)의 메모리 곡선이 평평해집니다)와
#   반복(iteration)당 시간을 재고, 예측과 나란히 놓습니다.
# - 재계산이 어떤 숫자도 바꾸지 않음을, 즉 손실(loss)이 똑같음을 확인합니다.
#
# 이 실습은 NVIDIA DLI 워크숍 *Model Parallelism: Building and Deploying Large Neural Networks*의 4.2절에 해당합니다
# (`--activations-checkpoint-method uniform`, 지금은 `--recompute-granularity full --recompute-method uniform`).

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
gpu = "cpu"              # the GPU of the one-GPU runs below ("A100-80GB" on a cluster)
iterations = 10
log_interval = 1
recompute_layers = 1     # uniform: layers per checkpointed group; block: layers checkpointed per stage

# %%
from labkit.diagrams import show
from labkit.estimate.recompute import against_measured, recompute_table
from labkit.answer_key import check
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.sweep import Sweep, profiled
from labkit.messages import say
from labkit.paths import example, shipped_corpus
from labkit.logs.losses import loss_table
from labkit.logs.views import comparison_table, iteration_time_figure
from labkit.profiling import views as profile_views
from labkit.spec import load_spec

# %% [markdown]
# ## 3.1 각 모드가 보관하는 것
#
# 일반적인 순전파에서는 모든 레이어가 중간 결과(활성값)를 역전파에서 필요할 때까지 보관합니다. 재계산(recomputation)은
# 더 적게 보관하는 대신 역전파 도중에 순전파의 일부를 다시 실행합니다:
# - **full, uniform**: 레이어를 `num_layers`개씩 묶습니다. 각 묶음은 입력만 보관하고, 묶음 전체가 재계산됩니다.
# - **full, block**: 각 파이프라인 스테이지(pipeline stage)의 처음 `num_layers`개 레이어는 입력만 보관하고, 나머지 레이어는
#   전부 보관합니다(아끼는 양도 재계산하는 양도 적습니다. 메모리가 조금만 모자랄 때 씁니다).
# - **selective**: 모든 레이어가 어텐션 코어(attention core)만 빼고 전부 보관합니다. 어텐션 코어란 $a \cdot s^2$ 크기의
#   점수 행렬(score matrix)과 그 softmax, dropout으로, 재계산 비용은 싸지만 시퀀스가 길면 보관하기에는 큽니다.

# %%
show("activation_checkpointing")

# %% [markdown]
# ## 3.2 예측하기
#
# 숫자를 보기 전에 먼저 여러분의 추측부터: 네 실행(`none`, `selective`, `full/uniform`, `full/block`)을 보관하는 활성값
# 메모리가 적은 것부터 많은 것 순으로, 그리고 반복이 빠른 것부터 느린 것 순으로 나열해 보세요. 3.4에서 여러분의 순서를
# 추정치(estimate)의 순서, 측정된 순서와 나란히 놓습니다.

# %% tags=["prediction"]
my_prediction = {
    "least memory first": ...,   # e.g. ["selective", "full/uniform", "none", "full/block"]
    "fastest first": ...,
}

# %% [markdown]
# 이제 추정치입니다. 이 작은 모델은 레이어가 2개입니다. 마이크로배치(micro-batch) 하나에 대해 각 레이어의 크기는 그 레이어가
# 보관하는 양으로 정하고(Korthikanti et al.의 레이어별 공식이며, 임베딩(embedding) 출력과 fp32 로짓(logit)은 모든 모드에서
# 보관됩니다), 추가 연산량(extra compute)은 재계산되는 순전파 작업이 한 스텝 전체 작업에서 차지하는 비율입니다.

# %%
base = load_spec(example(spec_file)).replace(**{
    "train.iters": iterations, "train.log_interval": log_interval,
    "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 1}]}}, data=shipped_corpus())
modes = {
    "none": None,
    "selective": {"granularity": "selective", "method": None},
    "full/uniform": {"granularity": "full", "method": "uniform", "num_layers": recompute_layers},
    "full/block": {"granularity": "full", "method": "block", "num_layers": recompute_layers},
}
specs = {name: base.replace(recompute=mode) for name, mode in modes.items()}
predicted = recompute_table(specs)
predicted.round(3)

# %% [markdown]
# ## 3.3 네 가지 모드 실행하기
#
# 각각 프로세스 하나로 네 실행을 함께 돌리고, 실행마다 반복 하나를 프로파일링(profiling)합니다.

# %%
jobs = backend_named(backend)
sweep = Sweep.submit(jobs, {name: profiled(spec, max(1, iterations - 1)) for name, spec in specs.items()},
                     prefix="lab03")
states = sweep.wait()
print({name: str(state) for name, state in states.items()})

# %% [markdown]
# ## 3.4 메모리 측정
#
# 먼저 워크숍에서처럼 로그의 메모리 항목을 봅니다:

# %%
comparison_table(sweep.logs, baseline="none")[["recompute", "max_allocated_mb", "iteration_ms", "speedup"]]

# %% [markdown]
# GPU에서 이 항목은 CUDA 할당자(allocator)의 최대값이며, 재계산을 쓰면 줄어듭니다(NVIDIA DLI 워크숍에서는 약 12 GB에서
# 3 GB로 떨어졌습니다). CPU에서는 프로세스의 상주 메모리(resident memory)로, PyTorch 자체만으로 수백 MB를 차지하므로
# 작은 모델의 활성값은 그 안에 묻혀 버립니다. 대신 프로파일러는 모든 할당을 셉니다. 프로파일링한 반복의 메모리 곡선은
# 순전파 동안 올라가고 역전파 동안 내려가며, 재계산은 이 곡선을 평평하게 만듭니다.

# %%
traces = {name: sweep.traces(name)[0] for name in sweep.jobs}
profile_views.memory_figure(traces).show()

# %%
measured = profile_views.comparison_table(traces).set_index("run")
measured[["saved_mb", "peak_growth_mb", "step_ms"]].round(3)

# %% [markdown]
# `saved_mb`는 역전파가 시작될 때 순전파가 할당된 채로 남겨 둔 메모리, 즉 역전파를 위해 보관한 활성값입니다(MiB).
# 이제 이를 예측과 나란히 놓습니다. 메모리는 재계산하지 않을 때 대비 아낀 양으로, 시간은 재계산 없는 실행의 반복
# 시간 대비 더 든 비율로 나타냅니다:

# %%
steady_ms = comparison_table(sweep.logs)["iteration_ms"]
against_measured(predicted, measured["saved_mb"], steady_ms).round(3)

# %% [markdown]
# 여러분의 순서를 추정치의 순서, 측정된 순서와 나란히 놓습니다(메모리: 보관한 활성값, 시간: 반복당 시간):

# %%
def order(values) -> list[str]:
    return [name for name, _ in sorted(dict(values).items(), key=lambda item: item[1])]


prediction_table(my_prediction,
                 estimated={"least memory first": order(predicted["activations_mib"]),
                            "fastest first": order(predicted["extra_compute"])},
                 measured={"least memory first": order(measured["saved_mb"]), "fastest first": order(steady_ms)})

# %% [markdown]
# 메모리는 레이어별 예측을 따릅니다. 각 모드는 예측한 순서대로, 공식이 빠뜨린 작은 텐서 몇 개 정도의 차이 안에서 예측한
# 만큼을 아낍니다.
#
# 치른 시간은 CPU가 보여 주지 못하는 부분입니다. 작은 모델은 반복 시간의 상당 부분을 레이어 바깥에서 쓰고, 네 실행이 이
# 머신의 코어를 나눠 쓰므로, 실행 간 시간 차이가 재계산한 순전파의 비용보다 큽니다. 어떤 실행은 `none`보다 빠르게
# 측정되기도 합니다(위의 `measured_time_paid`는 절약이 아니라 잡음(noise)으로 읽으세요). GPU에서는 이 비용이 측정되어
# 있습니다. Korthikanti et al.([arXiv:2205.05198](https://arxiv.org/abs/2205.05198))은 530B(5300억) 파라미터 GPT를
# A100 2240개로 학습하면서, 선택적 재계산(selective recomputation)과 시퀀스 병렬화(sequence parallelism)를 함께 써서
# 모델 FLOPs 활용률(model FLOPs utilisation) 54.2%를 얻었고, 전체 재계산(full recomputation)으로는 42.1%였습니다.
# 29% 더 빠른 것으로, 두 방식에 대한 추정치의 차이와 비슷합니다(`extra_compute`: full은 한 스텝 연산의 3분의 1을
# 반복하고, selective는 몇 퍼센트만 반복합니다).

# %% tags=["check-claim"]
compared = against_measured(predicted, measured["saved_mb"], steady_ms)
off = (compared["measured_saved_mib"] - compared["predicted_saved_mib"]).abs()
assert (off <= (0.3 * compared["predicted_saved_mib"]).clip(lower=0.25)).all(), compared
assert order(compared["measured_saved_mib"]) == order(compared["predicted_saved_mib"]), compared

# %%
iteration_time_figure(sweep.logs).show()

# %% [markdown]
# ## 3.5 재계산은 어떤 숫자도 바꾸지 않는다
#
# 재계산되는 순전파는 같은 드롭아웃 마스크(dropout mask)를 그대로 재현합니다(Megatron은 체크포인트마다 난수
# 상태(random state)를 함께 저장합니다). 그래서 손실은 비트 단위까지 같고, 네 실행 사이의 편차(spread)는 0입니다.

# %%
losses = loss_table(sweep.logs)
losses

# %% tags=["check-claim"]
assert (losses["spread"] == 0).all(), losses

# %% [markdown]
# ## 3.6 재계산을 처음부터 구현하기 (과제)
#
# 전체 재계산이 레이어 하나에 하는 일을 십여 줄로 옮기면 다음과 같습니다. `torch.autograd.Function`을 하나 만들어,
# forward에서는 레이어의 입력만 보관하고, backward에서는 순전파를 다시 실행해(이번에는 활성값을 보관하며) 그 결과를 거쳐
# 역전파합니다. Megatron의 `tensor_parallel.checkpoint`도 같은 일을 하되, 입력과 함께 난수 상태도 저장해서 다시 실행한
# 드롭아웃이 같은 마스크를 뽑게 합니다(아래 레이어에는 드롭아웃이 없으므로 이 구현은 그 부분을 생략해도 됩니다).

# %%
import torch


class Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, x):
        ctx.layer = layer
        ctx.save_for_backward(x)  # the input only: nothing the layer computes is kept
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            out = ctx.layer(x)  # the forward again, keeping its activations this time
        torch.autograd.backward(out, grad_out)  # fills the layer's weight gradients and x.grad
        return None, x.grad


# %% [markdown]
# megatron-core의 `tensor_parallel.checkpoint`, 그리고 모든 것을 보관하는 경우와 비교해 검증합니다: 그래디언트(gradient)가
# 같은지, 그리고 autograd가 역전파를 위해 저장한 바이트 수(saved-tensors 훅(hook)으로 셉니다)를 봅니다.

# %%
from labkit.train import cpu_compat

if not torch.cuda.is_available():
    cpu_compat.apply()  # megatron-core saves the GPU's random state; the compatibility layer saves the CPU's
from megatron.core.tensor_parallel import checkpoint as megatron_checkpoint

torch.manual_seed(0)
layer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
x = torch.randn(32, 64, requires_grad=True)


def saved_bytes_and_grads(forward):
    saved = []
    layer.zero_grad()
    x.grad = None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = forward()
    out.square().sum().backward()
    return sum(saved), [p.grad for p in layer.parameters()] + [x.grad]


kept, kept_grads = saved_bytes_and_grads(lambda: layer(x))
mine, my_grads = saved_bytes_and_grads(lambda: Recomputed.apply(layer, x))
megatron, megatron_grads = saved_bytes_and_grads(lambda: megatron_checkpoint(layer, False, x))
assert all(torch.allclose(a, b) and torch.allclose(a, c) for a, b, c in zip(my_grads, megatron_grads, kept_grads))
assert mine == megatron == x.numel() * x.element_size() < kept
print(say("lab03.saved_for_backward", kept=kept, mine=mine, megatron=megatron))

# %% [markdown]
# ## 연습 문제
#
# **연습 문제 1.** GPT-2 small은 레이어가 12개입니다. 파이프라인 스테이지 하나에서 `full` 재계산, `block` 방식,
# `num_layers` 4를 쓰면, 역전파 도중에 순전파를 다시 실행하는 레이어는 몇 개일까요?

# %%
answer_1 = ...

# %%
gpt2 = base.replace(model={"preset": "gpt2-small"})
check("03.1", answer_1, spec=gpt2)

# %% [markdown]
# **연습 문제 2 (과제).** `base`에서 출발해, 각 파이프라인 스테이지의 처음 2개 레이어만 체크포인팅하는 스펙(spec)을 만드세요.

# %%
answer_2 = ...

# %%
check("03.2", answer_2)

# %% [markdown]
# **연습 문제 3 (과제).** 16비트 레이어는 토큰 하나, 은닉 유닛(hidden unit) 하나당 $34 + 5 a s / h$ 바이트를 보관하는데, 선택적
# 재계산은 그중 어텐션 코어 몫인 $5 a s / h$를 버립니다. GPT-2 small($s$ = 1024, $h$ = 768, $a$ = 12, 12개 레이어)을
# bf16, 마이크로배치 4로 학습할 때, 이로써 마이크로배치당 몇 MiB를 아낄까요? (손으로 계산하세요: 레이어당
# $5as/h \cdot sbh$ 바이트.) 이는 Megatron의 비융합(unfused) 어텐션이 저장하는 어텐션 코어 기준으로, 실습들이 CPU에서
# 실행하는 방식이자 Korthikanti et al.이 센 방식입니다. 최근 GPU에서 megatron-core가 실행하는 플래시 어텐션(flash
# attention, 실습 05)에서는 점수 행렬이 애초에 저장되지 않습니다. 그 경우 선택적 재계산이 버릴 것이 남아 있지 않으므로
# 절약량은 약 0입니다.

# %%
answer_3 = ...

# %%
selective_bf16 = {"precision": "bf16", "recompute": {"granularity": "selective", "method": None}, "batch.micro": 4}
selective_gpt2 = recompute_table({"selective": gpt2.replace(**selective_bf16)})
check("03.3", answer_3, table=selective_gpt2)

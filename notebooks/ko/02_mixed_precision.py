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
# # 실습 02: 혼합 정밀도(mixed precision): fp32 기준 실행과 비교한 fp16과 bf16
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - 16비트 학습이 무엇을 바꾸는지 실행하기 전에 예측합니다: 파라미터당 바이트 수, 활성값(activation) 메모리, 그리고
#   텐서 코어(tensor core)가 있는 GPU에서의 속도.
# - 기준 실행(baseline), fp16, bf16을 나란히 학습하고(같은 스펙에서 `precision`만 바꿉니다) 반복(iteration) 시간,
#   메모리, 손실(loss)을 비교합니다.
# - 혼합 정밀도의 동적 손실 스케일(dynamic loss scale)을 설명합니다: 어느 16비트 형식에 필요한지, 왜 $2^{32}$에서
#   시작하는지, 왜 줄어드는지, 줄어드는 동안 왜 반복을 건너뛰는지(그리고 로그를 읽기 전에 건너뛸 횟수를 세어 봅니다).
# - 프로파일러(profiler)를 읽습니다: 행렬 곱셈에 쓰인 시간의 비율과 역전파(backward pass)를 위해 보관하는 메모리를
#   보고, 실행 결과를 TensorBoard에서 엽니다.
#
# 이 실습은 NVIDIA DLI 워크숍 *Model Parallelism: Building and Deploying Large Neural Networks*의 4.1절
# (`GPT_ARGS`에 `--fp16` 추가)에 해당하며, 여기에 `bf16`을 나란히 다룹니다.

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
iterations = 20          # keep 20 or more: one of the runs logs no loss for its first iterations (2.4 says why)
log_interval = 1
predict_on = "A100-80GB"  # a GPU with tensor cores, for the predictions

# %%
import math
import time
from pathlib import Path

import pandas as pd
import torch

from labkit.estimate.compare import compare
from labkit.estimate.memory import bytes_per_param
from labkit.answer_key import check
from labkit.diagrams import show
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.sweep import Sweep, profiled
from labkit.messages import say
from labkit.paths import example, shipped_corpus
from labkit.logs.loss_scale import loss_scale_history, skipped_until
from labkit.logs.views import comparison_table, iteration_time_figure, loss_figure
from labkit.profiling import tensorboard
from labkit.profiling import views as profile_views
from labkit.spec import load_spec

# %% [markdown]
# ## 2.1 먼저 예측하기
#
# 혼합 정밀도는 순전파(forward pass)와 역전파에 쓸 가중치의 16비트 사본과, 옵티마이저(optimizer)가 쓸 fp32 마스터
# 사본(master copy)을 함께 유지합니다. Adam을 쓸 때 파라미터당 바이트 수는 다음과 같습니다(Megatron의 계산 방식):
#
# | 정밀도 | 가중치 | 그래디언트(gradient) | 옵티마이저 상태(optimizer state) | 합계 |
# |---|---|---|---|---|
# | fp32 | 4 | 4 | 8 (m, v) | 16 |
# | bf16 | 2 | 4 (fp32) | 12 (fp32 마스터, m, v) | 18 |
# | fp16 | 2 | 2 | 16 (fp32 마스터와 그래디언트, m, v) | 20 |
#
# fp16 행의 fp32 그래디언트 사본은 옵티마이저 스텝 동안에만 존재합니다. 다음 반복의 `zero_grad`가 순전파 전에 이를
# 해제하므로, 최대 메모리에서 이 사본은 활성값 위에 더해지지 않고 활성값이 쓰는 메모리를 나눠 씁니다.
#
# 즉 *모델 상태(model state)*는 오히려 커집니다. 줄어드는 것은 16비트로 저장되는 활성값입니다. 어느 쪽이 이기는지는
# 모델과 배치에 달려 있습니다. 워크숍의 GPT-2 크기 모델에 대해 labkit의 추정치는 fp16에서 메모리가 *줄어든다*고
# 말하지만(절반이 된 활성값이 커진 모델 상태보다 더 크게 작용합니다), NVIDIA DLI 워크숍 "Model Parallelism"에서는 최대
# 메모리가 약 10 GB에서 12 GB로 늘었다고 보고했습니다. 그 차이는 추정치가 항목별로 세지 않는 메모리(할당자(allocator)의
# 캐시, 스텝 중에 만들어지는 손실 스케일링용 사본과 16비트 사본)입니다. 추정만 하지 말고 측정도 해야 하는 이유 가운데
# 하나입니다.

# %% tags=["nbval-check-output"]
for precision in ("fp32", "bf16", "fp16"):
    weight, grad, optimizer = bytes_per_param(precision)
    print(f"{precision}: {weight:g} + {grad:g} + {optimizer:g} = {weight + grad + optimizer:g} bytes per parameter")

# %% [markdown]
# 추정치를 보기 전에: 이 실습에서 *이 머신의 CPU로* 학습하는 세 실행에 대해 무엇을 예상하나요? 아래 셀에 예측을
# 적으세요(항목마다 정밀도 이름 하나). 2.3에서 labkit의 추정치, 측정값과 나란히 놓고 비교합니다.

# %% tags=["prediction"]
my_prediction = {
    "fastest here": ...,           # "fp32", "bf16" or "fp16"
    "logs no loss at first": ...,  # which precision skips its first iterations
}

# %%
base = load_spec(example(spec_file)).replace(
    **{"train.iters": iterations, "train.log_interval": log_interval}, data=shipped_corpus())
specs = {precision: base.replace(precision=precision) for precision in ("fp32", "fp16", "bf16")}
compare(specs)[["gpu", "precision", "bytes_per_param", "weights_mib", "gradients_mib", "optimizer_mib",
                "activations_mib", "total_mib", "iteration_ms"]].round(3)

# %% [markdown]
# labkit의 카탈로그(catalog)는 CPU에 세 정밀도 모두 같은 임시 최대 성능(placeholder peak) 하나를 줍니다. 그래서 이
# 머신에서 추정된 시간은 각 실행이 옮기는 활성값 바이트 수로만 달라지고, fp32에서는 그 양이 두 배이므로 추정치는 16비트
# 실행들을 앞에 둡니다. 이것은 연산 속도에 대한 추측일 뿐이며, CPU마다 사정이 다릅니다. AVX-512 BF16이나 AMX 명령어가
# 있는 CPU(Cooper Lake와 Sapphire Rapids 이후의 Intel Xeon, Zen 4 이후의 AMD)는 bf16 행렬 곱을 하드웨어로 처리해
# fp32보다 몇 배 빠릅니다. 반면 fp16은 대부분의 CPU와 그 PyTorch 빌드에 그런 경로가 없어 소프트웨어로 변환하므로, 흔히
# 열 배 이상 느립니다. 이 머신에는 무엇이 있을까요? 명령어 플래그(flag)와, 정밀도별 1024 x 1024 행렬 곱을 봅시다:

# %%
def matmul_ms(dtype, n=1024, budget_s=0.3):
    """The fastest of a few n x n matrix products (one, when a single product already takes budget_s)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a[:64, :64] @ b[:64, :64]  # the first call picks the kernel
    times = []
    while len(times) < 5 and sum(times) < budget_s:
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


cpuinfo = Path("/proc/cpuinfo")
flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
bf16_hardware = sorted(flags & {"avx512_bf16", "amx_bf16"})
fp16_hardware = sorted(flags & {"avx512_fp16", "amx_fp16"})
print(say("lab02.cpu_flags", bf16=", ".join(bf16_hardware) or say("lab02.none"),
          fp16=", ".join(fp16_hardware) or say("lab02.none"))
      if cpuinfo.exists() else say("lab02.no_cpuinfo"))
matmul = {name: matmul_ms(getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[name]))
          for name in ("fp32", "bf16", "fp16")}
for name, ms in matmul.items():
    print(say("lab02.matmul_speed", name=name, ms=ms, speedup=matmul["fp32"] / ms))

# %% [markdown]
# 위에서 bf16이 fp32보다 빨랐다면 이 CPU는 bf16 곱셈을 하드웨어로 처리합니다. 두 16비트 곱이 모두 더 느렸다면
# 소프트웨어로 변환하는 것이고, 추정치가 뭐라고 하든 아래의 16비트 학습 실행은 fp32보다 느릴 것입니다. 텐서 코어가
# 있는 GPU에서는 두 16비트 형식 모두 fp32보다 몇 배 빠르게 돕니다. 같은 레이아웃(layout)을 `predict_on`의 GPU에
# 놓으면 다음과 같습니다:

# %%
compare(specs, gpu=predict_on)[["gpu", "precision", "iteration_ms", "samples_per_s", "total_mib"]].round(4)

# %% [markdown]
# ## 2.2 세 가지를 나란히 학습하기
#
# 스펙 하나, 정밀도 셋. 세 실행은 함께 제출됩니다(랩톱에서는 코어를 나눠 쓰므로 실습 01과 비교하지 말고 서로끼리
# 비교하세요). 각 실행은 마지막에서 두 번째 반복을 프로파일링(profiling)합니다. 그때쯤이면 fp16도 건너뛰는 반복을
# 지나 있습니다.

# %%
jobs = backend_named(backend)
sweep = Sweep.submit(jobs, {name: profiled(spec, max(1, iterations - 1)) for name, spec in specs.items()},
                     prefix="lab02")
states = sweep.wait()
print({name: str(state) for name, state in states.items()})

# %% [markdown]
# ## 2.3 반복 시간, 메모리, 손실

# %%
comparison_table(sweep.logs, baseline="fp32", specs=sweep.specs)[
    ["iteration_ms", "speedup", "samples_per_s", "max_allocated_mb", "precision", "warmup_excluded"]]

# %% [markdown]
# 여러분의 예측, 추정치, 측정값을 나란히 놓습니다(추정치의 "fastest here"는 2.1의 행렬 곱 결과이고, "logs no loss at
# first"는 2.4의 손실 스케일로 한 예측입니다. 동률은 "or"로 이어 적습니다):

# %%
def fastest(times) -> str:
    times = dict(times)
    return " or ".join(sorted(name for name, t in times.items() if t <= min(times.values()) * 1.001))


measured_ms = comparison_table(sweep.logs)["iteration_ms"]
no_loss_first = [name for name, log in sweep.logs.items() if pd.isna(log.iterations["lm_loss"].iloc[0])]
# The catalog's one CPU peak cannot rank the precisions (2.1): the estimate of the fastest is the matrix products'.
prediction_table(my_prediction,
                 estimated={"fastest here": f"{fastest(matmul)} (2.1's matrix product)",
                            "logs no loss at first": "fp16"},
                 measured={"fastest here": fastest(measured_ms), "logs no loss at first": " or ".join(no_loss_first)})

# %% tags=["check-claim"]
if matmul["fp32"] * 2 < min(matmul["bf16"], matmul["fp16"]):  # 2.1: then the 16-bit runs train slower than fp32
    assert measured_ms["fp32"] < min(measured_ms["bf16"], measured_ms["fp16"]), measured_ms.to_dict()

# %%
iteration_time_figure(sweep.logs).show()

# %%
loss_figure(sweep.logs).show()

# %% [markdown]
# 세 실행은 labkit에 포함된 코퍼스로 학습하므로, 손실이 약 ln 730 = 6.6(실습 01에서처럼 토크나이저 전체에 대해
# 균등하게 찍은 값)에서부터 내려갑니다. fp32와 bf16은 소수점 둘째 자리까지 같은 곡선을 그립니다. bf16은 모든 곱을 유효
# 비트 8개로 반올림하지만 fp32의 표현 범위는 그대로 유지하고, fp32 마스터 가중치가 작은 업데이트를 보존하기 때문입니다.
# fp16은 처음에는 손실을 기록하지 않다가, 다른 실행들이 시작한 지점에서 출발해 건너뛴 반복 수만큼 늦게 fp32 곡선을
# 따라갑니다. 건너뛴 반복은 가중치를 하나도 바꾸지 않기 때문입니다. 여기서 정밀도가 바꾸는 것은 속도, 메모리, fp16의
# 처음 몇 반복이지, 모델이 배우는 내용이 아닙니다.
#
# bf16 명령어가 없는 CPU에서는 fp16과 bf16 모두 fp32보다 *느리게* 학습합니다. CPU가 소프트웨어로 변환하기 때문입니다.
# AVX-512 BF16이나 AMX가 있으면 bf16의 행렬 곱이 하드웨어에서 돌아 세 실행 중 가장 빠를 수도 있고, fp16은 여전히
# 변환을 거치므로 가장 느립니다. 이 CPU가 어느 쪽인지는 2.1에서 측정했습니다. GPU의 텐서 코어는 두 16비트 형식 모두
# fp32보다 몇 배 빠르게 곱합니다. CPU에서 로그의 메모리 항목은 프로세스의 상주 메모리(resident memory)이며 대부분은
# PyTorch 자체가 차지합니다. GPU에서는 CUDA 할당자의 값이므로 16비트 활성값의 효과가 드러납니다. 프로파일러(2.5)는 두
# 경우 모두 할당을 직접 봅니다.
#
# fp16의 손실 곡선은 늦게 시작합니다. 왜일까요?
#
# ## 2.4 손실 스케일과 건너뛴 반복
#
# fp16은 크기가 65504까지인 값만 담을 수 있습니다. 약 $6 \times 10^{-5}$ 아래로는 유효 비트가 점점 줄어들고(비정규
# 수(subnormal number)), 약 $6 \times 10^{-8}$ 아래에서는 그래디언트가 0이 됩니다. Megatron은 역전파 전에 손실에
# 스케일 $S$를 곱해 작은 그래디언트가 살아남게 하고, 옵티마이저 스텝 전에 그래디언트를 다시 $S$로 나눕니다. $S$가 너무
# 크면 `inf`로 오버플로(overflow)가 나고, 그 스텝은 **건너뜁니다**(가중치는 그대로 두고
# `number of skipped iterations`에 집계합니다). 그리고 $S$를 절반으로 줄입니다. 스케일은 일부러 가능한 한 큰 값인
# $2^{32}$에서 시작해, 스케일된 그래디언트가 범위 안에 들어올 때까지 줄어듭니다. 오버플로 없는 스텝이 1000번 이어지면
# 다시 두 배로 키워 봅니다. 히스테리시스(hysteresis)가 2이면 첫 번째 오버플로는 절반 감소를 준비시킬 뿐, 스케일을
# 줄이지는 않습니다.
#
# **연습 문제 1.** 로그를 읽기 전에 세어 보세요. NVIDIA DLI 워크숍 "Model Parallelism"의 fp16 실행은 히스테리시스 2로
# $2^{32}$에서 시작해, 반복 20에서 손실 스케일 131072를 기록했습니다. 그때까지 몇 번의 반복을 건너뛰었을까요?

# %%
answer_1 = ...

# %%
check("02.1", answer_1)

# %% [markdown]
# 이제 같은 $2^{32}$에서 시작한 이 실습의 fp16 실행 로그입니다:

# %%
history = loss_scale_history(sweep.logs["fp16"])
history

# %%
final_scale = history["loss_scale"].iloc[-1]
print(say("lab02.fp16_scale_fell", final=final_scale,
          predicted=skipped_until(base.optimizer.initial_loss_scale, final_scale),
          logged=history["skipped_total"].iloc[-1]))
print(say("lab02.bf16_scale", scale=loss_scale_history(sweep.logs["bf16"])["loss_scale"].iloc[-1],
          skipped=loss_scale_history(sweep.logs["bf16"])["skipped_total"].iloc[-1]))

# %% [markdown]
# **처음부터 구현하기(from scratch).** 동적 손실 스케일러 전체는 몇 줄이면 됩니다. 오버플로를 히스테리시스만큼 세다가 다
# 소진되면 절반으로 줄이고, 오버플로 없는 스텝이 `growth_interval`번 이어지면 두 배로 늘립니다(이때 히스테리시스도
# 복원합니다).

# %%
def my_loss_scales(overflows, scale=2.0 ** 32, hysteresis=2, growth_interval=1000, min_scale=1.0):
    """The scale after each step, given whether that step's gradients overflowed."""
    left, clean, scales = hysteresis, 0, []
    for overflow in overflows:
        if overflow:
            clean, left = 0, left - 1
            if left <= 0:
                scale = max(scale / 2, min_scale)
        else:
            clean += 1
            if clean == growth_interval:
                clean, left, scale = 0, hysteresis, scale * 2
        scales.append(scale)
    return scales


# %% [markdown]
# megatron-core의 `DynamicGradScaler`(fp16 실행이 실제로 사용한 것)와 비교해 검증합니다. 오버플로, 정상 스텝,
# 재증가가 모두 들어 있는 시퀀스를 씁니다(재증가를 한 번 보기 위해 여기서는 증가 간격(growth interval)을 3으로 둡니다):

# %%
import torch
from labkit.train import cpu_compat

if not torch.cuda.is_available():
    cpu_compat.apply()  # megatron-core keeps its scale on the GPU; labkit's compatibility layer puts it on the CPU
from megatron.core.optimizer.grad_scaler import DynamicGradScaler

overflows = [True] * 5 + [False] * 3 + [True, False, True, True]
reference = DynamicGradScaler(initial_scale=2.0 ** 32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=3, hysteresis=2)
megatron_scales = []
for overflow in overflows:
    reference.update(torch.tensor(overflow))
    megatron_scales.append(float(reference.scale))
assert my_loss_scales(overflows, growth_interval=3) == megatron_scales
print([f"2^{math.log2(s):g}" for s in megatron_scales])

# %% [markdown]
# 같은 이력을 TensorBoard 스칼라(scalar)로도 볼 수 있습니다. 실행의 이벤트 파일(event file)에서 다시 읽어 옵니다:

# %%
scalars = tensorboard.read_scalars(sweep.run_dirs["fp16"])
profile_views.scalars_figure(scalars, ["loss-scale"]).show()

# %% [markdown]
# ## 2.5 프로파일러로 보기 (선택 사항)
#
# 워크숍에서는 PyTorch 프로파일러 결과를 TensorBoard에서 읽습니다: 텐서 코어 커널(kernel)에 쓰인 GPU 시간의 비율,
# 그리고 fp16 사본이 만들어지는 지점에서 뛰어오르는 메모리 곡선. 여기서는 같은 질문에 프로파일링한 반복의
# 트레이스(trace)로 답합니다. `matmul_share`는 행렬 곱셈에 쓰인 시간의 비율, `saved_mb`는 순전파가 역전파를 위해 남겨
# 둔 메모리(활성값, MiB), `peak_growth_mb`는 한 스텝 안에서 메모리가 얼마나 올라갔는지입니다.

# %%
traces = {name: sweep.traces(name)[0] for name in sweep.jobs}
profile_views.comparison_table(traces).round(3)

# %%
profile_views.breakdown_figure(traces).show()

# %%
profile_views.memory_figure(traces).show()

# %% [markdown]
# 16비트 실행은 역전파를 위해 남기는 양이 더 적습니다(활성값 크기가 절반이고, 로짓(logit)은 fp32로 남습니다). 여기서
# 통신 시간은 대부분 한 랭크(rank)가 그래디언트 all-reduce에서 다른 랭크를 기다리는 시간입니다. 두 랭크가 이 머신의
# 코어를 다른 실행들과 나눠 쓰기 때문입니다. matmul 비율은 그 나머지 시간에 대한 비율입니다. GPU에서라면
# `tensor_core_share`가 커널 시간 중 텐서 코어에서 돈 비율을 보여 주겠지만, CPU 트레이스에는 커널이 없습니다.
#
# 스칼라를 대화형으로 살펴보려면 실행을 TensorBoard에서 여세요. 워크숍은 트레이스를 TensorBoard의 "PYTORCH_PROFILER"
# 탭에서 봤는데, 이 탭에는 PyTorch가 지원을 중단(deprecated)한 `torch-tb-profiler` 플러그인이 필요합니다. 대신 트레이스
# 파일을 [Perfetto](https://ui.perfetto.dev)에서 열거나(파일은 브라우저 안에서 읽히며 아무것도 업로드되지 않습니다),
# Chrome의 `chrome://tracing`에서 여세요.

# %%
from labkit.profiling import trace as traces_of

print(tensorboard.tensorboard_command(sweep.run_dirs["fp16"]))
print("\n".join(str(path) for path in traces_of.find_traces(sweep.run_dirs["fp16"])))

# %% [markdown]
# ## 2.6 모델 상태 샤딩(sharding): ZeRO와 Megatron의 분산 옵티마이저(distributed optimizer)
#
# 혼합 정밀도에서 모델 상태는 파라미터당 16~20바이트이고, 일반적인 데이터 병렬화(data parallelism)는 그 전부를 모든
# GPU에 둡니다. ZeRO(Rajbhandari et al., [arXiv:1910.02054](https://arxiv.org/abs/1910.02054))는 이를 $N$개의 데이터
# 병렬 GPU에 세 단계(stage)로 나눠 둡니다: 옵티마이저 상태(1단계), 이어서 그래디언트(2단계), 그리고 파라미터(3단계).
# Megatron의 분산 옵티마이저(`optimizer.distributed: true`, `--use-distributed-optimizer`)는 1단계에 해당합니다. 각
# 랭크는 자기 몫인 1/N 샤드(shard)의 fp32 마스터 가중치와 Adam 모멘트(moment)만 보관합니다. 통신량은 이것이 대체하는
# all-reduce와 같습니다: 스텝 전에 그래디언트를 reduce-scatter하고, 스텝 후에 갱신된 파라미터를 all-gather합니다.
# 3단계(PyTorch FSDP, DeepSpeed)는 순전파와 역전파에서 각 레이어(layer)의 파라미터를 다시 모읍니다. 통신량은 약 1.5배가
# 되지만 메모리는 가장 적게 씁니다.

# %%
show("zero_stages")

# %%
gpus = 8
print(say("lab02.zero_heading", gpus=gpus))
# one GPU: nothing to shard
print(say("lab02.zero_replicated", per_param=sum(bytes_per_param("bf16", 1, zero_stage=1))))
for stage in (1, 2, 3):
    print(f"  ZeRO-{stage}:     {sum(bytes_per_param('bf16', gpus, zero_stage=stage)):5.2f}")

# %% [markdown]
# ZeRO의 계산 방식은 파라미터당 $2 + 2 + K$바이트이며, 혼합 정밀도 Adam에서는 $K = 12$입니다. 16비트 가중치와
# 그래디언트, fp32 마스터 가중치와 두 fp32 모멘트입니다. Megatron의 bf16은 한 항목만 다릅니다. 그래디언트를 fp32(4바이트,
# `--grad-reduce-in-bf16`이면 2바이트)로 두므로 복제(replicated)한 상태는 $2 + 4 + 12 = 18$바이트이고, 분산 옵티마이저는
# $2 + 4 + 12/N$을 남깁니다(`bytes_per_param('bf16', gpus, distributed_optimizer=True)`, megatron-core가 실제로 할당하는
# 바이트). 실습 09에서 네 단계를 실행하고 측정합니다.
#
# Korthikanti et al.([arXiv:2205.05198](https://arxiv.org/abs/2205.05198))의 시퀀스 병렬화(sequence parallelism)는
# 또 하나의 큰 항목인 활성값을 텐서 병렬 GPU들에 나눠 둡니다. 텐서 병렬화(tensor parallelism)가 복제된 채로 남겨 두는
# LayerNorm과 드롭아웃(dropout)이 각각 시퀀스의 1/t만 처리하고, 텐서 병렬화의 all-reduce 하나하나는 통신량이 같은
# all-gather와 reduce-scatter로 바뀝니다. 실습 07에서는 모델을 텐서 병렬 랭크들에 나눠 봅니다. 실습 06의
# 플래너(planner)는 GPU에서 텐서 병렬화를 쓰는 곳이면 어디서나 시퀀스 병렬화를 켭니다.
#
# ## 연습 문제
#
# (연습 문제 1은 2.4절에서, 그 답을 보여 주는 로그보다 먼저 풀었습니다.)
#
# **연습 문제 2.** 손실 스케일 없이 학습하는 16비트 형식은 무엇일까요? `"fp16"` 또는 `"bf16"`으로 답하세요.

# %%
answer_2 = ...

# %%
check("02.2", answer_2)

# %% [markdown]
# **연습 문제 3 (과제).** fp16과 Megatron의 분산 옵티마이저를 데이터 병렬 GPU 8개에서 쓰면, 각 GPU는 파라미터당 몇 바이트의 모델
# 상태를 보관할까요? (`bytes_per_param`에 답이 있지만, 먼저 손으로 계산해 보세요.)

# %%
answer_3 = ...

# %%
check("02.3", answer_3)

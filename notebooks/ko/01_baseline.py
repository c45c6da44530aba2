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
# # 실습 01: 기준 실행(baseline run): 작업 작성, 제출, 관찰, 로그 읽기
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - 학습 실행을 실행 스펙(run spec)으로 기술하고, 그로부터 생성된 Slurm 작업 스크립트(job script)를 확인합니다(워크숍에서
#   손으로 작성하던 `sbatch` 스크립트를 이제 생성합니다. `srun`이 노드마다 태스크를 하나씩 띄우고, 각 태스크는 첫 번째
#   노드를 향해 `torchrun`을 시작합니다).
# - 이 스펙을 백엔드(backend)에 제출하고(랩톱에서는 로컬 백엔드, 클러스터에서는 Slurm이며 호출은 똑같습니다) 실행을
#   실시간으로 따라갑니다.
# - Megatron의 로그를 표로 읽어 냅니다: 반복(iteration) 시간, 손실(loss), 처리량(throughput), 메모리.
#
# 랩톱에서는 이 작업이 CPU 프로세스 두 개로 아주 작은 GPT를 학습합니다. 클러스터에서는 파라미터 셀(parameters cell)에서
# `backend = "slurm"`과 더 큰 `model`만 지정하면 되고, 그 밖에는 아무것도 바뀌지 않습니다.

# %% tags=["parameters"]
backend = "local"       # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
iterations = 30
log_interval = 3

# %%
from labkit.answer_key import check
from labkit.estimate import estimate
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.report import format_report, report, widget
from labkit.jobs.render import render
from labkit.messages import say
from labkit.paths import example, runs_dir, shipped_corpus
from labkit.logs.derive import steady_state
from labkit.logs.views import comparison_table, loss_figure
from labkit.spec import load_spec

# %% [markdown]
# ## 1.1 실행 스펙
#
# YAML 파일 하나가 모든 것을 정합니다. 무엇을 학습할지는 모델 프리셋(model preset)으로, 모델을 어떻게 나눌지는
# 텐서 병렬(tensor parallel), 파이프라인 병렬(pipeline parallel), 데이터 병렬(data parallel)로 정하고, 배치(batch),
# 정밀도(precision), 클러스터도 이 파일에 적습니다. 나머지(Megatron의 플래그, 작업 스크립트, 추정치(estimate))는 모두
# 이 파일에서 생성됩니다.

# %%
spec = load_spec(example(spec_file)).replace(
    **{"train.iters": iterations, "train.log_interval": log_interval},
    data=shipped_corpus())  # the corpus labkit ships
print(spec.to_yaml())
print(say("lab01.layout", world_size=spec.world_size, data_parallel=spec.data_parallel,
          micro_batches=spec.num_micro_batches, micro=spec.batch.micro))

# %% [markdown]
# ## 1.2 작업 스크립트
#
# Slurm에서는 바로 이 스크립트가 제출됩니다. 워크숍의 스크립트 그대로이되, 모든 값은 스펙에서 오고 사용자가 준
# 문자열은 모두 셸 인용(shell quoting) 처리됩니다. `labkit run SPEC --dry-run`도 같은 내용을 출력합니다.

# %%
script = render(spec, runs_dir() / "RUN_ID" / "logs", layout="multinode")
for name, text in script.scripts.items():
    print(f"# ===== {name} =====\n{text}")

# %% [markdown]
# 실행하기 전에 예상해 봅시다. 이 작은 GPT의 학습 반복 한 번이 이 머신에서 몇 밀리초 걸릴까요? 무작정 찍을 필요는
# 없습니다. 아래 셀은 반복 한 번이 하는 작업량(순전파(forward pass)와 역전파(backward pass)의 부동소수점 연산 수로,
# 세는 방법은 실습 05에서 배웁니다)과 이 머신이 fp32 행렬 곱을 얼마나 빨리 계산하는지를 보여 줍니다. 작업량을 속도로
# 나눈 값은 하한(floor)입니다. 행렬 곱 사이의 연산, 옵티마이저 스텝(optimizer step), 프로세스 간 통신이 그 위에
# 더해집니다. 1.4에서 여러분의 예측을 labkit의 추정치, 그리고 측정값과 나란히 놓고 비교합니다.

# %%
import time

import torch

work = estimate(spec).flops_per_iteration
a = torch.randn(512, 512)
a @ a  # the first product picks the kernel
start = time.perf_counter()
for _ in range(10):
    a @ a
speed = 10 * 2 * 512 ** 3 / (time.perf_counter() - start)
print(say("lab01.work_and_speed", gflop=work / 1e9, gflops=speed / 1e9, ms=work / speed * 1e3))

# %% tags=["prediction"]
my_prediction = {"time per iteration (ms)": ...}  # a number

# %% [markdown]
# ## 1.3 제출하고 지켜보기
#
# `submit`은 곧바로 `Job`을 반환합니다. 아래 뷰는 작업이 도는 동안 2초마다 갱신되며,
# [FASOP의 Megatron-LM 스크립트](https://github.com/AvatarHwang/FASOP)에 있는 `get_result.sh`처럼 노드별 로그, 작업
# 스스로가 파악한 병렬 레이아웃(layout)을 스펙과 비교한 결과, 지금까지 진행된 반복을 보여 줍니다.

# %%
jobs = backend_named(backend)
job = jobs.submit(spec)
job

# %% tags=["nbval-ignore-output", "widgets"]
widget(job)

# %%
state = job.wait(progress=False)
print(f"{job.job_id}: {state}")
assert str(state) == "COMPLETED", job.cause()

# %% [markdown]
# ## 1.4 로그 읽기
#
# 드라이버(driver)는 Megatron-LM 고유의 로그 형식으로 기록하므로, 같은 파서(parser)가 이 실행도, 클러스터에서 돌린 어떤
# Megatron 실행도 읽습니다. `job.result()`는 모든 노드의 로그를 파싱합니다.

# %%
log = job.result()
log.iterations[["iteration", "elapsed_ms", "lm_loss", "lr", "global_batch_size", "grad_norm"]]

# %%
loss_figure({"baseline": log}).show()

# %% [markdown]
# 손실은 약 ln 730 = 6.6에서 출발해 내려갑니다. 이 값은 코퍼스 토크나이저(tokenizer)의 토큰 730개 중에서 균등하게
# 찍었을 때의 손실입니다. 이 스펙은 labkit에 포함된 작은 코퍼스(corpus)로 학습합니다(`labkit/data/corpus/`, 토큰화되어
# 있으며 실습 08에서 직접 만듭니다). 작은 모델은 이 몇 번의 반복 안에 가장 자주 나오는 토큰들을 익힙니다.
# `data: {mock: true}`(예제 스펙 원래의 설정)로 두면 모델은 무작위 토큰을 보게 되고, 아무리 오래 학습해도 손실은
# ln 1024 = 6.93에 머뭅니다. 모의 데이터(mock data)는 데이터셋 없이 속도와 메모리를 재는 용도이며, 그 이상은 아닙니다.

# %% [markdown]
# 실행 하나를 한 행으로 요약합니다: 정상 상태(steady state)의 반복 시간, 처리량, 메모리. `tflops_per_gpu`는 프로세스당
# 초당 모델 FLOPs입니다(이만큼 작은 모델에서는 로그에 찍힌 값이 0.0으로 반올림되므로, 어느 값을 썼는지는
# `tflops_source`가 알려 줍니다). `mfu`는 CPU에서는 비어 있습니다. CPU에는 나눌 기준이 되는 공개된 최대 성능(peak)이
# 없기 때문입니다. GPU에서는 둘 다 채워집니다(실습 05).

# %%
comparison_table({"baseline": log}, specs={"baseline": spec})

# %%
prediction_table(my_prediction, estimated={"time per iteration (ms)": estimate(spec).iteration_time_s * 1e3},
                 measured={"time per iteration (ms)": steady_state(log.iterations).iteration_ms})

# %%
print(format_report(report(job), color=False))

# %% [markdown]
# 처음 몇 번의 반복은 더 느립니다(워밍업(warm-up): 메모리 할당, 첫 데이터 읽기). 정상 상태 시간은 이 반복들을
# 제외합니다. 위의 labkit 추정치는 CPU를 1.2에서 측정한 속도가 아니라 카탈로그(catalog)에 적힌 임시 최대 성능
# (placeholder peak)으로 계산하므로, CPU에서는 측정값과 크게 어긋날 수 있고 작업량 / 속도 하한보다 낮게 나오기도 합니다.
# 실습 06에서는 이 임시 값을 이 머신에서 측정한 프로파일(profile)로 바꿉니다. 실습 02는 이 기준 실행에서 출발합니다.
#
# ## 연습 문제
#
# **연습 문제 1.** `spec`에서 출발해 마이크로배치(micro-batch) 2와 프로세스 두 개는 그대로 두고, 글로벌 배치(global batch)
# 16으로 학습하는 스펙을 만드세요. 이제 각 프로세스는 반복마다 마이크로배치를 몇 개 실행할까요? (점으로 구분된 키
# `"batch.global"`과 함께 `spec.replace(...)`를 사용하세요.)

# %%
answer_1 = ...

# %%
check("01.1", answer_1)

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
# # 실습 05: 비용을 치르기 전에 추정하기: 파라미터, FLOPs, MFU, 학습 일수, 메모리
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - GPT 모델의 파라미터(parameter) 수를 모델의 형상(shape)으로부터 세고, NVIDIA 워크숍의 수치를 재현합니다;
# - 측정한 반복(iteration) 시간을 GPU당 TFLOP/s와 GPU 최대 성능(peak) 대비 비율로 바꿉니다;
# - 말뭉치(corpus)를 한 번 다 도는 데 며칠이 걸리는지 예측합니다;
# - 제출하기 전에 스펙(spec)으로부터 실행 전체를 추정합니다(반복 시간의 구성, 파이프라인 스테이지(pipeline stage)별
#   메모리, 메모리에 들어가는지 여부).
#
# 여기 나오는 모든 수치는 `labkit estimate SPEC` 뒤에서 도는 것과 같은 코드인 `labkit.estimate`에서 나옵니다.

# %% tags=["parameters"]
# The NVIDIA DLI workshop "Model Parallelism", section 4.4: a GPT on 16 A100s, global batch 512, 32.09 s/iter.
gpu = "A100-80GB"
num_gpus = 16
global_batch = 512
iteration_time_s = 32.09
dataset_tokens = 300e9
spec_file = "gpt2-xl-hetero.yaml"
llama_gpu = "H100-SXM"   # section 5.5: the GPU to size Llama-family models on
llama_nodes = 16         # ... and how many nodes of 8 of them

# %%
from ipywidgets import fixed, interact

from labkit import catalog
from labkit.estimate import (achieved_tflops, estimate, flops_72, flops_96, gpt_params, training_days,
                             utilization)
from labkit.estimate.views import (breakdown_table, days_per_epoch, memory_bars, model_size_table, sizing_table,
                                   time_breakdown)
from labkit.answer_key import check
from labkit.exercises import prediction_table
from labkit.messages import say
from labkit.paths import example
from labkit.spec import load_spec

# %% [markdown]
# NVIDIA DLI 워크숍의 4.4절은 레이어(layer) 40개, 은닉 크기(hidden size) 6144인 GPT를 A100 16개에서, 1024
# 토큰(token)짜리 시퀀스(sequence) 512개로 된 글로벌 배치(global batch)로 학습시켜 반복당 32.09 s를 측정했습니다. 공식을
# 보기 전에 먼저 예상해 보세요: 이 모델의 파라미터는 몇 개일까요? A100 하나가 낸 TFLOP/s는 얼마일까요(bf16 최대 성능은
# 312)? 그리고 그 16개 GPU로 3,000억(300 billion) 토큰을 한 번 훑는 데 며칠이 걸릴까요? 5.3에서 여러분의 예상을 공식의
# 답과 나란히 놓아 봅니다.

# %% tags=["prediction"]
my_sizes = {
    "parameters": ...,          # a number, e.g. 12e9
    "TFLOP/s per A100": ...,
    "days for 300B tokens": ...,
}

# %% [markdown]
# ## 5.1 파라미터는 몇 개인가?
#
# GPT 레이어 하나에는 어텐션 프로젝션(attention projection, 가중치 $4h^2$개)과 MLP($8h^2$개), 그리고 바이어스(bias)와
# 레이어 정규화(layer norm)가 들어 있고, 임베딩(embedding)이 $(V + s)h$를 더합니다. Narayanan et al. (SC21, eq. 2):
#
# $$P = 12 l h^2 \left(1 + \frac{13}{12h} + \frac{V + s}{12lh}\right)$$
#
# 여기서 $l$은 레이어 수, $h$는 은닉 크기, $V$는 어휘(vocabulary) 크기, $s$는 시퀀스 길이입니다. 워크숍의 예: 레이어
# 40개, $h$ = 6144, $V$ = 50257, 그리고 워크숍의 공식에 입력된 $s$ = 1048. 워크숍의 시퀀스는 1024 토큰이므로 1048은
# 오타입니다. 아래 셀들은 워크숍의 수치를 재현하려고 1048을 그대로 쓰며, 1024로 바꾸면 무엇이 달라지는지는 5.3에서
# 봅니다.

# %% tags=["nbval-check-output"]
params = gpt_params(l=40, h=6144, s=1048, V=50257)
print(f"{params:,} parameters")

# %% [markdown]
# Megatron-LM 논문이 학습시킨 크기들(SC21의 Table 1,
# [aws-samples/awsome-distributed-training](https://github.com/aws-samples/awsome-distributed-training)의 Megatron-LM
# 테스트 케이스에 실린 대로)을 `labkit/data/models.yaml`의 프리셋(preset)으로 보여 줍니다. 정확한 개수(GQA, SwiGLU,
# RMSNorm, 로터리 위치 임베딩(rotary positions), 묶지 않은 임베딩(untied embeddings)까지 반영합니다)는 공식의 값에
# 공식이 빠뜨린 마지막 레이어 정규화의 $2h$를 더한 것입니다.

# %% tags=["nbval-check-output"]
model_size_table()

# %% [markdown]
# 슬라이더를 움직여 보세요: $h$가 수천 단위에 이르면 곧바로 $12lh^2$ 항이 지배적이 됩니다. 모델의 크기가 대부분 깊이와
# 너비로 정해지는 이유입니다.

# %% tags=["nbval-ignore-output", "widgets"]
def show_params(l, h, s, V):
    count = gpt_params(l, h, s, V)
    print(f"{count:,} parameters ({count / 1e9:,.2f} billion)")


_ = interact(show_params, l=(2, 96, 2), h=(256, 12288, 256), s=fixed(2048), V=fixed(50257))

# %% [markdown]
# ## 5.2 반복 시간에서 GPU당 TFLOP/s와 활용률(utilisation)로
#
# 부동소수점 연산(floating-point operation)은 거의 전부 행렬 곱셈에서 나옵니다. 활성값 전체 재계산(full activation
# recomputation; 순전파(forward) 두 번과 역전파(backward) 한 번)을 쓰면, $B$개 시퀀스로 된 글로벌 배치에 대한 반복 한
# 번의 비용은 다음과 같습니다(SC21, eq. 3).
#
# $$F = 96 B s l h^2 \left(1 + \frac{s}{6h} + \frac{V}{16lh}\right)$$
#
# 이를 측정한 시간과 GPU 수로 나눈 뒤 GPU의 최대 성능과 비교합니다.

# %% tags=["nbval-check-output"]
flops = flops_96(B=global_batch, s=1048, l=40, h=6144, V=50257)
tflops = achieved_tflops(flops, iteration_time_s, num_gpus)
peak = catalog.gpu(gpu).peak("bf16")
share = utilization(flops, iteration_time_s, peak * num_gpus)
print(f"{flops:.4e} FLOPs per iteration")
print(f"{tflops:.1f} TFLOP/s per GPU, {share:.2%} of the {gpu}'s {peak:g} TFLOP/s")

# %% [markdown]
# 이 50.55%는 재계산한 순전파도 유용한 일로 셉니다: 이것은 *하드웨어* FLOP 활용률(hardware FLOP utilisation)입니다. 모델
# FLOP 활용률(model FLOP utilisation, MFU)은 모델에 꼭 필요한 일, 즉 $72Bslh^2(\dots)$만 셉니다: 같은 실행이 같은 속도로
# 돌아도 MFU는 더 낮습니다. 두 값 모두 `labkit estimate`에 나옵니다.

# %%
model_only = flops_72(B=global_batch, s=1048, l=40, h=6144, V=50257)
print(f"MFU {utilization(model_only, iteration_time_s, peak * num_gpus):.2%}  vs  HFU {share:.2%}")

# %% [markdown]
# ## 5.3 에포크(epoch)당 일수
#
# $T$개 토큰을 GPU $n$개에서 GPU당 $X$ TFLOP/s로 학습하는 데는, 재계산을 쓰면 약 $8TP/(nX)$초가 걸립니다(SC21, eq. 4;
# 재계산 없이는 $6TP/(nX)$).

# %% tags=["nbval-check-output"]
days = training_days(tokens=dataset_tokens, params=params, num_gpus=num_gpus, tflops_per_gpu=tflops)
print(f"{days:.0f} days per epoch on {num_gpus} GPUs")

# %% [markdown]
# 공식의 1048 대신 워크숍의 시퀀스가 실제로 가진 1024 토큰을 쓰면, 모델의 파라미터는 147,456개($24h$, 이 크기에서는
# 무시할 만한 양) 줄지만 반복 한 번의 FLOPs는 2.4% 줄어듭니다: GPU당 154.0 TFLOP/s, 208일. 여기서의 수치는 워크숍의
# 본문처럼 1048을 그대로 씁니다.

# %% tags=["check-claim"]
params_1024 = gpt_params(l=40, h=6144, s=1024, V=50257)
tflops_1024 = achieved_tflops(flops_96(B=512, s=1024, l=40, h=6144, V=50257), 32.09, 16)
assert gpt_params(l=40, h=6144, s=1048, V=50257) - params_1024 == 24 * 6144, params_1024
assert round(tflops_1024, 1) == 154.0 and round(training_days(300e9, params_1024, 16, tflops_1024)) == 208, tflops_1024

# %% [markdown]
# 여러분의 예상을 공식의 값과 나란히 놓아 봅니다(워크숍이 측정한 것은 공식의 출발점인 반복 시간뿐입니다):

# %%
prediction_table(my_sizes, estimated={"parameters": params, "TFLOP/s per A100": tflops, "days for 300B tokens": days},
                 measured={})

# %% [markdown]
# 7개월입니다. 논문의 GPT-3 예: 파라미터 175B, A100 1024개, GPU당 140 TFLOP/s.

# %% tags=["nbval-check-output"]
print(f"GPT-3: {training_days(tokens=300e9, params=175e9, num_gpus=1024, tflops_per_gpu=140):.0f} days")

# %% tags=["nbval-check-output"]
days_per_epoch(params=params, tokens=dataset_tokens, gpu_counts=[16, 64, 256, 1024], tflops_per_gpu=tflops).round(1)

# %% tags=["nbval-ignore-output", "widgets"]
def show_days(tokens, params, num_gpus, tflops_per_gpu, recompute):
    days = training_days(tokens, params, num_gpus, tflops_per_gpu, recompute)
    print(say("lab05.days_on_gpus", days=days, weeks=days / 7, gpus=num_gpus, tflops=tflops_per_gpu))


_ = interact(show_days, tokens=fixed(dataset_tokens), params=fixed(params), num_gpus=(8, 2048, 8),
             tflops_per_gpu=(50.0, 400.0, 10.0), recompute=True)

# %% [markdown]
# ## 5.4 스펙으로부터 추정하는 실행 전체
#
# 위의 공식에는 측정된 반복 시간이 필요합니다. `estimate(spec)`은 그 시간을 예측합니다: GPU를 측정한
# 프로파일(profile)로부터(또는 FLOPs / (peak x efficiency)로부터) 레이어별 연산 시간을, 1F1B 파이프라인과 그
# 버블(bubble)을, 텐서(tensor)·파이프라인(pipeline)·데이터 병렬(data-parallel) 통신을 계산하고, 모든 파이프라인
# 스테이지의 메모리를 해당 GPU와 대조합니다. 여기서는
# [FASOP의 Megatron-LM 스크립트](https://github.com/AvatarHwang/FASOP)에 있는 GPT-2 XL을, A100 노드 1개와 A10 노드 7개로
# 이루어진 FASOP의 이기종 클러스터(heterogeneous cluster)에서, 스크립트의 불균등 분할(uneven partition)
# `0-11-8-8-8-8-5-0`로 추정합니다.

# %% [markdown]
# 추정을 보기 전에: FASOP의 스크립트는 이 GPT-2 XL 레이아웃(layout; 파이프라인 8, 데이터 병렬 4, fp16, 글로벌 배치 64)을
# A10 4개짜리 노드 8개에서 실행했습니다. 반복당 몇 초가 걸릴 것 같습니까? 5.4의 끝에서 여러분의 예상을 labkit이 그
# 실행에 대해 추정한 값, 그리고 FASOP의 로그에 측정된 시간과 나란히 놓아 봅니다.

# %% tags=["prediction"]
my_prediction = {"GPT-2 XL on 32 A10, s per iteration": ...}  # a number

# %%
from labkit.diagrams import show
show("heterogeneous_pipeline")

# %%
spec = load_spec(example(spec_file))
est = estimate(spec)
print(say("lab05.estimate_summary", params=est.params, iteration_s=est.iteration_time_s, mfu=est.mfu,
          fits=say("lab05.yes") if est.fits_in_memory else say("lab05.no")))
time_breakdown(est).show()
breakdown_table(est).round(3)

# %%
memory_bars(est).show()

# %% [markdown]
# 1F1B에서 $p$개 스테이지 중 스테이지 $i$는 최대 $p - i$개 마이크로배치(micro-batch)의 활성값(activation)을 동시에 들고
# 있으므로, 앞쪽 스테이지가 가장 많이 들고 있습니다. 불균등 분할에서는 가장 작은 GPU에 놓인 가장 무거운 앞쪽 스테이지가
# 메모리 판정을 좌우합니다.
#
# 분할을 다시 보세요: 첫 번째 숫자, 즉 스테이지 0의 레이어 수가 0이고, 스테이지 0은 A100 노드입니다. A100은 임베딩만
# 맡은 채 스텝 내내 거의 놀고, 48개 레이어는 전부 A10이 짊어집니다. 이 레이아웃은 가장 빠른 GPU를 낭비합니다: 같은
# 설정으로 A10 노드 8개에서 추정해 보면 더 느리지 않습니다.

# %%
all_a10 = estimate(spec.replace(cluster="a10x8"))
print(say("lab05.first_stage", gpu=est.stage_gpus[0], layers=spec.partition_string.split("-")[0],
          stage_ms=est.stage_times_s[0] * 1e3, slowest_ms=max(est.stage_times_s) * 1e3,
          iteration_s=est.iteration_time_s, all_a10_s=all_a10.iteration_time_s))

# %% tags=["check-claim"]
assert spec.partition_string.startswith("0-") and est.stage_gpus[0].startswith("A100"), spec.partition_string
assert all_a10.iteration_time_s <= est.iteration_time_s * 1.01, (all_a10.iteration_time_s, est.iteration_time_s)

# %% [markdown]
# FASOP의 스크립트는 이 레이아웃을 A10 4개짜리 노드 8개에서 재계산(recompute) 없이 돌려 반복당 1.4 s를 측정했습니다.
# 실습 06에서는 A100에 제 몫을 주는 레이아웃을 탐색합니다.
#
# 추정기(estimator)는 얼마나 정확할까요? 여기서는 DGX A100에서 공개된 Megatron-LM 실행 결과와 비교합니다: SC21의 Table
# 1(`labkit/data/calibration.yaml`의 A100 효율은 이 표에 맞춰 피팅(fitting)했습니다)과 Korthikanti et al.의 Table
# 5(피팅에 전혀 쓰지 않은 검증용 데이터(held out)로, 선택적 재계산(selective recompute)과 시퀀스 병렬화(sequence
# parallelism)를 씁니다). 표에는 그 뒤로 다른 집합의 행도 이어지며, 각 행에 집합의 이름이 붙어 있습니다: NVIDIA의 H100과
# Blackwell 성능 요약, 100만 토큰까지의 컨텍스트 병렬화, 그리고 PyTorch 자체의 FSDP2 스택.

# %% tags=["nbval-ignore-output"]
from labkit.estimate.published import published_table
published_table().round(3)

# %%
# the run as FASOP's scripts made it: 8 nodes x 4 A10, no recompute, the 2022 stack's unfused attention
on_a10 = estimate(spec.replace(cluster="a10x8", recompute=None, kernels={"attention_backend": "unfused"}))
prediction_table(my_prediction, estimated={"GPT-2 XL on 32 A10, s per iteration": on_a10.iteration_time_s},
                 measured={"GPT-2 XL on 32 A10, s per iteration": 1.4})  # FASOP's Megatron-LM logs

# %% [markdown]
# ## 5.5 오늘날의 디코더(decoder) 모델: 여러분이 고른 GPU에서의 Llama (선택 사항)
#
# Llama 계열 모델은 5.1의 계산을 바꿉니다: 로터리 위치 임베딩(rotary positions; 위치 테이블 없음), RMSNorm(가중치만 있고
# 바이어스 없음), 선형 레이어(linear layer)에 바이어스 없음, SwiGLU의 MLP 행렬 세 개, 그리고 그룹 쿼리
# 어텐션(grouped-query attention)의 더 작은 K와 V. labkit의 프리셋은 Megatron-LM이 모델을 구성하는 방식 그대로
# 파라미터를 셉니다: Llama-2 7B는 파라미터가 6,738,415,616개로, 공개된 수치와 정확히 같습니다. 아래는 각 모델을
# `llama_gpu` 8개짜리 노드 `llama_nodes`개에서, bf16, 분산 옵티마이저(distributed optimizer), 선택적 재계산으로,
# Megatron 사용자가 출발점으로 삼을 만한 레이아웃에서 추정한 것입니다. Llama-3의 8,192 토큰 시퀀스는 시퀀스당 어텐션
# 점수(attention score)를 Llama-2의 네 배만큼 담지만(점수는 길이의 제곱에 비례해 늘어납니다), 이 GPU들에서
# megatron-core가 실행하는 플래시 어텐션(flash attention)은 그 점수를 저장하지 않습니다: labkit은 대신 헤드(head)별
# 통계를 셉니다.

# %% tags=["nbval-ignore-output"]
sizing_table(llama_gpu, llama_nodes)

# %% tags=["nbval-ignore-output", "widgets"]
_ = interact(sizing_table, gpu=sorted(catalog.gpus()), nodes=(1, 64), layouts=fixed(None), global_batch=fixed(1024),
             seq_length=fixed(None))

# %% [markdown]
# ## 연습 문제
#
# **연습 문제 1.** 실습들에서 쓰는 GPT-2 small(워크숍의 실습 모델)은 $l$ = 12, $h$ = 768, $s$ = 1024, $V$ = 50257입니다.
# 파라미터는 몇 개입니까?

# %%
answer_1 = ...

# %%
check("05.1", answer_1)

# %% [markdown]
# **연습 문제 2 (과제).** 워크숍에서 이 모델을 fp16으로 돌린 실행(글로벌 배치 16, GPU 4개; 기준 실행(baseline)에 `--fp16`만 추가하고
# 재계산은 없음)은 반복당 311.9 ms가 걸렸습니다. GPU당 몇 TFLOP/s입니까?

# %%
answer_2 = ...

# %%
check("05.2", answer_2)

# %% [markdown]
# **연습 문제 3 (과제).** GPU당 같은 157.7 TFLOP/s로, 18B 모델이 300B 토큰을 30일 안에 끝내려면 A100이 몇 개 필요합니까? (가장 작은
# 정수로 답하세요.)

# %%
answer_3 = ...

# %%
check("05.3", answer_3)

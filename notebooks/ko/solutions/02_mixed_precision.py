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
# # 실습 02 해답: 혼합 정밀도(mixed precision)

# %%
import math

from labkit.answer_key import check

# %% [markdown]
# **연습 문제 1.** $2^{32} / 131072 = 2^{15}$: 열다섯 번 절반으로 줄었고, 그 하나하나가 건너뛴 반복입니다. 여기에
# 히스테리시스(hysteresis) 2가 스케일을 줄이지 않고 흡수한 첫 오버플로(overflow)를 더하면 16입니다.

# %%
answer_1 = int(math.log2(2 ** 32 / 131072)) + 1
answer_1

# %%
check("02.1", answer_1)

# %% [markdown]
# **연습 문제 2.** bf16은 fp32의 지수 비트(exponent bit) 8개를 그대로 유지하고(약 $3 \times 10^{38}$까지 표현) 대신 가수
# 비트(mantissa bit)를 줄였습니다. 그래디언트(gradient)가 오버플로도 언더플로(underflow)도 나지 않으므로 스케일이 필요 없습니다.

# %%
answer_2 = "bf16"

# %%
check("02.2", answer_2)

# %% [markdown]
# **연습 문제 3.** 모든 GPU에 fp16 가중치(2)와 그래디언트(2)가 있고, fp32 마스터 가중치, fp32 그래디언트, Adam의 모멘트
# 두 개(16)는 8개로 나뉩니다: $2 + 2 + 16/8 = 6$.

# %%
answer_3 = 2 + 2 + 16 / 8
answer_3

# %%
check("02.3", answer_3)

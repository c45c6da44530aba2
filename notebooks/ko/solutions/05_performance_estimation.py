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
# # 실습 05 해답: 성능 추정(performance estimation)

# %%
import math

from labkit.estimate import achieved_tflops, flops_72, gpt_params, training_days
from labkit.answer_key import check

# %% [markdown]
# **연습 문제 1.** GPT-2 small: $l$ = 12, $h$ = 768, $s$ = 1024, $V$ = 50257.

# %%
answer_1 = gpt_params(l=12, h=768, s=1024, V=50257)
print(f"{answer_1:,}")

# %%
check("05.1", answer_1)

# %% [markdown]
# **연습 문제 2.** 그 실행은 `--fp16`만 추가했고 재계산(recomputation)은 없었습니다: $B$ = 16으로 $F = 72 B s l h^2(\dots)$를
# 구한 다음 0.3119 s와 GPU 4개로 나눕니다(GPU당 약 11.2 TFLOP/s).

# %%
answer_2 = achieved_tflops(flops_72(B=16, s=1024, l=12, h=768, V=50257), iteration_time_s=0.3119, num_gpus=4)
print(f"{answer_2:.1f} TFLOP/s per GPU")

# %%
check("05.2", answer_2)

# %% [markdown]
# **연습 문제 3.** 일수는 $1/n$에 비례합니다: $n \ge 16 \cdot d_{16} / 30$. 18B 모델은 5.1에서처럼 셉니다(워크숍의 공식이
# 1024 토큰 시퀀스에 대해 입력한 그대로 $s$ = 1048).

# %%
days_on_16 = training_days(tokens=300e9, params=gpt_params(40, 6144, 1048, 50257), num_gpus=16,
                           tflops_per_gpu=157.7296879710454)
answer_3 = math.ceil(16 * days_on_16 / 30)
print(answer_3, "GPUs:", round(training_days(300e9, gpt_params(40, 6144, 1048, 50257), answer_3, 157.73), 1), "days")

# %%
check("05.3", answer_3)

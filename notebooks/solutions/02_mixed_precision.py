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
# # Lab 02 solutions: mixed precision

# %%
import math

from labkit.answer_key import check

# %% [markdown]
# **Exercise 1.** $2^{32} / 131072 = 2^{15}$: fifteen halvings, each one a skipped iteration, plus the first overflow,
# which hysteresis 2 absorbs without halving: 16.

# %%
answer_1 = int(math.log2(2 ** 32 / 131072)) + 1
answer_1

# %%
check("02.1", answer_1)

# %% [markdown]
# **Exercise 2.** bf16 keeps fp32's 8 exponent bits (range up to about $3 \times 10^{38}$) and gives up mantissa
# bits instead; gradients neither overflow nor underflow, so no scale is needed.

# %%
answer_2 = "bf16"

# %%
check("02.2", answer_2)

# %% [markdown]
# **Exercise 3.** fp16 weights (2) and gradients (2) on every GPU, the fp32 master weights, fp32 gradients and Adam's
# two moments (16) split over 8: $2 + 2 + 16/8 = 6$.

# %%
answer_3 = 2 + 2 + 16 / 8
answer_3

# %%
check("02.3", answer_3)

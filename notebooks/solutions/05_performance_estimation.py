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
# # Lab 05 solutions: performance estimation

# %%
import math

from labkit.estimate import achieved_tflops, flops_72, gpt_params, training_days
from labkit.answer_key import check

# %% [markdown]
# **Exercise 1.** GPT-2 small: $l$ = 12, $h$ = 768, $s$ = 1024, $V$ = 50257.

# %%
answer_1 = gpt_params(l=12, h=768, s=1024, V=50257)
print(f"{answer_1:,}")

# %%
check("05.1", answer_1)

# %% [markdown]
# **Exercise 2.** That run added only `--fp16`, no recomputation: $F = 72 B s l h^2(\dots)$ with $B$ = 16, then
# divide by 0.3119 s and 4 GPUs (about 11.2 TFLOP/s per GPU).

# %%
answer_2 = achieved_tflops(flops_72(B=16, s=1024, l=12, h=768, V=50257), iteration_time_s=0.3119, num_gpus=4)
print(f"{answer_2:.1f} TFLOP/s per GPU")

# %%
check("05.2", answer_2)

# %% [markdown]
# **Exercise 3.** Days scale as $1/n$: $n \ge 16 \cdot d_{16} / 30$, with the 18B model counted as in 5.1 ($s$ = 1048,
# as the workshop's formula types it for its 1024-token sequences).

# %%
days_on_16 = training_days(tokens=300e9, params=gpt_params(40, 6144, 1048, 50257), num_gpus=16,
                           tflops_per_gpu=157.7296879710454)
answer_3 = math.ceil(16 * days_on_16 / 30)
print(answer_3, "GPUs:", round(training_days(300e9, gpt_params(40, 6144, 1048, 50257), answer_3, 157.73), 1), "days")

# %%
check("05.3", answer_3)

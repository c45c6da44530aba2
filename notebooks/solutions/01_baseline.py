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
# # Lab 01 solutions: the baseline run

# %%
from labkit.answer_key import check
from labkit.paths import example
from labkit.spec import load_spec

spec = load_spec(example("tiny-cpu.yaml"))

# %% [markdown]
# **Exercise 1.** Global 16 = micro 2 x data parallel 2 x 4 micro-batches.

# %%
answer_1 = spec.replace(**{"batch.global": 16})
answer_1.num_micro_batches

# %%
check("01.1", answer_1)

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
# # Lab 00 solutions: setup

# %%
from labkit.answer_key import check

# %% [markdown]
# **Exercise 1.** `default_backend()` picks Slurm wherever `sbatch` is on the PATH.

# %%
answer_1 = "slurm"

# %%
check("00.1", answer_1)

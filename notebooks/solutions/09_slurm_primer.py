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
# # Lab 09 solutions: a Slurm primer

# %%
from labkit.answer_key import check

# %% [markdown]
# **Exercise 1.** A job that waits for resources is PENDING, with the reason `Resources` beside it in `squeue`; it
# becomes RUNNING once the nodes are free.

# %%
answer_1 = "PENDING"

# %%
check("09.1", answer_1)

# %% [markdown]
# **Exercise 2.** Generic resources are `NAME:TYPE:COUNT` per node: `--gres=gpu:a100:2`.

# %%
answer_2 = "gpu:a100:2"

# %%
check("09.2", answer_2)

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
# # Lab 00 solutions: setup and a Slurm primer

# %%
from labkit.answer_key import check

# %% [markdown]
# **Exercise 1.** `default_backend()` picks Slurm wherever `sbatch` is on the PATH.

# %%
answer_1 = "slurm"

# %%
check("00.1", answer_1)

# %% [markdown]
# **Exercise 2.** A job that waits for resources is PENDING, with the reason `Resources` beside it in `squeue`; it
# becomes RUNNING once the nodes are free (in 0.6, when the first job was cancelled).

# %%
answer_2 = "PENDING"

# %%
check("00.2", answer_2)

# %% [markdown]
# **Exercise 3.** Generic resources are `NAME:TYPE:COUNT` per node: `--gres=gpu:a100:2`.

# %%
answer_3 = "gpu:a100:2"

# %%
check("00.3", answer_3)

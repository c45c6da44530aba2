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
# # Lab 04 solutions: gradient accumulation

# %%
from labkit.answer_key import check
from labkit.paths import example
from labkit.spec import load_spec

gpu = "cpu"
base = load_spec(example("tiny-cpu.yaml")).replace(
    cluster={"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 1}]})

# %% [markdown]
# **Exercise 1.** Four data-parallel GPUs of micro-batch 4 take 16 samples per pass; 64 / 16 = 4 micro-batches.

# %%
answer_1 = base.replace(**{"batch.micro": 4, "batch.global": 64,
                           "cluster": {"nodes": [{"gpu": gpu, "count": 2, "gpus_per_node": 2}]}})
answer_1.num_micro_batches

# %%
check("04.1", answer_1)

# %% [markdown]
# **Exercise 2.** Every iteration consumes one global batch: 16 x 10.

# %%
answer_2 = 16 * 10

# %%
check("04.2", answer_2)

# %% [markdown]
# **Exercise 3.** Each micro-batch's activations are freed by its own backward pass before the next forward, so the
# memory peak is one micro-batch's; the passes run one after another, so the time grows.

# %%
answer_3 = "time per iteration"

# %%
check("04.3", answer_3)

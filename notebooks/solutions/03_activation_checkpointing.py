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
# # Lab 03 solutions: activation checkpointing

# %%
from labkit.estimate.recompute import recompute_table
from labkit.answer_key import check
from labkit.paths import example
from labkit.spec import load_spec

base = load_spec(example("tiny-cpu.yaml")).replace(
    cluster={"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 1}]})
gpt2 = base.replace(model={"preset": "gpt2-small"})

# %% [markdown]
# **Exercise 1.** Block checkpoints (and so recomputes) the first `num_layers` layers of the stage; the other 8 keep
# all their activations: 4.

# %%
answer_1 = 4

# %%
check("03.1", answer_1, spec=gpt2)

# %% [markdown]
# **Exercise 2.**

# %%
answer_2 = base.replace(recompute={"granularity": "full", "method": "block", "num_layers": 2})

# %%
check("03.2", answer_2)

# %% [markdown]
# **Exercise 3.** $5as/h = 5 \cdot 12 \cdot 1024 / 768 = 80$ bytes per token and hidden unit, against 34 for the rest of
# the layer: at this sequence length the scores are most of a layer's activations. Times $sbh = 1024 \cdot 4 \cdot 768$
# and 12 layers, in MiB (with flash attention it would be about 0: the scores are never stored):

# %%
answer_3 = 80 * 1024 * 4 * 768 * 12 / 2 ** 20
answer_3

# %%
selective_bf16 = {"precision": "bf16", "recompute": {"granularity": "selective", "method": None}, "batch.micro": 4}
selective_gpt2 = recompute_table({"selective": gpt2.replace(**selective_bf16)})
check("03.3", answer_3, table=selective_gpt2)

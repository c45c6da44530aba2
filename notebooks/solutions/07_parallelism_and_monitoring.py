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
# # Lab 07 solutions: 3D parallelism and monitoring

# %%
from labkit.answer_key import check
from labkit.paths import example
from labkit.spec import load_spec

gpu = "cpu"
base = load_spec(example("tiny-cpu.yaml"))

# %% [markdown]
# **Exercise 1.** 8 GPUs in all; each model replica spans tensor x pipeline = 4 of them: 2 replicas.

# %%
answer_1 = 2 * 4 // (2 * 2)

# %%
eight = base.replace(**{"parallel.tensor": 2, "parallel.pipeline": 2,
                        "cluster": {"nodes": [{"gpu": gpu, "count": 2, "gpus_per_node": 4}]}})
check("07.1", answer_1, spec=eight)

# %% [markdown]
# **Exercise 2.** Every data-parallel replica computed gradients on its own samples; they are summed across the
# replicas once per iteration, in the data-parallel group.

# %%
answer_2 = "dp"

# %%
check("07.2", answer_2)

# %% [markdown]
# **Exercise 3.** $(p - 1) / (m + p - 1) = 7 / 23$ of the iteration (SC21's $(p - 1) / m = 7 / 16$ is the bubble
# over the bubble-free time).

# %%
answer_3 = 7 / 23
answer_3

# %%
check("07.3", answer_3)

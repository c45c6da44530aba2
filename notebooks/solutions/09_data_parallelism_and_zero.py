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
# # Lab 09 solutions: data parallelism and ZeRO

# %%
from labkit.answer_key import check
from labkit.estimate.memory import OptimizerDtypes, activation_bytes_per_layer, bytes_per_param
from labkit.estimate.params import Shape
from labkit.spec import load_spec

# %% [markdown]
# **Exercise 1.** Stage 3 splits the weights, the gradients and the optimizer state: all 16 bytes over the 64 GPUs.

# %%
answer_1 = sum(bytes_per_param("bf16", data_parallel=64, zero_stage=3))
answer_1

# %%
check("09.1", answer_1)

# %% [markdown]
# **Exercise 2.** Stage 2 keeps the 2-byte 16-bit weights on every GPU and splits the 2 bytes of gradient and the 12
# of optimizer state: $(2 + 14/64) \times 7.5 \times 10^9$ bytes, ZeRO's 16.6 GB (from 120 GB without ZeRO).

# %%
answer_2 = sum(bytes_per_param("bf16", data_parallel=64, zero_stage=2)) * 7.5e9 / 1e9
answer_2

# %%
check("09.2", answer_2)

# %% [markdown]
# **Exercise 3.** Table 2's two rows for $t = 8$; $sbh$ cancels. $5as/h = 5 \cdot 96 \cdot 2048 / 12288 = 80$:
# $(10 + 3 + 10) / ((34 + 80)/8) = 23 / 14.25 \approx 1.61$. labkit's count of megatron-core's layer agrees.

# %%
t, s, h, a = 8, 2048, 12288, 96
answer_3 = (10 + 24 / t + 5 * a * s / (h * t)) / ((34 + 5 * a * s / h) / t)
gpt3 = Shape.of(load_spec({"model": {"num_layers": 96, "hidden_size": h, "num_attention_heads": a, "seq_length": s,
                                     "vocab_size": 51200}}).model)
answer_3, activation_bytes_per_layer(gpt3, 1, tensor=t) / activation_bytes_per_layer(gpt3, 1, tensor=t,
                                                                                     sequence_parallel=True)

# %%
check("09.3", answer_3)

# %% [markdown]
# **Exercise 4.** The 2-byte bf16 weights and the 4-byte fp32 gradients stay whole on every GPU; the distributed
# optimizer splits the rest over the 8: the master's 2 bytes and two 2-byte moments, $2 + 4 + 6/8 = 6.75$ bytes (Megatron's
# default optimizer: $2 + 4 + 12/8 = 7.5$).

# %%
answer_4 = sum(bytes_per_param("bf16", data_parallel=8, distributed_optimizer=True,
                               optimizer_dtypes=OptimizerDtypes(exp_avg="bf16", exp_avg_sq="bf16")))
answer_4

# %%
check("09.4", answer_4)

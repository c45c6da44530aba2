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
# # Lab 10 solutions: expert parallelism

# %%
from labkit.answer_key import check
from labkit.estimate.params import active_params, attention_params, embedding_params, mlp_params, total_params
from labkit.megatron.shape import Shape
from labkit.spec import load_spec

# %% [markdown]
# **Exercise 1.** A token passes through every layer's attention and router, its top 2 of the 8 experts, the
# embeddings and the output layer. Mixtral-8x22B: 56 layers, hidden 6144, experts of width 16384 (SwiGLU: three
# matrices of $6144 \times 16384$), 48 query heads sharing 8 key-value heads of 128, a vocabulary of 32768 with
# untied output weights: about 39 B of its 141 B.

# %%
big = Shape.of(load_spec({"model": {"preset": "mixtral-8x22b"}}).model)
by_hand = (big.num_layers * (attention_params(big) + big.experts * big.hidden + 2 * mlp_params(big, big.expert_ffn_size)
                         + big.norm_params)
           + 2 * embedding_params(big) + big.norm_params)
answer_1 = by_hand / 1e9
answer_1, active_params(big) / 1e9, total_params(big) / 1e9

# %%
check("10.1", answer_1)

# %% [markdown]
# **Exercise 2.** The routed experts: 32 layers x 8 experts x $3 \times 4096 \times 14336$ weights = 45.1 B of the
# 46.7 B, about 96.6%. Attention, the routers, the norms and the embeddings are the other 3.4%: the part every rank
# keeps under expert parallelism, and the part a token shares with every other token.

# %%
mixtral = Shape.of(load_spec({"model": {"preset": "mixtral-8x7b"}}).model)
answer_2 = mixtral.num_layers * mixtral.experts * 3 * 4096 * 14336 / total_params(mixtral)
answer_2

# %%
check("10.2", answer_2)

# %% [markdown]
# **Exercise 3.** A micro-batch of 1 sequence of 4096 tokens fills $4096 \times 2$ expert slots per MoE layer; spread
# evenly over 8 experts, 1024 rows each. With expert parallel 8 each rank holds one expert, so 1024 rows arrive at
# each rank, most of them (7 in 8) from the other 7 ranks. Real routers are not even: megatron-core's
# `moe_expert_capacity_factor` caps each expert's rows (dropping the rest), or leaves them uncapped (the default).

# %%
answer_3 = 4096 * 1 * 2 // 8
answer_3

# %%
check("10.3", answer_3)

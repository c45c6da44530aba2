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
# # 실습 09 해답: 데이터 병렬화(data parallelism)와 ZeRO

# %%
from labkit.answer_key import check
from labkit.estimate.memory import OptimizerDtypes, activation_bytes_per_layer, bytes_per_param
from labkit.estimate.params import Shape
from labkit.spec import load_spec

# %% [markdown]
# **연습 문제 1.** 3단계는 가중치(weight), 그래디언트(gradient), 옵티마이저 상태(optimizer state)를 모두 나눕니다. 16바이트
# 전부가 GPU 64개에 나뉩니다.

# %%
answer_1 = sum(bytes_per_param("bf16", data_parallel=64, zero_stage=3))
answer_1

# %%
check("09.1", answer_1)

# %% [markdown]
# **연습 문제 2.** 2단계는 2바이트짜리 16비트 가중치를 모든 GPU에 그대로 두고, 그래디언트 2바이트와 옵티마이저 상태
# 12바이트를 나눕니다: $(2 + 14/64) \times 7.5 \times 10^9$바이트, 곧 ZeRO 논문의 16.6 GB입니다(ZeRO 없이는 120 GB).

# %%
answer_2 = sum(bytes_per_param("bf16", data_parallel=64, zero_stage=2)) * 7.5e9 / 1e9
answer_2

# %%
check("09.2", answer_2)

# %% [markdown]
# **연습 문제 3.** $t = 8$일 때 Table 2의 두 행을 쓰면 $sbh$는 약분됩니다. $5as/h = 5 \cdot 96 \cdot 2048 / 12288 = 80$이므로
# $(10 + 3 + 10) / ((34 + 80)/8) = 23 / 14.25 \approx 1.61$입니다. labkit이 megatron-core의 레이어(layer)를 세어 얻은
# 값도 이와 일치합니다.

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
# **연습 문제 4.** 2바이트 bf16 가중치와 4바이트 fp32 그래디언트는 모든 GPU에 그대로 남고, 분산 옵티마이저는 나머지를
# 8개에 나눕니다. 마스터의 2바이트와 2바이트짜리 모멘트 두 개이므로 $2 + 4 + 6/8 = 6.75$바이트입니다(Megatron의 기본
# 옵티마이저라면 $2 + 4 + 12/8 = 7.5$).

# %%
answer_4 = sum(bytes_per_param("bf16", data_parallel=8, distributed_optimizer=True,
                               optimizer_dtypes=OptimizerDtypes(exp_avg="bf16", exp_avg_sq="bf16")))
answer_4

# %%
check("09.4", answer_4)

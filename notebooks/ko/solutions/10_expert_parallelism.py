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
# # 실습 10 해답: 전문가 병렬화(expert parallelism)

# %%
from labkit.answer_key import check
from labkit.estimate.params import active_params, attention_params, embedding_params, mlp_params, total_params
from labkit.megatron.shape import Shape
from labkit.spec import load_spec

# %% [markdown]
# **연습 문제 1.** 토큰 하나는 모든 레이어의 어텐션과 라우터, 전문가 8개 중 상위 2개, 임베딩(embedding)과 출력 레이어를
# 지납니다. Mixtral-8x22B: 레이어 56개, 은닉 크기(hidden size) 6144, 폭 16384의 전문가(SwiGLU: $6144 \times 16384$ 행렬
# 세 개), 크기 128의 키-값 헤드 8개를 나눠 쓰는 쿼리 헤드 48개, 어휘 크기 32768과 임베딩에 묶이지 않은(untied) 출력
# 가중치: 141 B 중 약 39 B입니다.

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
# **연습 문제 2.** 라우팅되는 전문가: 레이어 32개 x 전문가 8개 x 가중치 $3 \times 4096 \times 14336$개 = 46.7 B 중 45.1 B, 약
# 96.6%입니다. 어텐션, 라우터, 정규화(norm) 레이어, 임베딩이 나머지 3.4%로, 전문가 병렬화에서 모든 랭크가 그대로 가지는
# 부분이자 토큰 하나가 다른 모든 토큰과 함께 쓰는 부분입니다.

# %%
mixtral = Shape.of(load_spec({"model": {"preset": "mixtral-8x7b"}}).model)
answer_2 = mixtral.num_layers * mixtral.experts * 3 * 4096 * 14336 / total_params(mixtral)
answer_2

# %%
check("10.2", answer_2)

# %% [markdown]
# **연습 문제 3.** 토큰 4096개짜리 시퀀스 1개로 된 마이크로배치는 MoE 레이어마다 전문가 슬롯 $4096 \times 2$개를 채웁니다.
# 전문가 8개에 고르게 퍼지면 각각 1024행입니다. 전문가 병렬 8에서는 랭크마다 전문가가 하나이므로 각 랭크에 1024행이
# 도착하며, 그 대부분(8개 중 7개)은 다른 랭크 7개에서 옵니다. 실제 라우터는 고르지 않습니다. megatron-core의
# `moe_expert_capacity_factor`는 전문가마다 행 수에 상한을 두거나(나머지는 버림), 상한 없이 둡니다(기본값).

# %%
answer_3 = 4096 * 1 * 2 // 8
answer_3

# %%
check("10.3", answer_3)

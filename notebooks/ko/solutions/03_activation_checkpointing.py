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
# # 실습 03 해답: 활성값 체크포인팅(activation checkpointing)

# %%
from labkit.estimate.recompute import recompute_table
from labkit.answer_key import check
from labkit.paths import example
from labkit.spec import load_spec

base = load_spec(example("tiny-cpu.yaml")).replace(
    cluster={"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 1}]})
gpt2 = base.replace(model={"preset": "gpt2-small"})

# %% [markdown]
# **연습 문제 1.** block 방식은 스테이지의 처음 `num_layers`개 레이어를 체크포인팅하고(따라서 재계산하고), 나머지 8개 레이어는
# 활성값(activation)을 모두 보관합니다: 4.

# %%
answer_1 = 4

# %%
check("03.1", answer_1, spec=gpt2)

# %% [markdown]
# **연습 문제 2.**

# %%
answer_2 = base.replace(recompute={"granularity": "full", "method": "block", "num_layers": 2})

# %%
check("03.2", answer_2)

# %% [markdown]
# **연습 문제 3.** $5as/h = 5 \cdot 12 \cdot 1024 / 768 = 80$: 토큰 하나, 은닉 유닛(hidden unit) 하나당 80바이트로, 레이어의
# 나머지 부분이 차지하는 34보다 큽니다. 이 시퀀스 길이에서는 점수 행렬이 레이어 활성값의 대부분을 차지합니다. 여기에
# $sbh = 1024 \cdot 4 \cdot 768$과 레이어 12개를 곱해 MiB로 나타냅니다(플래시 어텐션(flash attention)이라면 약 0입니다.
# 점수 행렬이 아예 저장되지 않기 때문입니다):

# %%
answer_3 = 80 * 1024 * 4 * 768 * 12 / 2 ** 20
answer_3

# %%
selective_bf16 = {"precision": "bf16", "recompute": {"granularity": "selective", "method": None}, "batch.micro": 4}
selective_gpt2 = recompute_table({"selective": gpt2.replace(**selective_bf16)})
check("03.3", answer_3, table=selective_gpt2)

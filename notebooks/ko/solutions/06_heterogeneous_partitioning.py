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
# # 실습 06 해답: 이기종 분할(heterogeneous partitioning)

# %%
from labkit.answer_key import check
from labkit.plan.search import search
from labkit.plan.views import ranked_table
from labkit.spec import load_spec

base = load_spec({"name": "gpt2-xl-on-a100-a10-hetero", "model": {"preset": "gpt2-xl"}, "precision": "fp16",
                  "batch": {"micro": 1, "global": 64}, "cluster": "a100-a10-hetero"})
plan = search(base, top=10)

# %% [markdown]
# **연습 문제 1.** 순위표(ranked table)의 첫 행이 가장 빠른 레이아웃입니다. 그 행의 `pp` 열을 봅니다.

# %%
answer_1 = int(ranked_table(plan, top=1)["pp"].iloc[0])
answer_1

# %%
check("06.1", answer_1, plan=plan)

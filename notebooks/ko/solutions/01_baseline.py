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
# # 실습 01 해답: 기준 실행

# %%
from labkit.answer_key import check
from labkit.paths import example
from labkit.spec import load_spec

spec = load_spec(example("tiny-cpu.yaml"))

# %% [markdown]
# **연습 문제 1.** 글로벌 배치(global batch) 16 = 마이크로배치(micro-batch) 2 x 데이터 병렬(data parallel) 2 x
# 마이크로배치 4개.

# %%
answer_1 = spec.replace(**{"batch.global": 16})
answer_1.num_micro_batches

# %%
check("01.1", answer_1)

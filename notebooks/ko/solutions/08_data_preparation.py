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
# # 실습 08 해답: 데이터 준비

# %%
import json
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")  # expected on CPU
from megatron.core.datasets.indexed_dataset import IndexedDataset

from labkit.data_prep import prepare
from labkit.answer_key import check
from labkit.paths import data_file

seq_length = 64
result = prepare(data_file("corpus", "corpus.jsonl"), "runs/data/corpus", progress=False)

# %% [markdown]
# **연습 문제 1.** 각 시퀀스(sequence)는 `seq_length`개 토큰을 입력으로, 그다음 토큰 하나를 마지막 레이블(label)로 쓰므로,
# 시퀀스 $n$개에는 토큰 $n \cdot s + 1$개가 필요합니다.

# %%
answer_1 = (result["tokens"] - 1) // seq_length
answer_1

# %%
check("08.1", answer_1, tokens=result["tokens"], seq_length=seq_length)

# %% [markdown]
# **연습 문제 2.** `body` 키 아래에 문서 세 개를 둡니다.

# %%
mine = Path("runs/data/mine.jsonl")
mine.parent.mkdir(parents=True, exist_ok=True)
mine.write_text("".join(json.dumps({"body": text}) + "\n" for text in
                        ["Ada met Cleo at the river.", "It was foggy on Monday.", "Fay had a wooden box."]))
answer_2 = IndexedDataset(prepare(mine, "runs/data/mine", json_key="body", progress=False)["prefix"])
len(answer_2)

# %%
check("08.2", answer_2)

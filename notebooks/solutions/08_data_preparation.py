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
# # Lab 08 solutions: data preparation

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
# **Exercise 1.** Each sequence takes `seq_length` tokens as inputs and the next one as its last label, so $n$
# sequences need $n \cdot s + 1$ tokens.

# %%
answer_1 = (result["tokens"] - 1) // seq_length
answer_1

# %%
check("08.1", answer_1, tokens=result["tokens"], seq_length=seq_length)

# %% [markdown]
# **Exercise 2.** Three documents under the key `body`.

# %%
mine = Path("runs/data/mine.jsonl")
mine.parent.mkdir(parents=True, exist_ok=True)
mine.write_text("".join(json.dumps({"body": text}) + "\n" for text in
                        ["Ada met Cleo at the river.", "It was foggy on Monday.", "Fay had a wooden box."]))
answer_2 = IndexedDataset(prepare(mine, "runs/data/mine", json_key="body", progress=False)["prefix"])
len(answer_2)

# %%
check("08.2", answer_2)

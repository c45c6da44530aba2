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

# %%

# %% [markdown]
# # Lab 08: Data preparation: corpus, tokenizer, indexed dataset
#
# **Objectives.** By the end of this lab you can
# - read a JSON-lines corpus, one document per line, the input Megatron-LM's `tools/preprocess_data.py` takes;
# - see what a byte-level BPE tokenizer (GPT-2's `vocab.json` + `merges.txt` form) does to text;
# - turn the corpus into Megatron's indexed dataset (`PREFIX_text_document.bin/.idx`) with `labkit data prepare`,
#   read it back, and point a run spec at it;
# - reason about how many training sequences a corpus gives.
#
# The corpus shipped with labkit (`labkit/data/corpus/`) is small and public domain (CC0), and its small byte-level
# BPE tokenizer was trained on it offline. Real GPT-2 `vocab.json`/`merges.txt` files work the same way.

# %% tags=["parameters"]
corpus = ""                # a JSON-lines corpus; empty: the one shipped with labkit
output_dir = "runs/data"   # where the indexed dataset is written (relative to the notebook)
seq_length = 64

# %%
import json
import warnings
from pathlib import Path

import pandas as pd

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")  # expected on CPU
from megatron.core.datasets.indexed_dataset import IndexedDataset

from labkit.data_prep import prepare
from labkit.exercises import check_number
from labkit.megatron_args import DEFAULT_MERGES, DEFAULT_VOCAB, megatron_args
from labkit.paths import data_file
from labkit.spec import load_spec
from labkit.train.tokenizer import GPT2BPETokenizer

corpus_path = Path(corpus) if corpus else data_file("corpus", "corpus.jsonl")
output_prefix = Path(output_dir) / corpus_path.stem

# %% [markdown]
# ## 8.1 The corpus
#
# One JSON object per line; the text is under the key `text` (Megatron's `--json-keys` default).

# %%
documents = pd.read_json(corpus_path, lines=True)
print(f"{len(documents):,} documents, {documents['text'].str.len().sum():,} characters")
documents.head(3)

# %% [markdown]
# ## 8.2 The tokenizer
#
# Byte-level BPE starts from the 256 bytes and merges the most frequent pairs: common words become one token, rare
# ones split into pieces, and nothing is ever out of vocabulary. `<|endoftext|>` separates documents.

# %%
tokenizer = GPT2BPETokenizer(DEFAULT_VOCAB, DEFAULT_MERGES)
sentence = "On Monday it was foggy, and Ada walked to the river with a zeppelin."
ids = tokenizer.tokenize(sentence)
print(f"vocabulary {tokenizer.vocab_size}, end-of-document id {tokenizer.eod}; {len(sentence)} characters -> "
      f"{len(ids)} tokens")
pd.DataFrame({"id": ids, "piece": [tokenizer.detokenize([i]) for i in ids]}).T

# %% [markdown]
# Words the corpus uses often are single tokens; "zeppelin", which it never uses, is spelled out in pieces.
#
# ## 8.3 The indexed dataset
#
# `labkit data prepare` (the same as `prepare(...)` here) tokenises every document, appends `<|endoftext|>`, and
# writes the token ids to `.bin` and the document boundaries to `.idx`: megatron-core's `IndexedDataset` format, which
# the training driver reads with `--data-path PREFIX_text_document`.

# %%
result = prepare(corpus_path, output_prefix, progress=False)
result

# %% tags=["nbval-check-output"]
dataset = IndexedDataset(result["prefix"])
lengths = dataset.sequence_lengths
print(f"{len(dataset):,} documents, {lengths.sum():,} tokens, {lengths.mean():.0f} tokens per document on average")
print("first document, first 30 tokens:", repr(tokenizer.detokenize(dataset[0][:30])))

# %% [markdown]
# Training does not see documents: the dataset concatenates them and cuts sequences of `seq_length + 1` tokens
# (inputs and the next-token labels, shifted by one), shuffled by epoch. A run spec names the data path and the
# tokenizer files, and they become the driver's flags:

# %%
spec = load_spec({"name": "tiny-corpus", "model": {"preset": "tiny", "seq_length": seq_length},
                  "data": {"mock": False, "path": result["prefix"]}, "train": {"iters": 10}})
flags = megatron_args(spec)
" ".join(str(f) for f in flags[flags.index("--data-path"):])

# %% [markdown]
# ## Exercises
#
# **Exercise 1.** How many training sequences of `seq_length` tokens (plus the one-token shift) does one pass over
# this corpus give? Use the token count above: each sequence consumes `seq_length` new tokens.

# %%
answer_1 = ...

# %%
check_number(answer_1, (result["tokens"] - 1) // seq_length, name="Exercise 1 (sequences per epoch)", rel_tol=0.01)

# %% [markdown]
# **Exercise 2.** Write a corpus of your own: three documents in a JSON-lines file whose text is under the key
# `body`, prepare it with `prepare(..., json_key="body")`, and open it with `IndexedDataset`. How many documents does
# it hold? Put the opened dataset in `answer_2`.

# %%
answer_2 = ...

# %%
check_number(None if answer_2 is ... else len(answer_2), 3, name="Exercise 2 (your own corpus)", rel_tol=0.0)

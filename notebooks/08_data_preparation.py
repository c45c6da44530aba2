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
# # Lab 08: Data preparation: corpus, tokenizer, indexed dataset (homework)
#
# **Objectives.** By the end of this lab you can
# - read a JSON-lines corpus, one document per line, the input Megatron-LM's `tools/preprocess_data.py` takes;
# - see what a byte-level BPE tokenizer (GPT-2's `vocab.json` + `merges.txt` form) does to text;
# - turn the corpus into Megatron's indexed dataset (`PREFIX_text_document.bin/.idx`) with `labkit data prepare`,
#   read it back, and point a run spec at it;
# - reason about how many training sequences a corpus gives;
# - prepare the same corpus for a Llama-style model and train it beside a GPT, both losses falling.
#
# The corpus shipped with labkit (`labkit/data/corpus/`) is small and public domain (CC0), and its small byte-level
# BPE tokenizer was trained on it offline. Real GPT-2 `vocab.json`/`merges.txt` files work the same way.

# %% tags=["parameters"]
corpus = ""                # a JSON-lines corpus; empty: the one shipped with labkit
output_dir = "runs/data"   # where the indexed dataset is written (relative to the notebook)
seq_length = 64
train_iterations = 40      # for each of the two models of section 8.4

# %%
import json
import warnings
from pathlib import Path

import pandas as pd

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")  # expected on CPU
from megatron.core.datasets.indexed_dataset import IndexedDataset

from labkit.data_prep import prepare
from labkit.answer_key import check
from labkit.jobs import backend_named
from labkit.logs.views import loss_figure
from labkit.megatron_args import DEFAULT_MERGES, DEFAULT_VOCAB, megatron_args
from labkit.paths import data_file
from labkit.spec import load_spec
from labkit.megatron.tokenizer import GPT2BPETokenizer, HuggingFaceTokenizer
from labkit.messages import say

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
print(say("lab08.tokenized", vocab=tokenizer.vocab_size, eod=tokenizer.eod, characters=len(sentence),
          tokens=len(ids)))
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
# ## 8.4 A Llama-style model on the same corpus
#
# Llama models differ from GPT-2 in their layer (RMSNorm instead of LayerNorm, rotary position embeddings instead of
# a learned position table, a SwiGLU MLP, grouped-query attention, no biases) and in their tokenizer (SentencePiece
# for Llama 2, a HuggingFace `tokenizer.json` for Llama 3). labkit ships a `tiny-llama` preset with that layer and a
# small Llama-style tokenizer trained on this corpus (`labkit/data/tokenizer/llama/tokenizer.json`; the script
# `data/build_llama_tokenizer.py` in the repository rebuilds it byte for byte). Prepare the corpus a second time with
# it; Megatron-LM's `--tokenizer-type HuggingFaceTokenizer --tokenizer-model FILE` is `tokenizer_type=` and
# `tokenizer_model=` here:

# %%
llama_tokenizer_file = data_file("tokenizer", "llama", "tokenizer.json")
llama_result = prepare(corpus_path, Path(output_dir) / f"{corpus_path.stem}-llama", progress=False,
                       tokenizer_type="HuggingFaceTokenizer", tokenizer_model=llama_tokenizer_file)
characters = documents["text"].str.len().sum()
pd.DataFrame({"vocabulary": [tokenizer.vocab_size, HuggingFaceTokenizer(llama_tokenizer_file).vocab_size],
              "tokens": [result["tokens"], llama_result["tokens"]]},
             index=["GPT-2 byte-level BPE", "Llama-style"]).assign(
    characters_per_token=lambda t: (characters / t["tokens"]).round(2))

# %% [markdown]
# The model's vocabulary comes from its tokenizer, as in Megatron-LM: the spec below leaves `model.vocab_size` out and
# gets the tokenizer's. (Writing a different number is an error naming both `model.vocab_size` and
# `data.tokenizer.model`.) Both models train for the same iterations with the same batch and learning rate; the two
# jobs share this machine's cores, so each process uses one thread (`OMP_NUM_THREADS`: two processes that each try to
# use every core slow each other down many times over).

# %%
common = {"model": {"seq_length": seq_length}, "batch": {"micro": 4, "global": 16}, "precision": "fp32",
          "recompute": "none", "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
          "train": {"iters": train_iterations, "log_interval": 5},
          "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 1}]},
          "job": {"env": {"OMP_NUM_THREADS": "1"}}}
side_by_side = {
    "tiny GPT": load_spec({**common, "name": "lab08-gpt", "model": {**common["model"], "preset": "tiny"},
                           "data": {"path": result["prefix"]}}),
    "tiny-llama": load_spec({**common, "name": "lab08-llama", "model": {**common["model"], "preset": "tiny-llama"},
                             "data": {"path": llama_result["prefix"], "tokenizer": {
                                 "type": "HuggingFaceTokenizer", "model": str(llama_tokenizer_file)}}}),
}
for label, run_spec in side_by_side.items():
    m = run_spec.model
    print(f"{label:>10}: {m.normalization}, {m.position_embedding_type} positions, biases {m.add_bias_linear}, "
          f"SwiGLU {m.swiglu}, vocabulary {m.vocab_size}")

# %%
jobs = backend_named("local")
trained = {label: jobs.submit(run_spec) for label, run_spec in side_by_side.items()}
for label, job in trained.items():
    state = job.wait(progress=False)
    assert str(state) == "COMPLETED", job.cause()
logs = {label: job.result() for label, job in trained.items()}
loss_figure(logs).show()

# %% [markdown]
# The two losses are per token of different tokenizers, so their levels do not compare directly; per character they
# do (loss x tokens / characters, in nats).

# %% tags=["nbval-ignore-output"]
per_character = {"tiny GPT": result["tokens"] / characters, "tiny-llama": llama_result["tokens"] / characters}
falling = pd.DataFrame({label: {"first loss": log.iterations["lm_loss"].iloc[0],
                                "last loss": log.iterations["lm_loss"].iloc[-1]} for label, log in logs.items()}).T
falling["last loss per character"] = falling["last loss"] * pd.Series(per_character)
falling.round(3)

# %%
assert (falling["last loss"] < falling["first loss"] - 1).all(), "a loss fell by less than one nat: see the table above"

# %% [markdown]
# ## Exercises
#
# **Exercise 1.** How many training sequences of `seq_length` tokens (plus the one-token shift) does one pass over
# this corpus give? Use the token count above: each sequence consumes `seq_length` new tokens.

# %%
answer_1 = ...

# %%
check("08.1", answer_1, tokens=result["tokens"], seq_length=seq_length)

# %% [markdown]
# **Exercise 2.** Write a corpus of your own: three documents in a JSON-lines file whose text is under the key
# `body`, prepare it with `prepare(..., json_key="body")`, and open it with `IndexedDataset`. How many documents does
# it hold? Put the opened dataset in `answer_2`.

# %%
answer_2 = ...

# %%
check("08.2", answer_2)

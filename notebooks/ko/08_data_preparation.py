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
# # 실습 08: 데이터 준비: 코퍼스(corpus), 토크나이저(tokenizer), 인덱스 데이터셋(indexed dataset) (과제)
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - 한 줄에 문서 하나씩 담긴 JSON-lines 코퍼스, 곧 Megatron-LM의 `tools/preprocess_data.py`가 받는 입력을 읽기
# - 바이트 수준 BPE 토크나이저(byte-level BPE tokenizer, GPT-2의 `vocab.json` + `merges.txt` 형식)가 텍스트를 어떻게
#   처리하는지 보기
# - `labkit data prepare`로 코퍼스를 Megatron의 인덱스 데이터셋(`PREFIX_text_document.bin/.idx`)으로 변환하고, 다시
#   읽어 들이고, 실행 스펙(run spec)이 이를 가리키게 하기
# - 코퍼스 하나에서 학습 시퀀스(training sequence)가 몇 개 나오는지 따져 보기
# - 같은 코퍼스를 Llama 계열 모델용으로 준비하고 GPT와 나란히 학습시켜, 두 손실(loss)이 모두 떨어지는 것을 확인하기
#
# labkit에 포함된 코퍼스(`labkit/data/corpus/`)는 작은 퍼블릭 도메인(CC0) 자료이며, 함께 든 작은 바이트 수준 BPE 토크나이저는
# 이 코퍼스로 미리(오프라인으로) 학습해 둔 것입니다. 실제 GPT-2 `vocab.json`/`merges.txt` 파일도 똑같이 동작합니다.

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
# ## 8.1 코퍼스
#
# 한 줄에 JSON 객체 하나이며, 텍스트는 `text` 키 아래에 있습니다(Megatron의 `--json-keys` 기본값).

# %%
documents = pd.read_json(corpus_path, lines=True)
print(f"{len(documents):,} documents, {documents['text'].str.len().sum():,} characters")
documents.head(3)

# %% [markdown]
# ## 8.2 토크나이저
#
# 바이트 수준 BPE는 256개 바이트에서 출발해 가장 자주 나오는 쌍을 병합(merge)해 나갑니다. 흔한 단어는 토큰(token) 하나가
# 되고, 드문 단어는 여러 조각으로 나뉘며, 어휘(vocabulary)에 없는 입력은 결코 생기지 않습니다. `<|endoftext|>`가 문서를
# 구분합니다.

# %%
tokenizer = GPT2BPETokenizer(DEFAULT_VOCAB, DEFAULT_MERGES)
sentence = "On Monday it was foggy, and Ada walked to the river with a zeppelin."
ids = tokenizer.tokenize(sentence)
print(say("lab08.tokenized", vocab=tokenizer.vocab_size, eod=tokenizer.eod, characters=len(sentence),
          tokens=len(ids)))
pd.DataFrame({"id": ids, "piece": [tokenizer.detokenize([i]) for i in ids]}).T

# %% [markdown]
# 코퍼스가 자주 쓰는 단어는 토큰 하나이고, 코퍼스에 한 번도 나오지 않는 "zeppelin"은 여러 조각으로 나뉘어 표현됩니다.
#
# ## 8.3 인덱스 데이터셋
#
# `labkit data prepare`(여기서의 `prepare(...)`와 같습니다)는 모든 문서를 토큰화(tokenise)하고 `<|endoftext|>`를 덧붙인
# 뒤, 토큰 id는 `.bin`에, 문서 경계는 `.idx`에 씁니다. 이것이 megatron-core의 `IndexedDataset` 형식이며, 학습
# 드라이버(training driver)는 `--data-path PREFIX_text_document`로 이를 읽습니다.

# %%
result = prepare(corpus_path, output_prefix, progress=False)
result

# %% tags=["nbval-check-output"]
dataset = IndexedDataset(result["prefix"])
lengths = dataset.sequence_lengths
print(f"{len(dataset):,} documents, {lengths.sum():,} tokens, {lengths.mean():.0f} tokens per document on average")
print("first document, first 30 tokens:", repr(tokenizer.detokenize(dataset[0][:30])))

# %% [markdown]
# 학습은 문서를 보지 않습니다. 데이터셋은 문서들을 이어 붙여 `seq_length + 1`개 토큰짜리 시퀀스(입력, 그리고 한 칸 밀린 다음
# 토큰 레이블(label))로 자르고, 에포크(epoch)마다 섞습니다. 실행 스펙에 데이터 경로와 토크나이저 파일을 적으면, 이것이
# 드라이버의 플래그(flag)가 됩니다:

# %%
spec = load_spec({"name": "tiny-corpus", "model": {"preset": "tiny", "seq_length": seq_length},
                  "data": {"mock": False, "path": result["prefix"]}, "train": {"iters": 10}})
flags = megatron_args(spec)
" ".join(str(f) for f in flags[flags.index("--data-path"):])

# %% [markdown]
# ## 8.4 같은 코퍼스로 학습하는 Llama 계열 모델
#
# Llama 모델은 두 가지 점에서 GPT-2와 다릅니다. 하나는 레이어(layer)입니다. LayerNorm 대신 RMSNorm을, 학습되는 위치 테이블
# 대신 회전 위치 임베딩(rotary position embedding)을, SwiGLU MLP와 그룹 쿼리 어텐션(grouped-query attention)을 쓰며, 바이어스가
# 없습니다. 다른 하나는 토크나이저입니다. Llama 2는 SentencePiece를, Llama 3는 HuggingFace `tokenizer.json`을 씁니다.
# labkit에는 그런 레이어를 쓰는 `tiny-llama` 프리셋(preset)과, 이 코퍼스로 학습한 작은 Llama 계열 토크나이저
# (`labkit/data/tokenizer/llama/tokenizer.json`; 저장소의 `data/build_llama_tokenizer.py` 스크립트가 이를 바이트 하나까지
# 똑같이 다시 만듭니다)가 들어 있습니다. 이 토크나이저로 코퍼스를 한 번 더 준비합니다. Megatron-LM의
# `--tokenizer-type HuggingFaceTokenizer --tokenizer-model FILE`은 여기서 `tokenizer_type=`과 `tokenizer_model=`입니다:

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
# Megatron-LM에서와 마찬가지로 모델의 어휘는 토크나이저에서 옵니다. 아래 스펙은 `model.vocab_size`를 적지 않고 토크나이저의
# 값을 받습니다. (다른 숫자를 적으면 `model.vocab_size`와 `data.tokenizer.model`을 모두 언급하는 오류가 납니다.) 두 모델은
# 같은 배치와 학습률(learning rate)로 같은 반복(iteration) 횟수만큼 학습합니다. 두 작업(job)이 이 머신의 코어를 나눠 쓰므로
# 각 프로세스는 스레드 하나만 씁니다(`OMP_NUM_THREADS`: 저마다 모든 코어를 쓰려는 두 프로세스는 서로를 몇 배나 느리게
# 만듭니다).

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
# 두 손실은 서로 다른 토크나이저의 토큰당 값이므로 수준을 직접 비교할 수 없습니다. 문자당 값으로 바꾸면 비교할 수 있습니다
# (손실 x 토큰 수 / 문자 수, 단위는 nats).

# %% tags=["nbval-ignore-output"]
per_character = {"tiny GPT": result["tokens"] / characters, "tiny-llama": llama_result["tokens"] / characters}
falling = pd.DataFrame({label: {"first loss": log.iterations["lm_loss"].iloc[0],
                                "last loss": log.iterations["lm_loss"].iloc[-1]} for label, log in logs.items()}).T
falling["last loss per character"] = falling["last loss"] * pd.Series(per_character)
falling.round(3)

# %%
assert (falling["last loss"] < falling["first loss"] - 1).all(), "a loss fell by less than one nat: see the table above"

# %% [markdown]
# ## 연습 문제
#
# **연습 문제 1.** 이 코퍼스를 한 번 훑으면 `seq_length`개 토큰(과 한 토큰 밀림)짜리 학습 시퀀스가 몇 개 나옵니까? 위의 토큰
# 수를 쓰세요. 시퀀스 하나가 새 토큰 `seq_length`개를 소비합니다.

# %%
answer_1 = ...

# %%
check("08.1", answer_1, tokens=result["tokens"], seq_length=seq_length)

# %% [markdown]
# **연습 문제 2.** 코퍼스를 직접 만들어 보세요. 텍스트가 `body` 키 아래에 있는 문서 세 개를 JSON-lines 파일로 쓰고,
# `prepare(..., json_key="body")`로 준비한 뒤 `IndexedDataset`으로 여세요. 문서가 몇 개 들어 있습니까? 연 데이터셋을
# `answer_2`에 넣으세요.

# %%
answer_2 = ...

# %%
check("08.2", answer_2)

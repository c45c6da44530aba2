"""`labkit data prepare`, the shipped corpus and tokenizer, and the mock/real datasets the driver reads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest

from labkit.cli import main as labkit
from labkit.megatron_args import DEFAULT_MERGES, DEFAULT_VOCAB
from labkit.megatron.tokenizer import EOD_TOKEN, GPT2BPETokenizer

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "labkit" / "data" / "corpus"


@pytest.fixture(scope="module")
def tokenizer():
    return GPT2BPETokenizer(DEFAULT_VOCAB, DEFAULT_MERGES)


def test_shipped_tokenizer_round_trips_the_corpus(tokenizer):
    vocab = json.loads(Path(DEFAULT_VOCAB).read_text())
    assert tokenizer.eod == vocab[EOD_TOKEN] and tokenizer.vocab_size == len(vocab) <= 1024
    text = json.loads((CORPUS / "corpus.jsonl").open().readline())["text"]
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text
    assert len(ids) < len(text) / 3  # merges learnt from the corpus compress it


def test_prepare_writes_an_indexed_dataset_megatron_reads(tmp_path, tokenizer, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = ["Ada walked to the river.", "Seven plus five is twelve.", "On Monday it was windy."]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + "\n")
    assert labkit(["data", "prepare", str(source), "--output-prefix", str(tmp_path / "out"), "--quiet"]) == 0
    assert "--data-path " + str(tmp_path / "out_text_document") in capsys.readouterr().out
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(dataset) == 3 and dataset.index.dtype == numpy.uint16
    for i, doc in enumerate(docs):
        assert dataset[i].tolist() == tokenizer.tokenize(doc) + [tokenizer.eod]


@pytest.mark.parametrize("line, message", [
    ("{not json", "in.jsonl:2: not valid JSON"),
    ('{"body": "x"}', "in.jsonl:2: no text field 'text'; pass --json-key"),
])
def test_prepare_names_the_bad_line(tmp_path, capsys, line, message):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    assert labkit(["data", "prepare", str(source), "--output-prefix", str(tmp_path / "out"), "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_prepare_names_a_missing_input(tmp_path, capsys):
    assert labkit(["data", "prepare", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_shipped_dataset_is_the_shipped_corpus_tokenised(tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(CORPUS / "corpus_text_document"))
    lines = (CORPUS / "corpus.jsonl").read_text().splitlines()
    assert len(dataset) == len(lines) == 1500
    for i in (0, 1, 777, 1499):
        assert dataset[i].tolist() == tokenizer.tokenize(json.loads(lines[i])["text"]) + [tokenizer.eod]

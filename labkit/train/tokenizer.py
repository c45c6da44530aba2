"""Tokenizers the driver and `labkit data prepare` share: GPT-2 byte-level BPE files, or a bare vocabulary size."""
from __future__ import annotations

import json
from pathlib import Path

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer:
    """A GPT-2 style `vocab.json` + `merges.txt` pair (labkit's shipped one or OpenAI's), `<|endoftext|>` as EOD.

    Taught in lab 08.
    """

    def __init__(self, vocab_file: str | Path, merge_file: str | Path):
        from tokenizers import ByteLevelBPETokenizer

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not Path(path).is_file():
                raise FileNotFoundError(f"{flag}: no such file {path}")
        self._bpe = ByteLevelBPETokenizer.from_file(str(vocab_file), str(merge_file))
        vocab = json.loads(Path(vocab_file).read_text())
        if EOD_TOKEN not in vocab:
            raise ValueError(f"--vocab-file: {vocab_file} has no {EOD_TOKEN} token to end documents with")
        self.vocab_size = len(vocab)
        self.eod = vocab[EOD_TOKEN]
        self.unique_identifiers = {"class": type(self).__name__, "vocab_file": str(vocab_file),
                                   "merge_file": str(merge_file)}

    def tokenize(self, text: str) -> list[int]:
        return self._bpe.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._bpe.encode_batch(texts)]

    def detokenize(self, ids) -> str:
        return self._bpe.decode(list(ids))


class NullTokenizer:
    """Mock data: ids 0..vocab_size-1, the last one standing for end-of-document (as Megatron's NullTokenizer)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.unique_identifiers = {"class": type(self).__name__, "vocab_size": vocab_size}


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron pads the embedding table so each tensor-parallel shard is a multiple of `divisible_by` rows."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple

"""Tokenizers the driver and `labkit data prepare` share, by Megatron-LM's --tokenizer-type names: GPT-2 byte-level BPE
files, a HuggingFace tokenizer.json, a SentencePiece .model, or a bare vocabulary size."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from labkit.megatron.flags import FLAG

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer:
    """A GPT-2 style `vocab.json` + `merges.txt` pair (labkit's shipped one or OpenAI's), `<|endoftext|>` as EOD.

    Taught in lab 08.
    """

    def __init__(self, vocab_file: str | Path, merge_file: str | Path):
        from tokenizers import ByteLevelBPETokenizer

        for flag, path in ((FLAG.vocab_file.name, vocab_file), (FLAG.merge_file.name, merge_file)):
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


class HuggingFaceTokenizer:
    """A HuggingFace `tokenizer.json` read by the `tokenizers` library (Llama 3's, or labkit's Llama-style one in
    labkit/data/tokenizer/llama); its end-of-sequence token ends documents.

    Megatron-LM loads the whole HuggingFace tokenizer directory and takes `eos_token` from its config; a lone
    tokenizer.json has no such setting, so the first of the usual end-of-sequence names it holds is used.

    Taught in lab 08.
    """

    EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")

    def __init__(self, model_file: str | Path):
        from tokenizers import Tokenizer

        if not Path(model_file).is_file():
            raise FileNotFoundError(f"--tokenizer-model: no such file {model_file}")
        try:
            self._tokenizer = Tokenizer.from_file(str(model_file))
        except Exception as exc:
            raise ValueError(f"--tokenizer-model: {model_file} is not a HuggingFace tokenizer.json ({exc})") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eos = [name for name in self.EOS_NAMES if self._tokenizer.token_to_id(name) is not None]
        if not eos:
            raise ValueError(f"--tokenizer-model: {model_file} has none of {', '.join(self.EOS_NAMES)} to end "
                             "documents with")
        self.eod = self._tokenizer.token_to_id(eos[0])
        self.unique_identifiers = {"class": type(self).__name__, "tokenizer_model": str(model_file)}

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts)]

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode(list(ids))


class SentencePieceTokenizer:
    """A SentencePiece `.model` read by the `sentencepiece` library, with the vocabulary Megatron-LM's
    SentencePieceTokenizer gives it: the model's pieces, then `<CLS>` `<SEP>` `<EOD>` `<MASK>` and whichever of the pad,
    BOS and EOS pieces the model lacks, appended as new ids. Documents end with `<EOD>`; no BOS is added. (Megatron-LM
    also splits those special names out of raw text; corpus text here never holds them.)"""

    def __init__(self, model_file: str | Path):
        import sentencepiece

        if not Path(model_file).is_file():
            raise FileNotFoundError(f"--tokenizer-model: no such file {model_file}")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        except Exception as exc:
            raise ValueError(f"--tokenizer-model: {model_file} is not a SentencePiece model ({exc})") from None
        self._pieces = self._sp.get_piece_size()
        vocab = {self._sp.id_to_piece(i): i for i in range(self._pieces)}
        def piece(token_id: int, fallback: str) -> str:
            return self._sp.id_to_piece(token_id) if 0 <= token_id < self._pieces else fallback

        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>", piece(self._sp.pad_id(), "<PAD>"),
                      piece(self._sp.bos_id(), "<BOS>"), piece(self._sp.eos_id(), "<EOS>")):
            vocab.setdefault(token, len(vocab))
        self._specials = {i: token for token, i in vocab.items() if i >= self._pieces}
        self.vocab_size = len(vocab)
        self.eod = vocab["<EOD>"]
        self.unique_identifiers = {"class": type(self).__name__, "tokenizer_model": str(model_file)}

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def detokenize(self, ids) -> str:
        """The text, an added special token written by name between spaces (as Megatron-LM does)."""
        parts, run = [], []
        for i in ids:
            if i in self._specials:
                parts += [self._sp.decode(run), self._specials[i]]
                run = []
            else:
                run.append(i)
        return " ".join(p for p in [*parts, self._sp.decode(run)] if p).strip()


class NullTokenizer:
    """Mock data, as Megatron-LM's _NullTokenizer (megatron/training/tokenizer/tokenizer.py): ids 0..vocab_size-1
    from --vocab-size, then one more, vocab_size, for end-of-document; its vocabulary is vocab_size + 1."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size
        self.unique_identifiers = {"class": type(self).__name__, "vocab_size": vocab_size}


def build_tokenizer(tokenizer_type: str, tokenizer_model=None, vocab_file=None, merge_file=None, vocab_size=None):
    """The tokenizer Megatron-LM's --tokenizer-type names, from the files or size its flags give."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    return NullTokenizer(vocab_size)


def tokenizer_vocab_size(tokenizer_type: str, tokenizer_model=None, vocab_file=None, merge_file=None) -> int:
    """The vocabulary the driver builds with this tokenizer: Megatron-LM takes the model's vocabulary from its
    tokenizer (--vocab-size only sizes NullTokenizer). Raises OSError or ValueError for a file it cannot use."""
    files = [f for f in (tokenizer_model, vocab_file, merge_file) if f is not None]
    stamps = tuple((str(f), os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in files)
    return _vocab_size(tokenizer_type, tokenizer_model, vocab_file, merge_file, stamps)


@functools.lru_cache(maxsize=16)
def _vocab_size(tokenizer_type, tokenizer_model, vocab_file, merge_file, stamps) -> int:
    """Cached by the files' names, times and sizes: a Llama 3 tokenizer.json takes a second to read."""
    return build_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file).vocab_size

"""`labkit data prepare INPUT.jsonl --output-prefix P`: tokenise a JSONL corpus into Megatron's indexed format.

Writes P_text_document.bin/.idx (Megatron-LM's tools/preprocess_data.py naming), which `--data-path
P_text_document` then reads through megatron-core's GPTDataset.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from labkit.megatron.flags import DEFAULT_MERGES, DEFAULT_VOCAB, FLAG as F

BATCH = 256


def register(sub) -> None:
    data = sub.add_parser("data", help="corpus tools")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = data_sub.add_parser("prepare", help="tokenise INPUT.jsonl into PREFIX_text_document.bin/.idx")
    p.add_argument("input", help="JSON lines, one document per line, text under --json-key")
    p.add_argument("--output-prefix", required=True, help="where to write (PREFIX_<key>_document.bin/.idx)")
    p.add_argument(F.tokenizer_type.name, default="GPT2BPETokenizer",
                   choices=["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"],
                   help="Megatron-LM's tokenizer name (default: GPT2BPETokenizer with --vocab-file/--merge-file)")
    p.add_argument(F.tokenizer_model.name, default=None,
                   help="HuggingFaceTokenizer: a tokenizer.json (labkit's Llama-style one: "
                        "labkit/data/tokenizer/llama/tokenizer.json); SentencePieceTokenizer: a .model file")
    p.add_argument(F.vocab_file.name, default=str(DEFAULT_VOCAB), help="GPT-2 style vocab.json (default: labkit's)")
    p.add_argument(F.merge_file.name, default=str(DEFAULT_MERGES), help="GPT-2 style merges.txt (default: labkit's)")
    p.add_argument("--json-key", default="text", help="the field holding each document's text (default: text)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="end every document with the tokenizer's end-of-document token (default: on)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_prepare)


def prepare(input_path: str | Path, output_prefix: str | Path, vocab_file=DEFAULT_VOCAB, merge_file=DEFAULT_MERGES,
            json_key: str = "text", append_eod: bool = True, progress: bool = True,
            tokenizer_type: str = "GPT2BPETokenizer", tokenizer_model: str | Path | None = None) -> dict:
    """Tokenise and write the dataset; returns {'prefix', 'documents', 'tokens'}. Raises ValueError naming the
    input line that cannot be read. The tokenizer is Megatron-LM's --tokenizer-type: GPT2BPETokenizer reads
    vocab_file/merge_file, HuggingFaceTokenizer and SentencePieceTokenizer read tokenizer_model.

    Taught in lab 08.
    """
    import numpy
    from tqdm import tqdm

    from labkit.megatron.tokenizer import build_tokenizer

    input_path = Path(input_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"input: no such file {input_path}")
    if tokenizer_type in ("HuggingFaceTokenizer", "SentencePieceTokenizer") and tokenizer_model is None:
        raise ValueError(f"--tokenizer-model: needed with --tokenizer-type {tokenizer_type}")
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    prefix = f"{output_prefix}_{json_key}_document"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = numpy.uint16 if tokenizer.vocab_size <= numpy.iinfo(numpy.uint16).max + 1 else numpy.int32

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    documents = tokens = 0
    with open(input_path, encoding="utf-8") as f:
        lines = f.readlines()
    for start in tqdm(range(0, len(lines), BATCH), total=-(-len(lines) // BATCH), unit="batch",
                      desc=f"tokenising {input_path.name}", disable=not progress):
        texts = []
        for number, line in enumerate(lines[start:start + BATCH], start=start + 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{input_path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                raise ValueError(f"{input_path}:{number}: no text field {json_key!r}; pass --json-key")
            texts.append(record[json_key])
        for ids in tokenizer.tokenize_batch(texts):
            if append_eod:
                ids.append(tokenizer.eod)
            if not ids:
                continue
            builder.add_document(ids, [len(ids)])
            documents += 1
            tokens += len(ids)
    if documents == 0:
        raise ValueError(f"{input_path}: no documents found")
    builder.finalize(prefix + ".idx")
    return {"prefix": prefix, "documents": documents, "tokens": tokens}


def _prepare(args) -> int:
    try:
        result = prepare(args.input, args.output_prefix, args.vocab_file, args.merge_file, args.json_key,
                         args.append_eod, progress=not args.quiet, tokenizer_type=args.tokenizer_type,
                         tokenizer_model=args.tokenizer_model)
    except (OSError, ValueError) as exc:
        print(f"labkit data prepare: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {result['prefix']}.bin/.idx: {result['documents']} documents, {result['tokens']} tokens; "
          f"train with --data-path {result['prefix']}")
    return 0

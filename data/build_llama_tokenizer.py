"""Write labkit's Llama-style tokenizer, reproducibly and offline.

    .venv/bin/python data/build_llama_tokenizer.py

labkit/data/tokenizer/llama/tokenizer.json: a HuggingFace `tokenizers` BPE laid out as Llama 2's tokenizer.json is
(github.com/meta-llama/llama: SentencePiece BPE with byte fallback): `<unk>` `<s>` `</s>` at ids 0-2, the 256 byte
tokens `<0x00>`..`<0xFF>` at 3-258 for text the merges do not cover, spaces written as `▁`, and `<s>` opening every
encoded document. Trained on labkit/data/corpus/corpus.jsonl; `--tokenizer-type HuggingFaceTokenizer
--tokenizer-model` reads it. Rebuilding gives the same bytes (tests/test_train_tokenizer.py checks).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PACKAGE_DATA = Path(__file__).resolve().parent.parent / "labkit" / "data"  # written in the checkout, not an install
CORPUS = PACKAGE_DATA / "corpus" / "corpus.jsonl"
OUT_DIR = PACKAGE_DATA / "tokenizer" / "llama"
VOCAB_SIZE = 1024  # the `tiny-llama` preset's vocabulary; the corpus's few words saturate the merges below it
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def build(corpus: Path = CORPUS, out_dir: Path = OUT_DIR) -> Path:
    """Train on the corpus's `text` fields and write out_dir/tokenizer.json; returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    # Letters outside the 100 most frequent characters are left to the byte tokens.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(BYTES), min_frequency=2, special_tokens=SPECIALS,
                                  limit_alphabet=100, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # The byte tokens go right after the specials, as in Llama's vocabulary, as ordinary tokens (a special token would
    # be dropped when decoding).
    layout = json.loads(tokenizer.to_str())
    learned = sorted(layout["model"]["vocab"].items(), key=lambda item: item[1])[len(SPECIALS):]
    layout["model"]["vocab"] = {token: i for i, token in enumerate(SPECIALS + BYTES + [t for t, _ in learned])}
    tokenizer = Tokenizer.from_str(json.dumps(layout))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tokenizer.save(str(path), pretty=True)
    return path


if __name__ == "__main__":
    out = build(out_dir=Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR)
    print(f"wrote {out}")

"""Write labkit's training corpus, its tokenizer and its indexed dataset, reproducibly and offline.

    .venv/bin/python data/generate_corpus.py

1. labkit/data/corpus/corpus.jsonl: short English documents composed by the seeded grammar below (no outside text, so the
   corpus is ours to give away: CC0, see labkit/data/corpus/README.md).
2. labkit/data/tokenizer/vocab.json + merges.txt: a byte-level BPE (GPT-2 form, `<|endoftext|>` as end-of-document) trained on
   that corpus with the `tokenizers` package.
3. labkit/data/corpus/corpus_text_document.bin/.idx: the corpus tokenised by `labkit data prepare`.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

PACKAGE_DATA = Path(__file__).resolve().parent.parent / "labkit" / "data"  # written in the checkout, not an install
CORPUS_DIR = PACKAGE_DATA / "corpus"
TOKENIZER_DIR = PACKAGE_DATA / "tokenizer"
VOCAB_SIZE = 1024  # the `tiny` model preset's vocabulary
SEED = 1234
DOCUMENTS = 1500

NAMES = ["Ada", "Ben", "Cleo", "Dara", "Emil", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena", "Milo", "Nia",
         "Omar", "Pia", "Quinn", "Rosa", "Sami", "Tess"]
ANIMALS = ["cat", "dog", "fox", "owl", "goat", "horse", "rabbit", "crow", "otter", "bee"]
PLACES = ["the river", "the old mill", "the market", "the hill", "the forest", "the harbour", "the library",
          "the garden", "the station", "the bakery"]
THINGS = ["a red kite", "a lantern", "a loaf of bread", "a map", "a small boat", "a basket of apples", "a letter",
          "a blue scarf", "a wooden box", "a bell"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "foggy", "cloudy", "snowy"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    animal, place, thing = rng.choice(ANIMALS), rng.choice(PLACES), rng.choice(THINGS)
    day, weather = rng.choice(DAYS), rng.choice(WEATHER)
    lines = [f"On {day} it was {weather}, and {a} walked to {place}.",
             f"There {a} met {b}, who had {thing}.",
             rng.choice([f"A {animal} followed them all the way home.",
                         f"They saw a {animal} near {rng.choice(PLACES)}.",
                         f"{b} said that the {animal} was looking for {rng.choice(THINGS)}."]),
             rng.choice([f"{a} gave {b} {rng.choice(THINGS)} in return.",
                         f"They carried {thing} to {rng.choice(PLACES)} together.",
                         f"When the day grew {rng.choice(WEATHER)}, they went back to {place}."]),
             f"In the evening {a} wrote down everything that had happened."]
    return " ".join(lines[:rng.randint(3, 5)])


def arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(3, 6)):
        x, y = rng.randint(0, 10), rng.randint(0, 10)
        if rng.random() < 0.5:
            facts.append(f"{NUMBER_WORDS[x].capitalize()} plus {NUMBER_WORDS[y]} is {NUMBER_WORDS[x + y]}.")
        else:
            x, y = max(x, y), min(x, y)
            facts.append(f"{NUMBER_WORDS[x].capitalize()} minus {NUMBER_WORDS[y]} is {NUMBER_WORDS[x - y]}.")
    return " ".join(facts)


def weather_report(rng: random.Random) -> str:
    days = rng.sample(DAYS, rng.randint(2, 4))
    parts = [f"On {d} the weather will be {rng.choice(WEATHER)} near {rng.choice(PLACES)}, "
             f"with {rng.randint(1, 30)} degrees at noon." for d in days]
    return "Weather report. " + " ".join(parts)


def inventory(rng: random.Random) -> str:
    who = rng.choice(NAMES)
    items = rng.sample(THINGS, rng.randint(2, 4))
    listed = ", ".join(items[:-1]) + f" and {items[-1]}"
    return (f"{who} keeps a list. In the box there are {listed}. "
            f"Every {rng.choice(DAYS)} {who} counts them again and finds {NUMBER_WORDS[len(items)]} things.")


def corpus(seed: int = SEED, documents: int = DOCUMENTS) -> list[str]:
    rng = random.Random(seed)
    kinds = [story, story, arithmetic, weather_report, inventory]
    return [" ".join(rng.choice(kinds)(rng) for _ in range(rng.randint(1, 4))) for _ in range(documents)]


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_model(str(out_dir))


def main() -> int:
    texts = corpus()
    jsonl = CORPUS_DIR / "corpus.jsonl"
    with open(jsonl, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    train_tokenizer(texts, TOKENIZER_DIR)
    return subprocess.call([sys.executable, "-m", "labkit.cli", "data", "prepare", str(jsonl),
                            "--output-prefix", str(CORPUS_DIR / "corpus"),
                            "--vocab-file", str(TOKENIZER_DIR / "vocab.json"),
                            "--merge-file", str(TOKENIZER_DIR / "merges.txt")])


if __name__ == "__main__":
    sys.exit(main())

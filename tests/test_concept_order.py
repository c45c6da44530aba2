"""No lab uses a term before the lab that teaches it, in the order a workshop takes the labs (labkit/data/workshop.yaml:
its sessions, then the homework labs), in either edition.

Each term is kept below with the lab that defines it and how each edition writes it; the labs' text cells are read
(code cells, where `virtual_stages=1` is a keyword and not a word to a student, are left out), each cell's lines
joined, so that a term broken over two lines is found.
"""
from __future__ import annotations

import re
from pathlib import Path

import jupytext
import pytest

from labkit import timetable

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

# term: (the lab that defines it, English pattern, Korean pattern), matched case-insensitively
TERMS = {
    "pipeline bubble": ("05", r"\bbubble", r"버블"),
    "1F1B": ("05", r"\b1F1B\b", r"\b1F1B\b"),
    "virtual stages": ("07", r"virtual\s+stages?", r"가상\s*스테이지"),
    "interleaved schedule": ("07", r"interleav", r"인터리브"),
    "min-max partition": ("06", r"min-max", r"min-max"),
    "Pareto front": ("06", r"Pareto", r"파레토"),
    "Spearman's rank correlation": ("06", r"Spearman", r"Spearman|스피어만"),
}
EDITIONS = {"English": (NOTEBOOKS, 1), "Korean": (NOTEBOOKS / "ko", 2)}


def text_of(path: Path) -> str:
    """A lab's text cells, each with its lines joined by spaces."""
    return "\n".join(" ".join(cell.source.split()) for cell in jupytext.read(path).cells
                     if cell.cell_type == "markdown")


def lab_source(directory: Path, lab: str) -> Path:
    (path,) = directory.glob(f"{lab}_*.py")
    return path


def problems_of(texts: dict[str, str], order: list[str], column: int) -> list[str]:
    """Each term (TERMS, with the pattern of `column`: 1 English, 2 Korean) that its lab never names, or that a lab
    before it in `order` uses; `texts`: each lab's text."""
    problems = []
    for term, (home, *patterns) in TERMS.items():
        pattern = re.compile(patterns[column - 1], re.IGNORECASE)
        if not pattern.search(texts[home]):
            problems.append(f"lab {home} is said to define {term!r} but never names it")
        for lab in order[:order.index(home)]:
            if pattern.search(texts[lab]):
                problems.append(f"lab {lab} uses {term!r} before lab {home}, which defines it, in the workshop's order "
                                f"{', '.join(order)}: define it there, or move the labs")
    return problems


@pytest.mark.parametrize("edition", EDITIONS)
def test_no_lab_uses_a_term_before_the_lab_that_defines_it(edition):
    directory, column = EDITIONS[edition]
    order = timetable.course_order()
    problems = problems_of({lab: text_of(lab_source(directory, lab)) for lab in order}, order, column)
    assert not problems, f"{edition} edition:\n" + "\n".join(problems)


def test_a_term_used_before_its_lab_is_reported(tmp_path):
    """A text cell naming virtual stages, broken over two lines, in a lab before 07 is reported; the same word as a
    code cell's keyword is not."""
    order = ["05", "06", "07"]
    texts = {"05": "bubble 1F1B", "06": "min-max Pareto Spearman", "07": "virtual stages interleaved"}
    assert problems_of(texts, order, 1) == []
    path = tmp_path / "05_x.py"
    path.write_text("# %% [markdown]\n# Each stage holds two virtual\n# stages.\n\n# %%\nvirtual_stages = 1\n")
    texts["05"] = text_of(path) + " bubble 1F1B"
    assert problems_of(texts, order, 1) == [
        "lab 05 uses 'virtual stages' before lab 07, which defines it, in the workshop's order 05, 06, 07: define it "
        "there, or move the labs"]
    path.write_text("# %% [markdown]\n# Each stage holds two chunks.\n\n# %%\nvirtual_stages = 1\n")
    texts["05"] = text_of(path) + " bubble 1F1B"
    assert problems_of(texts, order, 1) == []
    texts["07"] = "interleaved"
    assert problems_of(texts, order, 1) == ["lab 07 is said to define 'virtual stages' but never names it"]

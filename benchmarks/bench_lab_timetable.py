"""A timetable for teaching the lab series: per lab, the time a student spends reading, predicting, doing the
exercises and waiting for the runs.

    .venv/bin/python benchmarks/bench_lab_timetable.py [LAB_JSON]

What is counted, from the labs' sources (notebooks/NN_*.py): the words of the text cells, the lines of the code
cells, the cells tagged `prediction` and the exercises (`check(...)` cells). What is measured: the machine time of
each notebook, from a `labkit lab` run's lab.json (LAB_JSON, default: the newest runs/lab-*/lab.json). What is
assumed, and printed with the table:
- text is read at 238 words a minute, the mean silent reading rate of English non-fiction in Brysbaert's
  meta-analysis ("How many words do we read per minute?", J. Memory and Language 109, 2019);
- a line of code is read and run in 5 s (twelve lines a minute);
- a prediction takes 3 minutes, an exercise 6 (with its check and a second try).
These are assumptions, not measurements of students or of an instructor: nobody has timed the series. (Reading at
half that rate and 10 s per code line gives 6 h 30 min.)
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parents[1]
WORDS_PER_MINUTE = 238
CODE_LINE_S = 5
PREDICTION_MIN = 3
EXERCISE_MIN = 6


def lab_counts(source: Path) -> dict[str, int]:
    notebook = jupytext.read(source)
    text = " ".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    code = [c for c in notebook.cells if c.cell_type == "code" and "check-claim" not in c.metadata.get("tags", [])]
    return {"words": len(re.findall(r"[\w$`'-]+", text)),
            "code_lines": sum(1 for c in code for line in c.source.splitlines() if line.strip()),
            "predictions": sum("prediction" in c.metadata.get("tags", []) for c in code),
            "exercises": sum(bool(re.search(r"^check\(", c.source, re.M)) for c in code)}


def main() -> int:
    lab_json = Path(sys.argv[1]) if len(sys.argv) > 1 else max(ROOT.glob("runs/lab-*/lab.json"), default=None,
                                                                key=lambda p: p.stat().st_mtime)
    run_s: dict[str, float] = {}
    if lab_json is not None and lab_json.exists():
        run_s = {nb["name"]: nb["seconds"] for nb in json.loads(lab_json.read_text())["notebooks"]}
        print(f"machine times from {lab_json}")
    print(f"assumed: {WORDS_PER_MINUTE:.0f} words/min, {CODE_LINE_S} s per code line, {PREDICTION_MIN} min per "
          f"prediction, {EXERCISE_MIN} min per exercise\n")
    print(f"| lab | words | code lines | predictions | exercises | reading | predicting + exercises | runs | total |")
    print("|---|---|---|---|---|---|---|---|---|")
    total = 0.0
    for source in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py")):
        n = lab_counts(source)
        reading = n["words"] / WORDS_PER_MINUTE + n["code_lines"] * CODE_LINE_S / 60
        doing = n["predictions"] * PREDICTION_MIN + n["exercises"] * EXERCISE_MIN
        runs = run_s.get(source.stem)
        minutes = reading + doing + (runs or 0) / 60
        total += minutes
        print(f"| {source.stem} | {n['words']} | {n['code_lines']} | {n['predictions']} | {n['exercises']} | "
              f"{reading:.0f} min | {doing} min | {'-' if runs is None else f'{runs / 60:.1f} min'} | "
              f"{minutes:.0f} min |")
    print(f"\nseries: {total:.0f} min = {total // 60:.0f} h {total % 60:.0f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

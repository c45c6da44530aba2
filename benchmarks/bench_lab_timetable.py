"""The workshop timetable: per session and per lab, the minutes of its core, optional and homework units at an
instructor's pace, from the labs' own marks and counts (labkit/timetable.py) and the pace, sessions and machine
times of labkit/data/workshop.yaml; the README's tables are this output (tests/test_timetable.py holds them equal).

    .venv/bin/python benchmarks/bench_lab_timetable.py [LAB_JSON]

LAB_JSON (a `labkit lab` run's lab.json, e.g. from `make lab`) replaces workshop.yaml's machine times with that run's
measured ones, to refresh them (a notebook that did not run ok keeps workshop.yaml's). The rates are printed with the
tables; which of them are measurements and which assumptions is said in workshop.yaml.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from labkit import timetable

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    measured = {}
    if len(sys.argv) > 1:
        notebooks = json.loads(Path(sys.argv[1]).read_text())["notebooks"]
        measured = {nb["name"][:2]: nb["seconds"] for nb in notebooks if nb.get("status", "ok") == "ok"}
        failed = [nb["name"] for nb in notebooks if nb.get("status", "ok") != "ok"]
        print(f"machine times from {sys.argv[1]}: {measured}")
        if failed:
            print(f"left out, not ok in that run: {', '.join(failed)} (workshop.yaml's times stand for them)")
    print("pace:", ", ".join(f"{k} {v:g}" for k, v in asdict(timetable.pace()).items()), "\n")
    by_session, by_lab = timetable.markdown_tables(ROOT / "notebooks", measured)
    print(by_session, by_lab, sep="\n\n")
    pace, run_s = timetable.pace(), {**timetable.machine_s(), **measured}
    total = sum(sum(timetable.lab_minutes(timetable.lab_units(path), pace, run_s.get(path.name[:2], 0.0)).values())
                for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
    print(f"\nthe whole series at this pace: {total // 60:.0f} h {total % 60:.0f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

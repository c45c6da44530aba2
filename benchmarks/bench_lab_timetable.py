"""The workshop timetable: per lab and per session, the minutes of its core, optional and homework units at an
instructor's pace, from the labs' own marks and counts (labkit/timetable.py) and the pace, sessions and machine
times of labkit/data/workshop.yaml.

    .venv/bin/python benchmarks/bench_lab_timetable.py [LAB_JSON]

LAB_JSON (a `labkit lab` run's lab.json, e.g. from `make lab`) replaces workshop.yaml's machine times with that run's
measured ones, to refresh them. The rates are printed with the tables; which of them are measurements and which
assumptions is said in workshop.yaml.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from labkit import timetable

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    run_s = timetable.machine_s()
    if len(sys.argv) > 1:
        measured = {nb["name"][:2]: nb["seconds"] for nb in json.loads(Path(sys.argv[1]).read_text())["notebooks"]}
        run_s.update(measured)
        print(f"machine times from {sys.argv[1]}: {measured}")
    pace = timetable.pace()
    print("pace:", ", ".join(f"{k} {v:g}" for k, v in asdict(pace).items()), "\n")
    labs = {p.name[:2]: p for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))}
    minutes = {lab: timetable.lab_minutes(timetable.lab_units(path), pace, run_s[lab]) for lab, path in labs.items()}

    print("| lab | core | optional | homework | machine time in core | marked optional or homework |")
    print("|---|---|---|---|---|---|")
    for lab, path in labs.items():
        units = timetable.lab_units(path)
        marked = [u.heading for u in units if u.kind != "core"]
        if len(marked) == len(units):
            marked = [f"the whole lab ({units[0].kind})"]
        m = minutes[lab]
        print(f"| {path.stem} | {m['core']:.0f} min | {m['optional']:.0f} min | {m['homework']:.0f} min | "
              f"{run_s[lab]:.0f} s | {'; '.join(marked) or '-'} |")

    print("\n| session | labs | core | teaching time | optional | homework |")
    print("|---|---|---|---|---|---|")
    for session in timetable.sessions():
        core, optional, homework = (sum(minutes[lab][kind] for lab in session.labs) for kind in timetable.KINDS)
        print(f"| {session.title} | {', '.join(session.labs)} | {core:.0f} min | {session.teaching_min:.0f} min of "
              f"{session.minutes:.0f} | {optional:.0f} min | {homework:.0f} min |")
    after = sum(sum(minutes[lab].values()) for lab in timetable.homework_labs())
    print(f"| homework labs | {', '.join(timetable.homework_labs())} | - | - | - | {after:.0f} min |")
    total = sum(sum(m.values()) for m in minutes.values())
    print(f"\nthe whole series at this pace: {total // 60:.0f} h {total % 60:.0f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

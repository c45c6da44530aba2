"""How long the labs take to teach, and what fits a workshop's sessions: the timetable in the README, from the labs.

A lab is cut into units: its opening (title to first section), each `##` section, and each exercise (a line that
opens with **Exercise N.**). A unit is *core*, *optional* or *homework*: the lab says which in the unit's heading or
the exercise's bold lead, `(optional)` / `(homework)` in English and `(선택 사항)` / `(과제)` in Korean, so a student
sees it where the unit starts; an unmarked exercise is what its section is, and a lab whose title carries the marker
is that as a whole. Core units are taught in the session; optional ones are read if the class has time; homework is
done after it. Every cell still runs either way (later cells may use earlier
results), so a lab's machine time counts in full.

A unit's minutes, at the pace of `labkit/data/workshop.yaml` (its rates, their sources and which are assumptions are
stated there): its text words at a reading rate, its code lines at a rate, each prediction and each exercise with
its debrief; each lab adds the instructor's framing and its measured machine time. The counts come from the English
edition (Korean text has other word counts for the same content; the Korean edition marks the same units, which a
test holds). Nobody has timed a class through the series: the minutes are the stated rates applied to the counts.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from labkit.paths import data_file

KINDS = ("core", "optional", "homework")
"""What a unit is in a workshop: taught in the session, read if the class has time, done after the session."""

MARKERS = {"optional": ("(optional)", "(선택 사항)"), "homework": ("(homework)", "(과제)")}
"""The words in a unit's heading (or an exercise's bold lead) that make it optional or homework, per edition."""

_EXERCISE_LEAD = re.compile(r"^\*\*(Exercise|연습 문제) [0-9]+")
_WORD = re.compile(r"[\w$`'-]+")


@dataclass(frozen=True)
class Pace:
    """The rates a timetable applies to the labs' counts (see workshop.yaml for their sources)."""

    words_per_minute: float
    """Silent reading of the text cells."""
    code_line_s: float
    """Reading and running one non-empty line of a code cell."""
    prediction_min: float
    """Making one prediction (a cell tagged `prediction`)."""
    exercise_min: float
    """Doing one exercise with its check and a second try."""
    framing_min: float
    """The instructor's opening of each lab: its question and what to watch."""
    prediction_debrief_min: float
    """The class comparing its predictions with the measurement, per prediction."""
    exercise_debrief_min: float
    """Going over one exercise's answer with the class."""


@dataclass(frozen=True)
class Unit:
    """One stretch of a lab: its opening, a section, or one exercise."""

    lab: str
    """The lab's notebook name, e.g. 03_activation_checkpointing."""
    heading: str
    """The unit's heading (or the exercise's bold lead), as the lab writes it."""
    kind: str
    """core, optional or homework (KINDS)."""
    words: int
    """Words of its text cells."""
    code_lines: int
    """Non-empty lines of its code cells (claim checks left out: they are the lab's own tests)."""
    predictions: int
    """Cells tagged `prediction`."""
    exercises: int
    """Exercise checks (code cells that call check(...))."""

    def minutes(self, pace: Pace) -> float:
        """Minutes to teach this unit at `pace`, debriefs included (the lab's framing and machine time are not)."""
        return (self.words / pace.words_per_minute + self.code_lines * pace.code_line_s / 60
                + self.predictions * (pace.prediction_min + pace.prediction_debrief_min)
                + self.exercises * (pace.exercise_min + pace.exercise_debrief_min))


@dataclass(frozen=True)
class Session:
    """One sitting of a workshop."""

    title: str
    """What the session is about."""
    minutes: float
    """Its length, breaks included."""
    break_min: float
    """Its breaks."""
    labs: tuple[str, ...]
    """The labs it teaches (two-digit numbers), in order."""

    @property
    def teaching_min(self) -> float:
        return self.minutes - self.break_min


def unit_kind(heading: str) -> str:
    """core, optional or homework, from the markers in a heading."""
    for kind, words in MARKERS.items():
        if any(word in heading for word in words):
            return kind
    return "core"


def lab_units(notebook: Path | str) -> list[Unit]:
    """The units of one lab notebook (.ipynb), in order: its opening (from its `# ` title), each `##` section, and
    each exercise (a line that opens with **Exercise N**, in whatever section). A unit takes the kind its heading
    marks, else its section's (for an exercise), else the title's; text is counted line by line into the unit that
    line belongs to."""
    import nbformat

    notebook = Path(notebook)
    cells = nbformat.read(notebook, as_version=4).cells
    units: list[dict] = []
    title_kind = section_kind = "core"

    def start(heading: str, inherited: str) -> None:
        own = unit_kind(heading)
        units.append({"heading": heading, "kind": own if own != "core" else inherited, "words": 0, "code_lines": 0,
                      "predictions": 0, "exercises": 0})

    for cell in cells:
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# ") and not units:
                    start(line[2:].strip(), "core")
                    title_kind = section_kind = units[-1]["kind"]
                elif line.startswith("## "):
                    start(line[3:].strip(), title_kind)
                    section_kind = units[-1]["kind"]
                elif _EXERCISE_LEAD.match(line):
                    start(line.split(".**")[0].strip("*") if ".**" in line else line, section_kind)
                elif not units:
                    start(notebook.stem, "core")
                units[-1]["words"] += len(_WORD.findall(line))
        elif cell.cell_type == "code" and "check-claim" not in tags and "parameters" not in tags:
            if not units:
                start(notebook.stem, "core")
            units[-1]["code_lines"] += sum(1 for line in cell.source.splitlines() if line.strip())
            units[-1]["predictions"] += "prediction" in tags
            units[-1]["exercises"] += bool(re.search(r"^check\(", cell.source, re.M))
    return [Unit(lab=notebook.stem, **u) for u in units]


@functools.cache
def _workshop() -> dict:
    import yaml

    return yaml.safe_load(data_file("workshop.yaml").read_text(encoding="utf-8"))


def pace() -> Pace:
    """The instructor's pace workshop.yaml states."""
    return Pace(**_workshop()["pace"])


def sessions() -> list[Session]:
    """The workshop's sessions, as workshop.yaml lays them out."""
    return [Session(title=s["title"], minutes=s["minutes"], break_min=s["break_min"],
                    labs=tuple(f"{lab:02d}" for lab in s["labs"]))
            for s in _workshop()["sessions"]]


def homework_labs() -> list[str]:
    """The labs no session teaches, done after the sessions (two-digit numbers, in order)."""
    return [f"{lab:02d}" for lab in _workshop().get("homework_labs", [])]


def course_order() -> list[str]:
    """The labs in the order a workshop takes them: each session's, then the homework labs."""
    return [lab for session in sessions() for lab in session.labs] + homework_labs()


def machine_s() -> dict[str, float]:
    """Each lab's measured machine time (seconds), by two-digit number, as workshop.yaml records it."""
    return {f"{lab:02d}": float(s) for lab, s in _workshop()["machine_s"].items()}


def lab_minutes(units: list[Unit], at: Pace, run_s: float = 0.0) -> dict[str, float]:
    """Minutes of one lab by kind: the core carries the instructor's framing and the machine time, which a lab that is
    homework as a whole puts in its homework, unframed."""
    by_kind = {kind: sum(u.minutes(at) for u in units if u.kind == kind) for kind in KINDS}
    if any(u.kind == "core" for u in units):
        by_kind["core"] += at.framing_min + run_s / 60
    elif units:
        by_kind[units[0].kind] += run_s / 60
    return by_kind


def markdown_tables(notebook_dir: Path | str, run_s: dict[str, float] | None = None) -> tuple[str, str]:
    """The README's two timetable tables, per session and per lab, for the labs in `notebook_dir` at the pace of
    workshop.yaml, with its machine times or `run_s` (seconds by two-digit lab number) where given."""
    run_s = {**machine_s(), **(run_s or {})}
    at = pace()
    labs = {p.name[:2]: p for p in sorted(Path(notebook_dir).glob("[0-9][0-9]_*.ipynb"))}
    units = {lab: lab_units(path) for lab, path in labs.items()}
    minutes = {lab: lab_minutes(units[lab], at, run_s.get(lab, 0.0)) for lab in labs}
    by_session = ["| session | labs | core | teaching time | optional | homework |", "|---|---|---|---|---|---|"]
    for session in sessions():
        core, optional, homework = (sum(minutes[lab][kind] for lab in session.labs) for kind in KINDS)
        by_session.append(f"| {session.title} | {', '.join(session.labs)} | {core:.0f} min | "
                          f"{session.teaching_min:.0f} min of {session.minutes:.0f} | {optional:.0f} min | "
                          f"{homework:.0f} min |")
    after = sum(sum(minutes[lab].values()) for lab in homework_labs())
    by_session.append(f"| homework labs | {', '.join(homework_labs())} | - | - | - | {after:.0f} min |")
    by_lab = ["| lab | core | optional | homework | machine time in core | marked optional or homework |",
              "|---|---|---|---|---|---|"]
    for lab, path in labs.items():
        marked = [u.heading for u in units[lab] if u.kind != "core"]
        if units[lab] and len(marked) == len(units[lab]):
            marked = [f"the whole lab ({units[lab][0].kind})"]
        m = minutes[lab]
        by_lab.append(f"| {path.stem} | {m['core']:.0f} min | {m['optional']:.0f} min | {m['homework']:.0f} min | "
                      f"{run_s.get(lab, 0.0):.0f} s | {'; '.join(marked) or '-'} |")
    return "\n".join(by_session), "\n".join(by_lab)

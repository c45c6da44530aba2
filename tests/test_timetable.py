"""The workshop's timetable (labkit/timetable.py, labkit/data/workshop.yaml): the core of each session fits its
teaching time at the stated pace, every lab is taught once, and both editions mark the same units."""
from __future__ import annotations

from pathlib import Path

import pytest

from labkit import timetable

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook(lab: str, folder: Path = NOTEBOOKS) -> Path:
    (path,) = folder.glob(f"{lab}_*.ipynb")
    return path


@pytest.mark.parametrize("session", timetable.sessions(), ids=lambda s: s.title.split(":")[0])
def test_each_sessions_core_fits_its_teaching_time(session):
    pace, run_s = timetable.pace(), timetable.machine_s()
    core = {lab: timetable.lab_minutes(timetable.lab_units(notebook(lab)), pace, run_s[lab])["core"]
            for lab in session.labs}
    assert sum(core.values()) <= session.teaching_min, (
        f"{session.title}: the core takes {sum(core.values()):.0f} min of {session.teaching_min:.0f} "
        f"({', '.join(f'{lab} {m:.0f}' for lab, m in core.items())}): mark a section or exercise (optional) or "
        "(homework) in both editions")


def test_every_lab_is_taught_once_and_homework_labs_say_so():
    labs = sorted(p.name[:2] for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    assert sorted(timetable.course_order()) == labs
    for lab in timetable.homework_labs():
        units = timetable.lab_units(notebook(lab))
        assert {u.kind for u in units} == {"homework"}, f"lab {lab}'s title does not say (homework)"
    assert set(timetable.machine_s()) == set(labs)


def test_marked_sections_and_exercises_are_read_as_such():
    units = {u.heading: u.kind for u in timetable.lab_units(notebook("03"))}
    assert units["3.6 Recomputation from scratch (homework)"] == "homework"
    assert units["Exercise 1"] == "core" and units["Exercise 2 (homework)"] == "homework"
    assert units["3.4 Memory, measured"] == "core"
    exercises = [u for u in timetable.lab_units(notebook("03")) if u.heading.startswith("Exercise ")]
    assert [u.exercises for u in exercises] == [1, 1, 1]  # each exercise's check counted in its own unit


@pytest.mark.parametrize("lab", sorted(p.name[:2] for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
def test_the_korean_edition_marks_the_same_units(lab):
    english = [(u.kind, u.predictions, u.exercises) for u in timetable.lab_units(notebook(lab))]
    korean = [(u.kind, u.predictions, u.exercises) for u in timetable.lab_units(notebook(lab, NOTEBOOKS / "ko"))]
    assert korean == english


def test_the_readme_shows_the_timetable_the_labs_give():
    """The README's two tables are labkit.timetable's (benchmarks/bench_lab_timetable.py prints them)."""
    by_session, by_lab = timetable.markdown_tables(NOTEBOOKS)
    readme = (NOTEBOOKS.parent / "README.md").read_text()
    assert by_session in readme and by_lab in readme, "README.md: paste benchmarks/bench_lab_timetable.py's tables"


def test_an_unmarked_exercise_takes_its_sections_kind_and_only_a_title_marks_a_whole_lab(tmp_path):
    import nbformat

    def lab(*cells):
        path = tmp_path / "99_x.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=list(cells)), path)
        return [(u.heading, u.kind) for u in timetable.lab_units(path)]

    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    assert lab(md("# Lab 99: x\n\nwords"), md("## Exercises (homework)\n\n**Exercise 1.** one\n\n"
                                                "**Exercise 2 (optional).** two"), code("check('99.1', a)")) == [
        ("Lab 99: x", "core"), ("Exercises (homework)", "homework"), ("Exercise 1", "homework"),
        ("Exercise 2 (optional)", "optional")]
    assert lab(md("## 9.1 Opening (optional)\n\ntext"), md("## 9.2 Next\n\ntext")) == [
        ("9.1 Opening (optional)", "optional"), ("9.2 Next", "core")]
    assert lab(md("# Lab 99: x (homework)"), md("## 9.1 A")) == [("Lab 99: x (homework)", "homework"),
                                                                 ("9.1 A", "homework")]
    assert [u.code_lines for u in timetable.lab_units(tmp_path / "99_x.ipynb")] == [0, 0]
    assert lab(code("x = 1")) == [("99_x", "core")]  # a lab of code alone is one unit, which carries its run time

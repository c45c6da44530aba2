"""Every lab and solution notebook runs under nbval: lax (every cell runs without error), and strict on the cells
tagged `nbval-check-output`, whose stored outputs are deterministic (refresh them with `labkit lab --store-outputs`)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import backlinks
from labkit.paths import course_dir, source_tree

REPO_ROOT = source_tree()
NOTEBOOK_DIR = course_dir("notebooks")


def _nbval_runs(edition: Path) -> list:
    """One nbval run per lab, and one for all the solutions together (each is a few check cells: one pytest process
    for them all saves its start-up ten times). Lab 00 runs its Slurm primer against the suite's local Slurm."""
    labs = sorted(edition.glob("[0-9][0-9]_*.ipynb"))
    return [pytest.param([lab], id=str(lab.relative_to(NOTEBOOK_DIR)),
                         marks=[pytest.mark.slurm] if lab.name.startswith("00_") else []) for lab in labs] + \
        [pytest.param(sorted((edition / "solutions").glob("*.ipynb")),
                      id=str((edition / "solutions").relative_to(NOTEBOOK_DIR)))]


def test_every_lab_has_a_paired_source_and_a_solution():
    labs = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert labs, "no lab notebooks"
    for lab in labs:
        assert lab.with_suffix(".py").exists(), f"{lab.name}: no paired .py (jupytext --set-formats ipynb,py:percent)"
        assert (NOTEBOOK_DIR / "solutions" / lab.name).exists(), f"{lab.name}: no solutions/{lab.name}"


def cells(path: Path) -> list[tuple[str, str, list]]:
    """A notebook's cells as jupytext reads either form: type, source and tags (outputs are the .ipynb's alone)."""
    import jupytext

    return [(c.cell_type, c.source.strip(), c.metadata.get("tags", [])) for c in jupytext.read(path).cells]


def _paired_sources() -> list[Path]:
    return sorted(p for p in NOTEBOOK_DIR.rglob("*.py")
                  if p.with_suffix(".ipynb").exists() and "runs" not in p.relative_to(NOTEBOOK_DIR).parts)


@pytest.mark.parametrize("source", _paired_sources(), ids=lambda p: str(p.relative_to(NOTEBOOK_DIR)))
def test_every_notebook_holds_the_cells_of_its_source(source: Path):
    """What is run and shipped is the .ipynb, what is edited and reviewed is its jupytext .py: they hold the same
    cells, so an edit to one is never lost from the other."""
    assert cells(source.with_suffix(".ipynb")) == cells(source), \
        f"{source.with_suffix('.ipynb').name} differs from {source.name}: `jupytext --sync {source.relative_to(REPO_ROOT)}`"


def test_the_pairing_check_sees_an_edited_source(tmp_path):
    import shutil

    lab = NOTEBOOK_DIR / "01_baseline.py"
    shutil.copy(lab.with_suffix(".ipynb"), tmp_path / lab.with_suffix(".ipynb").name)
    edited = tmp_path / lab.name
    edited.write_text(lab.read_text().replace("# # Lab 01", "# # Lab 1", 1))
    assert cells(edited.with_suffix(".ipynb")) != cells(edited)


KOREAN = NOTEBOOK_DIR / "ko"


def _english_sources() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py")) + sorted((NOTEBOOK_DIR / "solutions").glob("*.py"))


@pytest.mark.parametrize("source", _english_sources(), ids=lambda p: str(p.relative_to(NOTEBOOK_DIR)))
def test_the_korean_edition_runs_the_same_code_and_is_up_to_date(source: Path):
    """notebooks/ko/ holds every lab and solution with the same cells as the English: each code cell (source, tags,
    stored outputs) identical, so the English edition's runs under nbval run the Korean one's code; its .ipynb is
    the one written from its source (`labkit lab --store-outputs --lang ko`)."""
    import jupytext
    from labkit import lab

    korean = KOREAN / source.relative_to(NOTEBOOK_DIR)
    assert korean.exists(), f"{source.name}: no Korean edition at {korean.relative_to(REPO_ROOT)}"
    assert lab.translation_problems(source, korean) == []
    assert lab.translation_problems(source.with_suffix(".ipynb"), korean.with_suffix(".ipynb")) == []
    text = [c.source for c in jupytext.read(korean).cells if c.cell_type == "markdown"]
    written = [c.source for c in jupytext.read(korean.with_suffix(".ipynb")).cells if c.cell_type == "markdown"]
    assert written == text, f"{korean.with_suffix('.ipynb').name} is older than its source: " \
                            f"run `labkit lab --store-outputs --lang ko --only {source.name[:2]}`"
    assert any(re.search("[\uac00-\ud7a3]", t) for t in text), f"{korean.name} has no Korean text"


def test_a_translation_that_changes_code_or_cells_is_refused(tmp_path):
    from labkit import lab

    english = NOTEBOOK_DIR / "00_setup.py"
    lines = english.read_text(encoding="utf-8")
    changed = tmp_path / "00_setup.py"
    changed.write_text(lines.replace("iterations = 4", "iterations = 5"), encoding="utf-8")
    assert lab.translation_problems(english, changed) == ["cell 2: its source differs from the English"]
    changed.write_text(lines.replace('# %% tags=["parameters"]', "# %%"), encoding="utf-8")
    assert lab.translation_problems(english, changed) == [
        "cell 2: tags [] where the English has ['parameters']"]
    changed.write_text(lines + "\n# %%\nprint('extra')\n", encoding="utf-8")
    assert lab.translation_problems(english, changed)[0].endswith("cells where the English has "
                                                                  f"{lines.count('# %%')}")
    with pytest.raises(lab.LabError, match="not a translation"):
        lab.write_translated_notebook(changed, english.with_suffix(".ipynb"))


def pytest_generate_tests(metafunc):
    """The nbval runs cover the edition chosen with --lab-edition (en by default)."""
    if metafunc.function.__name__ == "test_notebook_runs_under_nbval":
        edition = metafunc.config.getoption("lab_edition")
        chosen = {"en": [NOTEBOOK_DIR], "ko": [KOREAN], "all": [NOTEBOOK_DIR, KOREAN]}[edition]
        metafunc.parametrize("notebooks", [run for folder in chosen for run in _nbval_runs(folder)])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_notebook_runs_under_nbval(notebooks: list[Path], tmp_path):
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
               "--nbval-sanitize-with", str(NOTEBOOK_DIR / "nbval_sanitize.cfg"), "--nbval-cell-timeout", "300",
               *map(str, notebooks)]
    env = {**os.environ, "LABKIT_RUNS_DIR": str(tmp_path / "runs")}
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    names = ", ".join(nb.name for nb in notebooks)
    assert result.returncode == 0, f"{names} failed under nbval:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"


def test_every_taught_in_link_names_exactly_the_labs_that_call_it():
    """A docstring's "Taught in lab NN" back-link is checked against the labs' sources, as d2l generates its: a link
    to a lab that never calls the function fails, and so does a labkit function a lab calls with no link."""
    called, linked = backlinks.taught_in(NOTEBOOK_DIR), backlinks.taught_links()
    assert len(called) > 50 and called["labkit.logs.views.timer_breakdown_figure"] == {"07"}
    wrong = {home: f"says {sorted(linked.get(home, ()))}, called by {sorted(called.get(home, ()))}: "
                   f"write {backlinks.taught_phrase(called[home]) if home in called else 'no link'!r}"
             for home in set(called) | set(linked) if called.get(home, set()) != linked.get(home, set())}
    assert not wrong, wrong


def test_the_link_check_reads_calls_through_names_and_modules(tmp_path):
    source = ("from labkit.paths import example as ex\nfrom labkit.profiling import views\nimport labkit.catalog\n"
              "ex('tiny-cpu.yaml')\nviews.memory_figure({})\nlabkit.catalog.gpus\nfrom labkit.spec import load_spec\n")
    assert backlinks.labkit_calls(source) == {"labkit.paths.example", "labkit.profiling.views.memory_figure"}
    # a re-export is followed to where the function is defined
    assert backlinks.labkit_calls("from labkit.estimate import estimate\nestimate(spec)") == {
        "labkit.estimate.estimator.estimate"}
    (tmp_path / "03_x.py").write_text(source)
    assert backlinks.taught_in(tmp_path) == {"labkit.paths.example": {"03"},
                                       "labkit.profiling.views.memory_figure": {"03"}}
    assert backlinks.taught_phrase({"07"}) == "Taught in lab 07."
    assert backlinks.taught_phrase({"04", "01", "02"}) == "Taught in labs 01, 02 and 04."
    assert backlinks.TAUGHT.search(backlinks.taught_phrase({"04", "01", "02"})).group(1) == "01, 02 and 04"

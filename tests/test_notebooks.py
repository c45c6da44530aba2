"""Every lab and solution notebook runs under nbval: lax (every cell runs without error), and strict on the cells
tagged `nbval-check-output`, whose stored outputs are deterministic (refresh them with `labkit lab --store-outputs`)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.paths import course_dir, source_tree

REPO_ROOT = source_tree()
NOTEBOOK_DIR = course_dir("notebooks")

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")) + sorted((NOTEBOOK_DIR / "solutions").glob("*.ipynb"))


def test_every_lab_has_a_paired_source_and_a_solution():
    labs = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert labs, "no lab notebooks"
    for lab in labs:
        assert lab.with_suffix(".py").exists(), f"{lab.name}: no paired .py (jupytext --set-formats ipynb,py:percent)"
        assert (NOTEBOOK_DIR / "solutions" / lab.name).exists(), f"{lab.name}: no solutions/{lab.name}"


def _params(notebooks: list[Path]) -> list:
    """The Slurm primer (lab 09) runs its commands against the suite's local Slurm."""
    return [pytest.param(p, id=str(p.relative_to(NOTEBOOK_DIR)),
                         marks=[pytest.mark.slurm] if p.name.startswith("09_") else [])
            for p in notebooks]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("notebook", _params(NOTEBOOKS))
def test_notebook_runs_under_nbval(notebook: Path, tmp_path):
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
               "--nbval-sanitize-with", str(NOTEBOOK_DIR / "nbval_sanitize.cfg"), "--nbval-cell-timeout", "300",
               str(notebook)]
    env = {**os.environ, "LABKIT_RUNS_DIR": str(tmp_path / "runs")}
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"{notebook.name} failed under nbval:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"


def test_every_taught_in_link_names_exactly_the_labs_that_call_it():
    """A docstring's "Taught in lab NN" back-link is checked against the labs' sources, as d2l generates its: a link
    to a lab that never calls the function fails, and so does a labkit function a lab calls with no link."""
    from labkit import lab

    called, linked = lab.taught_in(NOTEBOOK_DIR), lab.taught_links()
    assert len(called) > 50 and called["labkit.logs.views.timer_breakdown_figure"] == {"07"}
    wrong = {home: f"says {sorted(linked.get(home, ()))}, called by {sorted(called.get(home, ()))}: "
                   f"write {lab.taught_phrase(called[home]) if home in called else 'no link'!r}"
             for home in set(called) | set(linked) if called.get(home, set()) != linked.get(home, set())}
    assert not wrong, wrong


def test_the_link_check_reads_calls_through_names_and_modules(tmp_path):
    from labkit import lab

    source = ("from labkit.paths import example as ex\nfrom labkit.profiling import views\nimport labkit.catalog\n"
              "ex('tiny-cpu.yaml')\nviews.memory_figure({})\nlabkit.catalog.gpus\nfrom labkit.spec import load_spec\n")
    assert lab.labkit_calls(source) == {"labkit.paths.example", "labkit.profiling.views.memory_figure"}
    # a re-export is followed to where the function is defined
    assert lab.labkit_calls("from labkit.estimate import estimate\nestimate(spec)") == {
        "labkit.estimate.estimator.estimate"}
    (tmp_path / "03_x.py").write_text(source)
    assert lab.taught_in(tmp_path) == {"labkit.paths.example": {"03"},
                                       "labkit.profiling.views.memory_figure": {"03"}}
    assert lab.taught_phrase({"07"}) == "Taught in lab 07."
    assert lab.taught_phrase({"04", "01", "02"}) == "Taught in labs 01, 02 and 04."
    assert lab.TAUGHT.search(lab.taught_phrase({"04", "01", "02"})).group(1) == "01, 02 and 04"

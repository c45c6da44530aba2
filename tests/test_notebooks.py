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

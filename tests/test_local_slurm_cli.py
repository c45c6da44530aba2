"""`labkit slurm up | down | status`: the local Slurm's scripts ship as package data, so a wheel install starts the
same cluster as a checkout (labkit.jobs.local_slurm)."""
from __future__ import annotations

import pytest

from labkit.cli import main
from labkit.jobs.local_slurm import SCRIPTS


def test_the_scripts_are_package_data():
    assert {"start.sh", "stop.sh", "common.sh"} <= {p.name for p in SCRIPTS.iterdir()}
    assert SCRIPTS.parent.name == "data" and SCRIPTS.parent.parent.name == "labkit"  # pyproject's data/**/* ships it


def test_status_without_a_cluster_says_how_to_start_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_SLURM_DIR", str(tmp_path / "none"))
    assert main(["slurm", "status"]) == 3
    assert f"no local Slurm in {tmp_path / 'none'}: `labkit slurm up` starts one" in capsys.readouterr().out


@pytest.mark.slurm
def test_up_on_a_running_cluster_keeps_it_and_status_lists_its_typed_gpus(local_slurm, monkeypatch, capfd):
    monkeypatch.setenv("LABKIT_SLURM_DIR", str(local_slurm.runtime_dir))
    monkeypatch.setenv("LABKIT_SLURM_ACCOUNTING", "1" if local_slurm.accounting else "0")
    assert main(["slurm", "up"]) == 0
    assert main(["slurm", "status"]) == 0
    out = capfd.readouterr().out
    assert all(node in out for node in ("n1", "n2", "n3", "n4")) and "gpu:a100:4" in out and "gpu:a10:4" in out

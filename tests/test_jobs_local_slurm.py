"""The local Slurm itself: real daemons, emulated nodes with typed fake GPUs, real sbatch jobs."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from labkit.jobs.local_slurm import SCRIPTS as SLURM_LOCAL

pytestmark = pytest.mark.slurm


def _wait_gone(job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still queued after {timeout} s")


def test_sbatch_job_runs_across_two_nodes_and_sees_its_typed_gpus(tmp_path: Path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n"
                      f"#SBATCH --nodes=2 --ntasks-per-node=1 --gres=gpu:a10:2 --output={tmp_path}/%j.out\n"
                      "srun bash -c 'echo \"$SLURMD_NODENAME rank=$SLURM_PROCID gpus=$CUDA_VISIBLE_DEVICES\"'\n")
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                            check=True).stdout.strip().split(";")[0]
    _wait_gone(job_id)
    lines = sorted((tmp_path / f"{job_id}.out").read_text().split("\n")[:2])
    nodes = [line.split()[0] for line in lines]
    assert len(set(nodes)) == 2 and "n1" not in nodes  # two distinct a10 nodes; n1 carries the a100s
    assert all(line.endswith("gpus=0,1") for line in lines)


def test_impossible_request_is_rejected_at_submit_time(tmp_path: Path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=1 --gres=gpu:a100:8\ntrue\n")
    rejected = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    assert rejected.returncode != 0
    assert "Requested node configuration is not available" in rejected.stderr


def test_start_is_idempotent(local_slurm):
    pid_files = sorted((local_slurm.runtime_dir / "run").glob("*.pid"))
    before = {f.name: f.read_text() for f in pid_files}
    again = subprocess.run(["bash", str(SLURM_LOCAL / "start.sh")], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert {f.name: f.read_text() for f in pid_files} == before
    slurmds = {f for f in before if f.startswith("slurmd-")}
    accounting = {"slurmdbd.pid", "mariadbd.pid"} if local_slurm.accounting else set()
    assert set(before) == {"slurmctld.pid"} | slurmds | accounting and len(slurmds) >= 2

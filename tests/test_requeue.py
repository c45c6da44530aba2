"""Requeue without lost work: Slurm's warning ahead of the time limit (USR1) -> the training processes save a
checkpoint at the end of their iteration and exit -> the batch script requeues the job -> the next attempt resumes.

The Slurm test makes every checkpoint save take longer than the local Slurm's KillWait (5 s), as a large model's does
(a 70B model's 1.3 TB of state takes minutes), so a save that Slurm's SIGTERM/SIGKILL interrupts is lost.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from labkit.cli import main as labkit
from labkit.jobs import SlurmBackend, State
from labkit.jobs.job import Job
from labkit.jobs.record import RunRecord
from labkit.jobs.report import report
from labkit.jobs.state import Attempt, Status
from labkit.logs import parse_log
from labkit.spec import load_spec
from requeued import NextAttempt

SAVE_S = 6
"""How long each checkpoint save of the Slurm test takes beyond its writing: more than KillWait (5 s)."""
STEP_S = 1
"""How long each iteration of the Slurm test takes at least: the warning must land well before the last iteration,
however late a loaded machine lets the test read the log."""


LINE = " iteration {:8d}/      12 | elapsed time per iteration (ms): 100.0 | lm loss: {:E} |\n"
SAVED = "  successfully saved checkpoint from iteration {:7d} to /ckpt [ t 1/1, p 1/1 ]\n"
LOADED = "  successfully loaded checkpoint from /ckpt [ t 1/1, p 1/1 ] at iteration {}\n"


def _requeued_logs(job_dir: Path, first_ran_to: int, saved: int) -> None:
    """A job's logs as the job script leaves them: the first attempt in JOBID/, the next in JOBID/attempt-1/."""
    (job_dir / "attempt-1").mkdir(parents=True)
    (job_dir / "n1.out").write_text("".join(LINE.format(i, 7.0) for i in range(1, first_ran_to + 1))
                                    + SAVED.format(saved) + "exiting program after receiving SIGUSR1.\n")
    (job_dir / "attempt-1" / "n1.out").write_text(LOADED.format(saved)
                                                  + "".join(LINE.format(i, 6.0) for i in range(saved + 1, 13)))


@pytest.mark.parametrize("first_ran_to, saved", [(6, 6), (8, 6)])
def test_logs_parse_counts_a_requeued_jobs_attempts_and_joins_them(tmp_path, capsys, first_ran_to, saved):
    _requeued_logs(tmp_path / "7", first_ran_to, saved)
    parsed = parse_log(tmp_path / "7")
    assert parsed.restarts == 1
    assert list(parsed.iterations["iteration"]) == list(range(1, 13))
    # Iterations the first attempt ran past its checkpoint were run again: the later attempt's rows stand.
    assert list(parsed.iterations["lm_loss"]) == [7.0] * saved + [6.0] * (12 - saved)
    assert labkit(["logs", "parse", str(tmp_path / "7")]) == 0
    assert "iterations: 1..12 of 12 (12 logged; 0 skipped, 0 nan; 1 restarts)" in capsys.readouterr().out


class _Scheduler:
    name = "scheduler"

    def poll(self, jobs):
        return {}

    def cancel(self, job):
        return False


def test_the_run_record_keeps_each_attempts_saved_iteration_and_why_it_stopped(tmp_path):
    spec = load_spec({"name": "tiny", "model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8},
                      "train": {"save": "/ckpt"}, "job": {"requeue": True},
                      "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 1}]}})
    job = Job(_Scheduler(), ["7"], RunRecord.create(spec, tmp_path / "runs"), Status(State.RUNNING))
    _requeued_logs(job.record.logs / "7", 6, 6)
    job.update(Status(State.RUNNING, restarts=1, ended_attempts=[Attempt(0, "REQUEUED", "0:0")]))
    [attempt] = job.record.attempts()
    assert attempt["attempt"] == 0 and attempt["outcome"] == "REQUEUED" and attempt["logs"] == "logs/7"
    assert attempt["saved_iteration"] == 6 and attempt["stopped_on"] == "SIGUSR1"
    assert attempt["cause"] == ("attempt 0: requeued (scontrol requeue, or the job's own requeue before its time "
                                "limit); stopped on SIGUSR1 after saving a checkpoint at iteration 6")


def test_the_driver_notes_the_exit_signal_from_the_start_of_the_run(monkeypatch):
    """A warning that comes while the model is built or a checkpoint loads is kept, not lost."""
    from labkit.train import training

    def set_up(args, exit_signal):
        os.kill(os.getpid(), signal.SIGUSR1)
        return exit_signal.received
    before = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(training, "_run", set_up)
    assert training.run(Namespace(exit_signal_handler=True, exit_signal="SIGUSR1")) is True
    assert signal.getsignal(signal.SIGUSR1) == before


def _slow_save_torchrun(where: Path) -> str:
    """torchrun, with the driver's checkpoint saves SAVE_S seconds slower (a stand-in for a large model's save) and each
    iteration at least STEP_S seconds long."""
    driver = where / "slow_save_driver.py"
    driver.write_text(
        "import sys, time\n"
        "from labkit.train import checkpoint, training\n"
        "from labkit.train.__main__ import main\n"
        "write, step = checkpoint.save, training.train_step\n"
        f"checkpoint.save = lambda *args, **kwargs: (time.sleep({SAVE_S}), write(*args, **kwargs))\n"
        f"training.train_step = lambda *args, **kwargs: (time.sleep({STEP_S}), step(*args, **kwargs))[1]\n"
        "sys.exit(main())\n")
    torchrun = where / "torchrun"
    # torchrun runs a script where the job script names the module: `-m labkit.train` -> slow_save_driver.py
    torchrun.write_text("#!/bin/bash\nargs=()\nwhile [ $# -gt 0 ]; do\n"
                        f"    if [ \"$1\" = -m ] && [ \"$2\" = labkit.train ]; then args+=({driver}); shift 2\n"
                        "    else args+=(\"$1\"); shift; fi\ndone\n"
                        f"exec {Path(sys.executable).with_name('torchrun')} \"${{args[@]}}\"\n")
    torchrun.chmod(0o755)
    return str(torchrun)


def _wait_for(what, condition, job, timeout: float):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s; {report(job).cause}"
        time.sleep(0.2)


@pytest.mark.slurm
@pytest.mark.slow
def test_usr1_saves_at_the_end_of_the_iteration_before_the_job_is_requeued(tmp_path, capsys):
    runs = tmp_path / "runs"
    backend = SlurmBackend(runs_dir=runs, torchrun=_slow_save_torchrun(tmp_path))
    spec = load_spec({
        "name": "requeue-slow-save", "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
        "batch": {"micro": 2, "global": 4}, "data": {"mock": True},
        "train": {"iters": 8, "log_interval": 1, "save": str(tmp_path / "checkpoints"), "save_interval": 1000},
        "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 1}]},
        "job": {"requeue": True}})
    job = backend.submit(spec)
    _wait_for("iteration 2", lambda: job.last_iteration() >= 2, job, 180)
    signalled_at = job.last_iteration()
    # What `#SBATCH --signal=B:USR1@N` sends ahead of the time limit.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job.job_id], check=True)

    _wait_for("the next attempt", NextAttempt(job), job, 120)
    assert job.wait(progress=False, timeout=240, poll_s=0.5) == State.COMPLETED, report(job).cause

    dirs = job.attempt_log_dirs()
    first, second = (next(dirs[n].glob("*.out")).read_text() for n in (0, 1))
    saved = re.search(r"successfully saved checkpoint from iteration +(\d+)", first)
    assert saved, "the first attempt saved no checkpoint after the warning"
    saved_at = int(saved.group(1))
    save_ms = float(re.search(r"save-checkpoint[ .:]+\(?([\d.]+)", first).group(1))
    assert save_ms > 5000  # longer than KillWait: Slurm's SIGKILL would have cut it short
    assert "exiting program after receiving SIGUSR1." in first
    assert f"successfully loaded checkpoint from {spec.train.save} [ t 1/1, p 1/1 ] at iteration {saved_at}" in second
    rows = job.iterations()
    assert (rows["attempt"] == 1).any(), f"the next attempt ran no iteration: the first saved at {saved_at}"
    resumed_at = int(rows[rows["attempt"] == 1]["iteration"].min())
    with capsys.disabled():
        print(f"\nsignal after iteration {signalled_at}, saved at {saved_at} ({save_ms / 1000:.1f} s), "
              f"resumed at {resumed_at}")
    assert signalled_at <= saved_at <= signalled_at + 3 and resumed_at == saved_at + 1
    assert list(rows["iteration"]) == list(range(1, 9))

    [attempt] = job.record.attempts()
    assert attempt["outcome"] == "REQUEUED" and attempt["saved_iteration"] == saved_at
    assert f"stopped on SIGUSR1 after saving a checkpoint at iteration {saved_at}" in attempt["cause"]
    capsys.readouterr()
    assert labkit(["logs", "parse", str(dirs[0])]) == 0  # the job's log directory, attempts included
    assert "iterations: 1..8 of 8 (8 logged; 0 skipped, 0 nan; 1 restarts)" in capsys.readouterr().out

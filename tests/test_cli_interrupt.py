"""Ctrl-C anywhere in the command line: exit status 130 and one line on stderr, never a traceback; under `labkit run
--wait` the line says that the job keeps running and the exact command that cancels it."""
from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import cli, jobs
from labkit.jobs import LocalBackend, State, job_of
from labkit.jobs.record import RunIndex, RunRecord

ROOT = Path(__file__).resolve().parent.parent
FAKE_TORCHRUN = str(ROOT / "tests" / "fake_torchrun.sh")
SPEC = {"name": "tiny", "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
        "batch": {"micro": 2, "global": 8}, "train": {"iters": 10, "log_interval": 5}, "data": {"mock": True},
        "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 1}]}}
# `labkit ...` in a new process, with its local runs' torchrun replaced by the stand-in (and, with SLOW_PLAN, a plan
# search that takes a minute), so that a real SIGINT can land in the middle of a command.
LAUNCH = f"""
import functools, os, sys, time
from labkit import jobs
from labkit.jobs.local import LocalBackend
jobs.BACKENDS["local"] = functools.partial(LocalBackend, torchrun={FAKE_TORCHRUN!r})
if os.environ.get("SLOW_PLAN"):
    import labkit.plan.search
    def slow(*args, **kwargs):
        print("searching", flush=True)
        time.sleep(60)
    labkit.plan.search.search = slow
from labkit.cli import main
sys.exit(main())
"""


@pytest.fixture(autouse=True)
def interruptible():
    """Ctrl-C acts as at a terminal, also where these tests run with it ignored (under nohup, or as a background job
    of a shell without job control, which starts its children with SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Python started so installs its KeyboardInterrupt handler


@pytest.fixture
def spec_file(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps(SPEC))
    return path


def test_ctrl_c_in_a_long_step_exits_130_with_one_line(monkeypatch, capsys):
    import labkit.plan.search

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(labkit.plan.search, "search", interrupted)
    code = cli.main(["plan", "a100-a10-hetero", "--model", "gpt2-xl", "--global-batch", "64"])
    out, err = capsys.readouterr()
    assert code == 130 and err.splitlines() == ["labkit plan: interrupted"], err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back


def test_ctrl_c_during_run_wait_says_the_job_runs_on_and_how_to_cancel_it(tmp_path, spec_file, monkeypatch,
                                                                           capsys):
    monkeypatch.setitem(jobs.BACKENDS, "local", functools.partial(LocalBackend, torchrun=FAKE_TORCHRUN))
    monkeypatch.setenv("FAKE_ITERATION_S", "30")  # still running when interrupted

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt
    runs = str(tmp_path / "my runs")
    with monkeypatch.context() as patch:
        patch.setattr(jobs.Job, "wait", interrupted)
        code = cli.main(["run", str(spec_file), "--backend", "local", "--runs-dir", runs, "--wait"])
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    (run,) = RunIndex(runs).run_dirs()
    command = f"labkit cancel {run.name} --runs-dir {shlex.quote(runs)}"
    assert code == 130 and "keeps running" in line and run.name in line and "tiny" in line, line
    assert line.endswith(command), line
    job = job_of(RunRecord(run))
    assert job.status().state == State.RUNNING  # it does run on
    assert cli.main(shlex.split(command)[1:]) == 0  # and the command it gave stops it
    assert "cancelled" in capsys.readouterr().out
    assert job_of(RunRecord(run)).status().state == State.CANCELLED


def _launch(args: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCH, *args], cwd=cwd, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_as_from_a_terminal)


def _wait_for(process: subprocess.Popen, text: str, timeout: float = 120) -> str:
    """Read the process's stdout until a line holds `text`."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if text in line or not line:
            break
    assert any(text in line for line in seen), (seen, process.stderr.read() if process.poll() is not None else "")
    return "".join(seen)


def test_sigint_to_labkit_plan_exits_130_with_one_line(tmp_path):
    process = _launch(["plan", "a100-a10-hetero", "--model", "gpt2-xl", "--global-batch", "64"],
                      {"SLOW_PLAN": "1"}, tmp_path)
    _wait_for(process, "searching")
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err.splitlines() == ["labkit plan: interrupted"], err


def test_sigint_to_labkit_run_wait_leaves_the_job_running_and_names_the_cancel_command(tmp_path, spec_file):
    runs = tmp_path / "runs"
    process = _launch(["run", str(spec_file), "--backend", "local", "--runs-dir", str(runs), "--wait"],
                      {"FAKE_ITERATION_S": "30"}, tmp_path)
    out = _wait_for(process, "run ")
    run_id = out.split()[1].rstrip(":")
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=60)
    (line,) = err.splitlines()
    assert process.returncode == 130 and "Traceback" not in err and "keeps running" in line, err
    command = line.rsplit("to stop it: ", 1)[1]
    assert command == f"labkit cancel {run_id} --runs-dir {runs}"
    job = job_of(RunRecord(runs / run_id))
    assert job.status().state == State.RUNNING  # the job was not stopped by the Ctrl-C
    assert cli.main(shlex.split(command)[1:]) == 0
    assert job_of(RunRecord(runs / run_id)).status().state == State.CANCELLED


def test_ctrl_c_while_the_program_exits_changes_nothing(tmp_path):
    # Once the command has ended, Python's exit (freeing a large parse can take a tenth of a second) ignores Ctrl-C:
    # otherwise, once Python has put back SIGINT's default action, it would kill the process silently.
    check = ("import signal, sys; from labkit.cli import main; code = main(); "
             "sys.exit(0 if code == 0 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 3)")
    done = subprocess.run([sys.executable, "-c", check, "completion", "bash"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert done.returncode == 0, done


def test_the_command_loads_the_library_inside_its_ctrl_c_handler():
    """What `labkit` imports before main() runs is the standard library and labkit.cli alone: a Ctrl-C while the
    library loads lands inside main's handler (one line, exit 130), not in a traceback from the import."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, labkit.cli; "
                             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('labkit', 'yaml', 'torch')))"],
                            capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['labkit', 'labkit.cli']"

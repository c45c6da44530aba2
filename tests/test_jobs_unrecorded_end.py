"""A run that finished but whose end could not be written (its runs directory became read-only, the disk filled up) is
recorded as it ended, from the evidence: the runner's exit status and the node logs decide, and the recorded cause
says what could not be written. Reading the records (`labkit runs`, `labkit status`) works on a full disk, and
`labkit cancel` of a run that has ended says how it ended."""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from labkit import jobs
from labkit.cli import main
from labkit.jobs import LocalBackend, State, job_of
from labkit.jobs import record as record_module
from labkit.jobs.local import RUNNER_EXIT, RUNNER_EXIT_BYTES
from labkit.jobs.record import RecordError, RunIndex, RunRecord
from labkit.spec import load_spec

FAKE_TORCHRUN = str(Path(__file__).resolve().parent / "fake_torchrun.sh")
SPEC = {"name": "tiny", "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
        "batch": {"micro": 2, "global": 8}, "train": {"iters": 10, "log_interval": 5}, "data": {"mock": True},
        "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 1}]}}
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def spec(**env):
    return load_spec({**SPEC, "job": {"env": env}})


def cli(*argv) -> int:
    return main([str(a) for a in argv])


def _running(job, timeout: float = 30) -> Path:
    """The job's state file once run.sh has written RUNNING into it."""
    state = job.log_dir / "state"
    deadline = time.monotonic() + timeout
    while not (state.exists() and state.read_text().strip() == "RUNNING"):
        assert time.monotonic() < deadline, "run.sh never started"
        time.sleep(0.02)
    return state


def _disk_full_for_the_end(job) -> None:
    """run.sh's end meets a full disk: its state.tmp is /dev/full, whose writes fail with ENOSPC."""
    _running(job)
    (job.log_dir / "state.tmp").symlink_to("/dev/full")


def _another_process(job):
    """The job as `labkit status` in another process sees it (a backend that did not start it)."""
    return job_of(RunRecord(job.record.path), LocalBackend(runs_dir=job.record.root))


def _full_disk(patch) -> None:
    """Every write of the run records fails with ENOSPC; the index can be read but not written."""
    for name in ("write", "fsync", "rename", "replace", "link", "mkdir"):
        def failing(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        patch.setattr(record_module.os, name, failing)
    execute = RunIndex._execute

    def read_only_index(self, sql, values=()):
        if not sql.lstrip().upper().startswith("SELECT"):
            with record_module._storing(self.root):
                raise record_module.sqlite3.OperationalError("database or disk is full")
        return execute(self, sql, values)
    patch.setattr(RunIndex, "_execute", read_only_index)


def test_an_end_that_met_a_full_disk_is_taken_from_the_runner_and_the_logs(tmp_path):
    backend = LocalBackend(runs_dir=tmp_path / "runs", torchrun=FAKE_TORCHRUN)
    job = backend.submit(spec(FAKE_ITERATION_S="0.5"))
    _disk_full_for_the_end(job)
    assert backend._children[job.job_id].wait(timeout=60) == 0
    assert not (job.log_dir / "state").read_text().strip() != "RUNNING"  # its end was never written
    assert "No space left on device" in (job.record.logs / "runner.out").read_text()

    for seen_by in (job, _another_process(job)):  # the labkit that started it (the child's status), and any other
        status = seen_by.backend.poll([seen_by])[seen_by]
        assert status.state == State.COMPLETED and status.exit_code == "0:0", status
        assert "No space left on device" in status.note and "exit status 0" in status.note
    assert job.wait(progress=False, timeout=30, poll_s=0.05) == State.COMPLETED
    last = job.record.last_status()
    assert last["state"] == "COMPLETED" and "could not be recorded" in last["cause"]
    assert "No space left on device" in last["cause"]
    assert job.record.metrics()["iterations"]  # every iteration the log shows


def test_without_the_runners_status_every_nodes_torchrun_status_decides(tmp_path):
    backend = LocalBackend(runs_dir=tmp_path / "runs", torchrun=FAKE_TORCHRUN)
    job = backend.submit(spec(FAKE_ITERATION_S="0.5"))
    _disk_full_for_the_end(job)
    backend._children[job.job_id].wait(timeout=60)
    exit_file = job.record.logs / RUNNER_EXIT
    exit_file.write_text(" " * (RUNNER_EXIT_BYTES - 1) + "\n")  # not even that fitted
    other = _another_process(job)
    status = other.backend.poll([other])[other]
    assert status.state == State.COMPLETED and "every node's torchrun exit status" in status.note, status
    node_out = next(job.log_dir.glob("*.out"))  # a node log that does not say how its torchrun ended
    node_out.write_text(node_out.read_text().replace("torchrun exited with status 0", "torchrun exi"))
    status = other.backend.poll([other])[other]
    assert status.state == State.FAILED and "without recording an end" in status.reason


def test_a_failed_run_whose_end_met_a_full_disk_reads_failed_with_its_code(tmp_path):
    backend = LocalBackend(runs_dir=tmp_path / "runs", torchrun=FAKE_TORCHRUN)
    job = backend.submit(spec(FAKE_ITERATION_S="0.5", FAKE_EXIT="3"))
    _disk_full_for_the_end(job)
    assert backend._children[job.job_id].wait(timeout=60) == 3
    other = _another_process(job)
    status = other.backend.poll([other])[other]
    assert (status.state, status.exit_code) == (State.FAILED, "3:0")
    assert job.wait(progress=False, timeout=30, poll_s=0.05) == State.FAILED
    assert "No space left on device" in job.record.last_status()["cause"]


def test_a_runner_killed_before_recording_an_end_still_reads_failed(tmp_path):
    backend = LocalBackend(runs_dir=tmp_path / "runs", torchrun=FAKE_TORCHRUN)
    job = backend.submit(spec())
    backend._children[job.job_id].wait(timeout=60)
    (job.log_dir / "state").write_text("RUNNING\n")  # as if SIGKILLed before its end: no exit status either
    (job.record.logs / RUNNER_EXIT).write_text(" " * (RUNNER_EXIT_BYTES - 1) + "\n")
    other = _another_process(job)
    status = other.backend.poll([other])[other]
    assert status.state == State.FAILED and status.reason == "the local runner stopped without recording an end"


def _can_mount() -> bool:
    """Whether this process may bind-mount (root, outside a container that forbids it)."""
    if not AS_ROOT or not shutil.which("mount"):
        return False
    with tempfile.TemporaryDirectory() as where:
        if subprocess.run(["mount", "--bind", where, where], capture_output=True).returncode:
            return False
        subprocess.run(["umount", where], check=True)
    return True


@contextlib.contextmanager
def _read_only(runs: Path, how: str):
    """`runs` read-only for the block; yields the error a write there meets. chmod -R a-w (its directories, or its
    files too), or, for root (whom modes do not stop), a read-only bind mount over it (files already open for writing
    stay so, as the runner's output does)."""
    if how == "mount":
        subprocess.run(["mount", "--bind", runs, runs], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", runs], check=True)
            yield "Read-only file system"
        finally:
            subprocess.run(["umount", "-l", runs], check=True)
        return
    paths = sorted(runs.rglob("*"), reverse=True) + [runs]
    modes = {path: path.stat().st_mode for path in paths}
    try:
        for path in paths:
            if how == "chmod files too" or path.is_dir():
                path.chmod(stat.S_IMODE(modes[path]) & ~0o222)
        yield "Permission denied"
    finally:
        for path in reversed(paths):
            path.chmod(modes[path])


@pytest.mark.parametrize("how", [
    pytest.param("chmod", marks=pytest.mark.skipif(AS_ROOT, reason="root writes into read-only directories")),
    pytest.param("chmod files too", marks=pytest.mark.skipif(AS_ROOT, reason="root writes into read-only directories")),
    pytest.param("mount", marks=pytest.mark.skipif(not _can_mount(), reason="bind mounts need root"))])
def test_a_runs_directory_made_read_only_mid_run(tmp_path, capsys, how):
    runs = tmp_path / "runs"
    backend = LocalBackend(runs_dir=runs, torchrun=FAKE_TORCHRUN)
    job = backend.submit(spec(FAKE_ITERATION_S="0.5"))
    _running(job)
    with _read_only(runs, how) as error:
        assert backend._children[job.job_id].wait(timeout=60) == 0
        assert (job.log_dir / "state").read_text().strip() == "RUNNING"
        assert error in (job.record.logs / "runner.out").read_text()
        other = _another_process(job)
        status = other.backend.poll([other])[other]
        assert status.state == State.COMPLETED and error in status.note, status
        # Read as it is: `labkit status` and `labkit runs` work and say how it ended, recording nothing.
        assert cli("status", job.record.run_id, "--json", "--runs-dir", runs) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["state"] == "COMPLETED" and "Traceback" not in err
        assert cli("runs", "--json", "--runs-dir", runs) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)[0]["state"] == "COMPLETED" and "nothing is recorded" in err
        assert cli("cancel", job.record.run_id, "--runs-dir", runs) == 1
        assert "already ended COMPLETED" in capsys.readouterr().err
        assert job.record.last_status()["state"] != "COMPLETED"
    assert cli("status", job.record.run_id, "--runs-dir", runs) == 0  # writable again: now it is recorded
    capsys.readouterr()
    last = job.record.last_status()
    assert last["state"] == "COMPLETED" and error in last["cause"] and "could not be recorded" in last["cause"]
    assert RunIndex(runs).rows()[0]["state"] == "COMPLETED"


def test_labkit_run_wait_says_how_the_job_ended_when_the_end_cannot_be_recorded(tmp_path, monkeypatch, capsys):
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(json.dumps(SPEC))
    runs = tmp_path / "runs"
    monkeypatch.setitem(jobs.BACKENDS, "local", functools.partial(LocalBackend, torchrun=FAKE_TORCHRUN))
    set_status = RunRecord.set_status

    def full_at_the_end(self, state, *args, **kwargs):
        if str(state) in ("COMPLETED", "FAILED"):
            raise RecordError(f"cannot write the run records in {self.path}: No space left on device")
        return set_status(self, state, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(RunRecord, "set_status", full_at_the_end)
        code = cli("run", spec_file, "--backend", "local", "--runs-dir", runs, "--wait")
    out, err = capsys.readouterr()
    (run,) = RunIndex(runs).run_dirs()
    assert code == 0 and f"{run.name}: COMPLETED" in out, (out, err)
    assert "No space left on device" in err and f"labkit status {run.name}" in err and "Traceback" not in err
    assert RunRecord(run).last_status()["state"] == "RUNNING"  # not recorded yet ...
    assert cli("status", run.name, "--runs-dir", runs) == 0  # ... until the next look
    capsys.readouterr()
    assert RunRecord(run).last_status()["state"] == "COMPLETED"


def test_runs_and_status_read_the_records_on_a_full_disk(tmp_path, capsys):
    runs = tmp_path / "runs"
    backend = LocalBackend(runs_dir=runs, torchrun=FAKE_TORCHRUN)
    done = backend.submit(spec())
    assert done.wait(progress=False, timeout=60, poll_s=0.05) == State.COMPLETED
    ended = backend.submit(spec())  # ends while nobody looks: recorded RUNNING
    backend._children[ended.job_id].wait(timeout=60)
    before = {p: (p / "events.jsonl").read_bytes() for p in RunIndex(runs).run_dirs()}
    with pytest.MonkeyPatch.context() as patch:
        _full_disk(patch)
        assert cli("runs", "--json", "--runs-dir", runs) == 0
        out, err = capsys.readouterr()
        states = {row["run_id"]: row["state"] for row in json.loads(out)}
        assert states[done.record.run_id] == "COMPLETED" and states[ended.record.run_id] == "COMPLETED", states
        assert "disk is full" in err and "nothing is recorded" in err and "Traceback" not in err
        assert cli("status", "--json", "--runs-dir", runs) == 0  # the latest run
        out, err = capsys.readouterr()
        assert json.loads(out)["run_id"] == ended.record.run_id and "Traceback" not in err
        assert cli("status", ended.record.run_id, "--json", "--runs-dir", runs) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["state"] == "COMPLETED" and "nothing is recorded" in err
        assert cli("cancel", ended.record.run_id, "--runs-dir", runs) == 1
        assert "already ended COMPLETED" in capsys.readouterr().err
    assert {p: (p / "events.jsonl").read_bytes() for p in RunIndex(runs).run_dirs()} == before  # nothing written
    assert cli("runs", "--runs-dir", runs) == 0  # space again: recorded
    capsys.readouterr()
    assert RunRecord(ended.record.path).last_status()["state"] == "COMPLETED"


@pytest.mark.parametrize("as_json", [False, True])
def test_cancel_of_a_run_that_has_ended_reports_how_it_ended(tmp_path, capsys, as_json):
    runs = tmp_path / "runs"
    backend = LocalBackend(runs_dir=runs, torchrun=FAKE_TORCHRUN)
    job = backend.submit(spec(FAKE_EXIT="2"))
    backend._children[job.job_id].wait(timeout=60)
    assert job.record.last_status()["state"] == "RUNNING"  # as last recorded: nobody looked since
    code = cli("cancel", job.record.run_id, "--runs-dir", runs, *(["--json"] if as_json else []))
    out, err = capsys.readouterr()
    assert code == 1
    if as_json:
        assert json.loads(out)["state"] == "FAILED" and json.loads(out)["cancelled"] is False
    else:
        assert "nothing to cancel" in err and "already ended FAILED" in err and "exit code 2" in err, err
    assert job.record.last_status()["state"] == "FAILED"


def test_an_end_whose_complaint_found_no_room_either_still_names_the_write_error(tmp_path):
    backend = LocalBackend(runs_dir=tmp_path / "runs", torchrun=FAKE_TORCHRUN)
    job = backend.submit(spec(FAKE_ITERATION_S="0.5"))
    _disk_full_for_the_end(job)
    (job.log_dir / "state.probe").symlink_to("/dev/full")  # the runner's last try beside it meets a full disk too
    assert backend._children[job.job_id].wait(timeout=60) == 0
    (job.record.logs / "runner.out").write_text("")  # and its complaint found no room in runner.out
    other = _another_process(job)
    status = other.backend.poll([other])[other]
    assert status.state == State.COMPLETED and "No space left on device" in status.note, status
    assert f"logs/{job.job_id}/state was not written" in status.note
    assert not (job.log_dir / "state.probe").exists() and not (job.log_dir / "state.probe").is_symlink()


def test_copies_that_a_full_disk_left_behind_the_last_event_are_made_again(tmp_path, capsys):
    runs = tmp_path / "runs"
    backend = LocalBackend(runs_dir=runs, torchrun=FAKE_TORCHRUN)
    job = backend.submit(spec())
    backend._children[job.job_id].wait(timeout=60)

    def full(self, last):
        raise RecordError(f"cannot write the run records in {self.path}: No space left on device")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunRecord, "_copy_last", full)
        with pytest.raises(RecordError):
            job.status()  # the end goes into events.jsonl, its copies do not
    status_json = job.record.path / "status.json"
    assert job.record.last_status()["state"] == "COMPLETED" and json.loads(status_json.read_text())["state"] == \
        "RUNNING"
    assert cli("status", job.record.run_id, "--runs-dir", runs) == 0  # the next look
    capsys.readouterr()
    assert json.loads(status_json.read_text())["state"] == "COMPLETED"
    assert RunIndex(runs).rows()[0]["state"] == "COMPLETED"


def test_a_forked_copy_of_the_backend_takes_no_exit_status_from_the_child_it_cannot_wait_for(tmp_path):
    import multiprocessing

    backend = LocalBackend(runs_dir=tmp_path / "runs", torchrun=FAKE_TORCHRUN)
    job = backend.submit(spec(FAKE_ITERATION_S="1"))
    _running(job)

    def in_a_fork(queue):  # as a multiprocessing worker that inherited the backend polls once the runner is gone
        while os.path.exists(f"/proc/{job.job_id}"):  # until the parent has reaped the runner, however slowly
            time.sleep(0.02)
        (job.log_dir / "state").write_text("RUNNING\n")  # as if the runner had been killed before its end
        (job.record.logs / RUNNER_EXIT).write_text(" " * (RUNNER_EXIT_BYTES - 1) + "\n")
        status = backend.poll([job])[job]
        queue.put((status.state.name, status.reason))

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=in_a_fork, args=(queue,))
    child.start()
    backend._children[job.job_id].wait(timeout=60)
    state, reason = queue.get(timeout=60)
    child.join(timeout=30)
    assert (state, reason) == ("FAILED", "the local runner stopped without recording an end")

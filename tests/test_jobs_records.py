"""Run records under races and faults: concurrent pollers, torn event lines, crashes at every write, a read-only or
full runs directory, a lost index, and cancelling a local job whose runner was killed on its own."""
from __future__ import annotations

import errno
import functools
import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.jobs import LocalBackend, State, job_of
from labkit.jobs import record as record_module
from labkit.jobs.record import RecordError, RunIndex, RunRecord, load_run
from labkit.spec import load_spec

FAKE_TORCHRUN = str(Path(__file__).resolve().parent / "fake_torchrun.sh")
SPEC = {"name": "tiny", "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
        "batch": {"micro": 2, "global": 8}, "train": {"iters": 10, "log_interval": 5}, "data": {"mock": True},
        "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 1}]}}


def spec(name="tiny", **env):
    return load_spec({**SPEC, "name": name, "job": {"env": env}})


def local(tmp_path) -> LocalBackend:
    return LocalBackend(runs_dir=tmp_path / "runs", torchrun=FAKE_TORCHRUN)


def cli(*argv) -> int:
    return main(list(argv))


def test_end_recorded_between_the_two_looks_is_read_from_the_state_file(tmp_path, monkeypatch):
    backend = local(tmp_path)
    job = backend.submit(spec())
    assert job.wait(progress=False, timeout=30, poll_s=0.05) == State.COMPLETED
    # Another poller's view: the state file still said RUNNING when read, then run.sh wrote its end and exited.
    state_file = job.log_dir / "state"
    state_file.write_text("RUNNING\n")

    def gone(_job):
        state_file.write_text("COMPLETED 0\n")
        return False

    monkeypatch.setattr(backend, "_alive", gone)
    assert backend.poll([job])[job].state == State.COMPLETED


FOUR_NODES = {**SPEC, "cluster": {"nodes": [{"gpu": "A10", "count": 4, "gpus_per_node": 1}]}}


def test_nodes_that_end_together_complete_the_run(tmp_path):
    """Four local nodes whose training ends at once: the runner reads each node's own exit status (bash's `wait -n`
    alone answered 127 for a node that had already exited, and 6 runs in 20 were recorded FAILED 127)."""
    backend = local(tmp_path)
    ends = []
    for i in range(8):
        job = backend.submit(load_spec({**FOUR_NODES, "name": f"together-{i}"}))
        ends.append((job.wait(progress=False, timeout=60, poll_s=0.05), (job.log_dir / "state").read_text().split()))
    assert ends == [(State.COMPLETED, ["COMPLETED", "0"])] * 8


def test_the_first_node_to_fail_ends_the_run_while_the_others_still_train(tmp_path):
    torchrun = tmp_path / "torchrun.sh"
    torchrun.write_text('#!/bin/bash\n[ "$SLURM_PROCID" = 2 ] && exit 3\nexec sleep 600\n')
    torchrun.chmod(0o755)
    job = LocalBackend(runs_dir=tmp_path / "runs", torchrun=str(torchrun)).submit(load_spec(FOUR_NODES))
    assert job.wait(progress=False, timeout=60, poll_s=0.05) == State.FAILED
    assert (job.log_dir / "state").read_text().split() == ["FAILED", "3"]


def test_torn_event_line_keeps_the_next_event(tmp_path):
    record = RunRecord.create(spec(), tmp_path / "runs")
    with open(record.path / "events.jsonl", "ab") as f:
        f.write(b'{"time": "2026-01-01T00:00:00", "sta')  # a write cut short by a crash
    record.set_status(State.COMPLETED, exit_code="0:0")
    assert [e["state"] for e in record.events()] == ["CREATED", "COMPLETED"]
    assert record.last_status()["state"] == "COMPLETED"
    lines = (record.path / "events.jsonl").read_bytes().split(b"\n")
    assert lines[1].endswith(b'"sta') and json.loads(lines[2])["state"] == "COMPLETED"


def _fail_the_nth_write(monkeypatch, n: int, error=errno.ENOSPC):
    """Every file write, sync and rename of the record layer fails from the n-th on (a disk that fills up)."""
    calls = {"n": 0}
    for name in ("write", "fsync", "rename", "replace", "link", "mkdir"):
        real = getattr(os, name)

        def failing(*args, _real=real, **kwargs):
            calls["n"] += 1
            if calls["n"] > n:
                raise OSError(error, os.strerror(error))
            return _real(*args, **kwargs)
        monkeypatch.setattr(record_module.os, name, failing)
    return calls


def test_every_crash_point_leaves_a_readable_record(tmp_path, monkeypatch, capsys):
    n, finished = 0, False
    while not finished:
        root = tmp_path / f"runs{n}"
        root.mkdir()
        with monkeypatch.context() as patch:
            calls = _fail_the_nth_write(patch, n)
            try:
                record = RunRecord.create(spec(), root)
                record.attach("local", "local", ["123"], pgid=123)
                record.set_status(State.RUNNING)
                record.set_status(State.COMPLETED, exit_code="0:0")
                record.save_metrics({"iterations": []})
                finished = calls["n"] <= n
            except RecordError as exc:
                assert str(root) in str(exc)
        assert not list(root.rglob("*.tmp")), n
        for path in root.iterdir():
            if path.is_dir():  # a run directory is whole: a loadable spec and its events
                rec = RunRecord(path)
                assert rec.spec.name == "tiny" and rec.events()[0]["state"] == "CREATED", n
                info = rec.job_info
                assert not info or info["job_ids"] == ["123"]
                capsys.readouterr()
                assert cli("status", str(path), "--json", "--runs-dir", str(root)) == (0 if info else 1)
                out, err = capsys.readouterr()
                assert "Traceback" not in err
                if info and rec.last_status()["state"] == "COMPLETED":
                    assert json.loads(out)["state"] == "COMPLETED", n
        assert cli("runs", "--runs-dir", str(root)) in (0, 1)
        capsys.readouterr()
        n += 1
    assert n > 10  # every step above was a crash point once


def test_status_reads_the_events_when_status_json_lags(tmp_path, capsys):
    record = RunRecord.create(spec(), tmp_path / "runs")
    record.attach("local", "local", ["999999"], pgid=999999)
    record.set_status(State.RUNNING)
    record._append_event({"state": "COMPLETED", "exit_code": "0:0", "reason": None, "cause": None})  # then a crash
    assert job_of(record).status(refresh=False).state == State.COMPLETED
    assert cli("runs", "--runs-dir", str(tmp_path / "runs")) == 0
    assert "COMPLETED" in capsys.readouterr().out
    assert RunIndex(tmp_path / "runs").rows()[0]["state"] == "COMPLETED"


@pytest.mark.parametrize("error", [errno.EROFS, errno.ENOSPC])
def test_unwritable_runs_directory_is_a_clear_error(tmp_path, monkeypatch, capsys, error):
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(json.dumps(SPEC))
    runs = tmp_path / "runs"
    runs.mkdir()
    _fail_the_nth_write(monkeypatch, 0, error)
    assert cli("run", str(spec_file), "--backend", "local", "--runs-dir", str(runs)) == 1
    err = capsys.readouterr().err
    assert f"cannot write the run records in {runs}: {os.strerror(error)}" in err and "Traceback" not in err
    assert list(runs.iterdir()) == []


def test_unwritable_index_is_a_clear_error(tmp_path, monkeypatch, capsys):
    RunRecord.create(spec(), tmp_path / "runs")

    def readonly(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")
    monkeypatch.setattr(record_module.sqlite3, "connect", readonly)
    assert cli("runs", "--runs-dir", str(tmp_path / "runs")) == 1
    err = capsys.readouterr().err
    assert f"cannot write the run records in {tmp_path / 'runs'}: attempt to write a readonly database" in err


def test_lost_index_is_rebuilt_with_the_original_times(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    times = (f"2026-01-01T10:{minute:02d}:00+00:00" for minute in itertools.count())
    monkeypatch.setattr(record_module, "_now", lambda: next(times))
    first = RunRecord.create(spec("first"), runs)
    second = RunRecord.create(spec("second"), runs)
    second.attach("local", "local", ["42"], pgid=42)
    second.set_status(State.FAILED, exit_code="1:0", cause="boom")
    before = RunIndex(runs).rows()
    (runs / "index.sqlite").unlink()
    assert cli("runs", "--runs-dir", str(runs)) == 0
    out, err = capsys.readouterr()
    assert "rebuilt" in err and first.run_id in out and second.run_id in out and "2026-01-01T10:00:00" in out
    assert RunIndex(runs).rows() == before
    assert cli("runs", "--rebuild", "--runs-dir", str(runs)) == 0
    assert RunIndex(runs).rows() == before


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` runs (a zombie its new parent has yet to reap does not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_cancel_after_the_runner_was_killed_stops_the_whole_group(tmp_path, capsys):
    backend = local(tmp_path)
    job = backend.submit(spec(FAKE_ITERATION_S="30"))
    deadline = time.monotonic() + 20
    while not list(job.log_dir.glob("*.argv")) and time.monotonic() < deadline:
        time.sleep(0.05)
    pgid = job.record.job_info["pgid"]
    assert pgid == int(job.job_id)
    os.kill(pgid, signal.SIGKILL)  # run.sh alone: its node and the stand-in torchrun run on
    backend._children[job.job_id].wait()  # reaped, as it would be once this process is gone
    assert _group_alive(pgid)
    # Not FAILED while its processes run: RUNNING, saying that the runner is gone and how to stop the rest.
    status = job.status()
    assert status.state == State.RUNNING and "labkit cancel" in status.reason
    assert job.record.last_status()["state"] == "RUNNING"
    assert cli("cancel", job.record.run_id, "--runs-dir", str(tmp_path / "runs")) == 0
    assert not _group_alive(pgid)
    assert load_run(job.record.run_id, tmp_path / "runs").last_status()["state"] == "CANCELLED"
    capsys.readouterr()
    assert cli("cancel", job.record.run_id, "--runs-dir", str(tmp_path / "runs")) == 1
    assert "nothing to cancel" in capsys.readouterr().err


def test_a_job_labkit_could_not_record_never_starts(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # labkit stopped between starting run.sh and writing job.json
    monkeypatch.setattr(RunRecord, "attach", interrupted)
    backend = local(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        backend.submit(spec())
    (child,) = backend._children.values()
    assert child.wait(timeout=10) != 0
    (run,) = RunIndex(tmp_path / "runs").run_dirs()
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["runner.exit", "runner.out"]  # no node started
    assert not RunRecord(run).settle_abandoned()  # the process that created it still runs: it may yet record it
    assert RunRecord(run).last_status()["state"] == "CREATED"


def test_launch_from_a_killed_labkit_never_runs_untracked(tmp_path):
    """The same from another process: SIGKILL labkit right after it started run.sh, before job.json."""
    code = ("import os, signal, sys; from labkit.jobs import LocalBackend; from labkit.jobs.record import RunRecord;"
            "RunRecord.attach = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL);"
            f"LocalBackend(runs_dir={str(tmp_path / 'runs')!r}, torchrun={FAKE_TORCHRUN!r})"
            f".submit({str(tmp_path / 'tiny.yaml')!r})")
    (tmp_path / "tiny.yaml").write_text(json.dumps(SPEC))
    assert subprocess.run([sys.executable, "-c", code]).returncode == -signal.SIGKILL
    (run,) = RunIndex(tmp_path / "runs").run_dirs()
    deadline = time.monotonic() + 10
    while subprocess.run(["pgrep", "-f", str(run)], capture_output=True).stdout and time.monotonic() < deadline:
        time.sleep(0.1)
    assert subprocess.run(["pgrep", "-f", str(run)], capture_output=True).stdout == b""
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["runner.exit", "runner.out"]
    creator = RunRecord(run).events()[0]["pid"]
    (run / f".job.json.{creator}-1.tmp").write_text("{")  # as if killed while writing job.json
    # `labkit runs` says what became of it, instead of CREATED for ever, and removes what it was writing.
    assert cli("runs", "--runs-dir", str(tmp_path / "runs")) == 0
    (row,) = RunIndex(tmp_path / "runs").rows()
    assert row["state"] == "FAILED" and row["cause"] == record_module.ABANDONED
    assert not list(run.glob(".*.tmp"))


def test_concurrent_writers_of_one_record_never_collide(tmp_path):
    """Pollers in several processes and threads record the same run's end at once."""
    from concurrent.futures import ThreadPoolExecutor
    record = RunRecord.create(spec(), tmp_path / "runs")

    def write(i):
        record.set_status(State.COMPLETED if i % 2 else State.RUNNING)
        record.save_metrics({"iterations": [], "writer": i})
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(64)))
    assert len(record.events()) == 65 and json.loads((record.path / "status.json").read_text())["state"]
    assert not list(record.path.glob("*.tmp")) and not list(record.path.glob(".*.tmp"))


def test_runs_lists_a_run_the_index_missed(tmp_path, monkeypatch, capsys):
    def lost(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")
    with monkeypatch.context() as patch:
        patch.setattr(RunIndex, "add", lost)  # a crash or a full disk between the run directory and its index row
        with pytest.raises(sqlite3.OperationalError):
            RunRecord.create(spec("missed"), tmp_path / "runs")
    RunRecord.create(spec("kept"), tmp_path / "runs")
    assert cli("runs", "--runs-dir", str(tmp_path / "runs")) == 0
    assert sorted(row["name"] for row in RunIndex(tmp_path / "runs").rows()) == ["kept", "missed"]


def test_an_end_that_could_not_be_recorded_is_recorded_by_the_next_poll(tmp_path, monkeypatch):
    backend = local(tmp_path)
    job = backend.submit(spec())
    job.backend._children[job.job_id].wait()
    with monkeypatch.context() as patch:
        _fail_the_nth_write(patch, 0)
        with pytest.raises(RecordError):
            job.status()
    assert job.status(refresh=False).state == State.RUNNING
    assert job.status().state == State.COMPLETED
    assert job.record.last_status()["state"] == "COMPLETED" and job.record.metrics()["iterations"]


def test_metrics_of_non_finite_times_are_strict_json():
    import pandas as pd
    from labkit.jobs.job import ITERATION_FIELDS, run_metrics
    table = pd.DataFrame({"iteration": [1, 2], "train_iters": [2, 2], "elapsed_ms": [float("inf"), float("inf")],
                          "lm_loss": [float("-inf"), float("nan")], "node": ["n1", "n1"],
                          "attempt": [0, 0]})[ITERATION_FIELDS]
    metrics = json.loads(json.dumps(run_metrics(table), allow_nan=False))
    assert metrics["mean_iteration_ms"] is None and metrics["final_lm_loss"] is None


def test_status_without_an_index_finds_the_latest_run(tmp_path, capsys):
    record = RunRecord.create(spec("only"), tmp_path / "runs")
    record.attach("local", "local", ["999999"], pgid=999999)
    record.set_status(State.FAILED, exit_code="1:0", cause="boom")
    (tmp_path / "runs" / "index.sqlite").unlink()
    assert cli("status", "--json", "--runs-dir", str(tmp_path / "runs")) == 0
    assert json.loads(capsys.readouterr().out)["run_id"] == record.run_id


def test_labkit_run_on_a_disk_that_fills_up_never_leaves_a_job_untracked(tmp_path, monkeypatch, capsys):
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(json.dumps(SPEC))
    from labkit import jobs
    monkeypatch.setitem(jobs.BACKENDS, "local", functools.partial(LocalBackend, torchrun=FAKE_TORCHRUN))
    n, code = 0, 1
    while code != 0:
        runs = tmp_path / f"runs{n}"
        runs.mkdir()
        with monkeypatch.context() as patch:
            _fail_the_nth_write(patch, n)
            code = cli("run", str(spec_file), "--backend", "local", "--runs-dir", str(runs))
        err = capsys.readouterr().err
        assert code in (0, 1) and "Traceback" not in err, (n, err)
        assert code == 0 or "No space left on device" in err, (n, err)
        for run in RunIndex(runs).run_dirs():
            if not (run / "job.json").exists():  # never recorded, so never started
                assert sorted(p.name for p in (run / "logs").iterdir()) in ([], ["runner.exit"],
                                                                           ["runner.exit", "runner.out"]), n
        # (a run.sh that is finishing may be writing its own logs/JOBID/state.tmp)
        assert not [p for p in runs.rglob("*.tmp") if "logs" not in p.relative_to(runs).parts], n
        n += 1
    assert n > 5


@pytest.mark.parametrize("submitted, recorded, starts", [(True, False, False), (True, True, True),
                                                         (False, False, True)])
def test_sbatch_script_starts_no_node_before_labkit_recorded_it(tmp_path, submitted, recorded, starts):
    from labkit.jobs.render import render
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    if recorded:
        (run / "job.json").write_text("{}")
    script = run / "job.sbatch"
    script.write_text(render(spec(), run / "logs", layout="multinode", run_id="run", torchrun="torchrun")
                      .scripts["job.sbatch"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", f"touch {tmp_path}/started"), ("scontrol", "echo n1")):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    if submitted:
        env["LABKIT_SUBMITTED"] = "1"
    subprocess.run(["timeout", "1", "bash", str(script)], env=env, cwd=run, capture_output=True)
    assert (tmp_path / "started").exists() == starts


def test_a_run_killed_while_labkit_creates_it_is_never_seen_half_made(tmp_path, capsys):
    runs = tmp_path / "runs"
    code = ("import os, signal; from labkit.jobs.record import RunRecord; from labkit.spec import load_spec;"
            "RunRecord._append_event = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL);"
            f"RunRecord.create(load_spec({str(tmp_path / 'tiny.yaml')!r}), {str(runs)!r})")
    (tmp_path / "tiny.yaml").write_text(json.dumps(SPEC))
    assert subprocess.run([sys.executable, "-c", code]).returncode == -signal.SIGKILL  # spec written, no event
    assert RunIndex(runs).run_dirs() == [] and len(list(runs.glob(".*.draft"))) == 1
    assert cli("runs", "--runs-dir", str(runs)) == 0 and "no runs yet" in capsys.readouterr().out
    later = RunRecord.create(spec("later"), runs)  # removes the dead creator's draft
    later.attach("local", "local", ["999999"], pgid=999999)
    later.set_status(State.FAILED, exit_code="1:0", cause="boom")
    assert not list(runs.glob(".*.draft")) and RunIndex(runs).run_dirs() == [later.path]
    assert cli("status", "--json", "--runs-dir", str(runs)) == 0
    assert json.loads(capsys.readouterr().out)["run_id"] == later.run_id


def test_a_half_made_run_of_an_older_labkit_is_failed_and_dated_by_its_spec(tmp_path, capsys):
    runs = tmp_path / "runs"
    done = RunRecord.create(spec("done"), runs)
    done.attach("local", "local", ["999999"], pgid=999999)
    done.set_status(State.FAILED, exit_code="1:0", cause="boom")
    half = runs / "20200101-000000-half"  # a spec and no event: killed between the two, before drafts
    (half / "logs").mkdir(parents=True)
    (half / "spec.yaml").write_text(spec("half").to_yaml())
    os.utime(half / "spec.yaml", (1577836800, 1577836800))
    (runs / "index.sqlite").unlink()
    assert cli("runs", "--runs-dir", str(runs)) == 0
    rows = {row["run_id"]: row for row in RunIndex(runs).rows()}
    assert rows[half.name]["state"] == "FAILED" and rows[half.name]["created"] < rows[done.run_id]["created"]
    assert "NaN" not in capsys.readouterr().out
    assert cli("status", "--json", "--runs-dir", str(runs)) == 0  # the latest run is the one that ran
    assert json.loads(capsys.readouterr().out)["run_id"] == done.run_id


def test_a_job_whose_record_fills_the_disk_reads_failed_not_pending(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise RecordError("cannot write the run records in runs: No space left on device")
    backend = local(tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(RunIndex, "update", full)  # job.json and its event written, the index row not
        with pytest.raises(RecordError):
            backend.submit(spec())
    (run,) = RunIndex(tmp_path / "runs").run_dirs()
    record = RunRecord(run)
    assert record.last_status()["state"] == "FAILED" and "No space left on device" in record.last_status()["cause"]
    # Had not even that line fitted, a poll would read FAILED once its runner is gone, never PENDING for ever.
    (child,) = backend._children.values()
    child.wait(timeout=10)
    job = job_of(RunRecord(run), backend)
    status = backend.poll([job])[job]
    assert status.state == State.FAILED and "before starting any node" in status.reason
    assert not list(run.rglob("*.tmp"))


def test_metrics_that_could_not_be_written_are_written_by_the_next_look(tmp_path, monkeypatch):
    job = local(tmp_path).submit(spec())
    job.backend._children[job.job_id].wait()
    write_once = RunRecord._write_once

    def full(self, name, *args):
        if name == "metrics.json":  # the end's event and status.json fit; metrics.json does not
            raise RecordError(f"cannot write the run records in {self.path}: No space left on device")
        return write_once(self, name, *args)
    with monkeypatch.context() as patch:
        patch.setattr(RunRecord, "_write_once", full)
        with pytest.raises(RecordError):
            job.status()
    assert job.record.last_status()["state"] == "COMPLETED" and job.record.metrics() is None
    assert job.status().state == State.COMPLETED
    assert job.record.metrics()["iterations"]


def _read_only(patch, runs: Path):
    """A read-only runs directory: every write fails, and SQLite may open the index only to read."""
    patch.setattr(RunIndex, "writable", lambda self: False)
    _fail_the_nth_write(patch, 0, errno.EROFS)
    connect = sqlite3.connect

    def read_only_connect(database, *args, **kwargs):
        if "mode=ro" not in str(database):
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return connect(database, *args, **kwargs)
    patch.setattr(record_module.sqlite3, "connect", read_only_connect)


@pytest.mark.parametrize("with_index", [True, False])
def test_a_read_only_runs_directory_is_listed_and_its_runs_reported(tmp_path, monkeypatch, capsys, with_index):
    runs = tmp_path / "runs"
    record = RunRecord.create(spec("kept"), runs)
    record.attach("local", "local", ["999999"], pgid=999999)
    record.set_status(State.RUNNING)
    if not with_index:
        (runs / "index.sqlite").unlink()
    events = (record.path / "events.jsonl").read_bytes()
    with monkeypatch.context() as patch:
        _read_only(patch, runs)
        assert cli("runs", "--runs-dir", str(runs)) == 0
        out, err = capsys.readouterr()
        assert record.run_id in out and "read-only" in err and "Traceback" not in err
        assert cli("status", "--json", "--runs-dir", str(runs)) == 0
        assert json.loads(capsys.readouterr().out)["run_id"] == record.run_id
    assert (record.path / "events.jsonl").read_bytes() == events  # nothing written


def test_a_damaged_index_is_rebuilt_and_the_error_says_how(tmp_path, capsys):
    runs = tmp_path / "runs"
    record = RunRecord.create(spec("kept"), runs)
    (runs / "index.sqlite").write_text("junk\n")
    assert cli("status", "--runs-dir", str(runs)) == 1
    assert "labkit runs --rebuild" in capsys.readouterr().err
    assert cli("runs", "--rebuild", "--runs-dir", str(runs)) == 0
    assert "index.sqlite.damaged" in capsys.readouterr().err
    assert [row["run_id"] for row in RunIndex(runs).rows()] == [record.run_id]
    assert (runs / "index.sqlite.damaged").read_text() == "junk\n"
    (runs / "index.sqlite").write_bytes(b"\0" * 4096)
    assert cli("runs", "--runs-dir", str(runs)) == 0  # plain `labkit runs` rebuilds it too
    assert record.run_id in capsys.readouterr().out


def test_a_run_whose_index_row_does_not_fit_says_why_it_never_started(tmp_path, monkeypatch, capsys):
    def full(*args, **kwargs):
        raise RecordError("cannot write the run records in runs: database or disk is full")
    with monkeypatch.context() as patch:
        patch.setattr(RunIndex, "add", full)
        with pytest.raises(RecordError):
            RunRecord.create(spec(), tmp_path / "runs")
    (run,) = RunIndex(tmp_path / "runs").run_dirs()
    assert cli("runs", "--runs-dir", str(tmp_path / "runs")) == 0  # not settled as abandoned by a stopped labkit
    (row,) = RunIndex(tmp_path / "runs").rows()
    assert row["state"] == "FAILED" and "disk is full" in row["cause"], row


def test_status_json_and_the_index_copy_the_last_event_whatever_the_order_of_writers(tmp_path, monkeypatch):
    record = RunRecord.create(spec(), tmp_path / "runs")
    update = RunIndex.update

    def another_poller_records_the_end_meanwhile(self, run_id, **fields):
        if fields.get("state") == "RUNNING" and len(record.events()) == 2:
            record._append_event({"state": "COMPLETED", "exit_code": "0:0", "reason": None, "cause": None})
        return update(self, run_id, **fields)
    monkeypatch.setattr(RunIndex, "update", another_poller_records_the_end_meanwhile)
    record.set_status(State.RUNNING)  # this writer's copies land after the other's event
    assert json.loads((record.path / "status.json").read_text())["state"] == "COMPLETED"
    assert RunIndex(tmp_path / "runs").rows()[0]["state"] == "COMPLETED"

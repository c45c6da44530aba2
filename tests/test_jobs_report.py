"""Failure causes, the report, the watcher and run records, on logs written the way jobs write them (no scheduler
needed)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from labkit.jobs import job_of
from labkit.jobs.diagnose import LogText, explain
from labkit.jobs.job import Job
from labkit.jobs.report import format_report, report, widget
from labkit.jobs.record import RunIndex, RunRecord, load_run
from labkit.jobs.slurm import settle
from labkit.jobs.state import Attempt, State, Status, slurm_state
from labkit.jobs.watcher import WATCHER
from labkit.logs import parse_log
from labkit.logs.parse import records
from labkit.spec import load_spec

WARNINGS = ("/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: deprecated\n"
            "  return func(*args, **kwargs)\n")
ITERATION = (" iteration        5/      10 | consumed samples:           40 | elapsed time per iteration (ms): 129.2 | "
             "lm loss: 6.936320E+00 | loss scale: 1.0 |\n")


class StaticBackend:
    """A backend whose jobs are in whatever state the test sets (by job id); it counts its polls."""
    name = "static"

    def __init__(self, **statuses):
        self.statuses = statuses
        self.polls = []
        self.cancelled = []

    def poll(self, jobs):
        self.polls.append(sorted(job.job_id for job in jobs))
        return {job: self.statuses[job.job_id] for job in jobs if job.job_id in self.statuses}

    def cancel(self, job):
        self.cancelled.append(job)


def tiny_spec(**spec_changes):
    return load_spec({"name": "tiny", "model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8},
                      "cluster": {"nodes": [{"gpu": "A10", "count": 2, "gpus_per_node": 1}]}, **spec_changes})


def make_job(tmp_path, state=State.FAILED, reason=None, exit_code="1:0", logs=None, backend=None, job_id="7",
             **spec_changes):
    record = RunRecord.create(tiny_spec(**spec_changes), tmp_path / "runs")
    job = Job(backend or StaticBackend(), [job_id], record, Status(state, exit_code, reason))
    for name, text in (logs or {}).items():
        path = record.logs / name if name.startswith("slurm-") else job.log_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return job


@pytest.mark.parametrize("state, reason, logs, cause", [
    (State.FAILED, None, {"n1.err": WARNINGS + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"},
     "out of memory (GPU): n1.err:3: torch.OutOfMemoryError: CUDA out of memory"),
    (State.FAILED, None, {"n1.out": "ERROR: out of memory at iteration 3 on rank 0: CUDA out of memory\n"},
     "out of memory (GPU): n1.out:1: ERROR: out of memory"),
    (State.FAILED, None, {"n2.err": "  exitcode  : -9 (pid: 123)\nSignal 9 (SIGKILL) received by PID 123\n"},
     "killed (SIGKILL) by something other than the kernel's out-of-memory killer"),
    (State.FAILED, None, {"slurm-7.out": "slurmstepd: error: Detected 1 oom_kill event in StepId=7.0.\n",
                          "n2.err": "Signal 9 (SIGKILL) received by PID 123\n"},
     "out of memory: killed by the kernel: slurm-7.out:1:"),
    (State.FAILED, None, {"n1.err": "usage: python -m labkit.train [Megatron-LM flags; --help lists them]\n"
                                    "python -m labkit.train: error: unrecognized arguments: --no-such-flag 7\n"},
     "refused its arguments: n1.err:2: python -m labkit.train: error: unrecognized arguments: --no-such-flag"),
    (State.PENDING, "Resources", {}, "pending (Resources): waiting for nodes to free up"),
    (State.CANCELLED, "Resources", {}, "cancelled"),
    (State.OUT_OF_MEMORY, None, {}, "out of memory: killed by the kernel"),
    (State.FAILED, None, {"n1.out": ITERATION + "ERROR: NaN loss at iteration 7 (lm loss nan); lower --lr\n"},
     "NaN loss: n1.out:2: ERROR: NaN loss at iteration 7"),
    (State.FAILED, None, {"n2.err": WARNINGS + "torch.distributed.DistNetworkError: Connection reset by peer\n"},
     "NCCL/gloo communication error: n2.err:3:"),
    (State.FAILED, None, {"n1.err": "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1269, unhandled system error\n"},
     "NCCL/gloo communication error: n1.err:1:"),
    (State.TIMEOUT, None, {"slurm-7.out": "slurmstepd: error: *** JOB 7 ON n1 CANCELLED AT 2026 DUE TO TIME LIMIT ***\n"},
     "time limit: the job ran past its limit of 0:01:00"),
    (State.CANCELLED, "None", {}, "cancelled"),
    (State.CANCELLED, "DependencyNeverSatisfied", {}, "cancelled: a job it depends on did not complete"),
    (State.NODE_FAIL, None, {}, "node failure"),
    (State.FAILED, None, {"n1.err": WARNINGS + "Traceback (most recent call last):\nKeyError: 'x'\n"},
     "error output on stderr: n1.err:3: Traceback (most recent call last):"),
    (State.FAILED, None, {"n1.err": WARNINGS}, "failed with exit code 1:0"),
])
def test_each_failure_gets_its_cause(state, reason, logs, cause):
    texts = [LogText(name, text) for name, text in logs.items()]
    found = explain(Status(state, "1:0", reason), tiny_spec(job={"time_limit": "0:01:00"}), texts)
    assert found.startswith(cause), found


def test_bad_data_path_is_named():
    path = "/data/missing_text_document"
    texts = [LogText("n1.err", WARNINGS + f"python -m labkit.train: error: --data-path: {path} has no "
                               f"{path}.bin or {path}.idx; create it with labkit data prepare\n")]
    spec = tiny_spec(data={"mock": False, "path": path})
    assert explain(Status(State.FAILED, "1:0"), spec, texts).startswith(f"bad data path '{path}': n1.err:3:")


def test_no_cause_while_running_or_after_success():
    def unread():
        raise AssertionError("the logs of a job that did not fail are not read")
        yield

    assert explain(Status(State.RUNNING), tiny_spec(), unread()) is None
    assert explain(Status(State.COMPLETED, "0:0"), tiny_spec(), unread()) is None


def test_a_job_finds_its_cause_in_its_node_and_batch_logs(tmp_path):
    job = make_job(tmp_path, State.TIMEOUT, logs={"n1.err": WARNINGS, "slurm-7.out": "slurmstepd: error: *** JOB 7"},
                   job={"time_limit": "0:01:00"})
    assert [t.name for t in job.log_texts()] == ["n1.err", "slurm-7.out"]
    assert job.cause() == "time limit: the job ran past its limit of 0:01:00"


def test_slurm_state_words():
    assert [slurm_state(s) for s in ("CANCELLED by 0", "OUT_OF_ME+", "TIMEOUT", "COMPLETING", "BOOT_FAIL", "")] == \
        [State.CANCELLED, State.OUT_OF_MEMORY, State.TIMEOUT, State.RUNNING, State.NODE_FAIL, State.UNKNOWN]


def node_out(rank, world=2, dp=2, extra=""):
    return (f"******************* job info 7 *******************\nNODE_RANK: {rank}\nWORLD_SIZE: {world}\n"
            f"DP_SIZE: {dp}\nPARTITION: 2\nusing world size: {world}, data-parallel size: {dp}, context-parallel size:"
            f" 1, tensor-model-parallel size: 1, pipeline-model-parallel size: 1\n{extra}")


def test_report_flags_job_info_that_disagrees_with_the_spec(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    job = make_job(tmp_path, State.COMPLETED, exit_code="0:0",
                   logs={"n1.out": node_out(0, extra=ITERATION), "n2.out": node_out(1, world=4, dp=4),
                         "n1.err": WARNINGS, "n1.gpu": "no nvidia-smi on n1: no GPU samples\n"})
    rep = report(job)
    assert rep.mismatches == ["n2: WORLD_SIZE is 4 in the job script, 2 in the spec",
                              "n2: WORLD_SIZE is 4 in the driver's log, 2 in the spec",
                              "n2: DP_SIZE is 4 in the job script, 2 in the spec",
                              "n2: DP_SIZE is 4 in the driver's log, 2 in the spec"]
    assert rep.iterations[["iteration", "elapsed_ms"]].values.tolist() == [[5, 129.2]]
    plain = format_report(rep, color=False)
    assert "MISMATCH n2: WORLD_SIZE is 4" in plain and "iteration 5 : 0.1292 s" in plain
    assert "==> n1.gpu <==\nno nvidia-smi on n1" in plain
    coloured = format_report(rep, color=True)
    assert "\x1b[" in coloured and "\x1b[" not in plain
    monkeypatch.setenv("NO_COLOR", "1")  # https://no-color.org: set and not empty turns colour off
    assert format_report(rep, color=True) == plain


def test_widget_refreshes_while_running_and_stops_at_the_end(tmp_path):
    backend = StaticBackend()
    job = make_job(tmp_path, State.RUNNING, exit_code=None, logs={"n1.out": node_out(0)}, backend=backend)
    view = widget(job, interval_s=0.05)
    assert "RUNNING" in view.value
    job.log_dir.joinpath("n1.out").write_text(node_out(0, extra=ITERATION))
    backend.statuses["7"] = Status(State.COMPLETED, "0:0")
    view.refresher.join(timeout=5)
    assert not view.refresher.is_alive()
    assert "COMPLETED" in view.value and "iteration 5 : 0.1292 s" in view.value
    assert job.record.last_status()["state"] == "COMPLETED"


def test_one_poll_refreshes_every_live_job_of_a_backend(tmp_path):
    backend, other = StaticBackend(), StaticBackend()
    jobs = [make_job(tmp_path, State.RUNNING, exit_code=None, backend=backend, job_id=i) for i in ("1", "2", "3")]
    done = make_job(tmp_path, State.COMPLETED, exit_code="0:0", backend=backend, job_id="4")
    elsewhere = make_job(tmp_path, State.RUNNING, exit_code=None, backend=other, job_id="5")
    backend.statuses.update({"1": Status(State.RUNNING), "2": Status(State.COMPLETED, "0:0"),
                             "3": Status(State.FAILED, "3:0")})
    assert jobs[0].state == State.RUNNING
    assert backend.polls == [["1", "2", "3"]] and other.polls == []  # one query; the ended job and the other backend
    assert [j.status(refresh=False).state for j in jobs] == [State.RUNNING, State.COMPLETED, State.FAILED]
    last = jobs[2].record.last_status()
    assert (last["state"], last["exit_code"], last["cause"]) == ("FAILED", "3:0", "failed with exit code 3:0")
    assert done.status(refresh=False).state == State.COMPLETED and elsewhere.state == State.RUNNING
    backend.statuses["1"] = Status(State.COMPLETED, "0:0")
    assert WATCHER.wait(jobs, timeout=5, poll_s=0.01) == {job: state for job, state in
                                                          zip(jobs, [State.COMPLETED, State.COMPLETED, State.FAILED])}
    assert backend.polls[1:] == [["1"]]


def test_runs_are_never_overwritten_and_an_interrupted_run_stays_readable(tmp_path):
    spec = load_spec({"name": "same name", "model": {"preset": "tiny"}})
    first, second = RunRecord.create(spec, tmp_path), RunRecord.create(spec, tmp_path)
    assert first.path != second.path and first.spec == second.spec == spec
    first.write_script("job.sbatch", "#!/bin/bash\n")
    with pytest.raises(FileExistsError):
        first.write_script("job.sbatch", "#!/bin/bash\necho replaced\n")
    first.attach("slurm", "multinode", ["41"])
    first.set_status(State.RUNNING)
    with open(first.path / "events.jsonl", "a") as events:  # the process died mid-write
        events.write('{"time": "2026-01-01T00:00:00", "state": "COMPL')
    assert load_run(first.run_id, tmp_path).last_status()["state"] == "RUNNING"
    assert load_run(first.path).job_info["job_ids"] == ["41"]
    rows = {r["run_id"]: r for r in RunIndex(tmp_path).rows()}
    assert rows[first.run_id]["state"] == "RUNNING" and rows[second.run_id]["state"] == "CREATED"
    (tmp_path / "index.sqlite").unlink()
    assert RunIndex(tmp_path).rebuild() == 2
    assert {r["run_id"]: r["state"] for r in RunIndex(tmp_path).rows()} == {first.run_id: "RUNNING",
                                                                             second.run_id: "CREATED"}


def test_finishing_writes_status_cause_and_metrics_once(tmp_path):
    job = make_job(tmp_path, State.RUNNING, logs={"n1.out": node_out(0, extra=ITERATION),
                                                   "n1.err": "Traceback (most recent call last):\n"})
    job.update(Status(State.FAILED, "1:0"))
    status = json.loads((job.record.path / "status.json").read_text())
    assert status["state"] == "FAILED" and status["cause"].startswith("error output on stderr")
    metrics = job.record.metrics()
    assert metrics["iterations"][0]["iteration"] == 5 and metrics["final_lm_loss"] == pytest.approx(6.93632)
    assert metrics["iterations"][0]["node"] == "n1"
    before = (job.record.path / "metrics.json").stat().st_mtime_ns
    time.sleep(0.01)
    job.record.save_metrics({"iterations": []})
    assert (job.record.path / "metrics.json").stat().st_mtime_ns == before


def test_metrics_are_the_parsers_iteration_table(tmp_path):
    # 2020's Megatron-LM prints `lm loss 6.9E+00 |` without a colon; two nodes print the same iterations
    old_style = (" iteration        5/      10 | elapsed time per iteration (ms): 129.2 | lm loss 6.936320E+00 |\n"
                 " iteration       10/      10 | elapsed time per iteration (ms): 120.8 | lm loss 6.5E+00 |\n")
    job = make_job(tmp_path, State.RUNNING, logs={"n1.out": old_style, "n2.out": old_style})
    job.update(Status(State.COMPLETED, "0:0"))
    metrics = job.record.metrics()
    parsed = parse_log(sorted(job.log_dir.glob("*.out")))
    assert [{k: v for k, v in row.items() if k != "attempt"} for row in metrics["iterations"]] == records(
        parsed.iterations[["iteration", "train_iters", "elapsed_ms", "lm_loss", "node"]])
    assert {row["attempt"] for row in metrics["iterations"]} == {0}
    assert [r["lm_loss"] for r in metrics["iterations"]] == [6.93632, 6.5]
    assert metrics["final_lm_loss"] == 6.5 and metrics["mean_iteration_ms"] == pytest.approx(120.8)
    assert job.last_iteration() == 10


def test_a_recorded_run_is_reattached_in_its_last_state(tmp_path):
    job = make_job(tmp_path, State.RUNNING)
    with pytest.raises(RuntimeError, match="has no job"):
        job_of(job.record)
    job.record.attach("local", "local", ["7"])
    job.update(Status(State.FAILED, "1:0"))
    again = job_of(job.record, StaticBackend())
    assert (again.job_ids, again.status(refresh=False)) == (["7"], Status(State.FAILED, "1:0"))
    assert again.backend.polls == []  # an ended job is not asked about again


def labkit(*args, cwd=None):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    spec = Path(__file__).resolve().parent.parent / "examples" / "gpt2-xl-hetero.yaml"
    done = labkit("run", str(spec), "--backend", "slurm", "--dry-run", "--runs-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "#SBATCH hetjob" in done.stdout and "#SBATCH --gres=gpu:a100:4" in done.stdout
    assert not (tmp_path / "index.sqlite").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec.read_text().replace("job: {exclusive: true}", "job: {exclusive: true, time_limit: soon}"))
    refused = labkit("run", str(bad), "--backend", "slurm", "--dry-run")
    assert refused.returncode == 2 and "job.time_limit: 'soon' is not a Slurm time limit" in refused.stderr


def test_cli_status_json_reads_a_finished_run(tmp_path):
    job = make_job(tmp_path, State.RUNNING, logs={"n1.out": node_out(0, extra=ITERATION)})
    job.record.attach("local", "local", job.job_ids)
    (job.log_dir / "state").write_text("COMPLETED 0\n")
    done = labkit("status", job.record.run_id, "--json", "--runs-dir", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["state"] == "COMPLETED" and status["iterations"][0]["iteration"] == 5
    listing = labkit("runs", "--runs-dir", str(tmp_path / "runs"))
    assert job.record.run_id in listing.stdout and "COMPLETED" in listing.stdout


def test_a_lagging_accounting_record_neither_reopens_a_job_nor_drops_its_reason():
    cancelled = [Status(State.CANCELLED, reason="DependencyNeverSatisfied")]
    # slurmdbd has not heard of the end yet: squeue's view stands
    assert settle(cancelled, [Status(State.PENDING, "0:0", "Dependency")]) == cancelled
    # it has, but without a reason: squeue's reason is kept with the record's state and exit code
    assert settle(cancelled, [Status(State.CANCELLED, "0:0", "None")]) == \
        [Status(State.CANCELLED, "0:0", "DependencyNeverSatisfied")]
    # the record's own reason and a job squeue no longer knows are taken as recorded
    failed = [Status(State.FAILED, "3:0", "NonZeroExitCode")]
    assert settle([Status(State.FAILED, reason="None")], failed) == failed
    assert settle([], failed) == failed


def test_only_a_job_sets_its_own_status():
    package = Path(__file__).resolve().parent.parent / "labkit"
    writers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                     if re.search(r"\._status\s*=(?!=)", p.read_text()))
    assert writers == ["jobs/job.py"]


def test_a_requeued_job_keeps_each_attempts_logs_outcome_and_iterations(tmp_path):
    job = make_job(tmp_path, State.RUNNING, exit_code=None)
    first, second = job.record.logs / "7", job.record.logs / "7" / "attempt-1"
    second.mkdir(parents=True)
    line = " iteration {:8d}/      12 | elapsed time per iteration (ms): {} | lm loss {:E} |\n"
    (first / "n1.out").write_text(
        "".join(line.format(i, 100.0, 7.0 - i / 10) for i in range(1, 9))
        + " successfully saved checkpoint from iteration       6 to /c [ t 1/1, p 1/1 ]\n")
    (second / "n1.out").write_text(
        "  successfully loaded checkpoint from /c [ t 1/1, p 1/1 ] at iteration 6\n"
        + "".join(line.format(i, 90.0, 6.0 - i / 10) for i in range(7, 13)))
    assert job.log_dir == second and job.last_iteration() == 12

    job.update(Status(State.RUNNING, restarts=1, ended_attempts=[Attempt(0, "NODE_FAIL", "0:0")]))
    job.update(Status(State.RUNNING, restarts=1, ended_attempts=[Attempt(0, "NODE_FAIL", "0:0")]))  # once only
    [attempt] = job.record.attempts()
    assert attempt["attempt"] == 0 and attempt["outcome"] == "NODE_FAIL" and attempt["logs"] == "logs/7"
    assert attempt["cause"].startswith("attempt 0: node failure") and "last checkpoint at iteration 6" in attempt["cause"]

    rows = job.iterations()
    assert list(rows["iteration"]) == list(range(1, 13))  # iterations 7 and 8 of the first attempt were redone
    assert list(rows["attempt"]) == [0] * 6 + [1] * 6
    job.update(Status(State.COMPLETED, "0:0", restarts=1))
    assert job.record.metrics()["mean_iteration_ms"] == pytest.approx((100.0 * 5 + 90.0 * 5) / 10)
    rep = report(job)
    assert rep.attempts[0]["outcome"] == "NODE_FAIL"
    assert "earlier attempt: NODE_FAIL: attempt 0: node failure" in format_report(rep, color=False)

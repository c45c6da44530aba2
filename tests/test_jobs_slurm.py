"""Jobs against the real local Slurm (emulated nodes n1 with gpu:a100:4, n2..n4 with gpu:a10:4).

Jobs that train, fail on bad data or wait for their time limit are submitted once, at the start of the module, and
checked by the last tests, so that they run while the quick scheduling tests go on. Scheduling tests put a stand-in
(tests/fake_torchrun.sh) where torchrun would be; the training tests run the real driver.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.jobs import Job, LocalBackend, SlurmBackend, SlurmError, State
from labkit.jobs import slurm as slurm_backend
from labkit.jobs.report import format_report, report
from labkit.net import free_port
from requeued import NextAttempt
from labkit.jobs.render import render, render_array
from labkit.spec import load_spec, with_changes

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parent.parent
FAKE_TORCHRUN = str(Path(__file__).resolve().parent / "fake_torchrun.sh")


def spec_for(nodes, name="tiny", **changes):
    data = {"name": name, "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
            "batch": {"micro": 2, "global": 8}, "train": {"iters": 10, "log_interval": 5}, "data": {"mock": True},
            "cluster": {"nodes": nodes}, "job": {"master_port": free_port()}}
    return load_spec(with_changes(data, **changes))


A10 = {"gpu": "A10", "count": 1, "gpus_per_node": 1}
A100 = {"gpu": "A100-40GB", "count": 1, "gpus_per_node": 1}
TWO_A10 = [{"gpu": "A10", "count": 2, "gpus_per_node": 1}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def slurm(runs):
    return SlurmBackend(runs_dir=runs)


@pytest.fixture(scope="module")
def fake(runs):
    return SlurmBackend(runs_dir=runs, torchrun=FAKE_TORCHRUN)


@pytest.fixture(scope="module")
def early(local_slurm, runs, slurm, fake):
    """The slow jobs, submitted together before the quick tests run (each job gets its own master port: the
    emulated nodes share this host, and other test sessions may share the cluster)."""
    jobs = {
        "timeout": fake.submit(spec_for([A10], "sleeper", **{"job.time_limit": "1", "train.iters": 100,
                                                              "train.log_interval": 1,
                                                              "job.env": {"FAKE_ITERATION_S": "30"}})),
        "two_nodes": slurm.submit(spec_for(TWO_A10, "tiny-2nodes")),
        "hetjob": slurm.submit(spec_for([A100, A10], "tiny-hetero")),
        "bad_data": slurm.submit(spec_for([A10], "bad-data",
                                          data={"mock": False, "path": "/nonexistent/corpus_text_document"})),
        "local": LocalBackend(runs_dir=runs).submit(spec_for(TWO_A10, "tiny-2nodes")),
    }
    yield jobs
    for job in jobs.values():
        if not job.state.finished:
            job.cancel()


def wait(job, timeout=240):
    state = job.wait(progress=False, timeout=timeout, poll_s=0.5)
    assert state.finished, f"{job!r} still {state} after {timeout} s"
    return state


def wait_running(job, timeout=60):
    deadline = time.monotonic() + timeout
    while job.state == State.PENDING and time.monotonic() < deadline:
        time.sleep(0.3)
    assert job.state == State.RUNNING


def argv(job, node):
    return (job.log_dir / f"{node}.argv").read_text().split("\0")[:-1]


# --- quick scheduling tests ------------------------------------------------------------------------------------------
def test_slurm_accepts_every_template_with_test_only(early, slurm, tmp_path):
    two = spec_for(TWO_A10, job={"partition": "debug", "time_limit": "0:10:00", "cpus_per_task": 1,
                                 "exclusive": True, "env": {"NCCL_DEBUG": "INFO"}})
    hetero = spec_for([A100, {"gpu": "A10", "count": 1, "gpus_per_node": 3, "cpus_per_node": 4}])
    scripts = dict(render(two, tmp_path).scripts)
    scripts.update({f"het-{k}": v for k, v in render(hetero, tmp_path).scripts.items()})
    scripts.update({f"pair-{k}": v for k, v in render(hetero, tmp_path, layout="pair").scripts.items()})
    scripts.update({f"array-{k}": v for k, v in render_array([two, two], [tmp_path, tmp_path]).scripts.items()})
    # The production options this cluster can honour: requeue with its signal, memory, GPUs per node, a cluster
    # whose node groups give their CPUs (so cpus_per_task is the node's), extra lines, c10d, an env preset.
    production = spec_for([A100], job={"requeue": True, "time_limit": "0:10:00", "mem": "1000M",
                                       "gpus_per_node_flag": "gpus-per-node", "sbatch": ["--comment=labkit"],
                                       "rendezvous": "c10d", "env_preset": "infiniband"},
                          train={"iters": 10, "log_interval": 5, "save": str(tmp_path / "ckpt")},
                          cluster="local-slurm", parallel={"tensor": 1, "pipeline": 1, "data": 16},
                          batch={"micro": 1, "global": 16})
    scripts.update({f"production-{k}": v for k, v in render(production, tmp_path).scripts.items()})
    assert "#SBATCH --cpus-per-task=4" in scripts["production-job.sbatch"]
    assert len(scripts) == 6
    for name, text in scripts.items():
        path = tmp_path / name
        path.write_text(text)
        verdict = slurm.test_only(path)
        assert "to start at" in verdict, (name, verdict)


def test_impossible_request_reaches_the_user_verbatim(early, slurm, runs, tmp_path):
    greedy = spec_for([{"gpu": "A100-40GB", "count": 1, "gpus_per_node": 8, "cpus_per_node": 4}], "greedy",
                      **{"batch.micro": 1})
    with pytest.raises(SlurmError, match="Requested node configuration is not available"):
        slurm.submit(greedy)
    spec_file = tmp_path / "greedy.yaml"
    spec_file.write_text(greedy.to_yaml())
    cli = subprocess.run([sys.executable, "-m", "labkit", "run", str(spec_file), "--backend", "slurm", "--wait",
                          "--runs-dir", str(runs)], capture_output=True, text=True)
    assert cli.returncode == 1
    assert "Batch job submission failed: Requested node configuration is not available" in cli.stderr


def test_cancel_gives_cancelled_with_its_cause(early, fake, runs):
    job = fake.submit(spec_for([A10], "to-cancel", **{"train.iters": 100, "train.log_interval": 1,
                                                     "job.env": {"FAKE_ITERATION_S": "5"}}))
    wait_running(job)
    cli = subprocess.run([sys.executable, "-m", "labkit", "cancel", job.record.run_id, "--runs-dir", str(runs)],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert wait(job, 60) == State.CANCELLED
    assert job.cause().startswith("cancelled")
    assert job.record.last_status()["state"] == "CANCELLED"


def _purged_by_the_controller(monkeypatch, backend, keep_jobcomp: bool) -> None:
    """What a finished job looks like once the controller has dropped it (MinJobAge): squeue and scontrol no longer
    know it; the jobcomp file is there only when `keep_jobcomp`."""
    real_run = slurm_backend._run

    def run(args, check=True, cwd=None, **where):
        if args[0] == "squeue":
            return subprocess.CompletedProcess(args, 1, "", "slurm_load_jobs error: Invalid job id specified")
        if args[:3] == ["scontrol", "-o", "show"]:
            return subprocess.CompletedProcess(args, 0, "", "")
        return real_run(args, check, cwd, **where)

    monkeypatch.setattr(slurm_backend, "_run", run)
    if not keep_jobcomp:
        monkeypatch.setitem(backend.config(), "JobCompType", "jobcomp/none")


def test_a_finished_job_reads_the_same_from_scontrol_sacct_and_the_jobcomp_file(early, local_slurm, fake, runs,
                                                                                monkeypatch):
    if not local_slurm.accounting:
        pytest.skip("the local Slurm runs without slurmdbd (LABKIT_SLURM_ACCOUNTING=0): sacct cannot answer")
    job = fake.submit(spec_for([A10], "exits-3", **{"job.env": {"FAKE_EXIT": "3"}}))
    assert wait(job, 60) == State.FAILED
    # A backend of its own: a refresh polls every live job of its backend, and the others are not purged.
    probe = SlurmBackend(runs_dir=runs)
    seen = {}
    with monkeypatch.context() as patch:  # the controller still knows the job: squeue, then scontrol
        patch.setitem(probe.config(), "AccountingStorageType", "accounting_storage/none")
        seen["scontrol"] = Job(probe, job.job_ids, job.record).status()
    with monkeypatch.context() as patch:
        _purged_by_the_controller(patch, probe, keep_jobcomp=False)
        assert probe.accounting()
        seen["sacct"] = Job(probe, job.job_ids, job.record).status()
    with monkeypatch.context() as patch:
        _purged_by_the_controller(patch, probe, keep_jobcomp=True)
        patch.setitem(probe.config(), "AccountingStorageType", "accounting_storage/none")
        seen["jobcomp"] = Job(probe, job.job_ids, job.record).status()
    assert {name: (s.state, s.exit_code) for name, s in seen.items()} == \
        {name: (State.FAILED, "3:0") for name in ("scontrol", "sacct", "jobcomp")}


def test_array_runs_each_spec_as_its_own_task_and_run(early, fake):
    port = free_port()  # an array's tasks share their job settings
    specs = [spec_for([A10], f"sweep-{iters}", **{"train.iters": iters, "job.master_port": port})
             for iters in (5, 10, 15)]
    jobs = fake.submit_array(specs)
    array_id = jobs[0].job_id.split("_")[0]
    assert [j.job_id for j in jobs] == [f"{array_id}_{i}" for i in range(3)]
    assert len({j.record.path for j in jobs}) == 3
    for job, iters in zip(jobs, (5, 10, 15)):
        assert wait(job, 60) == State.COMPLETED
        (node,) = job.node_logs()
        args = argv(job, node)
        assert args[args.index("--train-iters") + 1] == str(iters)
        assert job.result().iterations["iteration"].max() == iters


def test_afterok_chain_runs_in_order(early, fake):
    lab = [("baseline", {}), ("fp16", {"precision": "fp16"}),
           ("recompute", {"precision": "fp16", "recompute": {"granularity": "full", "method": "uniform",
                                                             "num_layers": 1}}),
           ("grad-accumulation", {"precision": "fp16", "batch.micro": 1})]
    jobs, previous = [], None
    for name, changes in lab:
        spec = spec_for([A10], name, **{"job.env": {"FAKE_ITERATION_S": "1"}}, **changes)
        previous = fake.submit(spec, after=previous)
        jobs.append(previous)
    reasons = subprocess.run(["squeue", "-h", "-o", "%i %r", "-j", ",".join(j.job_id for j in jobs[1:])],
                             capture_output=True, text=True).stdout
    assert reasons.count("Dependency") == 3, reasons
    for job in jobs:
        assert wait(job, 90) == State.COMPLETED
    starts = [float((job.log_dir / next(iter(job.node_logs()))).with_suffix(".argv").stat().st_mtime)
              for job in jobs]
    assert starts == sorted(starts)


def test_afterok_after_a_failure_is_cancelled(early, fake):
    failing = fake.submit(spec_for([A10], "fails", **{"job.env": {"FAKE_EXIT": "3"}}))
    dependent = fake.submit(spec_for([A10], "never"), after=failing)
    assert wait(failing, 60) == State.FAILED
    assert failing.status(refresh=False).exit_code == "3:0"
    assert wait(dependent, 60) == State.CANCELLED
    assert "depends on did not complete" in dependent.cause()


def test_master_slave_pair_shares_one_log_dir(early, fake):
    job = fake.submit(spec_for([A100, A10], "pair"), layout="pair")
    assert len(job.job_ids) == 2
    assert wait(job, 90) == State.COMPLETED
    info = report(job).info
    assert set(info) >= {"n1"} and len(info) == 2
    assert sorted(v["NODE_RANK"] for v in info.values()) == ["0", "1"]
    assert {v["MASTER_ADDR"] for v in info.values()} == {"n1"}


# --- the slow jobs submitted first ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_node_training_completes_and_its_log_parses(early):
    job = early["two_nodes"]
    assert wait(job) == State.COMPLETED, report(job).cause
    assert sorted(job.node_logs()) == ["n2", "n3"] or len(job.node_logs()) == 2
    rep = report(job)
    assert rep.mismatches == []
    assert sorted(v["NODE_RANK"] for v in rep.info.values()) == ["0", "1"]
    assert {v["LOG_WORLD_SIZE"] for v in rep.info.values() if "LOG_WORLD_SIZE" in v} == {"2"}
    iterations = job.result().iterations
    assert list(iterations["iteration"].drop_duplicates()) == [5, 10]
    assert iterations["lm_loss"].notna().all()
    assert job.record.metrics()["final_lm_loss"] > 0


@pytest.mark.slow
def test_hetjob_trains_across_a100_and_a10_nodes(early):
    job = early["hetjob"]
    assert wait(job) == State.COMPLETED, report(job).cause
    info = report(job).info
    assert "n1" in info and len(info) == 2  # n1 is the only a100 node
    assert info["n1"]["NODE_RANK"] == "0"
    assert [v["NODE_RANK"] for node, v in info.items() if node != "n1"] == ["1"]


@pytest.mark.slow
def test_bad_data_path_fails_with_that_cause(early):
    job = early["bad_data"]
    assert wait(job) == State.FAILED
    assert job.cause().startswith("bad data path '/nonexistent/corpus_text_document'")


@pytest.mark.slow
def test_time_limit_gives_timeout_with_that_cause(early):
    job = early["timeout"]
    assert wait(job, 200) == State.TIMEOUT
    assert job.cause() == "time limit: the job ran past its limit of 1"
    assert job.record.last_status()["cause"] == job.cause()


@pytest.mark.slow
def test_local_backend_gives_an_equivalent_run_record(early, runs):
    local, remote = early["local"], early["two_nodes"]
    assert wait(local) == State.COMPLETED, report(local).cause
    assert wait(remote) == State.COMPLETED
    for job in (local, remote):
        assert sorted(p.name for p in job.record.path.iterdir() if p.is_file()) == \
            sorted(["events.jsonl", "job.json", "metrics.json", job.record.scripts[0].name, "spec.yaml", "status.json"])
        assert all(set(files) == {"out", "err", "gpu"} for files in job.node_logs().values())
        assert len(job.node_logs()) == 2
    local_spec, remote_spec = local.record.spec, remote.record.spec
    local_spec.job.master_port = remote_spec.job.master_port  # the local backend picks a free port
    assert local_spec == remote_spec
    assert [r["iteration"] for r in local.record.metrics()["iterations"]] == \
        [r["iteration"] for r in remote.record.metrics()["iterations"]]
    table = subprocess.run([sys.executable, "-m", "labkit", "runs", "--runs-dir", str(runs)], capture_output=True,
                           text=True).stdout
    assert local.record.run_id in table and remote.record.run_id in table


def _requeue_spec(runs, name, **job):
    """A job that can be requeued, with the port derived from its id and attempt: the emulated nodes share this host,
    where a lost node's processes may still hold the first attempt's port when the next one starts."""
    return spec_for([A10], name, **{"job.requeue": True, "job.master_port": None, "train.iters": 40,
                                    "train.log_interval": 1, "train.save": str(runs / f"{name}-checkpoints"),
                                    "train.save_interval": 1000, **{f"job.{k}": v for k, v in job.items()}})


def _run_to(job, iteration: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while job.last_iteration() < iteration:
        assert not job.state.finished and time.monotonic() < deadline, report(job).cause
        time.sleep(0.3)


def _start_again(job, timeout: float = 120) -> None:
    """Wait for Slurm to requeue the job, then let it start (tests/requeued.py)."""
    deadline = time.monotonic() + timeout
    started = NextAttempt(job)
    while not started():
        assert time.monotonic() < deadline, f"{job!r} has not started again after {timeout} s"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_requeued_job_saves_resumes_from_its_checkpoint_and_keeps_both_attempts(early, slurm, runs):
    job = slurm.submit(_requeue_spec(runs, "requeued"))
    _run_to(job, 5)
    # What `#SBATCH --signal=B:USR1@N` sends ahead of the time limit: the script passes it on to the training
    # processes, which save and stop, then requeues the job.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job.job_id], check=True)
    _start_again(job)
    assert wait(job) == State.COMPLETED, report(job).cause
    first, second = job.attempt_log_dirs()[0] / "n2.out", job.log_dir
    saved = re.search(r"successfully saved checkpoint from iteration +(\d+)", next(
        p for p in job.attempt_log_dirs()[0].glob("*.out")).read_text())
    assert saved, "the first attempt saved no checkpoint when Slurm stopped it"
    resumed = next(second.glob("*.out")).read_text()
    assert f"at iteration {saved.group(1)}" in resumed and "successfully loaded checkpoint" in resumed
    rows = job.iterations()
    assert list(rows["iteration"]) == list(range(1, 41))
    assert rows[rows["attempt"] == 1]["iteration"].min() == int(saved.group(1)) + 1
    [attempt] = job.record.attempts()
    assert attempt["outcome"] == "REQUEUED" and f"after saving a checkpoint at iteration {saved.group(1)}" in \
        attempt["cause"]
    assert first.parent != second


@pytest.mark.slow
def test_a_node_lost_mid_run_is_reported_as_node_fail_then_the_next_attempt(early, slurm, runs):
    for other in early.values():  # taking a node down ends whatever runs on it
        other.wait(progress=False, timeout=240)
    job = slurm.submit(_requeue_spec(runs, "node-lost"))
    _run_to(job, 5)
    node = subprocess.run(["squeue", "-h", "-o", "%N", "-j", job.job_id], capture_output=True, text=True,
                          check=True).stdout.strip()
    # Down, as an administrator marks a lost node, and drained, so that the emulated node (whose slurmd still
    # answers) does not return to service and take the next attempt.
    for state in ("down", "drain"):
        subprocess.run(["scontrol", "update", f"nodename={node}", f"state={state}", "reason=labkit-test"], check=True)
    try:
        _start_again(job)
        assert wait(job) == State.COMPLETED, report(job).cause
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
    [attempt] = job.record.attempts()
    assert attempt["outcome"] == "NODE_FAIL" and attempt["cause"].startswith("attempt 0: node failure")
    assert (job.attempt_log_dirs()[0] / f"{node}.out").is_file() and next(job.attempt_log_dirs()[1].glob("*.out"))
    assert list(job.iterations()["iteration"]) == list(range(1, 41))
    assert "NODE_FAIL" in format_report(report(job), color=False)

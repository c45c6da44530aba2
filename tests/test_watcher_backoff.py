"""How often following jobs asks the scheduler: SlurmBackend against a scripted squeue/sacct, on a simulated clock
(no real sleeping), counting every scheduler command."""
from __future__ import annotations

import subprocess

import pytest

from labkit.cli import main
from labkit.jobs import slurm as slurm_module
from labkit.jobs.job import Job
from labkit.jobs.record import RunRecord
from labkit.jobs.slurm import SlurmBackend
from labkit.jobs.state import State
from labkit.jobs.sweep import Sweep
from labkit.jobs.watcher import SCHEDULER_BACKOFF, WATCHER, Backoff
from labkit.spec import load_spec

HOUR = 3600.0
SPEC = {"name": "followed", "model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8},
        "cluster": {"nodes": [{"gpu": "A10", "count": 2, "gpus_per_node": 1}]}}


class Scheduler:
    """squeue, sacct and scontrol for jobs whose states follow a timetable on a simulated clock; it logs each call
    (time, command, job ids asked about)."""

    def __init__(self):
        self.now = 0.0
        self.timetable: dict[str, list[tuple[float, str]]] = {}  # job id -> [(from time, Slurm state)]
        self.calls: list[tuple[float, str, list[str]]] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds

    def state(self, job_id: str) -> str:
        return [state for start, state in self.timetable[job_id] if start <= self.now][-1]

    def run(self, args, check=True, cwd=None, env=None, runner=None) -> subprocess.CompletedProcess:
        ids = args[args.index("-j") + 1].split(",") if "-j" in args else []
        self.calls.append((self.now, args[0], ids))
        if args[0] == "squeue":
            out = "".join(f"{i}|{self.state(i)}|None|0|\n" for i in ids if i in self.timetable)
        elif args[0] == "sacct":
            out = "".join(f"{i}|{self.state(i)}|0:0|None\n" for i in ids if i in self.timetable)
        elif args[:3] == ["scontrol", "show", "config"]:
            out = "AccountingStorageType = accounting_storage/slurmdbd\n"
        else:
            raise AssertionError(f"unexpected command {args}")
        return subprocess.CompletedProcess(args, 0, out, "")

    def squeue_times(self, job_id: str | None = None) -> list[float]:
        return [t for t, command, ids in self.calls if command == "squeue" and (job_id is None or job_id in ids)]


@pytest.fixture
def scheduler(monkeypatch):
    fake = Scheduler()
    monkeypatch.setattr(slurm_module, "_run", fake.run)
    monkeypatch.setattr(WATCHER, "clock", fake.clock)
    monkeypatch.setattr(WATCHER, "sleep", fake.sleep)
    return fake


def follow(scheduler, tmp_path, job_id: str, timetable: list[tuple[float, str]], backend=None) -> Job:
    scheduler.timetable[job_id] = timetable
    record = RunRecord.create(load_spec(SPEC), tmp_path / "runs")
    return Job(backend or SlurmBackend(runs_dir=tmp_path / "runs"), [job_id], record)


def test_an_hour_of_following_asks_squeue_41_times_not_3600(scheduler, tmp_path):
    job = follow(scheduler, tmp_path, "11", [(0, "PENDING"), (30, "RUNNING"), (2 * HOUR, "COMPLETED")])
    assert job.wait(progress=False, timeout=HOUR) == State.RUNNING
    times = scheduler.squeue_times()
    # 0, 2, 4, 8 ... s after submission; the start (seen at 32 s) brings the pace back to 2 s, then it doubles again
    # up to two minutes. The old one-second loop asked 3,600 times.
    assert times[:14] == [0, 2, 4, 8, 16, 32, 34, 36, 40, 48, 64, 96, 160, 280]
    assert max(b - a for a, b in zip(times, times[1:])) == SCHEDULER_BACKOFF.cap_s
    assert len(times) == 41 and scheduler.now == HOUR


def test_a_finished_job_is_never_asked_about_again_and_one_call_serves_every_live_job(scheduler, tmp_path):
    backend = SlurmBackend(runs_dir=tmp_path / "runs")
    short = follow(scheduler, tmp_path, "21", [(0, "RUNNING"), (100, "COMPLETED")], backend)
    long = follow(scheduler, tmp_path, "22", [(0, "RUNNING"), (1000, "FAILED")], backend)
    states = Sweep({"short": short, "long": long}).wait(raise_on_failure=False)
    assert states == {"short": State.COMPLETED, "long": State.FAILED}
    ended_at = scheduler.squeue_times("21")[-1]
    assert 100 <= ended_at <= 100 + SCHEDULER_BACKOFF.cap_s  # seen ending within one interval
    after = [ids for t, command, ids in scheduler.calls if t > ended_at]
    assert after and all("21" not in ids for ids in after)  # its final state is kept, never asked again
    assert all(ids == ["21", "22"] for t, command, ids in scheduler.calls if command == "squeue" and t < ended_at)
    # The long job's end brought the pace back to 2 s; once both ended, nothing is asked at all.
    calls = len(scheduler.calls)
    assert short.state == State.COMPLETED and long.state == State.FAILED and len(scheduler.calls) == calls


def test_asking_for_the_state_in_a_loop_is_paced_too(scheduler, tmp_path):
    job = follow(scheduler, tmp_path, "31", [(0, "RUNNING")])
    for _ in range(600):  # a notebook's `while not job.done(): time.sleep(1)`
        job.done()
        scheduler.sleep(1)
    assert scheduler.squeue_times() == [0, 2, 4, 8, 16, 32, 64, 128, 248, 368, 488]


def test_poll_seconds_overrides_the_backoff_for_sweep_wait(scheduler, tmp_path):
    backend = SlurmBackend(runs_dir=tmp_path / "runs")
    jobs = {name: follow(scheduler, tmp_path, job_id, [(0, "RUNNING"), (600, "COMPLETED")], backend)
            for name, job_id in (("a", "41"), ("b", "42"))}
    assert Sweep(jobs).wait(poll_s=30) == {"a": State.COMPLETED, "b": State.COMPLETED}
    assert scheduler.squeue_times() == [30.0 * i for i in range(21)]
    with pytest.raises(ValueError, match="poll_s: must be a positive number of seconds, got 0"):
        Sweep(jobs).wait(poll_s=0)


def test_the_backoff_interval_follows_the_quiet_time():
    pace = Backoff(first_s=2, cap_s=120)
    assert [pace.interval(q) for q in (0, 1, 2, 8, 100, 119, 5000)] == [2, 2, 2, 8, 100, 119, 120]
    assert Backoff.every(30) == Backoff(30, 30)


def test_run_wait_takes_poll_seconds(scheduler, tmp_path, monkeypatch, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: followed\nmodel: {preset: tiny}\nbatch: {micro: 2, global: 8}\n"
                    "cluster: {nodes: [{gpu: A10, count: 2, gpus_per_node: 1}]}\n")
    scheduler.timetable["51"] = [(0, "PENDING"), (40, "RUNNING"), (300, "COMPLETED")]
    monkeypatch.setattr(SlurmBackend, "_sbatch", lambda self, options, script, runner=None: "51")
    runs = str(tmp_path / "runs")
    assert main(["run", str(spec), "--backend", "slurm", "--wait", "--poll", "45", "--runs-dir", runs]) == 0
    assert scheduler.squeue_times() == [0, 45, 90, 135, 180, 225, 270, 315]
    assert main(["run", str(spec), "--backend", "slurm", "--poll", "45", "--runs-dir", runs]) == 2
    assert "--poll: sets how often --wait asks the scheduler; add --wait" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", str(spec), "--wait", "--poll", "0"])
    assert "'0' is not a positive number of seconds" in capsys.readouterr().err

"""Run records under concurrent pollers and random kills (goal: 0 wrong final states in 1,000 runs).

    .venv/bin/python benchmarks/bench_run_records.py [--runs 1000] [--at-once 50] [--pollers 3] [--seed 0]

Submits --runs local runs of a trivial job (tests/fake_torchrun.sh stands in for torchrun and sleeps a random
0-0.4 s per logged iteration), at most --at-once running together, while --pollers other processes follow every run
as `labkit status` would (job_of + status, over and over). A random quarter of the runs is interfered with while it
runs: run.sh alone is SIGKILLed, or the job is cancelled (its process group gets SIGTERM), or one node's stand-in
torchrun is SIGKILLed.

What happened is what run.sh wrote in its state file (LOGDIR/JOBID/state); a run.sh killed before writing an end
should read FAILED. A run's final state is wrong when its last event, its status.json or its index row says
anything else. Prints the counts, the wrong runs, and the time taken.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.jobs import LocalBackend, job_of  # noqa: E402
from labkit.jobs.record import RunIndex, RunRecord  # noqa: E402
from labkit.spec import load_spec  # noqa: E402

FAKE_TORCHRUN = str(ROOT / "tests" / "fake_torchrun.sh")
UNFINISHED = {"CREATED", "SUBMITTED", "PENDING", "RUNNING"}


def spec(name: str, pause_s: float):
    return load_spec({"name": name, "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
                      "batch": {"micro": 2, "global": 8}, "train": {"iters": 10, "log_interval": 5},
                      "data": {"mock": True}, "job": {"env": {"FAKE_ITERATION_S": f"{pause_s:.2f}"}},
                      "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 1}]}})


def poller(root: str, stop) -> None:
    """Follow every submitted run until told to stop, as a `labkit status` in another terminal would."""
    backend = LocalBackend(runs_dir=root)
    while not stop.is_set():
        for path in sorted(Path(root).iterdir()):
            record = RunRecord(path)
            try:
                if (path / "job.json").exists():
                    job_of(record, backend).status()
            except Exception as exc:  # a poller that fails is a finding: show it, go on
                print(f"poller: {path.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        time.sleep(0.01)


def interfere(job, how: str, rng: random.Random) -> None:
    time.sleep(rng.uniform(0.0, 0.8))
    try:
        if how == "kill-runner":
            os.kill(int(job.job_id), signal.SIGKILL)
        elif how == "cancel":
            job.cancel()
        elif how == "kill-node":
            torchruns = [p for p in Path("/proc").glob("[0-9]*") if _in_group(p, int(job.job_id))
                         and b"fake_torchrun" in _read(p / "cmdline")]
            if torchruns:
                os.kill(int(torchruns[0].name), signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _in_group(proc: Path, pgid: int) -> bool:
    stat = _read(proc / "stat").decode(errors="replace")
    try:
        return int(stat.rsplit(")", 1)[1].split()[2]) == pgid
    except (IndexError, ValueError):
        return False


def truth(record: RunRecord, job_id: str) -> str:
    """What happened, as run.sh recorded it: its end, or FAILED when it was killed before recording one."""
    state_file = record.logs / job_id / "state"
    words = state_file.read_text().split() if state_file.exists() else []
    return words[0] if words and words[0] != "RUNNING" else "FAILED"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--at-once", type=int, default=50)
    ap.add_argument("--pollers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs-dir", help="default: a new temporary directory")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(args.runs_dir or tempfile.mkdtemp(prefix="bench-run-records-"))
    root.mkdir(parents=True, exist_ok=True)
    backend = LocalBackend(runs_dir=root, torchrun=FAKE_TORCHRUN)
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    pollers = [context.Process(target=poller, args=(str(root), stop), daemon=True) for _ in range(args.pollers)]
    for p in pollers:
        p.start()
    start = time.monotonic()
    plans: dict[str, str] = {}
    live = []
    for i in range(args.runs):
        while len(live) >= args.at_once:
            live = [job for job in live if job.backend._children[job.job_id].poll() is None]
            time.sleep(0.01)
        job = backend.submit(spec(f"run{i}", rng.uniform(0.0, 0.4)))
        how = rng.choices(["none", "kill-runner", "cancel", "kill-node"], [75, 9, 8, 8])[0]
        plans[job.record.run_id] = how
        if how != "none":
            context.Process(target=interfere, args=(job, how, random.Random(rng.random()))).start()
        live.append(job)
    for job in live:
        job.backend._children[job.job_id].wait()
    # Let the pollers see every end (each run's recorded state settles once some process polls it after run.sh).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = RunIndex(root).rows()
        if len(rows) == args.runs and not any(r["state"] in UNFINISHED for r in rows):
            break
        time.sleep(0.2)
    stop.set()
    for p in pollers:
        p.join()
    elapsed = time.monotonic() - start

    index = {row["run_id"]: row for row in RunIndex(root).rows()}
    outcomes, wrong = Counter(), []
    for path in sorted(root.iterdir()):
        if not path.is_dir():
            continue
        record = RunRecord(path)
        expected = truth(record, record.job_info["job_ids"][0])
        status = record.path / "status.json"
        seen = {"events": record.last_status().get("state"),
                "status.json": __import__("json").loads(status.read_text())["state"] if status.exists() else None,
                "index": index.get(record.run_id, {}).get("state")}
        outcomes[(plans[record.run_id], expected)] += 1
        if any(state != expected for state in seen.values()):
            wrong.append(f"{record.run_id} ({plans[record.run_id]}): run.sh says {expected}, recorded {seen}")
    print(f"{args.runs} local runs, {args.at_once} at once, {args.pollers} pollers, seed {args.seed}: "
          f"{elapsed:.0f} s; records in {root}")
    for (how, state), count in sorted(outcomes.items()):
        print(f"  {how:12s} -> {state:10s} {count}")
    print(f"wrong final states: {len(wrong)}")
    for line in wrong:
        print("  " + line)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run records under concurrent pollers, random kills, Ctrl-C and faults (goal: 0 runs recorded wrongly or stuck).

    .venv/bin/python benchmarks/bench_run_records.py [--runs 1000] [--at-once 50] [--pollers 3] [--seed 0]
                                                     [--interrupts 20] [--faults 24] [--mid-run-faults 6]

Submits --runs local runs of a trivial job (tests/fake_torchrun.sh stands in for torchrun and sleeps a random
0-0.4 s per logged iteration, 0.3-1.5 s in a run interfered with), at most --at-once running together, while
--pollers other processes follow every run as `labkit status` would (job_of + status, over and over). About a third
of the runs is interfered with: run.sh alone is SIGKILLed (its nodes run on; a poll that says FAILED while they do is
counted), or the job is cancelled (its process group gets SIGTERM), or one node's stand-in torchrun is SIGKILLed, or
labkit itself is SIGKILLed while it submits (before, while or after it makes the run directory). `labkit runs` then
settles what no poller follows.

What happened is what run.sh wrote in its state file (LOGDIR/JOBID/state); a run.sh killed before writing an end,
and a run whose job labkit never recorded, should read FAILED. A run's final state is wrong when its last event, its
index row or its status.json (where there is one) says anything else, and stuck when it is still CREATED, SUBMITTED,
PENDING or RUNNING. Also counted: a run directory without a spec or events (half made), a state.tmp left, an ended
job without metrics.json, a traceback in a poller.

Then --interrupts `labkit run SPEC --wait` commands, each in a process of its own, get a Ctrl-C (SIGINT to their
process group, as a terminal sends it) at a random moment: while they submit, while they wait, or after the run has
ended. Each must exit 130 with one line on stderr (or 0, when it ended first); a line that says the job keeps running
must name its run and end with the exact command that cancels it, which half the time is then run (it must cancel the
job, or say how the job already ended). Their runs are checked with the others.

With root (to mount small tmpfs file systems), --faults more runs are submitted to a runs directory with 0 to 96 KB
free (the space is freed after the submission, then the runs are polled and listed), the finished runs are listed
and reported from a read-only copy (with and without its index), and the index is replaced by junk and listed. Then
--mid-run-faults runs of each kind meet a runs directory that turns read-only (a read-only bind mount over it: files
already open for writing stay so, as the runner's output does) or whose disk fills up, mid-run (after the first
logged iteration) or at the end (after the last, before torchrun exits). What happened is then the runner's exit
status (0 COMPLETED, 143 CANCELLED, 124 TIMEOUT, else FAILED, as run.sh's finish records it). Once the runner has
ended, and while the fault lasts, `labkit status RUN`, `labkit runs` and `labkit cancel RUN` must answer without a
traceback and say how it ended (cancel: exit 1, "already ended"); once the fault is gone, `labkit status RUN` must
record that end, with the write error in its cause when run.sh could not write its state file, and lose nothing of
the record (its events before the fault, its index row).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.cli import main as labkit  # noqa: E402
from labkit.jobs import LocalBackend, RecordError, State, job_of  # noqa: E402
from labkit.jobs.record import RunIndex, RunRecord  # noqa: E402
from labkit.spec import load_spec  # noqa: E402

FAKE_TORCHRUN = str(ROOT / "tests" / "fake_torchrun.sh")
UNFINISHED = {"CREATED", "SUBMITTED", "PENDING", "RUNNING"}


def spec_text(name: str, pause_s: float, **env) -> dict:
    return {"name": name, "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
            "batch": {"micro": 2, "global": 8}, "train": {"iters": 10, "log_interval": 5}, "data": {"mock": True},
            "job": {"env": {"FAKE_ITERATION_S": f"{pause_s:.2f}", **env}},
            "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 1}]}}


def spec(name: str, pause_s: float, **env):
    return load_spec(spec_text(name, pause_s, **env))


def poller(root: str, stop, tracebacks) -> None:
    """Follow every submitted run until told to stop, as a `labkit status` in another terminal would."""
    backend = LocalBackend(runs_dir=root)
    while not stop.is_set():
        for path in sorted(Path(root).iterdir()):
            record = RunRecord(path)
            try:
                if (path / "job.json").exists():
                    job_of(record, backend).status()
            except Exception as exc:  # a poller that fails is a finding: show it, go on
                with tracebacks.get_lock():
                    tracebacks.value += 1
                print(f"poller: {path.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        time.sleep(0.01)


def submit_then_die(root: str, name: str, pause_s: float) -> None:
    """labkit submitting a run, in a process of its own that is SIGKILLed at some point of it."""
    LocalBackend(runs_dir=root, torchrun=FAKE_TORCHRUN).submit(spec(name, pause_s))
    time.sleep(60)


def interfere(job, how: str, rng: random.Random, failed_while_running) -> None:
    time.sleep(rng.uniform(0.0, 0.8))
    try:
        if how == "kill-runner":
            os.kill(int(job.job_id), signal.SIGKILL)
            # What a poller says while the runner's nodes run on: never FAILED while they do.
            backend = LocalBackend(runs_dir=job.record.root)
            while any(_in_group(p, int(job.job_id)) for p in Path("/proc").glob("[0-9]*")):
                seen = job_of(RunRecord(job.record.path), backend).status().state
                if seen.finished and any(_in_group(p, int(job.job_id)) and not _zombie(p)
                                         for p in Path("/proc").glob("[0-9]*")):
                    with failed_while_running.get_lock():
                        failed_while_running.value += 1
                    break
                time.sleep(0.05)
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
        fields = stat.rsplit(")", 1)[1].split()
        return int(fields[2]) == pgid and fields[0] != "Z"
    except (IndexError, ValueError):
        return False


def _zombie(proc: Path) -> bool:
    return ") Z" in _read(proc / "stat").decode(errors="replace")


def truth(record: RunRecord) -> str:
    """What happened, as run.sh recorded it: its end, or FAILED when it was killed before recording one, or when
    labkit never recorded its job (then it started nothing)."""
    job_ids = record.job_info.get("job_ids")
    if not job_ids:
        return "FAILED"
    state_file = record.logs / job_ids[0] / "state"
    words = state_file.read_text().split() if state_file.exists() else []
    return words[0] if words and words[0] != "RUNNING" else "FAILED"


def quietly(*argv) -> tuple[int, str]:
    """A labkit command in this process: its exit status and stdout (a traceback out of it is exit 99)."""
    code, out, _ = with_stderr(*argv)
    return code, out


def with_stderr(*argv) -> tuple[int, str, str]:
    """A labkit command in this process: its exit status, stdout and stderr (a traceback out of it is exit 99)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = labkit([str(a) for a in argv])
    except Exception:  # noqa: BLE001 - a traceback is what this counts
        traceback.print_exc()
        return 99, "", ""
    return code, out.getvalue(), err.getvalue()


def check_runs(root: Path, plans: dict, findings: Counter, wrong: list, outcomes: Counter,
               truths: dict | None = None) -> None:
    """Compare every run's record with what happened (`truths`, by run id, where run.sh could not write it), after
    `labkit runs` settled what no poller follows."""
    if quietly("runs", "--runs-dir", str(root))[0] != 0:
        findings["tracebacks"] += 1
    index = {row["run_id"]: row for row in RunIndex(root).rows()}
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue
        record = RunRecord(path)
        if not (path / "spec.yaml").exists() or not record.events():
            findings["half-made runs seen"] += 1
            wrong.append(f"{path.name}: half made ({sorted(p.name for p in path.iterdir())})")
            continue
        expected, how = (truths or {}).get(record.run_id) or truth(record), plans.get(record.run_id, "kill-labkit")
        status = path / "status.json"  # a copy of the last event that a reader can do without (labkit.jobs.record)
        seen = {"events": record.last_status().get("state"), "index": index.get(record.run_id, {}).get("state"),
                **({"status.json": json.loads(status.read_text())["state"]} if status.exists() else {})}
        outcomes[(how, expected)] += 1
        if any(state in UNFINISHED for state in seen.values()):
            findings["stuck"] += 1
            wrong.append(f"{record.run_id} ({how}): run.sh says {expected}, recorded {seen} (stuck)")
        elif any(state != expected for state in seen.values()):
            findings["wrong final states"] += 1
            wrong.append(f"{record.run_id} ({how}): run.sh says {expected}, recorded {seen}")
        if record.job_info and seen["events"] in State.__members__ and State(seen["events"]).finished \
                and record.metrics() is None:
            findings["ended without metrics.json"] += 1
            wrong.append(f"{record.run_id} ({how}): ended {seen['events']} without metrics.json")
        if any(p.name.endswith(".tmp") for p in path.rglob("*")):
            findings["state.tmp or .tmp left"] += 1
            wrong.append(f"{record.run_id} ({how}): left {[p.name for p in path.rglob('*.tmp')]}")


@contextlib.contextmanager
def tmpfs(size_kb: int):
    """A small tmpfs mounted for the block (root only)."""
    where = Path(tempfile.mkdtemp(prefix="bench-run-records-fs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def can_mount() -> bool:
    try:
        with tmpfs(64):
            return True
    except (subprocess.CalledProcessError, OSError):
        return False


def full_disk_runs(n: int, rng: random.Random, findings: Counter, wrong: list, outcomes: Counter) -> None:
    """Each run submitted to its own runs directory with 0 to 96 KB free; the space is freed once its runner has
    ended, and the run is then polled and listed."""
    for i in range(n):
        free_kb = rng.choice([0, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 96])
        with tmpfs(512) as fs:
            root = fs / "runs"
            root.mkdir()
            RunIndex(root)._execute("SELECT 1")  # the index exists, as after the first run
            avail = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
            (fs / "filler").write_bytes(b"x" * max(0, avail - free_kb * 1024))
            backend = LocalBackend(runs_dir=root, torchrun=FAKE_TORCHRUN)
            with contextlib.suppress(RecordError):
                backend.submit(spec(f"full{i}", rng.uniform(0.0, 0.1)))
            codes = {job_id: child.wait() for job_id, child in backend._children.items()}
            (fs / "filler").unlink()
            truths = {}
            for path in RunIndex(root).run_dirs():
                job_ids = RunRecord(path).job_info.get("job_ids") or [None]
                if codes.get(job_ids[0]) is not None:  # what happened: the runner's exit status
                    truths[path.name] = EXIT_STATES.get(codes[job_ids[0]], "FAILED")
                with contextlib.suppress(RuntimeError, RecordError):
                    job_of(RunRecord(path), LocalBackend(runs_dir=root)).status()
            check_runs(root, {p.name: f"full-{free_kb}KB" for p in RunIndex(root).run_dirs()}, findings, wrong,
                       outcomes, truths)


def read_only_runs(root: Path, findings: Counter, wrong: list) -> int:
    """`labkit runs` and `labkit status` on a read-only copy of some finished runs, with and without its index."""
    runs = [p for p in RunIndex(root).run_dirs() if (p / "job.json").exists()][:20]
    with tmpfs(65536) as fs:
        copy = fs / "runs"
        copy.mkdir()
        for path in runs:
            shutil.copytree(path, copy / path.name)
        quietly("runs", "--rebuild", "--runs-dir", str(copy))  # the copy's own index
        checks = 0
        for with_index in (True, False):
            if not with_index:
                (copy / "index.sqlite").unlink()
            subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
            for argv in (["runs", "--json"], ["status", "--json"]):
                code, out = quietly(*argv, "--runs-dir", str(copy))
                listed = json.loads(out) if code == 0 else None
                if code != 0 or (argv[0] == "runs" and len(listed) != len(runs)):
                    findings["read-only: failed"] += 1
                    wrong.append(f"read-only ({'with' if with_index else 'without'} index): labkit {argv[0]} exit "
                                 f"{code}")
                checks += 1
            subprocess.run(["mount", "-o", "remount,rw", str(fs)], check=True)
    return checks


def damaged_index(root: Path, findings: Counter, wrong: list) -> None:
    before = {row["run_id"]: row["state"] for row in RunIndex(root).rows()}
    (root / "index.sqlite").write_text("junk\n")
    code, _ = quietly("runs", "--runs-dir", str(root))
    after = {row["run_id"]: row["state"] for row in RunIndex(root).rows()} if code == 0 else {}
    if after != before:
        findings["damaged index: not rebuilt"] += 1
        wrong.append(f"damaged index: labkit runs exit {code}, {len(after)} of {len(before)} runs back")


LAUNCH = f"""
import functools, sys
from labkit import jobs
from labkit.jobs.local import LocalBackend
jobs.BACKENDS["local"] = functools.partial(LocalBackend, torchrun={FAKE_TORCHRUN!r})
from labkit.cli import main
print("ready", flush=True)
sys.exit(main())
"""


def interrupted_runs(n: int, root: Path, rng: random.Random, plans: dict, findings: Counter, wrong: list) -> Counter:
    """`labkit run SPEC --wait` in processes of their own, each sent a Ctrl-C at a random moment (see the top)."""
    seen = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            spec_file = Path(tmp) / f"interrupt{i}.yaml"
            spec_file.write_text(json.dumps(spec_text(f"interrupt{i}", rng.uniform(0.3, 1.0))))
            before = set(RunIndex(root).run_dirs())
            process = subprocess.Popen([sys.executable, "-c", LAUNCH, "run", str(spec_file), "--backend", "local",
                                        "--runs-dir", str(root), "--wait"], cwd=tmp, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True)
            process.stdout.readline()  # "ready": labkit is imported, its command starts
            time.sleep(rng.uniform(0.0, 3.0))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
            out, err = process.communicate(timeout=120)
            runs = sorted(set(RunIndex(root).run_dirs()) - before)
            how = "interrupt"
            lines = err.splitlines()
            if "Traceback" in err:
                findings["tracebacks"] += 1
                wrong.append(f"interrupt {i}: {err[-300:]!r}")
            elif process.returncode == 0:
                seen["ended first"] += 1
            elif process.returncode != 130 or len(lines) != 1:
                findings["unclean interrupts"] += 1
                wrong.append(f"interrupt {i}: exit {process.returncode}, stderr {err[-300:]!r}")
            elif "keeps running" in lines[0]:
                seen["job runs on"] += 1
                command = lines[0].rsplit("to stop it: ", 1)[-1]
                (run,) = runs
                if command != shlex.join(["labkit", "cancel", run.name, "--runs-dir", str(root)]) \
                        or f"run {run.name} (" not in lines[0]:
                    findings["unclean interrupts"] += 1
                    wrong.append(f"interrupt {i}: {lines[0]!r} does not name {run.name} and its cancel command")
                elif rng.random() < 0.5:
                    how = "interrupt+cancel"
                    code, _, said = with_stderr(*shlex.split(command)[1:])
                    if code != 0 and "already ended" not in said:
                        findings["unclean interrupts"] += 1
                        wrong.append(f"interrupt {i}: `{command}` exit {code}: {said[-300:]!r}")
            else:  # interrupted before or while it submitted, or as the run ended
                seen["while submitting" if "submitting" in lines[0] else
                     "had ended" if "had ended" in lines[0] else "before submitting"] += 1
            for run in runs:
                plans[run.name] = how
    return seen


EXIT_STATES = {0: "COMPLETED", 143: "CANCELLED", 124: "TIMEOUT"}
"""run.sh's exit status -> the end its finish() records (any other status: FAILED)."""
WRITE_ERRORS = ("Read-only file system", "No space left on device", "Permission denied")


def _fill(fs: Path) -> Path:
    """A file that takes every free block of the file system `fs`."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"x" * size)
    finally:
        os.close(fd)
    return filler


@contextlib.contextmanager
def faulty(kind: str, fs: Path, root: Path):
    """For the block, the runs directory `root` (on the tmpfs `fs`) read-only or its disk full."""
    if kind.startswith("read-only"):
        # A read-only bind mount over it: new writes fail with EROFS, files open for writing stay so.
        subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(root)], check=True)
            yield
        finally:
            subprocess.run(["umount", "-l", str(root)], check=True)
    else:
        filler = _fill(fs)
        try:
            yield
        finally:
            filler.unlink()


def _wait_for_line(job, text: str, process, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if any(text in path.read_text(errors="replace") for path in job.log_dir.glob("*.out")):
            return
        time.sleep(0.005)


def read_during_fault(command: str, run_id: str, root: Path) -> str:
    """How `labkit status RUN`, `labkit runs` or `labkit cancel RUN` says the run ended (cancel: exit 1 and "already
    ended STATE"), or what went wrong."""
    argv = {"status": ["status", run_id, "--json"], "runs": ["runs", "--json"], "cancel": ["cancel", run_id]}[command]
    code, out, err = with_stderr(*argv, "--runs-dir", root)
    if command == "cancel":
        ended = err.split("already ended ", 1)[-1].split()[:1] if code == 1 and "already ended " in err else []
        return ended[0] if ended else f"exit {code}: {err[-200:]!r}"
    if code != 0:
        return f"exit {code}: {err[-200:]!r}"
    if command == "status":
        return json.loads(out)["state"]
    return {row["run_id"]: row["state"] for row in json.loads(out)}.get(run_id, "not listed")


def mid_run_faults(n: int, rng: random.Random, findings: Counter, wrong: list, outcomes: Counter) -> Counter:
    """Runs whose runs directory turns read-only or whose disk fills up mid-run or at the end (see the top); how many
    reads were made while a fault lasted, and of how many runs run.sh could not write the end."""
    seen = Counter()
    for kind in ("read-only mid-run", "read-only at the end", "full mid-run", "full at the end"):
        for i in range(n):
            with tmpfs(4096) as fs:
                root = fs / "runs"
                root.mkdir()
                backend = LocalBackend(runs_dir=root, torchrun=FAKE_TORCHRUN)
                job = backend.submit(spec(f"fault{i}", rng.uniform(0.2, 0.5), FAKE_LINGER_S="0.3"))
                process = backend._children[job.job_id]
                _wait_for_line(job, "iteration        5/" if "mid-run" in kind else "iteration       10/", process)
                events = (job.record.path / "events.jsonl").read_bytes()
                with faulty(kind, fs, root):
                    code = process.wait(timeout=120)
                    expected = EXIT_STATES.get(code, "FAILED")
                    run_id = job.record.run_id
                    for command in ("status", "runs", "cancel"):
                        said = read_during_fault(command, run_id, root)
                        seen["reads"] += 1
                        if said != expected:
                            findings["reads during a fault: wrong or failed"] += 1
                            wrong.append(f"{run_id} ({kind}): labkit {command} said {said!r}, runner ended {expected}")
                if with_stderr("status", run_id, "--runs-dir", root)[0] not in (0, 1):
                    findings["tracebacks"] += 1
                check_runs(root, {run_id: kind}, findings, wrong, outcomes, truths={run_id: expected})
                record = RunRecord(job.record.path)
                if not (job.record.path / "events.jsonl").read_bytes().startswith(events):
                    findings["records lost or overwritten"] += 1
                    wrong.append(f"{run_id} ({kind}): events.jsonl lost what it held before the fault")
                state_file = job.log_dir / "state"
                words = state_file.read_text().split() if state_file.exists() else []
                written = words[0] if words and words[0] != "RUNNING" else None  # the end run.sh wrote, if it could
                seen["ends unwritten"] += written is None
                if written != expected and not any(e in (record.last_status().get("cause") or "")
                                                   for e in WRITE_ERRORS):
                    findings["ends recorded without their write error"] += 1
                    wrong.append(f"{run_id} ({kind}): run.sh wrote {written}, recorded "
                                 f"{record.last_status()} without the write error")
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--at-once", type=int, default=50)
    ap.add_argument("--pollers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs-dir", help="default: a new temporary directory")
    ap.add_argument("--faults", type=int, default=24, help="runs submitted to a full disk (with root)")
    ap.add_argument("--mid-run-faults", type=int, default=6,
                    help="runs of each kind whose runs directory turns read-only or full mid-run or at the end")
    ap.add_argument("--interrupts", type=int, default=20, help="`labkit run --wait` commands sent a Ctrl-C")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(args.runs_dir or tempfile.mkdtemp(prefix="bench-run-records-"))
    root.mkdir(parents=True, exist_ok=True)
    backend = LocalBackend(runs_dir=root, torchrun=FAKE_TORCHRUN)
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    tracebacks, failed_while_running = context.Value("i", 0), context.Value("i", 0)
    pollers = [context.Process(target=poller, args=(str(root), stop, tracebacks), daemon=True)
               for _ in range(args.pollers)]
    for p in pollers:
        p.start()
    start = time.monotonic()
    plans: dict[str, str] = {}
    live = []
    killed_submitters = []
    for i in range(args.runs):
        while len(live) >= args.at_once:
            live = [job for job in live if job.backend._children[job.job_id].poll() is None]
            time.sleep(0.01)
        how = rng.choices(["none", "kill-runner", "cancel", "kill-node", "kill-labkit"], [68, 9, 8, 8, 7])[0]
        if how == "kill-labkit":  # labkit SIGKILLed at some point of submitting: before, while or after the record
            submitter = context.Process(target=submit_then_die, args=(str(root), f"run{i}", rng.uniform(0.0, 0.4)))
            submitter.start()
            time.sleep(rng.uniform(0.0, 2.0))  # a submission takes about a second on a busy machine
            os.kill(submitter.pid, signal.SIGKILL)
            killed_submitters.append(submitter)
            continue
        # (an interfered run lasts long enough for the interference to land on a busy machine)
        job = backend.submit(spec(f"run{i}", rng.uniform(0.0, 0.4) if how == "none" else rng.uniform(0.3, 1.5)))
        plans[job.record.run_id] = how
        if how != "none":
            context.Process(target=interfere, args=(job, how, random.Random(rng.random()),
                                                    failed_while_running)).start()
        live.append(job)
    outcomes, wrong, findings = Counter(), [], Counter()
    interrupts = interrupted_runs(args.interrupts, root, rng, plans, findings, wrong)
    for job in live:
        job.backend._children[job.job_id].wait()
    for submitter in killed_submitters:
        submitter.join()
    # A killed labkit's run.sh that got its go-ahead runs on: wait for every run.sh of the runs directory.
    while subprocess.run(["pgrep", "-f", f"{root}/.*/run.sh"], capture_output=True).stdout:
        time.sleep(0.2)
    # Let the pollers see every end (each run's recorded state settles once some process polls it after run.sh).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = RunIndex(root).rows()
        if not any(r["state"] in UNFINISHED - {"CREATED"} for r in rows):  # (`labkit runs` settles CREATED)
            break
        time.sleep(0.2)
    stop.set()
    for p in pollers:
        p.join()
    elapsed = time.monotonic() - start

    check_runs(root, plans, findings, wrong, outcomes)
    findings["tracebacks"] += tracebacks.value
    findings["FAILED while its processes ran"] += failed_while_running.value
    drafts = len(list(root.glob(".*.draft")))
    print(f"{args.runs} local runs, {args.at_once} at once, {args.pollers} pollers, seed {args.seed}: "
          f"{elapsed:.0f} s; records in {root}; {len(killed_submitters)} submissions killed "
          f"({drafts} drafts of them left for the next run to remove); {args.interrupts} `labkit run --wait` sent a "
          f"Ctrl-C ({interrupts['job runs on']} left their job running, {interrupts['before submitting']} were "
          f"interrupted before submitting and {interrupts['while submitting']} while, {interrupts['had ended']} as "
          f"the run ended; {interrupts['ended first']} ended first)")
    faults = ""
    if (args.faults or args.mid_run_faults) and can_mount():
        start = time.monotonic()
        full_disk_runs(args.faults, rng, findings, wrong, outcomes)
        checks = read_only_runs(root, findings, wrong)
        damaged_index(root, findings, wrong)
        seen = mid_run_faults(args.mid_run_faults, rng, findings, wrong, outcomes)
        faults = (f"{args.faults} runs on a full disk, {checks} read-only listings and reports, a damaged index, "
                  f"{4 * args.mid_run_faults} runs whose runs directory turned read-only or full mid-run or at the "
                  f"end ({seen['ends unwritten']} of them with an end run.sh could not write; {seen['reads']} reads "
                  f"while the fault lasted): {time.monotonic() - start:.0f} s")
    elif args.faults or args.mid_run_faults:
        faults = "faults skipped: mounting a small tmpfs needs root"
    print(faults)
    for (how, state), count in sorted(outcomes.items()):
        print(f"  {how:12s} -> {state:10s} {count}")
    for finding in ("wrong final states", "stuck", "FAILED while its processes ran", "half-made runs seen",
                    "state.tmp or .tmp left", "ended without metrics.json", "tracebacks", "unclean interrupts",
                    "read-only: failed", "damaged index: not rebuilt", "reads during a fault: wrong or failed",
                    "ends recorded without their write error", "records lost or overwritten"):
        print(f"{finding}: {findings[finding]}")
    for line in wrong:
        print("  " + line)
    return 1 if wrong or any(findings.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

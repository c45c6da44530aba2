"""A submitted run (as in submitit's Job): its state, logs, cancel, wait and result, whatever backend runs it; and the
Backend protocol the backends implement.

Backends report statuses and the Job applies them (`update`): a change of state goes to the run record with its
cause, and at the end the iteration metrics that labkit.logs.parse reads from the logs. The watcher refreshes every
live job of a backend at once; the diagnosis reads text the Job hands it.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol

import pandas as pd

from labkit.jobs.diagnose import LogText, explain, explain_attempt
from labkit.jobs.state import State, Status
from labkit.jobs.watcher import WATCHER, Backoff
from labkit.logs.parse import ParsedLog, checkpoint_events, jsonable, parse_log, parse_text, records

if TYPE_CHECKING:
    from labkit.jobs.record import RunRecord
    from labkit.spec import RunSpec

# The iteration columns a run's metrics.json and report keep, of those labkit.logs.parse reads.
ITERATION_FIELDS = ["iteration", "train_iters", "elapsed_ms", "lm_loss", "node", "attempt"]


class Backend(Protocol):
    """What runs jobs (LocalBackend on this host, SlurmBackend on a cluster). A backend reports statuses; it never
    sets a Job's state itself."""
    name: str
    backoff: Backoff
    """How often the watcher asks it about live jobs (labkit.jobs.watcher)."""

    def submit(self, spec, after=None) -> Job:
        """Render, record and start one run; with `after`, only once those jobs have COMPLETED."""

    def poll(self, jobs: list[Job]) -> dict[Job, Status]:
        """The status of each of `jobs`, with one scheduler query for all of them; a job left out keeps its own."""

    def cancel(self, job: Job) -> bool:
        """Stop the job; a later poll sees how it ended. True when it stopped something (False: already ended)."""


def tail_file(path: Path, lines: int = 10, max_bytes: int = 256_000) -> list[str]:
    """The last `lines` lines of a file, reading at most its last `max_bytes`; [] when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.replace("\r", "\n").splitlines()[-lines:] if lines else []


def _read(path: Path, max_bytes: int = 4_000_000) -> str:
    return "\n".join(tail_file(path, lines=10**9, max_bytes=max_bytes))


def run_metrics(iterations: pd.DataFrame) -> dict:
    """metrics.json: the iteration table, the last loss and the mean iteration time after each attempt's first
    (warm-up) logged iteration."""
    rows = records(iterations[ITERATION_FIELDS])
    warm = iterations.groupby("attempt").cumcount() > 0
    elapsed = iterations["elapsed_ms"][warm] if warm.any() else iterations["elapsed_ms"]
    return {"iterations": rows, "final_lm_loss": rows[-1]["lm_loss"] if rows else None,
            "mean_iteration_ms": jsonable(float(elapsed.mean())) if rows else None}


class Job:
    """One submitted run. `job_id` is the scheduler's id (several ids for a master/slave pair)."""

    def __init__(self, backend: Backend, job_ids: list[str], record: RunRecord, status: Status | None = None):
        self.backend = backend
        self.job_ids = list(job_ids)
        self.record = record
        self._status = status or Status(State.PENDING)
        self.unrecorded: Status | None = None
        """The latest status its backend reported that the run record could not hold (a full disk, a read-only runs
        directory); the next poll records it. None once recorded."""
        WATCHER.watch(self)

    @property
    def job_id(self) -> str:
        return self.job_ids[0]

    @cached_property
    def spec(self) -> RunSpec:
        return self.record.spec

    @property
    def log_dir(self) -> Path:
        """The latest attempt's log directory (LOGDIR/JOBID, or LOGDIR/JOBID/attempt-N once Slurm requeued the job
        N times and it started again): one NODE.out, NODE.err and NODE.gpu per node."""
        return list(self.attempt_log_dirs().values())[-1]

    def attempt_log_dirs(self) -> dict[int, Path]:
        """{attempt: its log directory} for the first attempt and every later one that has started, in order."""
        first = self.record.logs / self.job_id
        later = sorted((int(p.name.split("-")[1]), p) for p in first.glob("attempt-*")
                       if p.is_dir() and p.name.split("-")[1].isdigit()) if first.is_dir() else []
        return {0: first, **dict(later)}

    def node_logs(self, log_dir: Path | None = None) -> dict[str, dict[str, Path]]:
        """{node: {"out": path, "err": path, "gpu": path}} for the nodes that have written logs so far, in the latest
        attempt's directory (or `log_dir`)."""
        nodes: dict[str, dict[str, Path]] = {}
        log_dir = log_dir or self.log_dir
        if log_dir.is_dir():
            for path in sorted(log_dir.iterdir()):
                if path.is_file() and path.suffix in (".out", ".err", ".gpu"):
                    nodes.setdefault(path.stem, {})[path.suffix[1:]] = path
        return nodes

    def batch_logs(self) -> list[Path]:
        """The scheduler-level output (srun and slurmstepd messages such as time-limit and cancel notices)."""
        return sorted(p for p in self.record.logs.glob("slurm-*.out")
                      if any(p.name.startswith(f"slurm-{i}") for i in self.job_ids))

    def _outs(self, log_dir: Path | None = None) -> list[Path]:
        return [files["out"] for files in self.node_logs(log_dir).values() if "out" in files]

    # --- state ---------------------------------------------------------------------------------------------------
    def status(self, refresh: bool = True) -> Status:
        """The job's status; with `refresh`, asked of its backend (with every other live job of that backend) when
        the watcher's pace says it is time, so that a loop over `job.state` does not flood the scheduler."""
        if refresh and not self._status.state.finished:
            WATCHER.refresh([self])
        elif refresh:
            # An end recorded while its metrics or its copies could not be (a full disk): the next look writes them.
            if not self.record.has_metrics():
                self.record.save_metrics(run_metrics(self.iterations()))
            self.record.settle_copies()
        return self._status

    @property
    def state(self) -> State:
        return self.status().state

    def done(self) -> bool:
        return self.state.finished

    def update(self, status: Status) -> None:
        """Take the status its backend reports. A change of state is recorded, with the cause when the job did not
        complete; at the end, so are the iteration metrics of its logs."""
        self._record_attempts(status)
        previous, self._status = self._status, status
        if status.state == previous.state:
            return
        try:
            self.record.set_status(status.state, exit_code=status.exit_code, reason=status.reason,
                                   cause=self.cause())
        except BaseException:
            self._status, self.unrecorded = previous, status  # not recorded (a full disk): the next poll records it
            raise
        self.unrecorded = None
        if status.state.finished:
            self.record.save_metrics(run_metrics(self.iterations()))

    def _record_attempts(self, status: Status) -> None:
        """Record each attempt the scheduler reports ended that the run record does not hold yet, with its cause,
        once that attempt has stopped (the job waits again, the next attempt has started, or the job ended)."""
        if not status.ended_attempts:  # most polls: no requeue, so no need to read events.jsonl
            return
        recorded = {a.get("attempt") for a in self.record.attempts()}
        dirs = self.attempt_log_dirs()
        for attempt in status.ended_attempts:
            # While Slurm still stops an attempt (COMPLETING, reported as RUNNING) its logs are not final yet.
            settled = status.state != State.RUNNING or attempt.number + 1 in dirs
            if attempt.number in recorded or not settled:
                continue
            log_dir = dirs.get(attempt.number, self.record.logs / self.job_id / f"attempt-{attempt.number}")
            texts = list(self._log_texts(log_dir, batch=False))
            checkpoints = checkpoint_events("\n".join(log.text for log in texts))
            self.record.add_attempt(attempt.number, attempt.outcome, attempt.exit_code, attempt.reason,
                                    explain_attempt(attempt, texts), str(log_dir.relative_to(self.record.path)),
                                    saved_iteration=checkpoints["saved"], stopped_on=checkpoints["stopped_on"])

    # --- actions -------------------------------------------------------------------------------------------------
    def cancel(self) -> bool:
        """Stop the job, and record how it ended; True when it was stopped (False: nothing of it was running)."""
        stopped = self.backend.cancel(self)
        if stopped:
            WATCHER.refresh([self], force=True)
        return stopped

    def wait(self, progress: bool = True, timeout: float | None = None, poll_s: float | None = None) -> State:
        """Block until the job ends (or `timeout` seconds pass); with progress, a bar over training iterations read
        from the logs every second. The scheduler is asked as the watcher paces it (`poll_s`: every that many seconds
        instead)."""
        if not progress:
            return WATCHER.wait([self], timeout, poll_s)[self]
        from tqdm.auto import tqdm

        bar = tqdm(total=self.spec.train.iters, desc=f"{self.record.run_id} {self.job_id}", unit="it")

        def show() -> None:
            state, done_iters = self.status(refresh=False).state, self.last_iteration()
            if done_iters > bar.n or bar.postfix != str(state):
                bar.set_postfix_str(str(state), refresh=False)
                bar.update(max(0, done_iters - bar.n))
                bar.refresh()

        try:
            return WATCHER.wait([self], timeout, poll_s, tick=show)[self]
        except KeyboardInterrupt:
            bar.leave = False  # interrupted (Ctrl-C): the bar goes, so that the caller's one line is all that shows
            raise
        finally:
            bar.close()

    # --- logs ----------------------------------------------------------------------------------------------------
    def tail(self, lines: int = 10) -> dict[str, dict[str, list[str]]]:
        """The last `lines` lines of every node's out, err and gpu log: {node: {"out": [...], ...}}."""
        return {node: {kind: tail_file(path, lines) for kind, path in files.items()}
                for node, files in self.node_logs().items()}

    def log_texts(self) -> Iterator[LogText]:
        """The latest attempt's err and out log of every node, then the scheduler's output: what a cause is looked
        for in."""
        return self._log_texts(self.log_dir)

    def _log_texts(self, log_dir: Path, batch: bool = True) -> Iterator[LogText]:
        for node, files in self.node_logs(log_dir).items():
            for kind in ("err", "out"):
                if kind in files:
                    yield LogText(f"{node}.{kind}", _read(files[kind]))
        for path in (self.batch_logs() + [self.record.logs / "runner.out"]) if batch else []:
            if path.exists():
                yield LogText(path.name, _read(path))

    def cause(self, status: Status | None = None) -> str | None:
        """Why the job waits (pending, with squeue's reason) or did not complete; None while it runs or after
        success, unless its end was read from other evidence than its own record of it (Status.note), which is said
        too. `status`: of that status instead of the job's own."""
        status = status or self._status
        why = explain(status, self.spec, self.log_texts())
        return f"{why}; {status.note}" if why and status.note else why or status.note

    def result(self) -> ParsedLog:
        """The latest attempt's parsed training log: labkit.logs.parse_log over its node logs, each row naming its
        node."""
        return parse_log(self._outs(), per_node=True)

    def iterations(self) -> pd.DataFrame:
        """One row per logged iteration (ITERATION_FIELDS) across attempts: a requeued job's next attempt resumes
        from a checkpoint, and its rows replace the earlier attempt's from the iteration it resumed at. Empty before
        the first."""
        tables = []
        for number, log_dir in self.attempt_log_dirs().items():
            outs = self._outs(log_dir)
            if outs:
                table = parse_log(outs, per_node=True).iterations.assign(attempt=number)
                if tables and len(table):
                    tables[-1] = tables[-1][tables[-1]["iteration"] < table["iteration"].min()]
                tables.append(table)
        if not tables:
            return pd.DataFrame(columns=ITERATION_FIELDS)
        return pd.concat(tables, ignore_index=True)[ITERATION_FIELDS]

    def last_iteration(self) -> int:
        """The highest iteration in the last lines of the node logs (0 before the first)."""
        text = "".join(line + "\n" for path in self._outs() for line in tail_file(path, 50))
        found = parse_text(text).iterations["iteration"]
        return int(found.max()) if len(found) else 0

    def __repr__(self) -> str:
        return f"Job({self.backend.name}:{','.join(self.job_ids)}, run={self.record.run_id}, {self._status.state})"

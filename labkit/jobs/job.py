"""A submitted run: its state, logs, cancel, wait and result, whatever backend runs it (as in submitit's Job)."""
from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.jobs.runs import RunRecord


class State(str, enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    NODE_FAIL = "NODE_FAIL"
    UNKNOWN = "UNKNOWN"  # the scheduler no longer knows the job and left no record of its end

    @property
    def finished(self) -> bool:
        return self not in (State.PENDING, State.RUNNING, State.UNKNOWN)

    def __str__(self) -> str:
        return self.value


# Slurm's job states (squeue %T, sacct State, scontrol JobState) -> ours.
_SLURM_STATES = {
    "PENDING": State.PENDING, "REQUEUED": State.PENDING, "REQUEUE_HOLD": State.PENDING, "REQUEUE_FED": State.PENDING,
    "RESV_DEL_HOLD": State.PENDING, "CONFIGURING": State.RUNNING, "RUNNING": State.RUNNING,
    "COMPLETING": State.RUNNING, "SUSPENDED": State.RUNNING, "STAGE_OUT": State.RUNNING, "SIGNALING": State.RUNNING,
    "RESIZING": State.RUNNING, "STOPPED": State.RUNNING, "COMPLETED": State.COMPLETED, "FAILED": State.FAILED,
    "BOOT_FAIL": State.NODE_FAIL, "NODE_FAIL": State.NODE_FAIL, "CANCELLED": State.CANCELLED,
    "REVOKED": State.CANCELLED, "DEADLINE": State.TIMEOUT, "TIMEOUT": State.TIMEOUT,
    "OUT_OF_MEMORY": State.OUT_OF_MEMORY, "PREEMPTED": State.FAILED, "SPECIAL_EXIT": State.FAILED,
}


def slurm_state(text: str) -> State:
    """'CANCELLED by 0', 'CANCELLED+', 'OUT_OF_ME+' (sacct truncation) -> State."""
    word = re.split(r"[\s+]", text.strip(), maxsplit=1)[0].upper()
    if word in _SLURM_STATES:
        return _SLURM_STATES[word]
    matches = [s for name, s in _SLURM_STATES.items() if name.startswith(word)] if word else []
    return matches[0] if matches else State.UNKNOWN


@dataclass
class Status:
    state: State
    exit_code: str | None = None  # Slurm's "CODE:SIGNAL"
    reason: str | None = None  # the scheduler's reason (pending reason, "DependencyNeverSatisfied", ...)


class Job:
    """One submitted run. `job_id` is the scheduler's id (several ids for a master/slave pair)."""

    def __init__(self, backend, job_ids: list[str], record: "RunRecord"):
        self.backend = backend
        self.job_ids = list(job_ids)
        self.record = record
        self._status = Status(State.PENDING)

    @property
    def job_id(self) -> str:
        return self.job_ids[0]

    @property
    def spec(self):
        return self.record.spec

    @property
    def log_dir(self) -> Path:
        """LOGDIR/JOBID: one NODE.out, NODE.err and NODE.gpu per node."""
        return self.record.logs / self.job_id

    def node_logs(self) -> dict[str, dict[str, Path]]:
        """{node: {"out": path, "err": path, "gpu": path}} for the nodes that have written logs so far."""
        nodes: dict[str, dict[str, Path]] = {}
        if self.log_dir.is_dir():
            for path in sorted(self.log_dir.iterdir()):
                if path.suffix in (".out", ".err", ".gpu"):
                    nodes.setdefault(path.stem, {})[path.suffix[1:]] = path
        return nodes

    def batch_logs(self) -> list[Path]:
        """The scheduler-level output (srun and slurmstepd messages such as time-limit and cancel notices)."""
        return sorted(p for p in self.record.logs.glob("slurm-*.out")
                      if any(p.name.startswith(f"slurm-{i}") for i in self.job_ids))

    # --- state ---------------------------------------------------------------------------------------------------
    def status(self, refresh: bool = True) -> Status:
        if refresh and not self._status.state.finished:
            self.backend.poll([self])
        return self._status

    @property
    def state(self) -> State:
        return self.status().state

    def done(self) -> bool:
        return self.state.finished

    def _set_status(self, status: Status) -> None:
        changed = status.state != self._status.state
        self._status = status
        if changed:
            self.record.set_status(status.state, exit_code=status.exit_code, reason=status.reason,
                                   cause=self.cause() if status.state.finished and status.state != State.COMPLETED
                                   else None)
            if status.state.finished:
                self.record.save_metrics(self)

    # --- actions -------------------------------------------------------------------------------------------------
    def cancel(self) -> None:
        self.backend.cancel(self)

    def wait(self, progress: bool = True, timeout: float | None = None, poll_s: float = 1.0) -> State:
        """Block until the job ends (or `timeout` seconds pass); with progress, a bar over training iterations."""
        from labkit.jobs import monitor

        deadline = None if timeout is None else time.monotonic() + timeout
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.spec.train.iters, desc=f"{self.record.run_id} {self.job_id}", unit="it")
        try:
            while True:
                state = self.state
                if bar is not None:
                    done_iters = monitor.last_iteration(self)
                    if done_iters > bar.n or bar.postfix != str(state):
                        bar.set_postfix_str(str(state), refresh=False)
                        bar.update(max(0, done_iters - bar.n))
                        bar.refresh()
                if state.finished:
                    return state
                if deadline is not None and time.monotonic() > deadline:
                    return state
                time.sleep(poll_s)
        finally:
            if bar is not None:
                bar.close()

    def tail(self, lines: int = 10) -> dict[str, dict[str, list[str]]]:
        """The last `lines` lines of every node's out, err and gpu log: {node: {"out": [...], ...}}."""
        from labkit.jobs.monitor import tail_file
        return {node: {kind: tail_file(path, lines) for kind, path in files.items()}
                for node, files in self.node_logs().items()}

    def cause(self) -> str | None:
        """Why the job did not complete (None while running or after success)."""
        from labkit.jobs.monitor import explain
        return explain(self)

    def report(self):
        from labkit.jobs.monitor import report
        return report(self)

    def result(self):
        """The parsed training log: labkit.logs.parse_log over the node logs when available, else the iteration table."""
        from labkit.jobs.monitor import parse_iterations
        outs = [files["out"] for files in self.node_logs().values() if "out" in files]
        try:
            from labkit.logs import parse_log
        except ImportError:
            return parse_iterations(outs)
        return parse_log(outs)

    def __repr__(self) -> str:
        return f"Job({self.backend.name}:{','.join(self.job_ids)}, run={self.record.run_id}, {self._status.state})"

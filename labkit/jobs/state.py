"""A job's state as labkit reports it, whatever runs the job: the states, Slurm's words for them, and a status."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field


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
    """What a backend knows of a job at one moment."""
    state: State
    """Where the job is in its life."""
    exit_code: str | None = None
    """Slurm's "CODE:SIGNAL" (the local backend writes the same form); None until the job ends."""
    reason: str | None = None
    """The scheduler's reason: why it is pending, or why it ended ("DependencyNeverSatisfied", ...)."""
    restarts: int = 0
    """How many times the scheduler has requeued the job (Slurm's RestartCnt): the current attempt's number."""
    ended_attempts: list[Attempt] = field(default_factory=list)
    """How the earlier attempts ended, oldest first, as far as the scheduler has recorded them."""
    note: str | None = None
    """What the recorded cause must say even when the job completed: its end was read from other evidence (the
    runner's exit status and the node logs) because the end could not be written where it is kept, and why."""


@dataclass
class Attempt:
    """One earlier run of a job that Slurm requeued."""
    number: int
    """0 for the first run, 1 for the first requeue's, ..."""
    outcome: str
    """Slurm's word for how it ended: REQUEUED (scontrol requeue, or the job's own requeue before its time limit),
    NODE_FAIL (a node went down and Slurm requeued the job), PREEMPTED, ..."""
    exit_code: str | None = None
    """Slurm's "CODE:SIGNAL" for that attempt, when recorded."""
    reason: str | None = None
    """The scheduler's reason, when recorded."""

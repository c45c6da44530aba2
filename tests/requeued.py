"""Starting a requeued Slurm job's next attempt at once in the tests, as an administrator would with
`scontrol update StartTime=now`: Slurm holds a requeued job back a while (Reason BeginTime)."""
from __future__ import annotations

import subprocess
import time

from labkit.jobs import State

HOLD_S = 2.0
"""How long the job stays held first: slurmd refuses to launch a job whose credential it revoked at the requeue in the
same second ("Killing non-startable batch JobId=...: Job credential revoked", and the job ends FAILED 1:0)."""


class NextAttempt:
    """Called in a wait loop: True once the job's next attempt has started; releases the job once it has been held,
    pending after its requeue, for HOLD_S."""

    def __init__(self, job):
        self.job = job
        self.held_since: float | None = None

    def __call__(self) -> bool:
        if 1 in self.job.attempt_log_dirs():
            return True
        status = self.job.status()
        if status.restarts and status.state == State.PENDING:
            now = time.monotonic()
            self.held_since = self.held_since if self.held_since is not None else now
            if now - self.held_since >= HOLD_S:
                subprocess.run(["scontrol", "update", f"jobid={self.job.job_id}", "StartTime=now"],
                               capture_output=True)
        return False

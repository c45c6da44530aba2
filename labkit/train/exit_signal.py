"""--exit-signal-handler: stop at the end of an iteration when a signal arrives, after saving a checkpoint.

Slurm ends a job that is requeued (`scontrol requeue`, a job's own requeue ahead of its time limit, a preemption) or
that reaches its limit with SIGTERM to every process of every step, and SIGKILL KillWait seconds later; torchrun
passes the SIGTERM on to its workers. The handler only notes the signal: the training loop asks every rank, once per
iteration, whether any of them received it (one all-reduce of a single number), so that all ranks save the same
iteration and stop together. As Megatron-LM's `--exit-signal-handler` and `--exit-signal`, which default to SIGTERM.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGUSR1": signal.SIGUSR1, "SIGUSR2": signal.SIGUSR2}


class ExitSignal:
    """Notes `name` (one of SIGNALS) from installation until `restore()`."""

    def __init__(self, name: str = "SIGTERM"):
        self.name = name
        self.received = False
        self._previous = signal.signal(SIGNALS[name], self._note)

    def _note(self, signum, frame) -> None:
        self.received = True

    def anywhere(self, device: torch.device) -> bool:
        """Whether any rank has received the signal (a collective: every rank calls it at the same point)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(SIGNALS[self.name], self._previous)

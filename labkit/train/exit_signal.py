"""--exit-signal-handler: stop at the end of an iteration when a signal arrives, after saving a checkpoint.

The handler only notes the signal: the training loop asks every rank, once per iteration, whether any of them received
it (one all-reduce of a single number), so that all ranks save the same iteration and stop together. As Megatron-LM's
`--exit-signal-handler` and `--exit-signal`, which default to SIGTERM; like Megatron-LM (global_vars.py
set_global_variables) the driver installs the handler before it builds the model, so a signal that comes during the
set-up is kept.

Which signal: Slurm ends a job that is cancelled, preempted, requeued or past its time limit with SIGTERM to every
process of every step, and SIGKILL KillWait seconds later (30 s by default), too soon for a large model's checkpoint;
torchrun, too, kills its workers 30 s after a SIGTERM. A job with job.requeue therefore runs the driver with
`--exit-signal SIGUSR1`: its script receives Slurm's warning ahead of the time limit (`#SBATCH --signal=B:USR1@N`),
passes it on as USR1 to the processes of its steps (the node's shell and torchrun ignore it), and requeues the job
once they have saved and exited (labkit/templates/node.sh.j2).
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

"""`python -m labkit.train [Megatron-LM flags]` / `labkit-train`: launch with torchrun for more than one process."""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import traceback


@contextlib.contextmanager
def wandb_left_out(leave_out: bool):
    """megatron-core imports wandb as it loads (its timers and inference context, each import guarded), a second of
    CPU on every rank: a run that logs nothing to W&B loads megatron-core without it. Afterwards wandb imports again."""
    blocked = leave_out and "wandb" not in sys.modules
    if blocked:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError
    try:
        yield
    finally:
        if blocked and sys.modules.get("wandb", False) is None:
            del sys.modules["wandb"]


def main(argv: list[str] | None = None) -> int:
    from labkit.extras import MissingExtra, require

    try:
        require("labkit-train", "torch", "megatron")
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 1
    from labkit.train.arguments import parse_args

    args = parse_args(argv)  # exits 2 naming the flag on a bad command line, before torch's seconds of importing
    import torch
    import torch.distributed as dist

    from labkit.train import cpu_compat

    with wandb_left_out(not args.wandb_project):
        if not torch.cuda.is_available():
            cpu_compat.apply()
        from labkit.train.training import OOM_HINT, TrainingError, out_of_memory, run

    try:
        code = run(args)
        # Only after a clean run: a rank that failed alone would wait in the group's teardown for ranks still inside a
        # collective (until the NCCL watchdog); torchrun stops the others when this one exits.
        if dist.is_initialized():
            dist.destroy_process_group()
        return code
    except TrainingError as exc:
        print(f"ERROR: {exc}", flush=True)
        return 1
    except (FileNotFoundError, ValueError) as exc:  # a missing checkpoint file, a split that leaves no data, ...
        traceback.print_exc()
        print(f"ERROR: {exc}", flush=True)
        return 2
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        print(f"ERROR: out of memory while setting up on rank {args.rank}: {str(exc).strip().splitlines()[0]}; "
              f"{OOM_HINT}", flush=True)
        return 1


def entrypoint() -> None:
    """`labkit-train` and `python -m labkit.train`: main(), then out of the process without the interpreter's teardown.

    By then every rank has passed the run's last barrier, its logs are printed and its TensorBoard and W&B writers
    closed. What teardown would still do is destroy torch's and DeepSpeed's C++ objects in no fixed order, process
    groups that DeepSpeed still references among them, and a gloo worker thread left joinable aborts the process
    ("terminate called without an active exception", SIGABRT, after "after training is done"): torchrun then records
    a run that finished as failed (seen on a two-rank DeepSpeed run on CPUs; PyTorch's c10d discussion in
    https://github.com/pytorch/pytorch/pull/179291 describes such a teardown). An exception still leaves the usual way,
    with its traceback."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError, AttributeError):  # and what C and C++ libraries left in stdio's buffers
        ctypes.CDLL(None).fflush(None)
    os._exit(code)


if __name__ == "__main__":
    entrypoint()

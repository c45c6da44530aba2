"""`python -m labkit.train [Megatron-LM flags]` / `labkit-train`: launch with torchrun for more than one process."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from labkit.train import cpu_compat
    from labkit.train.arguments import parse_args

    args = parse_args(argv)  # exits 2 naming the flag on a bad command line
    if not torch.cuda.is_available():
        cpu_compat.apply()
    from labkit.train.training import TrainingError, run

    try:
        return run(args)
    except TrainingError as exc:
        print(f"ERROR: {exc}", flush=True)
        return 1
    except (FileNotFoundError, ValueError) as exc:
        print(f"ERROR: {exc}", flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

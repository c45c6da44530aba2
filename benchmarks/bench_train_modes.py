"""CPU iteration time of the training driver per parallel/precision mode (tiny GPT, mock data, gloo).

    .venv/bin/python benchmarks/bench_train_modes.py [--iters 30]

Each mode is a real `python -m labkit.train` run (two processes through torchrun where parallel, one thread per
process), 4 micro-batches of 2 x 128 tokens per iteration and per data-parallel rank. Printed: the mean of the
driver's own `elapsed time per iteration (ms)` over the intervals after the first (warm-up), the last lm loss, and
the peak resident memory the driver reports. Data parallel 2 processes twice the tokens of the others.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from labkit.net import free_port

MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
         "--micro-batch-size 2 --lr 1e-3 --mock-data --vocab-size 1024 --eval-iters 0 --log-interval 5").split()
MODES = {
    "world1": (1, ["--global-batch-size", "8"]),
    "dp2": (2, ["--global-batch-size", "16"]),
    "tp2": (2, ["--global-batch-size", "8", "--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2"]),
    "recompute": (1, ["--global-batch-size", "8", "--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"]),
    "bf16": (1, ["--global-batch-size", "8", "--bf16"]),
    "fp16": (1, ["--global-batch-size", "8", "--fp16"]),
}


def run(processes: int, flags: list[str], iters: int) -> dict:
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
                 f"--master-port={free_port()}"] if processes > 1 else [sys.executable])
    cmd = [*launcher, "-m", "labkit.train", *MODEL, "--train-iters", str(iters), *flags]
    start = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", out.stdout)]
    losses = re.findall(r"lm loss: ([\d.E+-]+)", out.stdout)
    memory = [float(m) for m in re.findall(r"max allocated: ([\d.]+)", out.stdout)]
    return {"ms": sum(times[1:]) / len(times[1:]), "loss": float(losses[-1]), "rss": max(memory),
            "wall": time.time() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    iters = parser.parse_args().iters
    print(f"tiny GPT (4 layers, hidden 64, seq 128), {iters} iterations, 4 micro-batches of 2 per data-parallel rank; "
          f"os.cpu_count()={os.cpu_count()}")
    print(f"{'mode':10s} {'procs':>5s} {'ms/iteration':>13s} {'last lm loss':>13s} {'peak RSS MB':>12s} "
          f"{'run wall s':>11s}")
    for name, (processes, flags) in MODES.items():
        r = run(processes, flags, iters)
        print(f"{name:10s} {processes:5d} {r['ms']:13.1f} {r['loss']:13.4f} {r['rss']:12.0f} {r['wall']:11.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

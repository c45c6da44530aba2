"""Where a training step's time and memory go, read from real profiler traces of the training driver.

Runs the driver on CPU (gloo) with --profile, one run at a time: data parallel on 2 processes, then one process in
fp32, bf16 and fp32 with full recomputation. Prints the tables the labs show: time by category, computation vs
communication per rank, communication per parallel group, the top operators, memory per step, and the runs compared.

    .venv/bin/python benchmarks/profile_breakdown.py [--size tiny|small] [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from labkit.net import free_port
from labkit.profiling import tensorboard as tb
from labkit.profiling import trace as tr
from labkit.profiling import views

SIZES = {
    "tiny": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
            "--vocab-size 1024 --micro-batch-size 2 --global-batch-size 8",
    "small": "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
             "--vocab-size 8192 --micro-batch-size 4 --global-batch-size 16",
}
COMMON = ("--lr 0.00015 --train-iters 4 --log-interval 1 --seed 1234 --eval-iters 0 --mock-data "
          "--profile --profile-step-start 2 --profile-step-end 4")
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def start(run_dir: Path, processes: int, flags: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}", f"--master-port={port}",
           "-m", "labkit.train", *flags.split(), "--tensorboard-dir", str(run_dir)]
    return subprocess.Popen(cmd, stdout=open(run_dir / "train.log", "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--keep", type=Path, help="write the runs here (default: a temporary directory)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="profile_breakdown-"))
    base = f"{SIZES[args.size]} {COMMON}"
    t0 = time.perf_counter()
    flags = {
        "dp2 fp32": (root / "dp2", 2, f"{base} --profile-ranks 0 1 --log-timers-to-tensorboard"),
        "fp32": (root / "fp32", 1, base),
        "bf16": (root / "bf16", 1, f"{base} --bf16"),
        "fp32 recompute": (root / "recompute", 1, f"{base} {RECOMPUTE}"),
    }
    dirs = {}
    for label, (run_dir, processes, run_flags) in flags.items():  # one at a time, so step times are not shared
        proc = start(run_dir, processes, run_flags)
        if proc.wait():
            sys.exit(f"{label} failed:\n{(run_dir / 'train.log').read_text()[-3000:]}")
        dirs[label] = run_dir
    print(f"model {args.size}: {SIZES[args.size]}\nruns in {root} ({time.perf_counter() - t0:.0f} s), "
          f"torch.profiler over iterations 3-4 on CPU (gloo)\n")
    pd.set_option("display.width", 160, "display.max_colwidth", 60, "display.float_format", "{:.3f}".format)

    dp2 = tr.load_traces(dirs["dp2 fp32"])
    print("== dp2 fp32: time by category per rank (share of profiled CPU time)")
    print(pd.concat({f"rank {t.rank}": tr.breakdown(t).set_index("category") for t in dp2}, axis=1).to_string(), "\n")
    print("== dp2 fp32: computation vs communication per rank (TensorBoard's distributed view)")
    print(tr.compute_communication(dp2).set_index("rank").T.to_string(), "\n")
    print("== dp2 fp32: communication per collective and parallel group")
    print(tr.communication(dp2).to_string(index=False), "\n")
    print("== dp2 fp32, rank 0: top operators by self time")
    print(tr.operators(dp2[0]).head(12).to_string(index=False), "\n")
    print("== dp2 fp32, rank 0: memory per profiled step (MB)")
    print(tr.memory_per_step(dp2[0]).to_string(index=False), "\n")
    print("== one process: fp32 vs bf16 vs recompute")
    single = {label: tr.load_traces(dirs[label])[0] for label in ("fp32", "bf16", "fp32 recompute")}
    print(views.comparison_table(single).set_index("run").T.to_string(), "\n")
    print("open in TensorBoard:", tb.tensorboard_command(root))


if __name__ == "__main__":
    main()

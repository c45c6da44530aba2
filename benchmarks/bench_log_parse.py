"""How fast `labkit logs parse` reads a large multi-rank log (goal: >= 50 MB/s), and its peak memory (goal: a 1 GB
log in <= 1.5 GB).

    .venv/bin/python benchmarks/bench_log_parse.py [--mb 200] [--nodes 4] [--gpus-per-node 8] [--repeat 3]

Writes a synthetic Slurm job log the way `srun -l` interleaves 32 ranks: every rank prints NCCL and warning noise,
the last rank prints the interval line (2025 format, timestamped) and a `(min, max)` timer block, every data-parallel
rank 0 prints its memory line. Then parses it with labkit.logs.parse_log and prints MB/s (best of --repeat runs).
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.logs import parse_log  # noqa: E402

TIMERS = ["forward-backward", "forward-compute", "backward-compute", "batch-generator", "forward-recv",
          "backward-send", "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
          "optimizer-copy-to-main-grad", "optimizer-clip-main-grad", "optimizer-inner-step", "optimizer"]


def synthetic_log(path: Path, megabytes: float, world: int, rng: random.Random) -> int:
    """Write about `megabytes` of log; returns the number of interval lines."""
    last = world - 1
    target = megabytes * 1e6
    written, iteration = 0, 0
    with open(path, "w") as out:
        while written < target:
            iteration += 1
            block = []
            for rank in range(world):
                block.append(f"{rank}: host{rank // 8}:{1000 + rank}:{2000 + rank} [{rank % 8}] NCCL INFO Channel "
                             f"{rank % 4:02d}/0 : {rank} -> {(rank + 1) % world} via P2P/IPC/read")
            if iteration % 5 == 0:
                block.append(f"{rng.randrange(world)}: /usr/lib/python3/site-packages/torch/autograd/graph.py:824: "
                             "UserWarning: c10d::allreduce_: an autograd kernel was not registered")
            block.append(
                f"{last}:  [2025-04-13 23:{iteration // 60 % 60:02d}:{iteration % 60:02d}] iteration {iteration:8d}/"
                f"  100000 | consumed samples: {iteration * 512:12d} | elapsed time per iteration (ms): "
                f"{800 + rng.random() * 50:.1f} | throughput per GPU (TFLOP/s/GPU): {180 + rng.random() * 5:.1f} | "
                f"learning rate: {1e-4 * (1 - iteration / 1e5):.6E} | global batch size:   512 | "
                f"lm loss: {10 / (1 + iteration / 100):.6E} | loss scale: 65536.0 | grad norm: "
                f"{rng.random() * 3:.3f} | number of skipped iterations:   0 | number of nan iterations:   0 |")
            block.append(f"{last}: (min, max) time across ranks (ms):")
            for name in TIMERS:
                lo = rng.random() * 300
                block.append(f"{last}:     {(name + ' ').ljust(48, '.')}: ({lo:.2f}, {lo * 1.05:.2f})")
            if iteration % 10 == 1:
                for rank in range(0, world, 4):
                    block.append(f"{rank}: [Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: "
                                 f"{rng.random() * 3e4:.4f} | max allocated: {rng.random() * 6e4:.4f} | reserved: "
                                 f"62000.0 | max reserved: 62000.0")
            text = "\n".join(block) + "\n"
            out.write(text)
            written += len(text)
    return iteration


def cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (the parser forks one on large logs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="size of the synthetic log in MB")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    world = args.nodes * args.gpus_per_node
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.out"
        iterations = synthetic_log(path, args.mb, world, random.Random(0))
        size_mb = path.stat().st_size / 1e6
        best = best_cpu = float("inf")
        for _ in range(args.repeat):
            start, start_cpu = time.perf_counter(), cpu_seconds()
            parsed = parse_log(path)
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, cpu_seconds() - start_cpu)
    assert len(parsed.iterations) == iterations, (len(parsed.iterations), iterations)
    print(f"log: {size_mb:.1f} MB, {world} ranks, {iterations} iterations, {len(parsed.timers)} timer rows, "
          f"{len(parsed.memory)} memory rows, {len(parsed.events)} events")
    peak_mb = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    print(f"peak resident memory: {peak_mb:,.0f} MB, {peak_mb / size_mb:.2f} x the log (goal for 1 GB: <= 1,500 MB)")
    print(f"parse_log: {best:.2f} s wall (best of {args.repeat}) = {size_mb / best:.1f} MB/s (goal >= 50 MB/s); "
          f"{best_cpu:.2f} s CPU (with its child) = {size_mb / best_cpu:.1f} MB/s per CPU second")
    return 0


if __name__ == "__main__":
    sys.exit(main())

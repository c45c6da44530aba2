"""Static memory per rank: labkit's estimate against the bytes megatron-core's own objects hold (goal: exact).

    .venv/bin/python benchmarks/bench_memory_vs_megatron_core.py [--models gpt llama]

The grid: tensor 1/2, pipeline 1/2, context 1/2, data 1/2/4 (world up to 4 gloo processes on the CPU), bf16 and fp16,
distributed optimizer on and off, --grad-reduce-in-bf16 on and off (bf16 only), and interleaved pipelines (two
one-layer chunks per stage), for a GPT-style and a Llama-style tiny model with odd widths
(tests/test_memory_vs_megatron_core.py: hidden 72, vocabulary 1000). Each point builds labkit's driver model and
megatron-core's DDP and optimizer, takes one optimizer step, and sums what each rank holds (parameter storage, DDP's
grad_data, main parameters with their gradients and Adam's moments).

One row per point and pipeline stage: the estimate for the stage (the data x context rank that updates the most,
as the estimator reports it), what megatron-core holds on that stage's fullest rank, their difference, how many of
the stage's ranks match in all four terms (weights, gradients, optimizer state, and of it the fp32 gradient copies
that the next iteration's zero_grad frees before its forward), and what the bytes-per-parameter
table alone gave before (optimizer sharded over data ranks only, fp32 gradients for bf16, no padding). Points of one
world size share a group of processes: three groups in all, about ten minutes on two busy cores.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_memory_vs_megatron_core import MODELS, Point, measure  # noqa: E402

from labkit.estimate.memory import bytes_per_param  # noqa: E402
from labkit.estimate.params import stage_params  # noqa: E402

MAX_WORLD = 4


def grid(models: list[str]) -> list[Point]:
    """Every layout of up to MAX_WORLD ranks, and the interleaved ones (two one-layer chunks per stage)."""
    layouts = [(t, p, c, d, 1) for t, p, c, d in itertools.product((1, 2), (1, 2), (1, 2), (1, 2, 4))]
    layouts += [(t, 2, 1, d, 2) for t, d in ((1, 1), (1, 2), (2, 1))]
    points = []
    for model, (t, p, c, d, v) in itertools.product(models, layouts):
        if t * p * c * d > MAX_WORLD:
            continue
        for precision, distributed, bf16_grads in itertools.product(("bf16", "fp16"), (False, True), (False, True)):
            if precision == "fp16" and bf16_grads:
                continue
            points.append(Point(model, t, p, c, d, precision, distributed, bf16_grads, v))
    return points


def table_bytes(point: Point, stage: int) -> float:
    """What the estimate said before it followed megatron-core: the stage's parameters times the bytes-per-parameter
    table, sharded over data ranks only, gradients in fp32 for bf16."""
    partition = [point.shape.num_layers // point.pipeline] * point.pipeline
    params = stage_params(point.shape, partition, point.tensor)[stage]
    return params * sum(bytes_per_param(point.precision, point.data, point.distributed))


def name(point: Point) -> str:
    flags = [point.precision] + (["dist-opt"] if point.distributed else []) + \
        (["bf16-grads"] if point.grad_reduce_in_bf16 else [])
    chunks = f" v{point.virtual_stages}" if point.virtual_stages > 1 else ""
    return (f"{point.model:5} t{point.tensor} p{point.pipeline}{chunks} c{point.context} d{point.data} "
            f"{' '.join(flags)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    opts = parser.parse_args(argv)
    points = grid(opts.models)
    start = time.time()
    measured = measure(points)
    elapsed = time.time() - start
    print(f"{'config':45} {'stage':>5} {'estimated bytes':>15} {'megatron-core':>15} {'difference':>10} "
          f"{'exact ranks':>11} {'table before':>13}")
    rows = exact_rows = 0
    for point in points:
        for stage in range(point.pipeline):
            ranks = [h for h in measured[point] if h.stage == stage]
            estimate = point.estimate(stage)
            est_total = estimate.weights + estimate.gradients + estimate.optimizer
            held_total = max(h.weights + h.gradients + h.optimizer for h in ranks)
            exact = sum((h.weights, h.gradients, h.optimizer, h.step_only) == tuple(
                getattr(point.estimate(stage, h.shard), k) for k in ("weights", "gradients", "optimizer", "step_only"))
                for h in ranks)
            rows += 1
            exact_rows += exact == len(ranks) and est_total == held_total
            print(f"{name(point):45} {stage:>5} {est_total:>15,} {held_total:>15,} {held_total - est_total:>10,} "
                  f"{exact:>9}/{len(ranks)} {table_bytes(point, stage):>13,.0f}")
    print(f"\n{exact_rows}/{rows} rows exact on every rank ({len(points)} points, {elapsed:.0f} s to build and "
          "measure them)")
    return 0 if exact_rows == rows else 1


if __name__ == "__main__":
    sys.exit(main())

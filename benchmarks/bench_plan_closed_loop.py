"""The planner against measurement on this machine (goals: Spearman >= 0.8; the pick within 10% of the measured best).

    .venv/bin/python benchmarks/bench_plan_closed_loop.py [--iters 10] [--limit 12]

Plans a small GPT (4 layers, hidden 256, 8 heads, 256 tokens, mock data, fp32) on this host's CPU as two training
processes (`labkit plan`'s search with every row kept), runs every layout that fits with the local backend (one after
another, so they do not share the cores), and compares each row's estimated step with the measured steady-state
step (labkit.logs.derive.steady_state). Prints a table of both, Spearman's rank correlation, and how far the
planner's pick is from the layout that measured fastest. The estimate uses this machine's measured profile where
`labkit profile` wrote one, else the catalog's analytic CPU.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.jobs import LocalBackend  # noqa: E402
from labkit.logs.derive import steady_state  # noqa: E402
from labkit.plan.search import search  # noqa: E402
from labkit.spec import load_spec  # noqa: E402

MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 256,
         "vocab_size": 1024}


def spearman(a: list[float], b: list[float]) -> float:
    """Pearson's correlation of the ranks (ties get their mean rank)."""
    def ranks(values):
        order = numpy.argsort(values, kind="stable")
        out = numpy.empty(len(values))
        out[order] = numpy.arange(len(values), dtype=float)
        for value in set(values):
            tied = [i for i, v in enumerate(values) if v == value]
            out[tied] = out[tied].mean()
        return out
    return float(numpy.corrcoef(ranks(a), ranks(b))[0, 1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="training iterations per layout (default 10)")
    parser.add_argument("--limit", type=int, default=12, help="most layouts to run (default 12, the best ranked)")
    args = parser.parse_args()
    base = load_spec({"name": "closed-loop", "model": MODEL, "batch": {"micro": 1, "global": 8},
                      "precision": "fp32", "data": {"mock": True},
                      "train": {"iters": args.iters, "log_interval": 1},
                      "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}})
    plan = search(base, top=None)
    rows = [r for r in plan.rows if not r.oom][:args.limit]
    print(f"{len(plan.rows)} layouts planned, running {len(rows)}", flush=True)
    measured = []
    with tempfile.TemporaryDirectory() as runs:
        backend = LocalBackend(runs_dir=runs)
        for row in rows:
            spec = load_spec(row.spec.to_dict())
            started = time.perf_counter()
            job = backend.submit(spec)
            state = job.wait(progress=False)
            if str(state) != "COMPLETED":
                print(f"tp{row.tp} pp{row.pp} dp{row.dp} micro {row.mbs}: {state}: {job.cause()}")
                return 1
            step_s = steady_state(job.result().iterations).iteration_ms / 1000
            measured.append(step_s)
            print(f"tp{row.tp} pp{row.pp} dp{row.dp} micro {row.mbs:<2d} vp{row.virtual_stages} "
                  f"sp {str(row.sequence_parallel):5s} estimated {row.estimated_s:8.4f} s  measured {step_s:8.4f} s  "
                  f"({time.perf_counter() - started:.0f} s wall)", flush=True)
    estimated = [r.estimated_s for r in rows]
    best = min(measured)
    pick = measured[0]  # the planner's top row
    print(f"\nSpearman (estimated vs measured step, {len(rows)} layouts): {spearman(estimated, measured):.3f}")
    print(f"planner's pick measured {pick:.4f} s; fastest measured {best:.4f} s: "
          f"the pick is {100 * (pick / best - 1):.1f}% slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())

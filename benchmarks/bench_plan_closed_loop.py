"""The planner against measurement here (goals: Spearman >= 0.85, max error <= 15%, the pick within 10% of the best).

    .venv/bin/python benchmarks/bench_plan_closed_loop.py [--iters 10] [--rounds 3] [--limit 14]

Plans a small GPT (4 layers, hidden 256, 8 heads, 256 tokens, mock data, fp32) on this host's CPU as two training
processes, as a user would: `labkit profile` at tensor sizes 1 and 2 and every micro-batch size the search tries
(labkit.plan.profiler.profile_model), then `labkit plan`'s search with every row kept, ranked on those profiles. It
runs every layout that fits with the local backend, one after another so that they do not share the cores,
`--rounds` times in turn (a slow spell of this shared machine then hits every layout alike), and compares each row's
estimated step with its measured one: the median of a run's steady-state steps (labkit.logs.derive.steady_state), the
least over the rounds. Other work on a shared machine only ever slows a run (it takes the cores the two training
processes need), so the fastest round is the closest to the layout's own time, as timeit takes the least of its
repeats; the spread over the rounds is printed beside it, with the 1-minute load average at the start and the end.

The profiles are taken the same way: again before every round, and each tensor size's fastest (the least forward
and backward time summed over its micro-batch sizes) is the one the rows are finally estimated with. One profile
takes about 20 seconds; with one profile a run, the same layout's estimate moved by up to 19% from one run to the
next (tensor 2 at micro-batch 8: 0.58, 0.66 and 0.69 s, benchmarks/results/plan_closed_loop.txt) where its fastest
round moved by 7%. The first round's profiles choose which layouts run. Prints Spearman's rank correlation and how far
the planner's pick (the run layout it ranks first) is from the layout that measured fastest.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.estimate.profiles import Profile  # noqa: E402
from labkit.jobs import LocalBackend  # noqa: E402
from labkit.logs.derive import steady_state  # noqa: E402
from labkit.plan.profiler import profile_model  # noqa: E402
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


def agreement(estimated: list[float], measured: list[float]) -> tuple[float, float, float]:
    """Spearman's rank correlation, the median and the largest relative error of the estimates."""
    errors = sorted(abs(e / m - 1) for e, m in zip(estimated, measured))
    return spearman(estimated, measured), statistics.median(errors), errors[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="training iterations per run (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every layout, in turn (default 3)")
    parser.add_argument("--limit", type=int, default=14, help="most layouts to run (default 14, the best ranked)")
    args = parser.parse_args()
    base = load_spec({"name": "closed-loop", "model": MODEL, "batch": {"micro": 1, "global": 8},
                      "precision": "fp32", "data": {"mock": True},
                      "train": {"iters": args.iters, "log_interval": 1},
                      "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}})
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        print(f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
        layouts = search(base, top=None).rows  # what the search will try, to profile every micro-batch size it uses
        micro_sizes = {tensor: sorted({row.mbs for row in layouts if row.tp == tensor}) for tensor in (1, 2)}
        taken: dict[int, list[Profile]] = {1: [], 2: []}

        def profile_both():
            began = time.perf_counter()
            for tensor in (1, 2):
                _, profile = profile_model(base, tensor=tensor, micro_batch=micro_sizes[tensor], repeats=8,
                                           path=Path(scratch) / f"tp{tensor}.json")
                taken[tensor].append(profile)
            print(f"profiled tp1 and tp2 in {time.perf_counter() - began:.0f} s: one pass of every micro-batch "
                  "size, forward and backward, "
                  + ", ".join(f"tp{t} {1e3 * pass_s(taken[t][-1]):.0f} ms" for t in (1, 2)), flush=True)

        profile_both()
        plan = search(base, top=None, profiles={("cpu", t): taken[t][0] for t in (1, 2)})
        rows = [r for r in plan.rows if not r.oom][:args.limit]
        print(f"{len(plan.rows)} layouts planned, running {len(rows)} x {args.rounds} rounds", flush=True)
        runs: list[list[float]] = [[] for _ in rows]
        backend = LocalBackend(runs_dir=str(Path(scratch) / "runs"))
        for round_index in range(args.rounds):
            if round_index:
                profile_both()
            for row, times in zip(rows, runs):
                job = backend.submit(load_spec(row.spec.to_dict()))
                state = job.wait(progress=False)
                if str(state) != "COMPLETED":
                    print(f"{_name(row)}: {state}: {job.cause()}")
                    return 1
                times.append(steady_state(job.result().iterations).iteration_ms / 1000)
            print(f"round {round_index + 1} done at {time.perf_counter() - started:.0f} s", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    fastest = {("cpu", t): min(taken[t], key=pass_s) for t in (1, 2)}
    final = [r for r in search(base, top=None, profiles=fastest).rows if not r.oom]
    estimates = {_name(r): r.estimated_s for r in final}
    assert len(estimates) == len(final), "two rows of one layout name: key the rows on more of their spec"
    print("planned with the profiles of round " + ", ".join(
        f"{taken[t].index(fastest[('cpu', t)]) + 1} (tp{t})" for t in (1, 2)), flush=True)
    rows, runs = zip(*sorted(((replace(row, estimated_s=estimates[_name(row)]), times)
                              for row, times in zip(rows, runs)), key=lambda pair: pair[0].estimated_s))
    measured = [min(times) for times in runs]
    for row, times, step_s in zip(rows, runs, measured):
        print(f"{_name(row)} estimated {row.estimated_s:7.4f} s  measured {step_s:7.4f} s "
              f"(rounds {min(times):.4f}-{max(times):.4f})  error {100 * (row.estimated_s / step_s - 1):+5.1f}%")
    estimated = [r.estimated_s for r in rows]
    best = min(measured)
    pick = measured[0]  # the layout the planner ranks first
    rank, median_error, max_error = agreement(estimated, measured)
    print(f"\nSpearman (estimated vs measured step, {len(rows)} layouts): {rank:.3f}")
    print(f"median error {100 * median_error:.1f}%, max {100 * max_error:.1f}%")
    rank, median_error, max_error = agreement(estimated, [statistics.median(times) for times in runs])
    print(f"(with each layout's median round instead: Spearman {rank:.3f}, "
          f"median error {100 * median_error:.1f}%, max {100 * max_error:.1f}%)")
    print(f"planner's pick measured {pick:.4f} s; fastest measured {best:.4f} s: "
          f"the pick is {100 * (pick / best - 1):.1f}% slower")
    return 0


def pass_s(profile: Profile) -> float:
    """A profile's forward and backward time of the whole model, summed over its micro-batch sizes."""
    total = 0.0
    for micro in (profile.micro_batch, *profile.other_micro_batches):
        forward = sum(profile.forward_s(0, len(profile.layers_s), micro, embedding=True, output=True))
        total += forward * (1 + profile.backward_factor_at(micro))
    return total


def _name(row) -> str:
    return f"tp{row.tp} pp{row.pp} dp{row.dp} micro {row.mbs:<2d} vp{row.virtual_stages}"


if __name__ == "__main__":
    sys.exit(main())

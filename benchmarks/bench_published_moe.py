"""labkit's estimate against the development rows of labkit/data/published_runs.yaml: NVIDIA's Megatron-Bridge 25.11
performance summary (Qwen3 30B-A3B and 235B-A22B on GB300, GB200, B200 and H100; dense Llama 3 and 3.1 on Blackwell)
and NeMo 25.02-25.04's Mixtral 8x7B on B200 and GB200.

    .venv/bin/python benchmarks/bench_published_moe.py [--all]

Prints each row (measured and estimated seconds per iteration, the error of the iteration time and of the throughput,
the estimate's exposed all-to-all and its memory), then the median and the largest |error| by system and by model
family. The published figure is tokens per second per GPU, turned into seconds per iteration; the error of the
throughput (tokens or model TFLOP/s per GPU: the same FLOPs per token on both sides) is measured / estimated time - 1.
The Blackwell GPUs' FP8 efficiencies were fitted to these rows' dense ones with the later releases' dense rows, the
MoE launch cost to their Blackwell Qwen3 rows, and Hopper's multiple of that cost to their H100 Qwen3 rows with the
later releases' (benchmarks/bench_blackwell_fit.py); nothing else was.
`--all` adds the other sets of the file for comparison.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.estimate import estimate  # noqa: E402
from labkit.estimate.published import published_runs  # noqa: E402


def family(spec) -> str:
    preset = (spec.model.preset or "").lower()
    kind = "MoE" if spec.model.num_experts else "dense"
    for name in ("mixtral", "qwen3", "llama", "gpt"):
        if name in preset:
            return f"{name.capitalize()} ({kind})"
    return f"{preset or 'GPT'} ({kind})"


def table(every: bool = False) -> pd.DataFrame:
    rows = []
    for run in published_runs():
        if not (run.dev or every) or run.measured_key != "iteration_time_s":
            continue
        est = estimate(run.spec)
        error = est.iteration_time_s / run.measured - 1
        rows.append({"set": run.set, "run": run.label, "system": run.spec.stage_gpus[0], "family": family(run.spec),
                     "precision": run.spec.precision, "measured_s": run.measured, "estimated_s": est.iteration_time_s,
                     "time_error": error, "throughput_error": run.measured / est.iteration_time_s - 1,
                     "all_to_all_s": est.exposed_comm_s.get("ep", 0.0), "peak_gib": max(est.memory_gb_per_stage),
                     "fits": est.fits_in_memory, "dev": run.dev})
    return pd.DataFrame(rows)


def summary(frame: pd.DataFrame, by: str) -> pd.DataFrame:
    grouped = frame.groupby(by)
    return pd.DataFrame({
        "rows": grouped.size(),
        "median |time error|": grouped["time_error"].apply(lambda e: e.abs().median()),
        "max |time error|": grouped["time_error"].apply(lambda e: e.abs().max()),
        "median time error": grouped["time_error"].median(),
        "median |throughput error|": grouped["throughput_error"].apply(lambda e: e.abs().median()),
        "max |throughput error|": grouped["throughput_error"].apply(lambda e: e.abs().max()),
    })


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="also the file's other sets (A100 and H100, dense)")
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    pd.set_option("display.float_format", lambda x: f"{x:.3f}")
    frame = table(args.all)
    shown = ["run", "precision", "measured_s", "estimated_s", "time_error", "throughput_error", "all_to_all_s",
             "peak_gib", "fits"]
    print(frame[shown].to_string(index=False))
    for by in ("system", "family"):
        print(f"\nby {by}:")
        print(summary(frame, by).to_string())
    print("\nall rows:")
    print(summary(frame.assign(all="all"), "all").to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fits the Blackwell GPUs' FP8 efficiency to Megatron-Bridge's dense rows of 25.11-26.06, the MoE launch cost to
25.11's, Hopper's multiple of that cost to the H100 MoE rows of 25.11-26.06, and checks them on the rest.

    .venv/bin/python benchmarks/bench_blackwell_fit.py

1. For each of B200, GB200 and GB300, `fp8_efficiency` (the share of the FP8 peak the linear layers' GEMMs reach)
   is the value on a 0.01 grid with the least mean |log error| over that GPU's dense Llama rows of both files
   (labkit/data/published_runs.yaml's megatron-bridge-25.11-moe-blackwell set and
   benchmarks/data/megatron_bridge_26_runs.yaml's 26.02-26.06 rows; the GPUs' catalog peaks say GB300 = GB200 =
   1.11 x B200, where the measured rows say 1.2 x and 1.03 x), MXFP8's rows at `mxfp8_share` of it: the share on a
   0.01 grid from 0.85 to 1 whose per-GPU fits leave the least mean |log error| over all those rows (most layouts run
   in both FP8-CS and MXFP8). Each release's dense rows are then predicted by the efficiencies fitted without them.
2. With those held, the stacks' `moe_launch_s_per_local_expert` is the median over the 25.11 set's five Blackwell
   Qwen3 rows of the value that makes each row's estimate equal its measurement, to 0.01 ms.
3. With those held, `moe_launch_scale.H100-SXM` (what Hopper spends per local expert, as a multiple of that launch
   cost) is the value on a 0.05 grid from 1 to 3 with the least mean |log error| over every H100 MoE row of both
   files (all seven read 10-47% fast at Blackwell's cost), printed with each row's error when the fit leaves that row
   out.
4. Prints the errors of the 25.11 set's rows, and of benchmarks/data/megatron_bridge_26_runs.yaml's rows (releases
   26.02 to 26.08: its Blackwell MoE rows, its H100 dense rows and all of 26.08 fitted to nothing), as assumed before
   these fits (the Blackwell FP8 efficiencies at H100-SXM's, Blackwell's launch cost on Hopper too) and with the
   fitted calibration, with each row's memory verdict, by GPU and model family, and whether the fit is the shipped
   calibration (labkit/data/calibration.yaml).

The error is estimated / measured iteration time - 1 (negative: the estimate is fast).
"""
from __future__ import annotations

import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.estimate import estimate  # noqa: E402
from labkit.estimate.calibration import Calibration, default_calibration  # noqa: E402
from labkit.estimate.published import PublishedRun, published_runs  # noqa: E402

DEV_SET = "megatron-bridge-25.11-moe-blackwell"
LATER = ROOT / "benchmarks" / "data" / "megatron_bridge_26_runs.yaml"
BLACKWELL = ("B200", "GB200", "GB300")
GRID = [round(0.30 + 0.01 * i, 2) for i in range(41)]
SHARE_GRID = [round(0.85 + 0.01 * i, 2) for i in range(16)]
SCALE_GRID = [round(1 + 0.05 * i, 2) for i in range(41)]
HOPPER = "H100-SXM"


def gpu(run: PublishedRun) -> str:
    return run.spec.stage_gpus[0]


def error(run: PublishedRun, calibration: Calibration) -> float:
    return estimate(run.spec, calibration=calibration).iteration_time_s / run.measured - 1


def mean_log_error(runs: list[PublishedRun], calibration: Calibration) -> float:
    return statistics.mean(abs(math.log1p(error(run, calibration))) for run in runs)


def with_moe_launch(calibration: Calibration, seconds: float) -> Calibration:
    for stack in ("megatron-bridge", "megatron-core"):
        calibration = calibration.with_stack(replace(calibration.stack(stack), moe_launch_s_per_local_expert=seconds))
    return calibration


def launch_that_explains(run: PublishedRun, calibration: Calibration) -> float:
    """The launch cost per MoE layer, micro-batch and local expert at which the row's estimate equals its
    measurement (bisection; the estimate grows with it)."""
    low, high = 0.0, 5e-3
    if error(run, with_moe_launch(calibration, low)) > 0:
        return 0.0
    if error(run, with_moe_launch(calibration, high)) < 0:
        raise ValueError(f"{run.label}: still fast at {1e3 * high:g} ms per local expert")
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if error(run, with_moe_launch(calibration, middle)) < 0 else (low, middle)
    return (low + high) / 2


def dense_rows(dev: list[PublishedRun], gpus=BLACKWELL) -> list[PublishedRun]:
    return [r for r in dev if gpu(r) in gpus and not r.spec.model.num_experts]


def fit_fp8_efficiency(rows: list[PublishedRun], base: Calibration) -> Calibration:
    """Each Blackwell GPU's fp8_efficiency on its dense rows, the rest of `base` held (a GPU without rows keeps
    `base`'s)."""
    fitted = base
    for name in BLACKWELL:
        dense = dense_rows(rows, (name,))
        if not dense:
            continue
        fitted = fitted.with_fp8_efficiency(name, min(GRID, key=lambda v: mean_log_error(
            dense, base.with_fp8_efficiency(name, v))))
    return fitted


def release(run: PublishedRun) -> str:
    return "25.11" if run.set == DEV_SET else run.label.split()[0]


def fit(dense: list[PublishedRun], moe: list[PublishedRun], base: Calibration) -> tuple[Calibration, list[str]]:
    """mxfp8_share and each Blackwell GPU's fp8_efficiency on the `dense` rows, then the launch cost on the `moe`
    rows; each release's dense rows' errors when the efficiencies are fitted without them."""
    by_share = {share: fit_fp8_efficiency(dense, replace(base, mxfp8_share=share)) for share in SHARE_GRID}
    share = min(SHARE_GRID, key=lambda s: (mean_log_error(dense, by_share[s]), abs(1 - s)))
    fitted = by_share[share]
    lines = [f"mxfp8_share: {share:.2f} over {len(dense)} dense rows (mean |log error| with each GPU's own fit "
             f"{mean_log_error(dense, by_share[1.0]):.3f} at 1.00 -> {mean_log_error(dense, fitted):.3f})"]
    for name in BLACKWELL:
        rows = dense_rows(dense, (name,))
        lines.append(f"fp8_efficiency.{name}: {fitted.fp8_efficiency[name]:.2f} over {len(rows)} dense rows (mean "
                     f"|log error| {mean_log_error(rows, base):.3f} at {base.fp8_efficiency[name]:.2f} -> "
                     f"{mean_log_error(rows, fitted):.3f})")
    lines.append("each release's dense rows when the efficiencies are fitted without them (mxfp8_share held; rows "
                 "of a GPU no other release has are left out):")
    for name in sorted({release(r) for r in dense}):
        rest = [r for r in dense if release(r) != name]
        left_out = [r for r in dense if release(r) == name and dense_rows(rest, (gpu(r),))]
        if not left_out:
            continue
        without = fit_fp8_efficiency(rest, replace(base, mxfp8_share=share))
        values = ", ".join(f"{g} {without.fp8_efficiency[g]:.2f}" for g in BLACKWELL if dense_rows(rest, (g,)))
        out, inside = [abs(error(r, without)) for r in left_out], [abs(error(r, fitted)) for r in left_out]
        lines.append(f"  {name}: {len(left_out)} rows, median |error| {statistics.median(out):.3f}, max {max(out):.3f} "
                     f"({values}; in the fit {statistics.median(inside):.3f}, {max(inside):.3f})")
    launches = sorted(launch_that_explains(r, fitted) for r in moe)
    seconds = round(statistics.median(launches), 5)  # to 0.01 ms, as calibration.yaml writes it
    lines.append(f"moe_launch_s_per_local_expert: {1e3 * seconds:.2f} ms, the median over {len(moe)} rows of "
                 + ", ".join(f"{1e3 * s:.2f}" for s in launches) + " ms "
                 f"(shipped {1e3 * base.stack('megatron-bridge').moe_launch_s_per_local_expert:.2f} ms)")
    return with_moe_launch(fitted, seconds), lines


def best_scale(rows: list[PublishedRun], calibration: Calibration) -> float:
    return min(SCALE_GRID, key=lambda v: mean_log_error(rows, calibration.with_moe_launch_scale(HOPPER, v)))


def fit_hopper_scale(rows: list[PublishedRun], calibration: Calibration) -> tuple[Calibration, list[str]]:
    """H100's moe_launch_scale over its MoE rows, the rest of `calibration` held, and each row's error when the fit
    leaves it out."""
    scale = best_scale(rows, calibration)
    fitted = calibration.with_moe_launch_scale(HOPPER, scale)
    lines = [f"moe_launch_scale.{HOPPER}: {scale:.2f} over {len(rows)} MoE rows (mean |log error| "
             f"{mean_log_error(rows, calibration.with_moe_launch_scale(HOPPER, 1.0)):.3f} at 1 -> "
             f"{mean_log_error(rows, fitted):.3f}); each row left out of the fit:"]
    for row in rows:
        others = [r for r in rows if r is not row]
        left_out = best_scale(others, calibration)
        without = error(row, calibration.with_moe_launch_scale(HOPPER, left_out))
        lines.append(f"  {row.label:36s} scale {left_out:.2f}  error {without:+.3f} (in the fit "
                     f"{error(row, fitted):+.3f})")
    return fitted, lines


def family(run: PublishedRun) -> str:
    return "MoE" if run.spec.model.num_experts else "dense"


def table(runs: list[PublishedRun], calibrations: dict[str, Calibration]) -> pd.DataFrame:
    rows = []
    for run in runs:
        row = {"run": run.label, "gpu": gpu(run), "family": family(run), "measured_s": run.measured}
        for name, calibration in calibrations.items():
            row[name] = error(run, calibration)
        row["fits"] = estimate(run.spec).fits_in_memory
        rows.append(row)
    return pd.DataFrame(rows)


def summary(frame: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    groups = frame.groupby(["gpu", "family"])
    out = {"rows": groups.size()}
    for name in names:
        out[f"median |err| {name}"] = groups[name].apply(lambda e: e.abs().median())
        out[f"max |err| {name}"] = groups[name].apply(lambda e: e.abs().max())
    return pd.DataFrame(out)


def main() -> int:
    pd.set_option("display.width", 200)
    pd.set_option("display.float_format", lambda x: f"{x:+.3f}")
    shipped = default_calibration()
    assumed = replace(shipped, mxfp8_share=1.0)
    for name in BLACKWELL:  # as before this fit: H100-SXM's FP8 fraction, MXFP8's the same
        assumed = assumed.with_fp8_efficiency(name, shipped.fp8_efficiency["H100-SXM"])
    dev = [r for r in published_runs() if r.set == DEV_SET]
    later = published_runs(LATER)
    assumed = assumed.with_moe_launch_scale(HOPPER, 1.0)
    dense = dense_rows(dev + later)
    moe = [r for r in dev if gpu(r) in BLACKWELL and r.spec.model.num_experts]
    fitted, lines = fit(dense, moe, assumed)
    hopper = [r for r in dev + later if gpu(r) == HOPPER and r.spec.model.num_experts]
    fitted, hopper_lines = fit_hopper_scale(hopper, fitted)
    print("\n".join(lines + hopper_lines))
    same = all(fitted.fp8_efficiency[n] == shipped.fp8_efficiency[n] for n in BLACKWELL) and \
        fitted.mxfp8_share == shipped.mxfp8_share and math.isclose(
        fitted.stack("megatron-bridge").moe_launch_s_per_local_expert,
        shipped.stack("megatron-bridge").moe_launch_s_per_local_expert) and \
        fitted.moe_launch_scale[HOPPER] == shipped.moe_launch_scale.get(HOPPER)
    print(f"the shipped calibration {'is' if same else 'is NOT'} this fit")
    calibrations = {"as H100": assumed, "fitted": fitted}
    releases = sorted({release(r) for r in later})
    names = list(calibrations)
    for title, runs in (("25.11 rows (the fit's)", dev),
                        (f"{releases[0]}-{releases[-1]} rows (the Blackwell dense rows in step 1's fit, the H100 MoE "
                         "rows in step 3's)", later)):
        frame = table(runs, calibrations)
        print(f"\n{title}:")
        print(frame.to_string(index=False))
        print(summary(frame, names).to_string())
        for name in names:
            print(f"all {len(frame)} rows, {name}: median |error| {frame[name].abs().median():.3f}, "
                  f"max {frame[name].abs().max():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

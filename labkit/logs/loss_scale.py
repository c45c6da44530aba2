"""fp16's dynamic loss scale: read from a log, and predicted.

fp16 holds magnitudes up to 65504 and loses precision below about 6e-5, so gradients are computed for the loss times a
scale S (small gradients then survive) and divided by S before the optimizer step. When a scaled gradient overflows
to inf, the step is skipped (the log counts it under "number of skipped iterations") and, once `hysteresis`
overflows have been seen, S is halved; after `loss_scale_window` clean steps it doubles again. From Megatron's
initial scale of 2^32 the first steps overflow until S is small enough, which is why an fp16 run starts with a run of
skipped iterations and no loss. bf16 has fp32's exponent range: no scale, no skipped iterations.
"""
from __future__ import annotations

import math

import pandas as pd


def loss_scale_history(parsed) -> pd.DataFrame:
    """One row per logged interval: iteration, loss_scale (at the end of the interval), skipped (steps skipped in the
    interval), skipped_total (so far) and trained (whether a loss was logged: some step of the interval applied).

    Taught in lab 02.
    """
    its = parsed.iterations.sort_values("iteration")
    skipped = its["skipped"].fillna(0).astype(int)
    return pd.DataFrame({"iteration": its["iteration"].astype(int).to_numpy(),
                         "loss_scale": its["loss_scale"].to_numpy(dtype=float),
                         "skipped": skipped.to_numpy(), "skipped_total": skipped.cumsum().to_numpy(),
                         "trained": its["lm_loss"].notna().to_numpy()})


def skipped_until(initial_scale: float, final_scale: float, hysteresis: int = 2) -> int:
    """Skipped iterations while a dynamic loss scale falls from `initial_scale` to `final_scale` through consecutive
    overflows: the first `hysteresis - 1` overflows leave the scale as it is, every further one halves it.

    Taught in lab 02.
    """
    if initial_scale <= 0 or final_scale <= 0 or hysteresis < 1:
        raise ValueError("loss scales must be positive and hysteresis at least 1")
    halvings = math.log2(initial_scale / final_scale)
    if halvings < 0 or not float(halvings).is_integer():
        raise ValueError(f"{final_scale:g} is not {initial_scale:g} halved a whole number of times")
    return int(halvings) + hysteresis - 1 if halvings else 0

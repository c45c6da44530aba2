"""Training losses of several runs side by side: do two ways of computing the same step (one large micro-batch or
accumulated small ones, one process or tensor-parallel ranks) give the same loss?"""
from __future__ import annotations

from typing import Mapping

import pandas as pd


def loss_table(runs: Mapping) -> pd.DataFrame:
    """One row per iteration logged by every run, one column of `lm loss` per run, and `spread` (largest minus
    smallest of the row). Runs are {name: ParsedLog}; iterations that some run did not log are left out.

    Taught in labs 03, 04, 09 and 10.
    """
    if len(runs) < 2:
        raise ValueError("runs: give at least two {name: ParsedLog} to compare")
    columns = {}
    for name, parsed in runs.items():
        its = parsed.iterations.dropna(subset=["lm_loss"])
        columns[name] = pd.Series(its["lm_loss"].to_numpy(dtype=float), index=its["iteration"].astype(int))
    table = pd.DataFrame(columns).dropna()
    table.index.name = "iteration"
    table["spread"] = table.max(axis=1) - table.min(axis=1)
    return table

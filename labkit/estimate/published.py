"""Published Megatron-LM runs (labkit/data/published_runs.yaml) as run specs, and the estimator's predictions beside them.

    published_table()      # one row per run: measured, predicted, error
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from labkit.estimate.calibration import Calibration
from labkit.estimate.estimator import estimate
from labkit.paths import data_file
from labkit.spec import RunSpec, load_spec

PUBLISHED_RUNS = data_file("published_runs.yaml")


@dataclass
class PublishedRun:
    set: str            # which paper's table
    label: str
    spec: RunSpec
    measured_key: str   # "tflops_per_gpu" or "iteration_time_s": the figure the paper prints
    measured: float


def published_runs(path=PUBLISHED_RUNS) -> list[PublishedRun]:
    data = yaml.safe_load(Path(path).read_text())
    cluster, model = data["cluster"], data["model"]
    per_node = cluster["gpus_per_node"]
    runs = []
    for name, group in data["sets"].items():
        recompute = {"granularity": group["recompute"]}
        if group["recompute"] == "full":
            recompute.update(method="uniform", num_layers=1)
        for billions, heads, hidden, layers, t, p, gpus, batch, measured in group["runs"]:
            spec = load_spec({
                "name": f"{name}-{billions:g}B",
                "model": {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, **model},
                "parallel": {"tensor": t, "pipeline": p, "data": gpus // (t * p),
                             "sequence_parallel": group["sequence_parallel"]},
                "batch": {"micro": 1, "global": batch}, "precision": "fp16", "recompute": recompute,
                # Megatron-LM of 2021-22: its fused softmax still writes the s x s scores (no flash attention)
                "kernels": {"attention_backend": "unfused"},
                "cluster": {"nodes": [{"gpu": cluster["gpu"], "count": max(1, gpus // per_node),
                                       "gpus_per_node": min(gpus, per_node),
                                       "inter_node_gbps": cluster["inter_node_gbps"]}]},
            })
            runs.append(PublishedRun(name, f"{billions:g}B t{t} p{p} {gpus} GPUs", spec, group["measured"],
                                     measured))
    return runs


def published_table(path=PUBLISHED_RUNS, calibration: Calibration | None = None) -> pd.DataFrame:
    """Each published run with the figure its paper prints, labkit's prediction of it (under `calibration`, the
    shipped one by default) and the relative error.

    Taught in lab 05.
    """
    rows = []
    for run in published_runs(path):
        est = estimate(run.spec, calibration=calibration)
        predicted = est.tflops_per_gpu if run.measured_key == "tflops_per_gpu" else est.iteration_time_s
        rows.append({"set": run.set, "run": run.label, "figure": run.measured_key, "measured": run.measured,
                     "predicted": predicted, "error": predicted / run.measured - 1, "mfu": est.mfu})
    return pd.DataFrame(rows)

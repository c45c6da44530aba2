"""Published measured runs (labkit/data/published_runs.yaml: Megatron-LM on A100, megatron-core and Llama 3 on H100,
mixture-of-experts models, Blackwell systems and context parallelism up to 1M tokens from NVIDIA's NeMo and
Megatron-Bridge performance documents, PyTorch's own FSDP2 stack on H200) as run specs, and the estimator's predictions
beside them.

    published_table()      # one row per run: measured, predicted, error
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from labkit.estimate.calibration import Calibration
from labkit.estimate.estimator import estimate
from labkit.megatron import sizes
from labkit.megatron.flops import model_flops
from labkit.megatron.shape import Shape
from labkit.paths import data_file
from labkit.spec import RunSpec, load_spec

PUBLISHED_RUNS = data_file("published_runs.yaml")


@dataclass
class PublishedRun:
    set: str            # which source's table (a key of published_runs.yaml's `sets`)
    label: str
    spec: RunSpec
    measured_key: str   # "tflops_per_gpu" or "iteration_time_s": the figure compared
    measured: float
    held_out: bool      # no calibration constant was fitted to this set
    dev: bool = False   # development data: rows the estimator's terms were developed against (calibration.yaml names
                        # the few constants fitted to them)


# SC21's and Korthikanti's tables: [billions of parameters, heads, hidden, layers, tensor, pipeline, GPUs, global
# batch, measured]
MEGATRON_2021_COLUMNS = ["billions", "heads", "hidden", "layers", "tensor", "pipeline", "gpus", "global", "measured"]


def published_runs(path=PUBLISHED_RUNS) -> list[PublishedRun]:
    data = yaml.safe_load(Path(path).read_text())
    runs = []
    for name, group in data["sets"].items():
        columns = group.get("columns", MEGATRON_2021_COLUMNS)
        for row in group["runs"]:
            run = dict(zip(columns, row))
            spec, label = _spec(name, group, run, data)
            measured, key = run["measured"], group["measured"]
            if key == "tokens_per_s_per_gpu":
                measured, key = run["global"] * spec.model.seq_length / (measured * run["gpus"]), "iteration_time_s"
            elif key == "model_tflops_per_gpu":
                flops = model_flops(Shape.of(spec.model), run["global"])
                measured, key = flops / (measured * 1e12 * run["gpus"]), "iteration_time_s"
            runs.append(PublishedRun(name, label, spec, key, measured, bool(group["held_out"]),
                                     bool(group.get("dev", False))))
    return runs


def _spec(name: str, group: dict, run: dict, data: dict) -> tuple[RunSpec, str]:
    """One row as a run spec, and its label. A set may give several systems (`clusters`, by name), each row naming its
    own (`system`); a row may give its own `precision`, expert-parallel size (`expert`) and `kernels` (a mapping of
    the spec's kernels fields its recipe sets, such as the MoE all-to-all's overlap or CUDA graphs)."""
    cluster = {**data["cluster"], **group.get("cluster", {}), **group.get("clusters", {}).get(run.get("system"), {})}
    gpus = run["gpus"]
    t, p, c = run["tensor"], run["pipeline"], run.get("context", 1)
    if "model" in run:  # a preset, or a shape the set spells out
        model = dict(group.get("models", {}).get(run["model"], {"preset": run["model"]}), seq_length=run["seq"])
        label = str(run["label"])
    else:
        model = {"num_layers": run["layers"], "hidden_size": run["hidden"], "num_attention_heads": run["heads"],
                 **data["model"]}
        label = f"{run['billions']:g}B t{t} p{p} {gpus} GPUs"
    parallel = {"tensor": t, "pipeline": p, "context": c, "data": sizes.data_parallel_size(gpus, t, c, p),
                "sequence_parallel": group.get("sequence_parallel", t > 1), **group.get("parallel", {}),
                **group.get("parallel_by_model", {}).get(run.get("model"), {})}
    if run.get("virtual", 1) > 1:
        parallel["virtual_stages"] = run["virtual"]
    if run.get("expert", 1) > 1:
        parallel["expert"] = run["expert"]
    recompute = None
    if group.get("recompute"):
        recompute = {"granularity": group["recompute"]}
        if group["recompute"] == "full":
            recompute.update(method="uniform", num_layers=1)
    # Megatron-LM of 2021-22: its fused softmax still writes the s x s scores (no flash attention)
    kernels = dict(group.get("kernels", {"attention_backend": "unfused"}))
    if "kernels" in group:  # Transformer Engine's overlap of the tensor-parallel transfers, where there are any,
        kernels["tp_comm_overlap"] = t > 1 and kernels.get("tp_comm_overlap", True)  # unless the set says none
    if "stack" in group:  # the software the set ran (labkit/data/calibration.yaml's stacks)
        kernels["stack"] = group["stack"]
    kernels.update(run.get("kernels") or {})
    precision = run.get("precision", group.get("precision", "fp16"))
    optimizer = {**group.get("optimizer", {}), **({"zero_stage": run["zero"]} if run.get("zero") is not None else {})}
    spec = load_spec({
        "name": f"{name}-{label}".replace(" ", "-"),
        "model": model, "parallel": parallel,
        "batch": {"micro": run.get("micro", 1), "global": run["global"]},
        "precision": precision, "recompute": recompute, "optimizer": optimizer,
        "kernels": kernels,
        "cluster": {"nodes": _nodes(cluster, gpus)},
    })
    return spec, label


def _nodes(cluster: dict, gpus: int) -> list[dict]:
    """The node groups of `gpus` GPUs of a set's system. With `rack_gpus` (GB200 and GB300 NVL72 racks run as racks of
    that many GPUs), one group per rack: each node group starts an NVLink domain of its own (labkit.estimate.
    topology), so that no rack's domain reaches into the next."""
    per_node = cluster["gpus_per_node"]
    rack = cluster.get("rack_gpus") or gpus
    groups = []
    for start in range(0, gpus, rack):
        count = min(rack, gpus - start)
        groups.append({"gpu": cluster["gpu"], "count": max(1, count // per_node), "gpus_per_node": min(count, per_node),
                       "inter_node_gbps": cluster["inter_node_gbps"]})
    return groups


def published_table(path=PUBLISHED_RUNS, calibration: Calibration | None = None) -> pd.DataFrame:
    """Each published run with the figure its paper prints, labkit's prediction of it (under `calibration`, the
    shipped one by default) and the relative error, and whether its memory estimate admits the run that trained
    (`fits`, with the fullest stage's GiB in `peak_gib`).

    Taught in lab 05.
    """
    rows = []
    for run in published_runs(path):
        est = estimate(run.spec, calibration=calibration)
        predicted = est.tflops_per_gpu if run.measured_key == "tflops_per_gpu" else est.iteration_time_s
        rows.append({"set": run.set, "run": run.label, "figure": run.measured_key, "measured": run.measured,
                     "predicted": predicted, "error": predicted / run.measured - 1, "mfu": est.mfu,
                     "held_out": run.held_out, "dev": run.dev, "fits": est.fits_in_memory,
                     "peak_gib": max(est.memory_gb_per_stage)})
    return pd.DataFrame(rows)

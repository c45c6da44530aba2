"""Several specs estimated side by side: the prediction a lab writes down before it measures the same runs.

    compare({"fp32": spec, "bf16": spec.replace(precision="bf16")})            # on each spec's own cluster
    compare({"fp32": spec, "bf16": ...}, gpu="A100-80GB")                      # the same layouts on A100s
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Mapping

import pandas as pd

from labkit.estimate.estimator import GIB, estimate
from labkit.estimate.memory import OptimizerDtypes, bytes_per_param
from labkit.spec import RunSpec

MIB = 2 ** 20


def on_gpu(spec: RunSpec, gpu: str) -> RunSpec:
    """The spec with every node group's GPU replaced by `gpu` (same node and process counts)."""
    groups = [{**asdict(group), "gpu": gpu} for group in spec.cluster_or_default().nodes]
    return spec.replace(cluster={"nodes": groups})


def compare(specs: Mapping[str, RunSpec], gpu: str | None = None) -> pd.DataFrame:
    """One row per spec: its layout, predicted iteration time and throughput, and the memory of one GPU of its fullest
    pipeline stage split into weights, gradients, optimizer state and activations (MiB).

    `gpu`: estimate every spec on this catalog GPU instead of its own cluster's.

    Taught in labs 02, 04 and 07.
    """
    if not specs:
        raise ValueError("specs: give at least one {name: RunSpec}")
    rows = {}
    for name, spec in specs.items():
        if gpu is not None:
            spec = on_gpu(spec, gpu)
        est = estimate(spec)
        fullest = max(est.memory_detail, key=lambda stage: stage["total"])
        rows[name] = {
            "gpu": est.stage_gpus[0], "precision": spec.precision,
            "tp": spec.parallel.tensor, "pp": spec.parallel.pipeline, "dp": spec.data_parallel,
            "micro_batch": spec.batch.micro, "global_batch": spec.batch.global_,
            "num_micro_batches": spec.num_micro_batches,
            "iteration_ms": est.iteration_time_s * 1e3,
            "samples_per_s": spec.batch.global_ / est.iteration_time_s,
            "bytes_per_param": sum(bytes_per_param(spec.precision, spec.data_parallel, spec.optimizer.distributed,
                                                   optimizer=spec.optimizer.name, context=spec.parallel.context,
                                                   grad_reduce_in_bf16=spec.optimizer.grad_reduce_in_bf16,
                                                   optimizer_dtypes=OptimizerDtypes.of(spec.optimizer))),
            **{f"{part}_mib": fullest[part] * GIB / MIB
               for part in ("weights", "gradients", "optimizer", "step_only", "activations", "total")},
            "fits_in_memory": est.fits_in_memory,
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "run"
    return table

"""The cost/time Pareto front over cluster compositions: 0..N nodes of each of two GPU types.

FASOP's Pareto chart (Hwang et al., HPDC '24, github.com/AvatarHwang/FASOP) asks the same question.

Each composition is a cluster of catalog instances (GPUs per node, links and price per node-hour from labkit/data/gpus.yaml);
its fastest fitting layout comes from the planner's search, asked for one row and with each GPU type's nodes kept
together (the search over every node order is for one chosen cluster, not for a sweep of dozens).
"""
from __future__ import annotations

import time
from dataclasses import replace

import pandas as pd

from labkit import catalog
from labkit.plan.search import search
from labkit.plan.views import MARKERS
from labkit.spec import ClusterSpec, NodeGroup, RunSpec


def composition(gpu_a: str, count_a: int, gpu_b: str, count_b: int) -> ClusterSpec:
    groups = []
    for name, count in ((gpu_a, count_a), (gpu_b, count_b)):
        if count:
            gpu = catalog.gpu(name)
            if not gpu.gpus_per_node:
                raise ValueError(f"{name}: labkit/data/gpus.yaml gives no gpus_per_node (instance) for it; add one to sweep it")
            groups.append(NodeGroup(gpu=gpu.name, count=count, gpus_per_node=gpu.gpus_per_node))
    return ClusterSpec(nodes=groups)


def pareto_flags(times: list[float], prices: list[float]) -> list[bool]:
    """True where no other point is at least as fast and as cheap and strictly better in one of the two."""
    flags = []
    for i, (t, c) in enumerate(zip(times, prices)):
        dominated = any((t2 <= t and c2 <= c) and (t2 < t or c2 < c)
                        for j, (t2, c2) in enumerate(zip(times, prices)) if j != i)
        flags.append(not dominated)
    return flags


def sweep(base: RunSpec, gpu_a: str, gpu_b: str, max_nodes: int = 8, profiles=None) -> pd.DataFrame:
    """Best layout of `base` on every cluster of 0..max_nodes nodes of gpu_a and of gpu_b (not both zero).

    Columns: cluster, nodes_a, nodes_b, cluster_type, marker, the best row's layout and times, price_per_step,
    fits, pareto (on the front among fitting clusters), search_s. `df.attrs["sweep_seconds"]` holds the total time.

    Taught in lab 06.
    """
    a, b = catalog.gpu(gpu_a).name, catalog.gpu(gpu_b).name
    started = time.perf_counter()
    records = []
    for n_a in range(max_nodes + 1):
        for n_b in range(max_nodes + 1):
            if n_a + n_b == 0:
                continue
            cluster = composition(a, n_a, b, n_b)
            plan = search(replace(base, cluster=cluster), top=1, orders="grouped", profiles=profiles)
            kind = "heterogeneous" if n_a and n_b else ("homogeneous-0" if n_a else "homogeneous-1")
            record = {"cluster": f"{n_a} x {a} + {n_b} x {b}", "nodes_a": n_a, "nodes_b": n_b,
                      "cluster_type": {"homogeneous-0": f"{a} only", "homogeneous-1": f"{b} only"}.get(kind, "mixed"),
                      "marker": MARKERS[kind], "search_s": plan.search_seconds}
            best = plan.best
            if best is None:
                record.update(fits=False)
            else:
                record.update(tp=best.tp, dp=best.dp, pp=best.pp, mbs=best.mbs, partition=best.partition,
                              estimated_s=best.estimated_s, price_per_step=best.price_per_step, fits=not best.oom,
                              throughput_seq_s=base.batch.global_ / best.estimated_s)
            records.append(record)
    df = pd.DataFrame.from_records(records)
    fitting = df["fits"].fillna(False).astype(bool)
    df["pareto"] = False
    ok = df[fitting]
    df.loc[ok.index, "pareto"] = pareto_flags(ok["estimated_s"].tolist(), ok["price_per_step"].tolist())
    df.attrs["sweep_seconds"] = time.perf_counter() - started
    return df

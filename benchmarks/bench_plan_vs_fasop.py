"""labkit's planner beside FASOP on FASOP's own heterogeneous GPT-2 XL case, with FASOP's profiles and link figures.

    .venv/bin/python benchmarks/bench_plan_vs_fasop.py [--data DIR]

FASOP's run (benchmarks/data/fasop_runs/: log_gpt2XL--heterogeneous.txt, gpt2_heterogeneous.csv; FASOP's profiles are
the copies labkit ships in labkit/data/profiles/fasop/): 1 node x 4 A100 + 7 nodes x 4 A10,
global batch 64, GPT-2 XL as FASOP configures it (48 layers, hidden 1600, 16 heads, seq 1024, vocab 50257, fp16).
Its CSV pins the link figures of that run: the DP all-reduce column is reproduced by 128 Gbit/s inside an A10 node and
1840 Gbit/s inside the A100 node, the embedding all-reduce column by 40 Gbit/s between nodes, and the price column by
a whole p4d.24xlarge (32.7726 USD/h) plus 7 g5.24xlarge (8.144 USD/h) - FASOP's default figures, not its --pareto
ones (400 and 100 Gbit/s, 8 GPUs per node), which this script uses for the 81-cluster sweep instead.

Prints: (1) FASOP's top 10 rows with FASOP's estimate, labkit's estimate of the same layout and partition, and labkit's
exact partition of the same layout with its estimate and the slowest stage under both partitions; (2) labkit's top 10
and its search time against FASOP's 23.8 s; (3) the Pareto sweep over 0..8 nodes of each type and its time.
"""
from __future__ import annotations

import argparse
import ast
import csv
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.estimate import estimate, load_profile  # noqa: E402
from labkit.paths import data_file  # noqa: E402
from labkit.plan.pareto import sweep  # noqa: E402
from labkit.plan.placement import as_cluster, node_kinds  # noqa: E402
from labkit.plan.search import _balanced_partition, _Links, _StageCosts, search  # noqa: E402
from labkit.spec import ClusterSpec, NodeGroup, ParallelSpec, load_spec  # noqa: E402
from labkit.estimate.params import Shape  # noqa: E402

FASOP_SEARCH_S = 23.795272827148438  # "Finished 23.795..." in log_gpt2XL--heterogeneous.txt
INSTANCE_KIND = {"p4d.24xlarge": 0, "g5.24xlarge": 1}  # node kinds in the cluster below: A100 first, A10 second


def fasop_base():
    return load_spec({
        "name": "fasop-gpt2xl-hetero",
        "model": {"preset": "gpt2-xl", "num_attention_heads": 16},  # FASOP's model_config uses 16 heads
        "batch": {"micro": 1, "global": 64}, "precision": "fp16", "recompute": "none",
        "cluster": {"nodes": [
            {"gpu": "A100-40GB", "count": 1, "gpus_per_node": 4, "inter_node_gbps": 40, "intra_node_gbps": 1840},
            {"gpu": "A10", "count": 7, "gpus_per_node": 4, "inter_node_gbps": 40, "intra_node_gbps": 128}]},
    })


def fasop_profiles(directory: Path) -> dict:
    table = {}
    for path in sorted(directory.glob("gpt2XL_*_*.npy")):
        prof = load_profile(path)
        table[(prof.gpu, prof.tensor)] = prof
    return table


def fasop_rows(path: Path, top: int) -> list[dict]:
    rows = []
    with open(path) as fh:
        for rec in csv.DictReader(fh):
            partition = ast.literal_eval(rec["partition"])
            rows.append({
                "mbs": int(rec["mbs"]), "tp": int(rec["tp"]), "dp": int(rec["dp"]), "pp": int(float(rec["pp"])),
                "order": tuple(INSTANCE_KIND[n] for n in ast.literal_eval(rec["node placement"])),
                # FASOP counts the embedding and the output layer as layers of the first and last stage
                "partition": [partition[0] - 1, *partition[1:-1], partition[-1] - 1],
                "estimated_s": float(rec["estimated time (s/step)"]),
                "oom": rec["is_oom"] == "True",
            })
            if len(rows) == top:
                break
    return rows


def placement_label(order) -> str:
    return "".join("A" if k == 0 else "B" for k in order)


def stage_steps(spec, est, links) -> list[float]:
    """Each stage's 1F1B steady-state step: its compute plus its sends and receives (what the partition balances)."""
    from labkit.estimate.timing import ACTIVATION_BYTES

    shape = Shape.of(spec.model)
    message = spec.batch.micro * shape.seq_length * shape.hidden * ACTIVATION_BYTES[spec.precision]
    edges = [0.0, *links.boundary_times(message), 0.0]
    return [t + edges[i] + edges[i + 1] for i, t in enumerate(est.stage_times_s)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data",
                    help="folder holding fasop_runs/gpt2_heterogeneous.csv (default: benchmarks/data)")
    args = ap.parse_args()
    profiles = fasop_profiles(data_file("profiles", "fasop"))
    base = fasop_base()
    kinds, _ = node_kinds(base.cluster)
    shape = Shape.of(base.model)

    print("== FASOP's top 10 rows (GPT-2 XL, 1 x 4 A100 + 7 x 4 A10, global batch 64), FASOP's profiles and links")
    print(f"{'mbs':>3} {'tp':>2} {'dp':>2} {'pp':>2} {'placement':9} {'FASOP partition':36} {'FASOP s':>8} "
          f"{'ours s':>8} | {'our partition':36} {'ours s':>8} | {'max step F':>10} {'max step L':>10} "
          f"{'max comp F':>10} {'max comp L':>10}")
    all_balanced = True
    costs = _StageCosts(shape, base.precision, base.batch.global_, lambda gpu, tensor: profiles.get((gpu, tensor)))
    for row in fasop_rows(args.data / "fasop_runs" / "gpt2_heterogeneous.csv", 10):
        cluster = as_cluster(row["order"], kinds, base.cluster)
        theirs = replace(base, cluster=cluster, batch=replace(base.batch, micro=row["mbs"]),
                         parallel=ParallelSpec(tensor=row["tp"], pipeline=row["pp"], data=row["dp"],
                                               partition=row["partition"]))
        theirs = load_spec(theirs.to_dict())
        links = _Links.of(theirs)
        ours_layers = _balanced_partition(replace(theirs, parallel=replace(theirs.parallel, partition=None)),
                                             shape, costs, links, caps=False)
        ours = load_spec(replace(theirs, parallel=replace(theirs.parallel, partition=ours_layers)).to_dict())
        est_theirs, est_ours = estimate(theirs, profiles), estimate(ours, profiles)
        step_f, step_l = max(stage_steps(theirs, est_theirs, links)), max(stage_steps(ours, est_ours, links))
        comp_f, comp_l = max(est_theirs.stage_times_s), max(est_ours.stage_times_s)
        all_balanced &= step_l <= step_f * (1 + 1e-9)
        print(f"{row['mbs']:>3} {row['tp']:>2} {row['dp']:>2} {row['pp']:>2} {placement_label(row['order']):9} "
              f"{'-'.join(map(str, row['partition'])):36} {row['estimated_s']:8.4f} {est_theirs.iteration_time_s:8.4f} | "
              f"{'-'.join(map(str, ours_layers)):36} {est_ours.iteration_time_s:8.4f} | "
              f"{step_f * 1e3:8.2f}ms {step_l * 1e3:8.2f}ms {comp_f * 1e3:8.2f}ms {comp_l * 1e3:8.2f}ms")
    print(f"our partition at least as balanced as FASOP's (max stage step) on every row: {all_balanced}")

    print("\n== labkit's top 10 on the same cluster, profiles and links")
    search(base, top=10, profiles=profiles)  # warm imports and caches; the timed run below starts from a fresh search
    timings, cpu = [], []
    for _ in range(5):
        started = time.process_time()
        plan = search(base, top=10, profiles=profiles)
        cpu.append(time.process_time() - started)
        timings.append(plan.search_seconds)
    for r in plan.rows[:10]:
        print(f"{r.mbs:>3} {r.tp:>2} {r.dp:>2} {r.pp:>2} vp{r.virtual_stages} "
              f"{placement_label(tuple(0 if g.startswith('A100') else 1 for g in r.placement)):9} "
              f"{'-'.join(map(str, r.partition)):36} {r.estimated_s:8.4f} s  pipeline {r.pipeline_s:.4f}  "
              f"dp {r.dp_allreduce_s:.4f}  emb {r.embedding_allreduce_s:.4f}  oom {r.oom}")
    best = min(timings)
    median = sorted(timings)[len(timings) // 2]
    cpu_median = sorted(cpu)[len(cpu) // 2]
    print(f"search: {plan.configs_evaluated} layouts estimated, {plan.configs_pruned} ruled out by their lower bound; "
          f"wall {median:.3f} s median of 5 (best {best:.3f} s), CPU {cpu_median:.3f} s; FASOP {FASOP_SEARCH_S:.1f} s "
          f"-> {FASOP_SEARCH_S / median:.0f}x faster (wall), {FASOP_SEARCH_S / cpu_median:.0f}x (CPU); "
          f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    full = search(base, profiles=profiles)
    print(f"full ranking without pruning: {full.configs_evaluated} layouts estimated in {full.search_seconds:.3f} s; "
          f"same best row: {full.best.partition == plan.best.partition and full.best.estimated_s == plan.best.estimated_s}")

    print("\n== Pareto sweep: 0..8 nodes of A100-40GB (8/node, 400 Gbit/s) and A10 (4/node, 100 Gbit/s), catalog prices")
    pareto_base = replace(base, cluster=ClusterSpec(nodes=[NodeGroup(gpu="A10", count=1, gpus_per_node=4)]))
    started, cpu_started = time.perf_counter(), time.process_time()
    df = sweep(pareto_base, "A100-40GB", "A10", max_nodes=8, profiles=profiles)
    elapsed, cpu_elapsed = time.perf_counter() - started, time.process_time() - cpu_started
    front = df[df["pareto"]].sort_values("estimated_s")
    print(front[["cluster", "tp", "dp", "pp", "mbs", "estimated_s", "price_per_step"]].to_string(index=False))
    print(f"{len(df) + 1} compositions (the empty one skipped), {int(df['fits'].fillna(False).sum())} fit; "
          f"sweep {elapsed:.2f} s wall, {cpu_elapsed:.2f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())

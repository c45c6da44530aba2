"""What `labkit plan` proposes for Mixtral-8x7B on 8 nodes of 8 H100 and on one GB200 NVL72 rack (18 trays of 4 GPUs),
with the reasons: the ranked table, the explanation (`labkit plan --explain`: the top row against the runner-up and the
best layout of each family, and what its expert parallelism bought), and the best layouts with and without expert
parallelism side by side.

    .venv/bin/python benchmarks/bench_moe_plan.py [--top N] [--bf16 | --fp8]

Every figure is labkit's estimate (labkit.estimate.estimate under the shipped calibration), not a measurement: the
token all-to-all of an MoE layer is charged exposed (megatron-core's alltoall dispatcher without
--overlap-moe-expert-parallel-comm), the tokens drop-less and balanced (labkit.estimate.memory.MOE_TOKEN_IMBALANCE).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.plan.explain import explain_text  # noqa: E402
from labkit.plan.inputs import planning_input  # noqa: E402
from labkit.plan.search import search  # noqa: E402
from labkit.plan.views import layout_name, ranked_table  # noqa: E402

CASES = {
    "8 nodes x 8 H100 (NVLink in a node, 8 x 400 Gbit/s InfiniBand per node)":
        ({"nodes": [{"gpu": "H100", "count": 8, "gpus_per_node": 8}]}, 256),
    "one GB200 NVL72 rack (18 trays x 4 GPUs, one NVLink domain)":
        ({"nodes": [{"gpu": "GB200", "count": 18, "gpus_per_node": 4}]}, 576),
}
COLUMNS = ["micro", "tp", "cp", "ep", "etp", "dp", "pp", "vp", "recompute", "ZeRO", "s/step", "max GB/stage", "oom"]


def row_line(row) -> str:
    bd = row.breakdown
    return (f"{layout_name(row)}\n    {row.estimated_s:.3f} s/step: compute {bd['compute']:.3f}, bubble "
            f"{bd['bubble']:.3f}, all-to-all {bd['ep_comm']:.3f}, tensor {bd['tp_comm']:.3f}, pipeline "
            f"{bd['pp_comm']:.3f}, data {bd['dp_comm']:.3f}, optimizer {bd['optimizer']:.3f}; "
            f"{max(row.memory_gb_per_stage):.1f} GB on the fullest GPU")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    args = parser.parse_args()
    for title, (cluster, global_batch) in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cluster.yaml")
            path.write_text(yaml.safe_dump(cluster))
            base, constraints = planning_input(str(path), "mixtral-8x7b", global_batch, args.precision)
        plan = search(base, top=args.top, constraints=constraints)
        print(f"=== Mixtral-8x7B on {title}: global batch {global_batch} x 4096 tokens, {args.precision}")
        print(ranked_table(plan, top=args.top)[COLUMNS].to_string(index=False))
        print(f"{plan.configs_evaluated} layouts estimated, {plan.configs_pruned} ruled out by their lower bound, "
              f"in {plan.search_seconds:.2f} s")
        fitting = [r for r in plan.rows if not r.oom]
        with_ep = [r for r in fitting[:args.top] if r.ep > 1]
        print(f"\nlayouts with expert parallelism among the top {args.top}: {len(with_ep)}")
        best_ep = next((r for r in fitting if r.ep > 1), None)
        best_dense = next((r for r in fitting if r.ep == 1), None)
        for label, row in (("best with expert parallelism", best_ep), ("best without", best_dense)):
            print(f"{label}: " + (row_line(row) if row else "none fits"))
        print("\n" + explain_text(plan, base, constraints, top=args.top) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`labkit plan` (rank parallel layouts of a model on a cluster) and `labkit profile` (measure per-layer times here)."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from labkit import catalog
from labkit.spec import RunSpec, SpecError, load_spec
from labkit.spec.checks import PRECISIONS
from labkit.spec.load import read_file


def register(sub) -> None:
    p = sub.add_parser("plan", help="rank tensor/pipeline/data layouts, micro-batch and node order by estimated time "
                                    "or price, and print the best as a run spec")
    p.add_argument("target", metavar="CLUSTER_OR_SPEC",
                   help="a cluster name from labkit/data/clusters.yaml, a cluster YAML (nodes: [...]) "
                        "or a run spec whose cluster, model and batch are used")
    p.add_argument("--model", help="model preset from labkit/data/models.yaml; default: the spec's model")
    p.add_argument("--global-batch", type=int, help="sequences per step; default: the spec's batch.global")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="default: the spec's, else bf16 where every GPU has it, else fp16")
    p.add_argument("--objective", choices=("time", "cost"), default="time",
                   help="time: fastest step; cost: cheapest step (price per node-hour from labkit/data/gpus.yaml)")
    p.add_argument("--max-step-s", type=float, help="time budget: with --objective cost, the slowest step allowed")
    p.add_argument("--max-price-per-step", type=float,
                   help="cost budget (USD): with --objective time, the dearest step allowed")
    p.add_argument("--price", action="append", default=[], metavar="GPU=USD_PER_GPU_HOUR",
                   help="what one GPU of a type costs per hour (repeatable), over cluster.nodes[].price_per_gpu_hour "
                        "and the catalog's cloud prices")
    p.add_argument("--top", type=int, default=10, help="rows to show (default 10)")
    p.add_argument("--profiles", help="directory of per-layer profiles (default: yours under ~/.labkit/profiles, then the shipped ones)")
    p.add_argument("--json", action="store_true", help="print rows, search_seconds, configs_evaluated and spec as JSON")
    p.add_argument("--output", "-o", help="also write the chosen run spec to this YAML file")
    p.set_defaults(func=_plan)

    p = sub.add_parser("profile", help="measure per-layer forward time of a model on this machine and write it to "
                                       "~/.labkit/profiles/ ($LABKIT_HOME/profiles) for the estimator and the planner")
    p.add_argument("--model", required=True, metavar="PRESET|SPEC", help="model preset name or run spec file")
    p.add_argument("--tensor", type=int, default=1, help="tensor-parallel size the profile stands for (default 1)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="timed forward passes per layer (median is kept)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: bf16 on a GPU, fp32 on CPU")
    p.add_argument("--output", "-o", help="profile path (default ~/.labkit/profiles/<model>_<gpu>_tp<t>.json)")
    p.set_defaults(func=_profile)


def _fail(message: str) -> int:
    print(f"labkit: {message}", file=sys.stderr)
    return 2


def base_spec(target: str, model: str | None, global_batch: int | None, precision: str | None) -> RunSpec:
    """The spec the planner varies: from a named cluster, a cluster YAML or a run spec, plus the flags."""
    spec_data: dict = {}
    cluster = None
    if target in catalog.clusters():
        cluster = catalog.clusters()[target]["nodes"]
    else:
        path = Path(target)
        if not path.exists():
            hint = catalog.closest(target, catalog.clusters())
            raise SpecError([f"CLUSTER_OR_SPEC: {target!r} is neither a file nor a cluster name; known clusters: "
                             f"{', '.join(catalog.clusters())}" + (f" (closest: {', '.join(hint)})" if hint else "")])
        data = read_file(path)
        if "nodes" in data and "model" not in data:
            cluster = data
        else:
            spec_data = load_spec(path).to_dict()
            cluster = spec_data.get("cluster")
    if isinstance(cluster, list):
        cluster = {"nodes": cluster}
    if not cluster or not cluster.get("nodes"):
        raise SpecError(["cluster: the planner needs a cluster; name one from labkit/data/clusters.yaml or give a spec "
                         "with cluster.nodes"])
    if model:
        spec_data["model"] = {"preset": model}
    elif not spec_data.get("model"):
        raise SpecError(["--model: missing; pick a preset: " + ", ".join(catalog.models())])
    if global_batch:
        spec_data["batch"] = {"micro": 1, "global": global_batch}
    elif not spec_data.get("batch"):
        raise SpecError(["--global-batch: missing; give the sequences per step, e.g. --global-batch 64"])
    # The cluster alone first: every bad node field is named, before anything is derived from it.
    on_cluster = {"model": {"preset": "tiny"}, "cluster": cluster,
                  "batch": {"micro": 1, "global": _world(cluster["nodes"])}}
    checked = load_spec(on_cluster)
    groups = checked.cluster.nodes
    if precision is None and "precision" not in spec_data:
        has_bf16 = all(catalog.gpu(g.gpu).bf16 for g in groups if catalog.resolve_gpu_name(g.gpu))
        precision = "bf16" if has_bf16 else "fp16"
    if precision:
        spec_data["precision"] = precision
    spec_data.setdefault("name", f"plan-{spec_data['model'].get('preset') or 'model'}")
    # validated without the cluster (the layout is what the planner chooses), then placed on it
    spec_data.update(cluster=None, parallel={"tensor": 1, "pipeline": 1}, recompute=None)
    base = load_spec(spec_data)
    load_spec({**on_cluster, "precision": base.precision})  # the precision on these GPUs
    return replace(base, cluster=checked.cluster)


def _world(nodes) -> int:
    """GPUs in all, from node groups not yet checked (a bad count is named by the check that follows)."""
    try:
        return max(1, sum(int(g.get("count", 1)) * int(g.get("gpus_per_node", 1)) for g in nodes))
    except (AttributeError, TypeError, ValueError):
        return 1


def _prices(items: list[str]) -> dict[str, float]:
    """--price GPU=USD_PER_GPU_HOUR values; SpecError naming --price for one that is not."""
    prices, errors = {}, []
    for item in items:
        name, _, usd = item.partition("=")
        try:
            value = float(usd)
        except ValueError:
            value = -1.0
        if not catalog.resolve_gpu_name(name.strip()) or not value >= 0 or value == float("inf"):
            errors.append(f"--price: {item!r} is not GPU=USD_PER_GPU_HOUR with a known GPU, e.g. --price A100-80GB=1.8")
        else:
            prices[catalog.resolve_gpu_name(name.strip())] = value
    if errors:
        raise SpecError(errors)
    return prices


# Exit status when the plan cannot keep a constraint: no layout fits in memory, or none meets the budget.
UNMET = 3


def _unmet(plan, args) -> str | None:
    """What the best row breaks (None: nothing), and the row that comes closest, for exit status 3."""
    best = plan.best
    if best.oom:
        def overshoot(row):
            return max(m / catalog.gpu(g).memory_limit_gb for m, g in zip(row.memory_gb_per_stage, row.spec.stage_gpus))
        closest = min(plan.rows, key=overshoot)
        return (f"memory: no layout fits; closest: tp{closest.tp} pp{closest.pp} dp{closest.dp} micro {closest.mbs}"
                f"{' with recompute' if closest.recompute else ''} needs {overshoot(closest):.0%} of its GPUs' memory")
    if best.within_budget:
        return None
    broken = []
    if args.max_step_s is not None:
        closest = min((r for r in plan.rows if not r.oom), key=lambda r: r.estimated_s)
        broken.append(f"--max-step-s {args.max_step_s:g}: no fitting layout is that fast; closest: tp{closest.tp} "
                      f"pp{closest.pp} dp{closest.dp} at {closest.estimated_s:.3f} s per step")
    if args.max_price_per_step is not None:
        closest = min((r for r in plan.rows if not r.oom), key=lambda r: r.price_per_step)
        broken.append(f"--max-price-per-step {args.max_price_per_step:g}: no fitting layout is that cheap; closest: "
                      f"tp{closest.tp} pp{closest.pp} dp{closest.dp} at {closest.price_per_step:.4f} USD per step")
    return "; ".join(broken)


def _plan(args) -> int:
    from labkit.megatron_args import megatron_args, pipeline_layout
    from labkit.plan.search import search
    from labkit.plan.views import ranked_table

    try:
        base = base_spec(args.target, args.model, args.global_batch, args.precision)
        prices = _prices(args.price)
    except SpecError as exc:
        for error in exc.errors:
            print(f"labkit plan: {error}", file=sys.stderr)
        return 2
    profiles = None
    if args.profiles:
        from labkit.estimate import Shape
        from labkit.estimate.estimator import profiled_model
        from labkit.estimate.profiles import find_profile
        model = profiled_model(Shape.of(base.model))  # the preset of this layer shape, as the estimator finds it
        profiles = lambda gpu, tensor: find_profile(model, gpu, tensor, directory=args.profiles)  # noqa: E731
    plan = search(base, objective=args.objective, max_step_s=args.max_step_s,
                  max_price_per_step=args.max_price_per_step, top=args.top, profiles=profiles,
                  progress=not args.json and sys.stderr.isatty(), prices=prices)
    if not plan.rows:
        return _fail("no layout uses every GPU of this cluster for this model and batch; change --global-batch")
    chosen = load_spec(plan.best.spec.to_dict())  # the run spec as a user would load it: validated, complete
    chosen.name = f"{base.name}-t{chosen.parallel.tensor}p{chosen.parallel.pipeline}d{chosen.data_parallel}"
    if args.output:
        Path(args.output).write_text(chosen.to_yaml())
    unmet = _unmet(plan, args)
    if args.json:
        out = plan.to_dict(top=args.top)
        out["spec"] = chosen.to_dict()
        out["unmet"] = unmet
        print(json.dumps(out, indent=2, default=float))
        return UNMET if unmet else 0
    print(ranked_table(plan, top=args.top).to_string(index=False))
    print(f"\n{plan.configs_evaluated} layouts estimated, {plan.configs_pruned} ruled out by their pipeline time "
          f"alone, in {plan.search_seconds:.3f} s")
    if chosen.parallel.partition:
        print(f"\nchosen: PARTITION=\"{chosen.partition_string}\"  layout {pipeline_layout(chosen.layer_partition)}")
    else:
        print(f"\nchosen: PARTITION=\"{chosen.partition_string}\" (even split, {chosen.parallel.virtual_stages} "
              "virtual stages per GPU)")
    print("megatron: " + " ".join(megatron_args(chosen)))
    print("\n" + chosen.to_yaml(), end="")
    if unmet:
        print(f"\nlabkit plan: cannot keep {unmet}", file=sys.stderr)
        return UNMET
    return 0


def _profile(args) -> int:
    from labkit.plan.profiler import profile_model

    try:
        path, profile = profile_model(args.model, tensor=args.tensor, micro_batch=args.micro_batch,
                                      repeats=args.repeats, precision=args.precision, path=args.output)
    except (SpecError, ValueError) as exc:
        return _fail(str(exc))
    layers = profile.layers_s
    print(f"{profile.model} on {profile.gpu} (tp{profile.tensor}, micro-batch {profile.micro_batch}, "
          f"{profile.precision}): embedding {profile.embedding_s * 1e3:.3f} ms, "
          f"layer {sum(layers) / len(layers) * 1e3:.3f} ms x {len(layers)}, output {profile.output_s * 1e3:.3f} ms")
    print(f"wrote {path}")
    return 0

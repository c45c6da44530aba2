"""`labkit plan` (rank parallel layouts of a model on a cluster) and `labkit profile` (measure per-layer times here)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from labkit import catalog
from labkit.profiling.cli import register_nsys
from labkit.spec import SpecError, load_spec
from labkit.spec.checks import PRECISIONS


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
    p.add_argument("--orders", choices=("auto", "all", "grouped"), default="auto",
                   help="node orders tried: all (every order up to symmetry), grouped (each GPU type's nodes kept "
                        "together, every order of the types), auto (all unless there are more than "
                        "labkit.plan.search.MAX_ORDERS of them, else grouped; the default)")
    p.add_argument("--top", type=int, default=10, help="rows to show (default 10)")
    p.add_argument("--profiles", help="directory of per-layer profiles (default: yours under ~/.labkit/profiles, then the shipped ones)")
    p.add_argument("--explain", action="store_true",
                   help="why the top row wins: it against the runner-up and the best row of each other family "
                        "(compute, bubble, exposed communication, memory headroom)")
    p.add_argument("--json", action="store_true",
                   help="print rows, search_seconds, configs_evaluated, assumed (the stack and overlaps the estimates "
                        "take) and spec as JSON")
    p.add_argument("--output", "-o", help="also write the chosen run spec to this YAML file (not when exit status 3 "
                                          "says no layout keeps the memory or the budget)")
    p.set_defaults(func=_plan)

    p = sub.add_parser("profile", help="measure per-layer forward time of a model on this machine and write it to "
                                       "~/.labkit/profiles/ ($LABKIT_HOME/profiles) for the estimator and the planner",
                       epilog="labkit profile nsys REPORT.sqlite|DIR ...: read Nsight Systems captures instead")
    p.add_argument("--model", metavar="PRESET|SPEC", help="model preset name or run spec file (required)")
    p.add_argument("--tensor", type=int, default=1, help="tensor-parallel size the profile stands for (default 1)")
    p.add_argument("--micro-batch", type=_sizes, default=(1,), metavar="N[,N...]",
                   help="micro-batch sizes to measure (default 1); the estimate interpolates between them")
    p.add_argument("--repeats", type=int, default=5, help="timed forward passes per layer (median is kept)")
    p.add_argument("--host-processes", type=int, default=None, metavar="N",
                   help="on a CPU: the training processes that share this host, which the profile runs beside each "
                        "other (default: the laptop cluster's 2)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: bf16 on a GPU, fp32 on CPU")
    p.add_argument("--output", "-o", help="profile path (default ~/.labkit/profiles/<model>_<gpu>_tp<t>.json)")
    p.set_defaults(func=_profile)
    readers = p.add_subparsers(dest="profile_reader", metavar="{nsys}")
    register_nsys(readers)


def _sizes(text: str) -> tuple[int, ...]:
    """`--micro-batch 1,2,4`: one or more positive sizes."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes of at least 1 separated by commas, e.g. 1,2,4")
    return sizes


def _fail(message: str) -> int:
    print(f"labkit: {message}", file=sys.stderr)
    return 2


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
    """What the best row breaks (None: nothing), and the row that comes closest in full, for exit status 3."""
    from labkit.plan.views import layout_name

    best = plan.best
    if best.oom:
        def overshoot(row):
            return max(m / catalog.gpu(g).memory_limit_gb for m, g in zip(row.memory_gb_per_stage, row.spec.stage_gpus))
        closest = min(plan.rows, key=overshoot)
        return (f"memory: no layout fits; closest: {layout_name(closest)}, needs {overshoot(closest):.0%} of its GPUs' "
                "memory")
    if best.within_budget:
        return None
    broken = []
    if args.max_step_s is not None:
        closest = min((r for r in plan.rows if not r.oom), key=lambda r: r.estimated_s)
        broken.append(f"--max-step-s {args.max_step_s:g}: no fitting layout is that fast; closest: "
                      f"{layout_name(closest)}, at {closest.estimated_s:.3f} s per step")
    if args.max_price_per_step is not None:
        closest = min((r for r in plan.rows if not r.oom), key=lambda r: r.price_per_step)
        broken.append(f"--max-price-per-step {args.max_price_per_step:g}: no fitting layout is that cheap; closest: "
                      f"{layout_name(closest)}, at {closest.price_per_step:.4f} USD per step")
    return "; ".join(broken)


def _plan(args) -> int:
    from labkit.megatron_args import megatron_args, pipeline_layout
    from labkit.plan.inputs import assumptions, planning_input
    from labkit.plan.search import search
    from labkit.plan.views import ranked_table

    try:
        base, constraints = planning_input(args.target, args.model, args.global_batch, args.precision)
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
    options = dict(objective=args.objective, max_step_s=args.max_step_s, max_price_per_step=args.max_price_per_step,
                   profiles=profiles, prices=prices, orders=args.orders)
    plan = search(base, top=args.top, progress=not args.json and sys.stderr.isatty(), constraints=constraints,
                  **options)
    if not plan.rows:
        return _fail("no layout uses every GPU of this cluster for this model and batch; change --global-batch")
    chosen = load_spec(plan.best.spec.to_dict())  # the run spec as a user would load it: validated, complete
    chosen.name = f"{base.name}-t{chosen.parallel.tensor}p{chosen.parallel.pipeline}d{chosen.data_parallel}"
    unmet = _unmet(plan, args)
    if unmet:  # the reason first, before any table; no spec that breaks it is written
        print(f"labkit plan: cannot keep {unmet}", file=sys.stderr)
        if args.output:
            print(f"labkit plan: {args.output} not written: no layout keeps that", file=sys.stderr)
        sys.stderr.flush()
    elif args.output:
        Path(args.output).write_text(chosen.to_yaml())
    assumed = assumptions(base)
    if args.json:
        out = plan.to_dict(top=args.top)
        out["spec"] = chosen.to_dict()
        out["unmet"] = unmet
        out["assumed"] = assumed
        if args.explain:
            from labkit.plan.explain import explain_table
            out["explain"] = explain_table(plan, base, constraints, **options).to_dict(orient="records")
        print(json.dumps(out, indent=2, default=float))
        return UNMET if unmet else 0
    print(ranked_table(plan, top=args.top).to_string(index=False))
    print(f"\n{plan.configs_evaluated} layouts estimated, {plan.configs_pruned} ruled out by a lower bound on their "
          f"step time, in {plan.search_seconds:.3f} s")
    print(_assumed_line(assumed))
    if args.explain:
        from labkit.plan.explain import explain_text
        print("\n" + explain_text(plan, base, constraints, **options))
    if unmet:
        return UNMET
    if chosen.parallel.partition:
        print(f"\nchosen: PARTITION=\"{chosen.partition_string}\"  layout {pipeline_layout(chosen.layer_partition)}")
    else:
        split = ("the embedding and loss counted as layers" if chosen.parallel.account_for_embedding_in_pipeline_split
                 else "even split")
        print(f"\nchosen: PARTITION=\"{chosen.partition_string}\" ({split}, {chosen.parallel.virtual_stages} "
              "virtual stages per GPU)")
    print("megatron: " + " ".join(megatron_args(chosen)))
    print("\n" + chosen.to_yaml(), end="")
    return 0


# where a layout allows each overlap (labkit.megatron.rules' pairings)
_WHERE = {"overlap_param_gather": " where the optimizer is sharded",
          "tp_comm_overlap": " where sequence parallelism is",
          "overlap_moe_expert_parallel_comm": " where the layout has expert ranks (interleaved when pipelined)"}


def _assumed_line(assumed: dict) -> str:
    """The software the plan's estimates take, in one line: the stack and each overlap (a run spec's kernels set
    them)."""
    overlaps = ", ".join(f"{name} {'on' + _WHERE.get(name, '') if on else 'off'}" for name, on in assumed.items()
                         if name != "stack")
    return f"assumed: kernels.stack {assumed['stack']}, {overlaps} (a run spec's kernels set them)"


def _profile(args) -> int:
    from labkit.plan.profiler import profile_model

    if not args.model:
        return _fail("profile: give --model PRESET|SPEC to measure, or `labkit profile nsys REPORT.sqlite|DIR` to "
                     "read Nsight Systems captures")
    try:
        extra = {"host_processes": args.host_processes} if args.host_processes is not None else {}
        path, profile = profile_model(args.model, tensor=args.tensor, micro_batch=args.micro_batch,
                                      repeats=args.repeats, precision=args.precision, path=args.output, **extra)
    except (SpecError, ValueError) as exc:
        return _fail(str(exc))
    for micro in args.micro_batch:
        layers, ends = profile.forward_s(0, len(profile.layers_s), micro, embedding=True, output=True)
        print(f"{profile.model} on {profile.gpu} (tp{profile.tensor}, micro-batch {micro}, {profile.precision}): "
              f"layer {layers / len(profile.layers_s) * 1e3:.3f} ms x {len(profile.layers_s)}, "
              f"embedding + output {ends * 1e3:.3f} ms, "
              f"backward {profile.backward_factor_at(micro):.2f} x forward")
    print(f"wrote {path}")
    return 0

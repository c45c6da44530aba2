"""`labkit profiling summary RUN_OR_TRACE [--json]`: what the profiled steps of a run spent their time and memory on.
`labkit profile nsys REPORT.sqlite|DIR ... [--json] [--html FILE]`: the same questions of Nsight Systems captures."""
from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("profiling", help="read a run's torch.profiler traces and TensorBoard scalars")
    psub = p.add_subparsers(dest="profiling_command", metavar="COMMAND", required=True)
    s = psub.add_parser("summary", help="profiled steps, time by category, compute vs communication, memory, per rank")
    s.add_argument("path", metavar="RUN_OR_TRACE", help="run directory (traces found below it) or one trace JSON")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.add_argument("--tensor", type=int, default=1, help="tensor-parallel size, to name communication groups")
    s.add_argument("--pipeline", type=int, default=1, help="pipeline-parallel size, to name communication groups")
    s.add_argument("--context", type=int, default=1, help="context-parallel size, to name communication groups")
    s.add_argument("--top", type=int, default=8, help="operators listed per rank")
    s.set_defaults(func=_summary)


def _summary(args) -> int:
    from pathlib import Path

    from labkit.profiling import tensorboard, trace

    try:
        traces = trace.load_traces(args.path)
    except (FileNotFoundError, ValueError) as exc:
        print(f"labkit profiling: {exc}", file=sys.stderr)
        return 2
    try:
        result = trace.summary(traces, tensor=args.tensor, pipeline=args.pipeline, top=args.top, context=args.context)
    except ValueError as exc:  # parallel sizes that do not divide the traces' world
        print(f"labkit profiling: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.path) if Path(args.path).is_dir() else None
    if run_dir is not None and tensorboard.event_dirs(run_dir):
        result["tensorboard_command"] = tensorboard.tensorboard_command(run_dir)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['traces']} trace(s), world size {result['world_size']}")
    for rank in result["ranks"]:
        steps = rank["profiled_steps"]
        print(f"\nrank {rank['rank']} ({rank['device']}, {rank['backend'] or 'no process group'}): "
              f"{len(steps)} profiled steps {steps}, {rank['step_ms']} ms per step  [{rank['path']}]")
        print("  time by category: " + ", ".join(f"{k} {v:.1%}" for k, v in rank["breakdown"].items() if v))
        if rank["tensor_core_share"] is not None:
            print(f"  tensor cores: {rank['tensor_core_share']:.1%} of kernel time")
        print("  " + ", ".join(f"{k} {v:.1%}" for k, v in rank["compute_communication"].items()))
        if rank["communication_ms_by_group"]:
            print("  communication by group (ms): " + ", ".join(f"{g} {ms:.2f}"
                                                              for g, ms in rank["communication_ms_by_group"].items()))
        if rank["peak_memory_growth_mb"] is not None:
            saved = rank["saved_for_backward_mb"]
            print(f"  memory peak over a step's start: {rank['peak_memory_growth_mb']:.2f} MB"
                  + (f", saved for backward: {saved:.2f} MB" if saved is not None else ""))
        for op in rank["top_operators"]:
            print(f"    {op['self_ms']:10.3f} ms  {op['calls']:6d}x  {op['category']:<13} {op['operator']}")
    if "tensorboard_command" in result:
        print(f"\nopen in TensorBoard: {result['tensorboard_command']}")
    return 0


def register_nsys(readers) -> None:
    """`labkit profile nsys`: a reader of Nsight Systems captures under `labkit profile` (labkit.plan.cli's per-layer
    profiler, which adds it to its subcommands)."""
    p = readers.add_parser("nsys", help="time per kernel class, computation vs communication and the captured steps "
                                        "of Nsight Systems reports, per rank")
    p.add_argument("paths", nargs="+", metavar="REPORT.sqlite|DIR",
                   help="nsys export --type sqlite files, or directories of them (a run's logs/nsys)")
    p.add_argument("--json", action="store_true", help="print the tables as JSON")
    p.add_argument("--html", metavar="FILE", help="also write the figure (plotly) to this HTML file")
    p.set_defaults(func=_nsys)


def _nsys(args) -> int:
    from labkit.profiling import nsys

    try:
        reports = nsys.load_reports(args.paths)
    except (FileNotFoundError, ValueError, OSError) as exc:
        print(f"labkit profile nsys: {exc}", file=sys.stderr)
        return 2
    if args.html:
        nsys.figure(reports).write_html(args.html, include_plotlyjs=True)
    if args.json:
        print(json.dumps(nsys.summary(reports), indent=2))
        return 0
    classes, split, steps = nsys.kernel_time(reports), nsys.overlap(reports), nsys.steps(reports)
    for row in split.itertuples():
        times = classes[(classes["rank"] == row.rank) & (classes["time_ms"] > 0)]
        print(f"rank {row.rank}: {row.window_ms:.3f} ms captured")
        print("  GPU time by class: " + ", ".join(f"{cls} {ms:.3f} ms ({share:.1%})" for cls, ms, share
                                                  in zip(times["class"], times["time_ms"], times["share"])))
        print(f"  compute {row.compute_ms:.3f} ms, communication {row.communication_ms:.3f} ms of which "
              f"{row.overlap_ms:.3f} ms under compute ({row.overlap_share:.1%}), exposed "
              f"{row.exposed_communication_ms:.3f} ms, idle {row.idle_ms:.3f} ms")
        for step in steps[steps["rank"] == row.rank].itertuples():
            print(f"  iteration {step.iteration}: {step.duration_ms:.3f} ms (forward {step.forward_ms:.3f}, backward "
                  f"{step.backward_ms:.3f}, optimizer {step.optimizer_ms:.3f})")
    if args.html:
        print(f"figure: {args.html}")
    return 0

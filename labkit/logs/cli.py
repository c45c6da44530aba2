"""`labkit logs parse LOG... [--json]`: a run's logs summarised, or everything parsed as one JSON object;
`labkit logs export --mlflow STORE LOG...`: the run written into an MLflow tracking store (labkit.logs.export)."""
from __future__ import annotations

import json
import sys


def register(sub) -> None:
    logs = sub.add_parser("logs", help="read Megatron training logs")
    logs_sub = logs.add_subparsers(dest="logs_command", metavar="COMMAND")
    p = logs_sub.add_parser("parse", help="parse Megatron logs (files, per-node files of a job, or a run directory)",
                            description="Parse Megatron-LM, Megatron-DeepSpeed, NeMo and labkit logs. Several "
                                        "files are read as the logs of one job (e.g. JOBID/NODE.out).")
    p.add_argument("logs", nargs="+", metavar="LOG", help="log file or run/job directory")
    p.add_argument("--json", action="store_true",
                   help="print iterations, memory, timers, validation, arguments, parallel, events, partial_lines "
                        "and summary as one JSON object")
    p.add_argument("--gpu", help="catalog GPU name for MFU (e.g. A100-80GB), when the log does not say")
    p.add_argument("--spec", help="the run's spec (YAML): model shape, batch and GPUs for TFLOP/s and MFU when the "
                                  "log does not print them")
    p.set_defaults(func=_parse)
    e = logs_sub.add_parser("export", help="write a finished run's parameters and metrics into an experiment tracker",
                            description="Write the arguments block as parameters and every logged iteration's "
                                        "metrics (and validation losses) into MLflow, as one run.")
    e.add_argument("logs", nargs="+", metavar="LOG", help="log file or run/job directory")
    e.add_argument("--mlflow", required=True, metavar="STORE",
                   help="MLflow tracking store: a directory (its file store) or a tracking URI")
    e.add_argument("--experiment", default="labkit", help="MLflow experiment name (default: labkit)")
    e.add_argument("--run-name", help="MLflow run name (default: the run directory's or log's name)")
    e.set_defaults(func=_export)
    logs.set_defaults(func=lambda args: (logs.print_help(), 1)[1])


def _parse(args) -> int:
    from labkit.logs import parse_log
    from labkit.logs.derive import summarize
    from labkit.logs.parse import jsonable
    from labkit.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec) if args.spec else None
        parsed = parse_log(args.logs)
        summary = summarize(parsed, spec=spec, gpu=args.gpu)
    except (FileNotFoundError, KeyError) as exc:
        print(f"labkit logs parse: {exc}", file=sys.stderr)
        return 2
    except SpecError as exc:
        print(f"labkit logs parse: --spec {args.spec}: " + "; ".join(exc.errors), file=sys.stderr)
        return 2
    if args.json:
        out = parsed.to_json()
        out["summary"] = jsonable(summary)
        json.dump(out, sys.stdout, default=str, allow_nan=False)
        print()
        return 0
    print(format_summary(summary))
    return 0


def _export(args) -> int:
    from labkit.extras import MissingExtra
    from labkit.logs.export import export_mlflow

    try:
        run_id = export_mlflow(args.logs, args.mlflow, experiment=args.experiment, run_name=args.run_name)
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as exc:
        print(f"labkit logs export: {exc}", file=sys.stderr)
        return 2
    print(f"MLflow run {run_id} in experiment {args.experiment!r} at {args.mlflow}")
    return 0


def format_summary(s: dict) -> str:
    """The summary as a few lines a person reads at a glance."""
    def num(value, fmt="{:,.1f}"):
        return "-" if value is None else fmt.format(value)

    lines = [f"logs: {', '.join(s['sources'])}  ({', '.join(s['formats']) or 'no known format'})"]
    if s["iterations_logged"]:
        lines.append(f"iterations: {s['first_iteration']}..{s['last_iteration']} of {num(s['train_iters'], '{}')} "
                     f"({s['iterations_logged']} logged; {s['skipped_iterations']} skipped, "
                     f"{s['nan_iterations']} nan; {s['restarts']} restarts)")
        lines.append(f"lm loss: last {num(s['last_lm_loss'], '{:.4f}')}, lowest {num(s['min_lm_loss'], '{:.4f}')}")
        left_out = s["warmup_iterations_excluded"] + s["outlier_iterations_excluded"]
        lines.append(f"steady iteration time: {num(s['steady_iteration_ms'])} ms "
                     f"(left out: warm-up {s['warmup_iterations_excluded']}, spikes "
                     f"{s['outlier_iterations_excluded']})" if left_out else
                     f"steady iteration time: {num(s['steady_iteration_ms'])} ms")
        lines.append(f"throughput: {num(s['tokens_per_s'], '{:,.0f}')} tokens/s, "
                     f"{num(s['tflops_per_gpu'])} TFLOP/s per GPU"
                     + (f" ({s['tflops_source']})" if s["tflops_source"] else "")
                     + (f", MFU {100 * s['mfu']:.1f}%" if s["mfu"] is not None else ""))
    else:
        lines.append("iterations: none logged")
    parallel = {k: v for k, v in s["parallel"].items() if k != "parameters_per_rank"}
    if parallel:
        lines.append("parallel: " + ", ".join(f"{k} {v}" for k, v in parallel.items()))
    lines.append(f"memory: peak allocated {num(s['max_allocated_mb'])} MB over {s['ranks_reporting_memory']} ranks")
    lines.append(f"events: {s['errors']} errors, {s['warnings']} warnings; {s['partial_lines']} partial lines ignored")
    return "\n".join(lines)

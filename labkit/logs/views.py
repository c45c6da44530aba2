"""What a person looks at after a run: the comparison table and plotly figures, each from parsed logs.

Every function takes one ParsedLog or a mapping {run name: ParsedLog} (runs keep the mapping's order) and returns a
DataFrame or a plotly Figure, so notebooks and the dashboard only arrange them.

    runs = {"baseline": parse_log("runs/base"), "fp16": parse_log("runs/fp16"), ...}
    comparison_table(runs, baseline="baseline", gpu="A100-80GB")
    loss_figure(runs).show()
"""
from __future__ import annotations

from typing import Mapping

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from labkit import catalog
from labkit.logs.derive import mean_phase_times, memory_per_rank, per_rank_timers, phase_times, steady_state, \
    throughput
from labkit.logs.parse import ParsedLog

COLORS = qualitative.Plotly + qualitative.D3


def _runs(runs) -> dict[str, ParsedLog]:
    if isinstance(runs, ParsedLog):
        return {"run": runs}
    if not isinstance(runs, Mapping) or not runs:
        raise TypeError("runs: give a ParsedLog or a non-empty mapping {run name: ParsedLog}")
    return dict(runs)


def comparison_table(runs, baseline: str | None = None, specs: Mapping | None = None,
                     gpu: str | None = None) -> pd.DataFrame:
    """One row per run: steady iteration time, speed-up over the baseline, peak memory, TFLOP/s per GPU and MFU.

    The speed-up compares samples per second (the same as iteration time when the global batch is equal; fairer when
    gradient accumulation changes the batch). specs: {run: RunSpec} to supply what a log does not print (model shape
    for TFLOP/s, the GPUs for MFU); gpu: one catalog GPU name for every run.

    Taught in labs 01, 02, 03, 04 and 07.
    """
    runs = _runs(runs)
    baseline = baseline or next(iter(runs))
    if baseline not in runs:
        raise KeyError(f"baseline: {baseline!r} is not one of the runs ({', '.join(runs)})")
    rows = {}
    for name, parsed in runs.items():
        speed = throughput(parsed, spec=(specs or {}).get(name), gpu=gpu)
        memory = memory_per_rank(parsed)
        args = parsed.arguments
        rows[name] = {
            "iteration_ms": speed.iteration_ms,
            "samples_per_s": speed.samples_per_s,
            "tokens_per_s": speed.tokens_per_s,
            "max_allocated_mb": memory["peak_allocated_mb"].max() if len(memory) else None,
            "tflops_per_gpu": speed.tflops_per_gpu,
            "tflops_source": speed.tflops_source,
            "mfu": speed.mfu,
            "global_batch_size": speed.global_batch_size,
            "num_micro_batches": parsed.parallel.get("num_micro_batches"),
            "precision": speed.precision,
            "recompute": _recompute(args),
            "warmup_excluded": speed.steady.warmup_iterations if speed.steady else [],
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    speed = pd.to_numeric(table["samples_per_s"], errors="coerce")
    if not pd.notna(speed[baseline]):
        # Without the batch size, compare time per iteration.
        speed = 1 / pd.to_numeric(table["iteration_ms"], errors="coerce")
    table.insert(1, "speedup", speed / speed[baseline])
    table.index.name = "run"
    return table


def _recompute(args: dict) -> str | None:
    if args.get("recompute_granularity"):
        method = args.get("recompute_method")
        return f"{args['recompute_granularity']}" + (f" ({method})" if method else "")
    if args.get("checkpoint_activations") or args.get("activations_checkpoint_method"):
        return "full"
    return "none" if args else None


def loss_figure(runs, validation: bool = True) -> go.Figure:
    """Training loss against iteration for each run; validation losses as markers on the same axes.

    Taught in labs 01, 02, 04 and 08.
    """
    runs = _runs(runs)
    fig = go.Figure()
    for k, (name, parsed) in enumerate(runs.items()):
        color = COLORS[k % len(COLORS)]
        its = parsed.iterations.dropna(subset=["lm_loss"])
        fig.add_trace(go.Scatter(x=its["iteration"], y=its["lm_loss"], mode="lines+markers", name=name,
                                 line={"color": color}, marker={"size": 4}))
        val = parsed.validation.dropna(subset=["iteration", "lm_loss"]) if validation else parsed.validation[:0]
        val = val[val["split"].isin(["valid", "validation", "val"])]  # not the test set
        if len(val):
            fig.add_trace(go.Scatter(x=val["iteration"], y=val["lm_loss"], mode="markers", name=f"{name} (validation)",
                                     marker={"color": color, "symbol": "diamond-open", "size": 9}))
    fig.update_layout(title="Loss", xaxis_title="iteration", yaxis_title="lm loss", template="plotly_white")
    return fig


def iteration_time_figure(runs) -> go.Figure:
    """Elapsed time per iteration for each run, warm-up and spikes marked, the steady-state mean as a dotted line.

    Taught in labs 02, 03 and 04.
    """
    runs = _runs(runs)
    fig = go.Figure()
    kept_ms, off_scale = [], []
    for k, (name, parsed) in enumerate(runs.items()):
        color = COLORS[k % len(COLORS)]
        its = parsed.iterations.dropna(subset=["elapsed_ms"])
        steady = steady_state(parsed.iterations)
        left_out = set(steady.warmup_iterations) | set(steady.outlier_iterations)
        symbols = ["x" if i in left_out else "circle" for i in its["iteration"]]
        fig.add_trace(go.Scatter(x=its["iteration"], y=its["elapsed_ms"], mode="lines+markers", name=name,
                                 line={"color": color}, marker={"symbol": symbols, "size": 7}))
        kept_ms += [ms for i, ms in zip(its["iteration"], its["elapsed_ms"]) if i not in left_out]
        off_scale += [(name, i, ms) for i, ms in zip(its["iteration"], its["elapsed_ms"]) if i in left_out]
        if steady.iteration_ms is not None and len(its):
            fig.add_trace(go.Scatter(x=[its["iteration"].min(), its["iteration"].max()],
                                     y=[steady.iteration_ms] * 2, mode="lines", name=f"{name} steady",
                                     line={"color": color, "dash": "dot"}))
    title = "Time per iteration (x: warm-up and spikes left out of the steady mean)"
    if kept_ms:
        # A profiled or warm-up iteration can take seconds where the steady ones take milliseconds: scale the axis
        # to the steady ones and name those that run off it.
        top = 1.5 * max(kept_ms)
        beyond = [f"{name} {i}: {ms:,.0f} ms" for name, i, ms in off_scale if ms > top]
        fig.update_yaxes(range=[0, top])
        if beyond:
            title += "<br><sup>off the scale: " + "; ".join(beyond[:4]) + ("; ..." if len(beyond) > 4 else "") + \
                "</sup>"
    fig.update_layout(title=title, xaxis_title="iteration", yaxis_title="time per iteration (ms)",
                      template="plotly_white")
    return fig


def memory_figure(parsed: ParsedLog, gpu: str | None = None) -> go.Figure:
    """Memory per rank at its last report: allocated, peak allocated, reserved; the GPU's usable memory as a line."""
    table = memory_per_rank(parsed)
    labels = [_rank_label(r) for r in table.itertuples()]
    fig = go.Figure()
    for column, label in (("allocated_mb", "allocated"), ("peak_allocated_mb", "max allocated"),
                          ("reserved_mb", "reserved")):
        fig.add_trace(go.Bar(x=labels, y=table[column], name=label))
    if gpu is not None:
        limit_mb = catalog.gpu(gpu).memory_limit_gb * 1024
        fig.add_hline(y=limit_mb, line_dash="dash", annotation_text=f"{gpu} usable memory")
    fig.update_layout(title="Memory per rank", barmode="group", xaxis_title="rank", yaxis_title="MB",
                      template="plotly_white")
    return fig


def _rank_label(row) -> str:
    rank = "?" if pd.isna(row.rank) else int(row.rank)
    return f"rank {rank}" + (f" ({row.node})" if isinstance(row.node, str) else "")


def timer_breakdown_figure(runs) -> go.Figure:
    """Where an iteration's time goes, as stacked bars of the leaf timers (slowest rank per phase).

    Several runs: one bar per run (mean over its steady iterations). One run: one bar per timed iteration.

    Taught in lab 07.
    """
    if isinstance(runs, ParsedLog):
        table = phase_times(runs)
        x, title = [str(i) for i in table.index], "Timer breakdown per iteration"
    else:
        runs = _runs(runs)
        table = pd.DataFrame({name: mean_phase_times(p) for name, p in runs.items()}).T
        x, title = list(table.index), "Timer breakdown per run (steady iterations)"
    # A timer a run (or an iteration) lacks is NaN, and a NaN bar restarts plotly's stack, hiding every phase above
    # it: it stacks as 0 ms instead.
    table = table.fillna(0.0)
    fig = go.Figure()
    for k, phase in enumerate(table.columns):
        fig.add_trace(go.Bar(x=x, y=table[phase], name=phase, marker={"color": COLORS[k % len(COLORS)]}))
    fig.update_layout(title=title, barmode="stack", yaxis_title="ms", template="plotly_white")
    return fig


def timeline_figure(parsed: ParsedLog, node: str | None = None, iterations: list[int] | None = None) -> go.Figure:
    """Per-rank timeline of one iteration's timers: every rank of a node (or the job) on its own row, its phases laid
    end to end (mean over the chosen iterations), like the report of FASOP's Megatron-LM scripts.

    Ranks come from per-rank timers; a log with only Megatron's (min, max) summary shows the fastest and slowest rank.
    """
    table = per_rank_timers(parsed, node=node, iterations=iterations)
    fig = go.Figure()
    for k, phase in enumerate(table.columns):
        durations = table[phase].fillna(0.0)
        starts = table[list(table.columns[:k])].fillna(0.0).sum(axis=1) if k else durations * 0
        fig.add_trace(go.Bar(y=list(table.index), x=durations, base=starts, orientation="h", name=phase,
                             marker={"color": COLORS[k % len(COLORS)]},
                             hovertemplate=f"{phase}: %{{x:.2f}} ms (from %{{base:.2f}} ms)<extra>%{{y}}</extra>"))
    where = f"node {node}" if node else "all ranks"
    fig.update_layout(title=f"Timeline of an iteration's timers, {where}", barmode="overlay", xaxis_title="ms",
                      yaxis={"autorange": "reversed"}, template="plotly_white", height=200 + 28 * max(1, len(table)))
    return fig

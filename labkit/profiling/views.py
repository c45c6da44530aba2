"""plotly figures and comparison tables over the profiling readers; every function returns a figure or a DataFrame.

Runs are given as Trace objects or as run directories / trace files (the lowest profiled rank is read). Comparisons
take a mapping of label -> run, e.g. {"fp32": ..., "bf16": ...} or {"recompute off": ..., "recompute on": ...}.
"""
from __future__ import annotations

from typing import Mapping

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.profiling import trace as tr

CATEGORY_COLORS = {"matmul": "#1f77b4", "attention": "#9467bd", "elementwise": "#ff7f0e", "normalization": "#8c564b",
                   "communication": "#d62728", "memory": "#7f7f7f", "other": "#bcbd22"}
SPLIT_COLORS = {"computation": "#2ca02c", "overlapping": "#17becf", "communication": "#d62728", "other": "#c7c7c7"}


def operator_figure(run, top: int = 15) -> go.Figure:
    """Horizontal bars: the operators with the most self time, coloured by category."""
    ops = tr.operators(_trace(run)).head(top).iloc[::-1]
    fig = px.bar(ops, x="self_ms", y="operator", color="category", orientation="h", color_discrete_map=CATEGORY_COLORS,
                 hover_data=["calls", "total_ms"], labels={"self_ms": "self time (ms)", "operator": ""},
                 title=f"Top {len(ops)} operators by self time")
    return fig.update_layout(yaxis={"categoryorder": "array", "categoryarray": ops["operator"].tolist()})


def kernel_figure(run, top: int = 15) -> go.Figure:
    """Horizontal bars: the GPU kernels with the most time, coloured by category, tensor-core kernels marked."""
    t = _trace(run)
    ks = tr.kernels(t).head(top).iloc[::-1]
    if ks.empty:
        raise ValueError(f"{t.path}: a CPU trace has no GPU kernels; use operator_figure")
    ks = ks.assign(label=[f"{'[TC] ' if tc else ''}{name[:70]}" for name, tc in zip(ks["kernel"], ks["tensor_core"])])
    share = tr.tensor_core_share(t)
    return px.bar(ks, x="total_ms", y="label", color="category", orientation="h", color_discrete_map=CATEGORY_COLORS,
                  hover_data=["kernel", "calls", "mean_us"], labels={"total_ms": "time (ms)", "label": ""},
                  title=f"Top {len(ks)} kernels; tensor cores {share:.1%} of kernel time")


def breakdown_figure(runs) -> go.Figure:
    """Stacked bars of the time share by category (matmul, attention, elementwise, ...), one bar per run.

    Taught in lab 02.
    """
    table = breakdown_table(runs)
    fig = px.bar(table, x="share", y="run", color="category", orientation="h", color_discrete_map=CATEGORY_COLORS,
                 hover_data=["time_ms"], labels={"share": "share of time", "run": ""}, title="Where the time goes",
                 category_orders={"category": list(tr.CATEGORIES), "run": list(_runs(runs))})
    return fig.update_layout(xaxis_tickformat=".0%", barmode="stack")


def breakdown_table(runs) -> pd.DataFrame:
    """Long table of run, category, time_ms, share (one run may be given as a single Trace or path)."""
    return pd.concat([tr.breakdown(t).assign(run=label) for label, t in _runs(runs).items()], ignore_index=True)


def compute_communication_figure(traces) -> go.Figure:
    """Per rank, stacked bars of computation / overlapping / communication / other time (ms) over the profiled steps."""
    split = tr.compute_communication(_rank_traces(traces))
    fig = go.Figure()
    for part, color in SPLIT_COLORS.items():
        fig.add_bar(name=part, y=[f"rank {r}" for r in split["rank"]], x=split[f"{part}_ms"], orientation="h",
                    marker_color=color, customdata=split[f"{part}_share"],
                    hovertemplate="%{x:.1f} ms (%{customdata:.1%})")
    return fig.update_layout(barmode="stack", title="Computation vs communication per rank",
                             xaxis_title="time over the profiled steps (ms)")


def communication_group_figure(traces, tensor: int = 1, pipeline: int = 1, context: int = 1) -> go.Figure:
    """Per rank, stacked bars of communication time by parallel group (tp / cp / dp / pp).

    Taught in lab 07.
    """
    groups = tr.communication_by_group(_rank_traces(traces), tensor, pipeline, context)
    groups = groups.assign(rank=[f"rank {r}" for r in groups["rank"]])
    return px.bar(groups, x="time_ms", y="rank", color="group", orientation="h", hover_data=["calls", "share"],
                  category_orders={"group": list(tr.GROUPS)}, labels={"time_ms": "communication time (ms)", "rank": ""},
                  title="Communication per parallel group")


def memory_figure(runs) -> go.Figure:
    """Allocated memory over the profiled steps, one line per run (overlaid to compare, e.g. recompute on vs off).

    Taught in labs 02, 03 and 04.
    """
    fig = go.Figure()
    for label, t in _runs(runs).items():
        curve = tr.memory_curve(t)
        fig.add_scatter(x=curve["time_ms"], y=curve["allocated_mb"], name=label, mode="lines", line_shape="hv")
    return fig.update_layout(title="Memory over the profiled steps",
                             xaxis_title="time from the first profiled step (ms)",
                             yaxis_title="allocated (MB)")


def memory_timeline_figure(path) -> go.Figure:
    """Stacked areas of a memory timeline by category (parameters, activations, gradients, ...)."""
    timeline = tr.memory_timeline(path)
    fig = go.Figure()
    for category in tr.MEMORY_TIMELINE_CATEGORIES:
        fig.add_scatter(x=timeline["time_ms"], y=timeline[f"{category}_mb"], name=category, stackgroup="memory",
                        mode="lines", line_shape="hv")
    return fig.update_layout(title="Memory by category", xaxis_title="time (ms)", yaxis_title="MB")


def comparison_table(runs) -> pd.DataFrame:
    """One row per run: step time, category shares, tensor-core share, communication share, memory peak growth and
    memory saved for the backward pass.

    Taught in labs 02, 03 and 04.
    """
    rows = []
    for label, t in _runs(runs).items():
        st, parts, mem = tr.steps(t), tr.breakdown(t).set_index("category")["share"], tr.memory_per_step(t)
        split = tr.compute_communication(t).iloc[0]
        rows.append({"run": label, "profiled_steps": len(st), "step_ms": st["duration_ms"].mean(),
                     **{f"{c}_share": parts[c] for c in ("matmul", "attention", "elementwise")},
                     "tensor_core_share": tr.tensor_core_share(t),
                     "communication_share": split["communication_share"] + split["overlapping_share"],
                     "peak_growth_mb": mem["growth_mb"].max() if len(mem) else None,
                     "saved_mb": mem["saved_mb"].max() if mem["saved_mb"].notna().any() else None})
    return pd.DataFrame(rows)


def comparison_figure(runs) -> go.Figure:
    """Two runs (or more) side by side: time share by category on the left, memory over the steps on the right."""
    runs = _runs(runs)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55],
                        subplot_titles=("Share of time by category", "Allocated memory (MB)"))
    table = breakdown_table(runs)
    for category in tr.CATEGORIES:
        part = table[table["category"] == category]
        fig.add_bar(x=part["run"], y=part["share"], name=category, marker_color=CATEGORY_COLORS[category],
                    legendgroup="category", row=1, col=1)
    for label, t in runs.items():
        curve = tr.memory_curve(t)
        fig.add_scatter(x=curve["time_ms"], y=curve["allocated_mb"], name=label, mode="lines", line_shape="hv",
                        legendgroup="memory", row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=1)
    fig.update_xaxes(title_text="time from the first profiled step (ms)", row=1, col=2)
    return fig.update_layout(barmode="stack", title=" vs ".join(runs))


def scalars_figure(scalars: pd.DataFrame, tags: list[str]) -> go.Figure:
    """TensorBoard scalars (from tensorboard.read_scalars) over steps, one panel per tag, one line per run.

    Taught in lab 02.
    """
    frame = scalars[scalars["tag"].isin(tags)]
    missing = sorted(set(tags) - set(frame["tag"]))
    if missing:
        raise KeyError(f"no scalar tag {missing}; the runs have {sorted(scalars['tag'].unique())}")
    fig = px.line(frame, x="step", y="value", color="run", facet_row="tag", category_orders={"tag": tags},
                  height=120 + 260 * len(tags), title="TensorBoard scalars")
    fig.update_yaxes(matches=None, title_text="")
    for trace in fig.data:  # a tag whose values span two orders of magnitude or more (a loss scale) gets a log axis
        values = frame.loc[(frame["run"] == trace.legendgroup) & (frame["tag"] == _tag_of(trace)), "value"]
        if len(values) and values.min() > 0 and values.max() >= 100 * values.min():
            fig.layout["yaxis" + trace.yaxis[1:]].type = "log"
    return fig


def _tag_of(trace) -> str:
    """The facet a plotly express trace was drawn in (its hover template names it)."""
    return trace.hovertemplate.split("tag=", 1)[1].split("<br>", 1)[0]


def _trace(run) -> tr.Trace:
    return run if isinstance(run, tr.Trace) else tr.load_traces(run)[0]


def _rank_traces(traces) -> list[tr.Trace]:
    if isinstance(traces, tr.Trace):
        return [traces]
    if isinstance(traces, (list, tuple)):
        return [t if isinstance(t, tr.Trace) else tr.load_trace(t) for t in traces]
    return tr.load_traces(traces)


def _runs(runs) -> dict[str, tr.Trace]:
    if isinstance(runs, Mapping):
        return {str(label): _trace(run) for label, run in runs.items()}
    t = _trace(runs)
    return {t.path.parent.name: t}

"""What the planner shows: the ranked table (FASOP's columns), the cost/time Pareto chart, a pipeline schedule (the
estimator's own events, labkit.estimate.timing)."""
from __future__ import annotations

import pandas as pd

from labkit.estimate.timing import Event, Pipeline

TABLE_COLUMNS = {
    "mbs": "micro", "tp": "tp", "cp": "cp", "ep": "ep", "etp": "etp", "dp": "dp", "pp": "pp", "virtual_stages": "vp",
    "sequence_parallel": "sp",
    "recompute_granularity": "recompute", "distributed_optimizer": "dist opt", "zero_stage": "ZeRO",
    "placement": "placement",
    "partition": "partition", "idle_gpus": "idle GPUs",
    "estimated_s": "s/step", "pipeline_s": "pipeline s", "dp_allreduce_s": "DP all-reduce s",
    "embedding_allreduce_s": "embedding all-reduce s", "price_per_step": "USD/step", "oom": "oom",
    "memory_gb_per_stage": "max GB/stage",
}


def _short_placement(names: list[str]) -> str:
    """A100-40GB x1, A10 x7 -> 'A100-40GB A10x7' (runs of one kind collapsed)."""
    runs: list[list] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return " ".join(name if n == 1 else f"{name}x{n}" for name, n in runs)


def ranked_table(plan, top: int | None = None) -> pd.DataFrame:
    """The ranked rows with FASOP's columns (plus virtual stages, sequence parallelism, recompute, the distributed
    optimizer, and the GPUs of stages left without transformer layers, which the price still counts; for a
    mixture-of-experts model the expert-parallel and expert-tensor sizes).

    Taught in lab 06.
    """
    rows = plan.rows[:top] if top else plan.rows
    # the expert-parallel columns for a mixture-of-experts model only
    moe = any(r.spec is not None and r.spec.model.num_experts for r in rows)
    columns = {key: label for key, label in TABLE_COLUMNS.items() if moe or key not in ("ep", "etp")}
    records = []
    for r in rows:
        rec = {label: getattr(r, key) for key, label in columns.items()}
        if moe:
            rec["etp"] = r.etp or r.tp
        rec["placement"] = _short_placement(r.placement)
        rec["partition"] = "-".join(str(n) for n in r.partition)
        rec["recompute"] = r.recompute_granularity or "-"
        rec["max GB/stage"] = round(max(r.memory_gb_per_stage), 2)
        for key in ("s/step", "pipeline s", "DP all-reduce s", "embedding all-reduce s"):
            rec[key] = round(rec[key], 4)
        rec["USD/step"] = round(rec["USD/step"], 5)
        records.append(rec)
    return pd.DataFrame.from_records(records, columns=list(columns.values()))


def layout_name(row) -> str:
    """Every layout field of a plan row on one line, as the table's columns name them: 'tp4 cp2 pp8 vp5 dp2 micro 1,
    sequence parallel, distributed optimizer, no recompute, partition 10-10-..., on H100-SXMx8'."""
    experts = f" ep{row.ep} etp{row.etp or row.tp}" if row.ep > 1 or (row.spec and row.spec.model.num_experts) else ""
    parts = [f"tp{row.tp} cp{row.cp}{experts} pp{row.pp} vp{row.virtual_stages} dp{row.dp} micro {row.mbs}",
             "sequence parallel" if row.sequence_parallel else "no sequence parallel",
             ("ZeRO stage 2 (optimizer states and gradients sharded)" if row.zero_stage == 2 else
              "ZeRO stage 3 (optimizer states, gradients and parameters sharded)") if row.zero_stage > 1 else
             "distributed optimizer" if row.distributed_optimizer else "no distributed optimizer",
             f"{row.recompute_granularity} recompute" if row.recompute_granularity else "no recompute"]
    if row.pp > 1:
        parts.append("partition " + "-".join(str(n) for n in row.partition))
    if row.spec.parallel.account_for_embedding_in_pipeline_split:
        parts.append("embedding and loss counted as layers")
    return ", ".join(parts) + f", on {_short_placement(row.placement)}"


MARKERS = {"homogeneous-0": "square", "homogeneous-1": "circle", "heterogeneous": "triangle-up"}


def pareto_figure(sweep: pd.DataFrame, title: str = "Cost and time per step by cluster composition"):
    """Scatter of price per step against step time, one point per cluster composition; marker shape by cluster type
    (square and circle for the two homogeneous kinds, triangle for mixed clusters), front joined.

    Taught in lab 06.
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    for kind, group in sweep.groupby("cluster_type", sort=False):
        fig.add_trace(go.Scatter(
            x=group["estimated_s"], y=group["price_per_step"], mode="markers", name=kind,
            marker=dict(symbol=group["marker"].iloc[0], size=10, opacity=0.75),
            text=group["cluster"], customdata=group[["tp", "dp", "pp", "mbs"]].values,
            hovertemplate="%{text}<br>%{x:.3f} s/step, $%{y:.4f}/step<br>"
                          "tp %{customdata[0]} dp %{customdata[1]} pp %{customdata[2]} mbs %{customdata[3]}<extra></extra>"))
    front = sweep[sweep["pareto"]].sort_values("estimated_s")
    fig.add_trace(go.Scatter(x=front["estimated_s"], y=front["price_per_step"], mode="lines", name="Pareto front",
                             line=dict(color="black", dash="dot")))
    fig.update_layout(title=title, xaxis_title="estimated time per step (s)", yaxis_title="price per step (USD)")
    return fig


def schedule_events(pipeline: Pipeline) -> pd.DataFrame:
    """Start and end of every forward and backward (of every model chunk, when interleaved) of the 1F1B schedule the
    pipeline's time comes from, for drawing it. `Estimate.pipeline` and `Row.pipeline` are the ones estimated."""
    return pd.DataFrame(pipeline.events(), columns=list(Event._fields))


def schedule_figure(pipeline: Pipeline, stage_labels: list[str] | None = None, title: str | None = None):
    """Gantt chart of one step's forwards (light) and backwards (dark) per stage, micro-batch numbers on the bars
    (and the model chunk in the hover text when the schedule is interleaved).

    Taught in labs 06 and 07.
    """
    import plotly.graph_objects as go

    events = schedule_events(pipeline)
    labels = stage_labels or [f"stage {i}" for i in range(len(pipeline.stage_times_s))]
    v = pipeline.virtual_stages
    fig = go.Figure()
    for op, color in (("forward", "#9ecae1"), ("backward", "#3182bd")):
        sub = events[events["op"] == op]
        fig.add_trace(go.Bar(
            y=[labels[i] for i in sub["stage"]], x=sub["end_s"] - sub["start_s"], base=sub["start_s"],
            orientation="h", name=op, marker_color=color, text=sub["micro_batch"], textposition="inside",
            customdata=sub["chunk"],
            hovertemplate="micro-batch %{text}, chunk %{customdata}: %{base:.4f} s + %{x:.4f} s<extra>" + op
                          + "</extra>"))
    default_title = "1F1B pipeline schedule" if v == 1 else f"interleaved 1F1B pipeline schedule, {v} chunks per stage"
    fig.update_layout(title=title or default_title, barmode="overlay", xaxis_title="seconds",
                      yaxis=dict(autorange="reversed"), bargap=0.2)
    return fig

"""Calculators for notebooks: plain functions returning DataFrames and plotly figures (widgets wrap them elsewhere)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from labkit import catalog
from labkit.estimate.flops import training_days
from labkit.estimate.params import Shape, gpt_params, total_params
from labkit.spec import ModelSpec

# The size table awsome-distributed-training's Megatron-LM test case uses: Narayanan et al. SC21 Table 1, 1.7B to 310B.
SC21_PRESETS = ["gpt-1.7b", "gpt-3.6b", "gpt-7.5b", "gpt-18.4b", "gpt-39.1b", "gpt-76.1b", "gpt-145.6b", "gpt-310.1b"]


def _shape(preset: str) -> Shape:
    return Shape.of(ModelSpec(**{k: v for k, v in catalog.models()[preset].items() if k != "source"}))


def model_size_table(presets: list[str] | None = None) -> pd.DataFrame:
    """Layers, hidden size, heads and parameter count of model presets (default: SC21's 1.7B..310B).

    Taught in lab 05.
    """
    rows = []
    for name in presets or SC21_PRESETS:
        shape = _shape(name)
        rows.append({"model": name, "layers": shape.num_layers, "hidden": shape.hidden, "heads": shape.heads,
                     "seq_length": shape.seq_length, "vocab": shape.vocab,
                     "params": total_params(shape), "params_B": round(total_params(shape) / 1e9, 1),
                     "formula_params": gpt_params(shape.num_layers, shape.hidden, shape.seq_length, shape.vocab)})
    return pd.DataFrame(rows)


def days_per_epoch(params: float, tokens: float, gpu_counts: list[int], tflops_per_gpu: float,
                   recompute: bool = True) -> pd.DataFrame:
    """Training days for `tokens` tokens at an achieved TFLOP/s per GPU, for each GPU count (SC21 eq. 4).

    Taught in lab 05.
    """
    return pd.DataFrame([{"gpus": n, "tflops_per_gpu": tflops_per_gpu,
                          "days": training_days(tokens, params, n, tflops_per_gpu, recompute)} for n in gpu_counts])


def memory_table(est) -> pd.DataFrame:
    """Memory per GPU of each pipeline stage (GiB) from an Estimate, with its limit and verdict."""
    df = pd.DataFrame(est.memory_detail)
    df.insert(0, "stage", range(len(df)))
    df.insert(1, "gpu", est.stage_gpus)
    df["limit"] = est.memory_limit_gb_per_stage
    return df


def memory_bars(est) -> go.Figure:
    """Stacked bars of weights, gradients, optimizer state and activations per stage, with each GPU's memory.

    Taught in lab 05.
    """
    df = memory_table(est)
    labels = [f"stage {i} ({g})" for i, g in zip(df["stage"], df["gpu"])]
    fig = go.Figure()
    for part in ("weights", "gradients", "optimizer", "activations"):
        fig.add_bar(name=part, x=labels, y=df[part])
    fig.add_scatter(name="GPU memory", x=labels, y=df["limit"], mode="lines+markers", line={"dash": "dash"})
    fig.update_layout(barmode="stack", yaxis_title="GiB per GPU", title="Memory per GPU by pipeline stage")
    return fig


def breakdown_table(est) -> pd.DataFrame:
    """Seconds and share of the iteration for each part of the breakdown.

    Taught in lab 05.
    """
    total = est.iteration_time_s
    return pd.DataFrame([{"part": k, "seconds": v, "share": v / total if total else 0.0}
                         for k, v in est.breakdown.items()])


def time_breakdown(est) -> go.Figure:
    """One stacked horizontal bar: where an iteration's time goes.

    Taught in lab 05.
    """
    df = breakdown_table(est)
    fig = go.Figure()
    for row in df.itertuples():
        fig.add_bar(name=row.part, y=["iteration"], x=[row.seconds], orientation="h",
                    hovertemplate=f"{row.part}: %{{x:.4g}} s ({100 * row.share:.1f}%)<extra></extra>")
    fig.update_layout(barmode="stack", xaxis_title="seconds", height=260,
                      title=f"Iteration time {est.iteration_time_s:.3g} s")
    return fig


def compare_measured(predicted_s: float, measured_s: float) -> pd.DataFrame:
    """Prediction beside measurement, as the labs show them.

    Taught in lab 06.
    """
    return pd.DataFrame([{"predicted_s": predicted_s, "measured_s": measured_s,
                          "error": (predicted_s - measured_s) / measured_s}])

"""Calculators for notebooks: plain functions returning DataFrames and plotly figures (widgets wrap them elsewhere)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from labkit import catalog
from labkit.estimate.flops import training_days
from labkit.estimate.memory import StageMemory
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


# Layouts a Megatron user would start from, per model: (tensor, pipeline) on nodes of 8 GPUs, as in Llama 2/3 and
# Megatron-LM's published recipes (tensor parallelism within a node, pipeline across nodes for the largest).
LLAMA_LAYOUTS = {"llama2-7b": (1, 1), "llama3-8b": (2, 1), "llama2-13b": (2, 1), "llama2-70b": (8, 2),
                 "llama3-70b": (8, 2)}


def sizing_table(gpu: str, nodes: int, layouts: dict[str, tuple[int, int]] | None = None, global_batch: int = 1024,
                 seq_length: int | None = None) -> pd.DataFrame:
    """Each model on `nodes` nodes of 8 `gpu`s in bf16 with the distributed optimizer and selective recompute (sequence
    parallel where tensor > 1):
    parameters, the fullest GPU's memory, whether it fits, iteration time, MFU and training days per trillion tokens.
    A layout that does not divide the cluster or the batch is reported as a row with its reason.

    Taught in lab 05.
    """
    from labkit.estimate.estimator import estimate
    from labkit.spec import SpecError, load_spec

    rows = []
    for preset, (tensor, pipeline) in (layouts or LLAMA_LAYOUTS).items():
        model = {"preset": preset, **({"seq_length": seq_length} if seq_length else {})}
        row = {"model": preset, "tensor": tensor, "pipeline": pipeline, "gpus": nodes * 8}
        try:
            spec = load_spec({"name": preset, "model": model, "precision": "bf16",
                              "parallel": {"tensor": tensor, "pipeline": pipeline, "sequence_parallel": tensor > 1},
                              "recompute": {"granularity": "selective"}, "optimizer": {"distributed": True},
                              "batch": {"micro": 1, "global": global_batch},
                              "cluster": {"nodes": [{"gpu": gpu, "count": nodes, "gpus_per_node": 8}]}})
        except SpecError as exc:
            rows.append({**row, "problem": exc.errors[0]})
            continue
        est = estimate(spec)
        tokens_per_iteration = global_batch * spec.model.seq_length
        rows.append({**row, "params_B": round(est.params / 1e9, 2), "data": spec.data_parallel,
                     "memory_gb": round(max(est.memory_gb_per_stage), 1), "fits": est.fits_in_memory,
                     "iteration_s": round(est.iteration_time_s, 2), "mfu": round(est.mfu, 3),
                     "days_per_T_tokens": round(1e12 / tokens_per_iteration * est.iteration_time_s / 86400, 1)})
    return pd.DataFrame(rows)


def memory_table(est) -> pd.DataFrame:
    """Memory per GPU of each pipeline stage (GiB) from an Estimate, with its limit and verdict."""
    df = pd.DataFrame(est.memory_detail)
    df.insert(0, "stage", range(len(df)))
    df.insert(1, "gpu", est.stage_gpus)
    df["limit"] = est.memory_limit_gb_per_stage
    return df


def memory_bars(est) -> go.Figure:
    """Stacked bars of weights, gradients, optimizer state and activations per stage, with each GPU's memory. The
    optimizer step's fp32 working copies (StageMemory.step_only, with an evaluation's forward where the run validates)
    use the memory the activations free before the step: the optimizer bar leaves them out and the last bar is the
    larger of the two, named by which it is, so that a stage's bars add up to its peak.

    Taught in lab 05.
    """
    df = memory_table(est)
    labels = [f"stage {i} ({g})" for i, g in zip(df["stage"], df["gpu"])]
    # what the optimizer step's phase holds beyond the model state both phases share (StageMemory.optimizer_step)
    phases = [StageMemory(**{k: v for k, v in d.items() if k != "total"}) for d in est.memory_detail]
    step = pd.Series([m.optimizer_step - (m.weights + m.gradients + m.optimizer - m.step_only) for m in phases])
    last = ["activations" if a >= s else "the optimizer step's copies" for a, s in zip(df["activations"], step)]
    parts = {"weights": df["weights"], "gradients": df["gradients"], "optimizer": df["optimizer"] - df["step_only"],
             "activations": df["activations"].where(df["activations"] >= step, step)}
    fig = go.Figure()
    for part, gib in parts.items():
        fig.add_bar(name=part, x=labels, y=gib, customdata=last if part == "activations" else [part] * len(labels),
                    hovertemplate="%{customdata}: %{y:.3g} GiB<extra></extra>")
    fig.add_scatter(name="GPU memory", x=labels, y=df["limit"], mode="lines+markers", line={"dash": "dash"})
    fig.update_layout(barmode="stack", yaxis_title="GiB per GPU", title="Memory per GPU by pipeline stage")
    return fig


def breakdown_table(est) -> pd.DataFrame:
    """Seconds and share of the iteration for each part of the breakdown (the token all-to-all, ep_comm, only where a
    mixture-of-experts model spends any).

    Taught in lab 05.
    """
    total = est.iteration_time_s
    return pd.DataFrame([{"part": k, "seconds": v, "share": v / total if total else 0.0}
                         for k, v in est.breakdown.items() if v or k != "ep_comm"])


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

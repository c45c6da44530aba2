"""Figures derived from a parsed log: steady-state iteration time, tokens/s, TFLOP/s per GPU, MFU, timer tables.

The first logged interval carries start-up (allocator, kernels, data loader) and is never steady; spikes such as an
evaluation or a checkpoint save inside an interval are not steady either. `steady_state` leaves both out and says which
iterations it left out, so a reader can check the choice.

TFLOP/s per GPU are the log's own when it prints them; otherwise they are computed with the estimator's model-FLOPs
formula (labkit.megatron.flops.model_flops) from the model shape in the log's arguments block or from a RunSpec. No log
prints MFU: it is TFLOP/s per GPU over the GPU's peak from the catalog (labkit.catalog).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from labkit import catalog
from labkit.megatron.flags import FLAG
from labkit.megatron.flops import model_flops
from labkit.megatron.shape import Shape

# A leading interval this much slower than the median of the rest still belongs to the warm-up.
WARMUP_FACTOR = 1.10
# An interval this much slower than the steady median holds something else (evaluation, checkpoint save).
OUTLIER_FACTOR = 1.5
# Timers that are not per-iteration work.
NON_ITERATION_PHASES = {"evaluate", "save-checkpoint", "load-checkpoint", "model-and-optimizer-setup",
                        "train/valid/test-data-iterators-setup", "interval-time"}


@dataclass
class SteadyState:
    iteration_ms: float | None  # mean elapsed time per iteration over the steady intervals
    median_ms: float | None
    std_ms: float | None
    steady_iterations: list[int] = field(default_factory=list)
    warmup_iterations: list[int] = field(default_factory=list)  # leading intervals left out
    outlier_iterations: list[int] = field(default_factory=list)  # later intervals left out as spikes

    def to_dict(self) -> dict:
        return asdict(self)


def steady_state(iterations: pd.DataFrame, warmup: int | None = None) -> SteadyState:
    """Steady-state time per iteration from the interval lines.

    warmup: how many leading logged intervals to leave out; by default the first one, and any following ones more
    than WARMUP_FACTOR slower than the median of the rest. Intervals more than OUTLIER_FACTOR slower than the steady
    median are left out as spikes. With a single interval there is nothing to compare, so it is used as is.

    Taught in labs 01 and 06.
    """
    rows = iterations.dropna(subset=["elapsed_ms"]).sort_values("iteration")
    its = rows["iteration"].astype(int).tolist()
    ms = rows["elapsed_ms"].to_numpy(dtype=float)
    if len(ms) == 0:
        return SteadyState(None, None, None)
    if warmup is None:
        n = 1 if len(ms) > 1 else 0
        while n < len(ms) - 1 and ms[n] > WARMUP_FACTOR * np.median(ms[n + 1:]):
            n += 1
    else:
        n = max(0, min(int(warmup), len(ms) - 1))
    rest, rest_its = ms[n:], its[n:]
    median = float(np.median(rest))
    keep = rest <= OUTLIER_FACTOR * median
    steady = rest[keep]
    return SteadyState(
        iteration_ms=float(steady.mean()),
        median_ms=float(np.median(steady)),
        std_ms=float(steady.std()) if len(steady) > 1 else 0.0,
        steady_iterations=[i for i, k in zip(rest_its, keep) if k],
        warmup_iterations=its[:n],
        outlier_iterations=[i for i, k in zip(rest_its, keep) if not k],
    )


def shape_from_arguments(args: dict) -> Shape | None:
    """The model shape Megatron printed in its arguments block (None when a size is missing)."""
    def get(*names):
        for name in names:
            value = args.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    layers, hidden, heads = get("num_layers"), get("hidden_size"), get("num_attention_heads")
    seq, vocab = get("seq_length"), get("padded_vocab_size", "vocab_size")
    if None in (layers, hidden, heads, seq, vocab):
        return None
    groups = get("num_query_groups") if args.get("group_query_attention") else None
    kv_channels, experts = get("kv_channels"), get("num_experts")  # validate_args prints kv_channels always
    moe = {}
    if experts:  # validate_args prints the layer pattern as its list (an integer N stays N)
        freq = args.get("moe_layer_freq")
        moe = {"experts": experts, "topk": get("moe_router_topk") or FLAG.moe_router_topk.default,
               "expert_ffn": get("moe_ffn_hidden_size"), "shared_ffn": get("moe_shared_expert_intermediate_size"),
               "moe_layer_freq": None if freq in (None, 1) else str(freq)}
    return Shape(num_layers=layers, hidden=hidden, heads=heads, seq_length=seq, vocab=vocab, query_groups=groups,
                 kv_channels=kv_channels if kv_channels != hidden // heads else None, qk_layernorm=bool(args.get("qk_layernorm")), **moe,
                 ffn=get("ffn_hidden_size"), swiglu=bool(args.get("swiglu")),
                 tied=not args.get("untie_embeddings_and_output_weights", False),
                 norm=_text_arg(args, "normalization", "LayerNorm"),
                 positions=_text_arg(args, "position_embedding_type", "learned_absolute"),
                 bias=args.get("add_bias_linear", True) is not False,
                 hidden_dropout=_float_arg(args, "hidden_dropout", 0.1),
                 attention_dropout=_float_arg(args, "attention_dropout", 0.1))


def _text_arg(args: dict, name: str, default: str) -> str:
    value = args.get(name)
    return value if isinstance(value, str) and value else default


def _float_arg(args: dict, name: str, default: float) -> float:
    value = args.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def precision_from_arguments(args: dict) -> str | None:
    """fp32, fp16 or bf16 from the flags, or from `using torch.float16 for parameters ...`; None when not printed."""
    if args.get("bf16") is True:
        return "bf16"
    if args.get("fp16") is True:
        return "fp16"
    dtype = str(args.get("params_dtype", ""))
    for name, precision in (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32")):
        if dtype.endswith(name):
            return precision
    if "bf16" in args or "fp16" in args:
        return "fp32"
    return None


@dataclass
class Throughput:
    iteration_ms: float | None
    global_batch_size: int | None
    seq_length: int | None
    world_size: int | None
    samples_per_s: float | None
    tokens_per_s: float | None
    tflops_per_gpu: float | None
    tflops_source: str | None  # "log" (printed by the run) or "model FLOPs" (computed here)
    mfu: float | None
    peak_tflops_per_gpu: float | None
    gpu: str | None
    precision: str | None
    steady: SteadyState | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["steady"] = self.steady.to_dict() if self.steady else None
        return out


def throughput(parsed, spec=None, gpu: str | None = None, warmup: int | None = None) -> Throughput:
    """Steady-state speed of a run: tokens/s, TFLOP/s per GPU and MFU.

    spec: a labkit RunSpec; when given it supplies the model shape, batch, precision, world size and GPUs (its cluster)
    wherever the log does not print them. gpu: a catalog GPU name for every rank (overrides the spec's cluster).
    """
    its = parsed.iterations
    steady = steady_state(its, warmup)
    args = parsed.arguments
    steady_rows = its[its["iteration"].isin(steady.steady_iterations)] if steady.steady_iterations else its

    gbs = _median_int(steady_rows, "global_batch_size") or _int(args.get("global_batch_size"))
    if gbs is None and _int(args.get("batch_size")):
        # Megatron-LM before 2021 had only a per-data-parallel-rank `batch_size`.
        gbs = _int(args["batch_size"]) * (_int(parsed.parallel.get("data")) or 1)
    if gbs is None and spec is not None:
        gbs = spec.batch.global_
    shape = shape_from_arguments(args)
    if shape is None and spec is not None and spec.model.num_layers:
        shape = Shape.of(spec.model)
    seq = _median_int(steady_rows, "seq_length") or (shape.seq_length if shape else None) \
        or _tokens_per_sample(its) or _int(args.get("seq_length"))
    world = _int(parsed.parallel.get("world_size")) or _int(args.get("world_size"))
    if world is None and spec is not None:
        world = spec.world_size
    precision = precision_from_arguments(args) or (spec.precision if spec is not None else None)

    t = steady.iteration_ms
    samples_per_s = gbs / (t / 1000) if t and gbs else None
    tokens_per_s = samples_per_s * seq if samples_per_s and seq else None

    logged = steady_rows["tflops_per_gpu"].dropna() if "tflops_per_gpu" in steady_rows else pd.Series(dtype=float)
    computed = None
    if t and gbs and world and shape is not None:
        shape = Shape(**{**asdict(shape), "seq_length": seq or shape.seq_length})
        computed = model_flops(shape, gbs) / (t / 1000) / world / 1e12
    if len(logged) and (logged.mean() > 0 or computed is None):
        tflops, source = float(logged.mean()), "log"
    elif computed is not None:
        # a tiny model's logged figure rounds to 0.0 (Megatron prints one decimal): the model FLOPs say more
        tflops, source = computed, "model FLOPs" if not len(logged) else "model FLOPs (the log rounds to 0.0)"
    else:
        tflops, source = None, None

    peaks = _peaks(spec, gpu, world, precision)
    peak = float(np.mean(peaks)) if peaks else None
    mfu = tflops / peak if tflops and peak else None
    gpu_name = gpu or (_gpu_names(spec)[0] if spec is not None and len(set(_gpu_names(spec))) == 1 else None)
    return Throughput(iteration_ms=t, global_batch_size=gbs, seq_length=seq, world_size=world,
                      samples_per_s=samples_per_s, tokens_per_s=tokens_per_s, tflops_per_gpu=tflops,
                      tflops_source=source, mfu=mfu, peak_tflops_per_gpu=peak, gpu=gpu_name, precision=precision,
                      steady=steady)


def _gpu_names(spec) -> list[str]:
    return [g.gpu for g in spec.cluster_or_default().nodes for _ in range(g.count * g.gpus_per_node)]


def _peaks(spec, gpu, world, precision) -> list[float]:
    """Peak TFLOP/s of every rank's GPU (a mixed cluster has several).

    With the precision unknown, the 16-bit tensor-core peak is used, as published MFU figures do. A CPU has none:
    the catalog's `cpu` peak is a placeholder, so a run on it gets no MFU."""
    precision = precision or "bf16"
    if gpu is not None and catalog.gpu(gpu).is_cpu:
        return []
    if gpu is not None:
        return [_peak(catalog.gpu(gpu), precision)] * (world or 1)
    if spec is None:
        return []
    peaks = []
    for name in _gpu_names(spec):
        try:
            if catalog.gpu(name).is_cpu:
                return []
            peaks.append(_peak(catalog.gpu(name), precision))
        except KeyError:
            return []
    return peaks


def _peak(gpu, precision: str) -> float:
    for p in (precision, "fp16", "fp32"):
        if p in gpu.peak_tflops:
            return gpu.peak(p)
    raise KeyError(f"{gpu.name}: no peak TFLOP/s in the catalog")


def _int(value) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        value = int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite float (`seq_length inf`)
        return None
    return value if 0 < value < 2**63 else None  # beyond int64 it is a damaged line's number, not a size


def _median_int(df: pd.DataFrame, column: str) -> int | None:
    if column not in df:
        return None
    values = pd.to_numeric(df[column], errors="coerce").dropna()
    values = values[values.abs() < 2**63]  # infinite or beyond int64: a damaged line's number
    return int(values.median()) if len(values) else None


def _tokens_per_sample(its: pd.DataFrame) -> int | None:
    both = its.dropna(subset=["consumed_tokens", "consumed_samples"])
    both = both[both["consumed_samples"] > 0]
    if both.empty:
        return None
    return int(round(float((both["consumed_tokens"] / both["consumed_samples"]).median())))


# ---------------------------------------------------------------------------------------------------------------------
# Timers

def leaf_phases(phases) -> list[str]:
    """Phases that do not contain others, in first-seen order, so stacked times add up to the iteration.

    Megatron's `forward-backward` holds forward-compute, backward-compute and the pipeline sends; `optimizer` holds
    its `optimizer-*` steps; DeepSpeed prints `fwd` and `fwd_microstep` for the same work, and `bwd` holds `bwd_inner`
    and `bwd_allreduce`.
    """
    names = list(dict.fromkeys(p for p in phases if isinstance(p, str)))
    present = set(names)
    leaves = []
    for name in names:
        if name in NON_ITERATION_PHASES:
            continue
        if name == "forward-backward" and present & {"forward-compute", "backward-compute"}:
            continue
        if any(other != name and (other.startswith(name + "-") or other.startswith(name + "_inner"))
               for other in present):
            continue
        if name.endswith("_microstep") and name[:-len("_microstep")] in present:
            continue
        leaves.append(name)
    return leaves


def _leaf_timers(parsed, iterations: list[int] | None) -> tuple[pd.DataFrame, list[str]]:
    """Timer rows of logged iterations (those in `iterations`, when given) for leaf phases only, and those phases."""
    t = parsed.timers
    t = t[t["iteration"].notna()]
    if iterations is not None:
        t = t[t["iteration"].isin(iterations)]
    phases = leaf_phases(t["phase"])
    return t[t["phase"].isin(phases)], phases


def timer_table(parsed, by: str = "rank", iterations: list[int] | None = None) -> pd.DataFrame:
    """Mean milliseconds per leaf phase (columns) for each rank, task or node (rows), over training iterations.

    by: "rank", "task", "node", or "range" for the (min, max)-across-ranks form (rows "fastest rank", "slowest rank").
    Per-rank rows come from per-rank timers (Megatron's `times across ranks`, DeepSpeed's `[Rank N] time (ms)`, or
    one-line `time (ms)` printed by several ranks); a log with only the (min, max) summary gives the "range" rows.
    """
    t, phases = _leaf_timers(parsed, iterations)
    if t.empty:
        return pd.DataFrame()
    if by == "range":
        ranged = t.dropna(subset=["max_ms"])
        lo = ranged.groupby("phase")["min_ms"].mean()
        hi = ranged.groupby("phase")["max_ms"].mean()
        table = pd.DataFrame({"fastest rank": lo, "slowest rank": hi}).T
    else:
        keyed = t.dropna(subset=[by])
        if keyed.empty:
            return pd.DataFrame()
        table = keyed.groupby([by, "phase"])["ms"].mean().unstack("phase")
    return table[[p for p in phases if p in table.columns]]


def per_rank_timers(parsed, node: str | None = None, iterations: list[int] | None = None) -> pd.DataFrame:
    """The timer table the timeline draws: per rank where the log has it, else per srun task, else min/max."""
    p = parsed
    if node is not None:
        timers = parsed.timers[parsed.timers["node"] == node]
        p = _with_timers(parsed, timers)
    for by in ("rank", "task"):
        table = timer_table(p, by=by, iterations=iterations)
        if not table.empty and (len(table) > 1 or by == "task"):
            table.index = [f"{by} {int(i)}" for i in table.index]
            return table
    table = timer_table(p, by="range", iterations=iterations)
    if table.empty:
        table = timer_table(p, by="rank", iterations=iterations)
        table.index = [f"rank {int(i)}" for i in table.index]
    return table


def _with_timers(parsed, timers):
    from dataclasses import replace
    return replace(parsed, timers=timers)


# ---------------------------------------------------------------------------------------------------------------------
# Summary

def summarize(parsed, spec=None, gpu: str | None = None) -> dict:
    """The headline of a run: progress, loss, steady speed, memory, problems found."""
    its = parsed.iterations
    speed = throughput(parsed, spec=spec, gpu=gpu)
    losses = its["lm_loss"].dropna() if "lm_loss" in its else pd.Series(dtype=float)
    memory = parsed.memory
    peak_mem = memory["max_allocated_mb"].max() if "max_allocated_mb" in memory and len(memory) else None
    events = parsed.events
    return {
        "sources": list(parsed.sources),
        "formats": list(parsed.formats),
        "iterations_logged": int(len(its)),
        "first_iteration": _first(its["iteration"].min()) if len(its) else None,
        "last_iteration": _first(its["iteration"].max()) if len(its) else None,
        "train_iters": _first(its["train_iters"].max()) if len(its) else None,
        "last_lm_loss": float(losses.iloc[-1]) if len(losses) else None,
        "min_lm_loss": float(losses.min()) if len(losses) else None,
        "skipped_iterations": _first(its["skipped"].sum()) if len(its) else 0,
        "nan_iterations": _first(its["nan"].sum()) if len(its) else 0,
        "steady_iteration_ms": speed.iteration_ms,
        "warmup_iterations_excluded": speed.steady.warmup_iterations if speed.steady else [],
        "outlier_iterations_excluded": speed.steady.outlier_iterations if speed.steady else [],
        "global_batch_size": speed.global_batch_size,
        "seq_length": speed.seq_length,
        "tokens_per_s": speed.tokens_per_s,
        "tflops_per_gpu": speed.tflops_per_gpu,
        "tflops_source": speed.tflops_source,
        "mfu": speed.mfu,
        "max_allocated_mb": _first(peak_mem),
        "ranks_reporting_memory": int(memory["rank"].nunique()) if len(memory) else 0,
        "parallel": dict(parsed.parallel),
        "errors": int((events["level"] == "error").sum()) if len(events) else 0,
        "warnings": int((events["level"] == "warning").sum()) if len(events) else 0,
        "partial_lines": int(len(parsed.partial_lines)),
        "restarts": int(parsed.restarts),
    }


def _first(value):
    if value is None or value is pd.NA:
        return None
    if isinstance(value, (float, np.floating)):
        return None if np.isnan(value) else (int(value) if float(value).is_integer() else float(value))
    if isinstance(value, np.integer):
        return int(value)
    return value


# ---------------------------------------------------------------------------------------------------------------------
# Tables the views draw

def phase_times(parsed, iterations: list[int] | None = None) -> pd.DataFrame:
    """Milliseconds per leaf phase (columns) for each logged iteration (rows): the slowest rank's time, which is
    the one that paces the step (the `max` of a `(min, max)` block, or the largest per-rank value)."""
    t, phases = _leaf_timers(parsed, iterations)
    if t.empty:
        return pd.DataFrame()
    value = t["max_ms"].fillna(t["ms"])
    table = value.groupby([t["iteration"].astype(int), t["phase"]]).max().unstack("phase")
    return table[[p for p in phases if p in table.columns]]


def mean_phase_times(parsed, warmup: int | None = None) -> pd.Series:
    """Mean time per leaf phase over the steady iterations (all timed iterations if none are steady)."""
    table = phase_times(parsed)
    if table.empty:
        return pd.Series(dtype=float)
    steady = steady_state(parsed.iterations, warmup).steady_iterations
    rows = table[table.index.isin(steady)] if steady else table
    return (rows if len(rows) else table).mean()


def memory_per_rank(parsed) -> pd.DataFrame:
    """One row per reporting rank: its last report, and its peak `max allocated` over all reports."""
    m = parsed.memory
    if m.empty:
        return pd.DataFrame(columns=["node", "rank", "iteration", "allocated_mb", "max_allocated_mb", "reserved_mb",
                                     "max_reserved_mb", "peak_allocated_mb"])
    m = m.assign(rank=m["rank"].fillna(m["task"]))
    keys = ["node", "rank"]
    ordered = m.sort_values(["iteration", "line"], na_position="first", kind="stable")
    last = ordered.groupby(keys, dropna=False, sort=False).tail(1).set_index(keys)
    peak = m.groupby(keys, dropna=False)["max_allocated_mb"].max()
    out = last[["iteration", "allocated_mb", "max_allocated_mb", "reserved_mb", "max_reserved_mb"]].copy()
    out["peak_allocated_mb"] = peak.reindex(out.index).to_numpy()
    return out.reset_index().sort_values(["rank", "node"], kind="stable", ignore_index=True)

"""torch.profiler Chrome traces -> tables: where the time of a training step goes.

One trace per rank, as `torch.profiler` exports it (`export_chrome_trace`, `.json` or `.json.gz`). The same questions
are answered for a CPU run (gloo; time is in CPU operators and gloo's worker threads) and a GPU run (NCCL; time is in
kernels):

- how many steps were profiled (`ProfilerStep#N` spans) and how long each took;
- time by operator (self and total) and by kernel, and the share in matmul / attention / elementwise / the rest;
- the tensor-core share of kernel time (the profiler's "GPU kernel view");
- computation vs communication per rank, split like TensorBoard's distributed view (computation, overlapping,
  communication, other), and communication per collective and per parallel group (tp / dp / pp);
- the memory curve over the profiled steps, from the trace's `[memory]` events (`profile_memory=True`), and the
  categorised memory timeline (parameters, activations, gradients, ...) from `export_memory_timeline`.
"""
from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from labkit.megatron import sizes
from labkit.spec.layout import Layout

CATEGORIES = ("matmul", "attention", "elementwise", "normalization", "communication", "memory", "other")
GROUPS = ("tp", "dp", "pp", "cp", "ep", "embedding", "model", "world", "unknown")

# Operator names (aten without the namespace, trailing "_" and "_backward"/"Backward0" removed) by category.
_OPERATOR_CATEGORIES = [
    ("attention", r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|(?<!log_)softmax|attention"),
    ("matmul", r"^(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|mv|dot|einsum|_scaled_mm|_addmm_activation|"
               r"_int_mm|_grouped_mm|addmv|LinearWithGradAccumulationAndAsyncCommunication)$"),
    ("normalization", r"layer_norm|rms_norm|group_norm|batch_norm|instance_norm"),
    ("elementwise", r"^(_foreach_\w+|add|sub|rsub|mul|div|pow|neg|abs|exp|log|sqrt|rsqrt|tanh|sigmoid|gelu|silu|relu|"
                    r"threshold|clamp|clamp_min|clamp_max|where|masked_fill|dropout|native_dropout|bernoulli|copy|"
                    r"_to_copy|to|fill|zero|zeros_like|ones_like|lerp|addcmul|addcdiv|maximum|minimum|reciprocal|"
                    r"square|erf|cos|sin|_fused_dropout|fused_dropout|clone|sign|eq|ne|lt|gt|le|ge|logical_\w+|"
                    r"bitwise_\w+|hardtanh|leaky_relu|nan_to_num|isinf|isnan|"
                    r"_amp_foreach_non_finite_check_and_unscale|_amp_update_scale)$"),
]
# Kernel names by category (GPU traces).
_KERNEL_CATEGORIES = [
    ("communication", r"^nccl"),
    ("attention", r"flash|fmha|attention|softmax|sdpa"),
    ("matmul", r"gemm|matmul|cutlass|cublas|xmma|nvjet|gmma|hmma|splitk|dot_kernel"),
    ("normalization", r"layer_?norm|rms_?norm|batch_?norm|group_?norm"),
    ("elementwise", r"elementwise|pointwise|vectorized|triton_poi|fill|copy_kernel|dropout|foreach|adam|unrolled"),
]
# Kernels that run on tensor cores: the name fragments the PyTorch profiler's TensorBoard plugin uses (cuBLAS/cuDNN
# HMMA/IMMA/XMMA kernels), plus Hopper's warp-group MMA (gmma), cuBLASLt's nvjet kernels and FlashAttention.
_TENSOR_CORE = re.compile(r"h884|s884|h1688|s1688|c1688|hmma|imma|i8816|16816|xmma_gemm|xmma_implicit_gemm|"
                          r"xmma_sparse|gmma|tensorop|nvjet|flash_fwd|flash_bwd|fmha", re.I)
_COLLECTIVE_PATTERNS = [
    ("reduce_scatter", r"reduce_?scatter"),
    ("all_reduce", r"all_?reduce"),
    ("all_gather", r"all_?gather"),
    ("all_to_all", r"all_?to_?all"),
    ("broadcast", r"broadcast|bcast"),
    ("send_recv", r"send|recv"),
    ("barrier", r"barrier"),
    ("reduce", r"reduce"),
]
# Megatron-core's process-group descriptions (parallel_state `group_desc`) to parallel groups; first match wins.
_GROUP_DESCRIPTIONS = [
    ("ep", r"EXPERT"),
    ("tp", r"TENSOR_MODEL_PARALLEL|TENSOR_AND_EXPERT"),
    ("dp", r"DATA_PARALLEL|DISTRIBUTED_OPTIMIZER"),
    ("pp", r"PIPELINE"),
    ("cp", r"CONTEXT_PARALLEL"),
    ("embedding", r"EMBEDDING"),
    ("model", r"MODEL_PARALLEL"),
    ("world", r"default_pg"),
]


@dataclass
class Trace:
    """One rank's profiler trace: its complete ("X") events, memory events and distributed info."""

    path: Path
    rank: int
    world_size: int
    backend: str | None
    process_groups: list[dict]
    events: pd.DataFrame = field(repr=False)
    memory_events: pd.DataFrame = field(repr=False)
    frames: pd.DataFrame = field(repr=False)  # Python frames (with_stack=True): tid, ts, end, name
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> str:
        """"cuda" when the trace holds GPU kernels, else "cpu"."""
        return "cuda" if (self.events["cat"] == "kernel").any() else "cpu"

    @cached_property
    def step_windows(self) -> pd.DataFrame:
        """Profiled steps: step, start and end (µs, trace clock).

        The profiler's `ProfilerStep#N` spans (written when it runs with a schedule), without the empty one it opens
        between the last `step()` and `stop()`. A trace without them is cut at its optimizer steps instead: step k
        ends where the k-th `Optimizer.step#...` ends (the loop's last act) and starts where the previous one ended.
        """
        ev = self.events
        annotations = ev[ev["cat"] == "user_annotation"]
        marked = annotations[annotations["name"].str.startswith("ProfilerStep#")]
        ops = np.sort(ev.loc[ev["cat"] == "cpu_op", "ts"].to_numpy())
        if len(marked):
            out = pd.DataFrame({"step": marked["name"].str.slice(len("ProfilerStep#")).astype(int).to_numpy(),
                                "start": marked["ts"].to_numpy(), "end": (marked["ts"] + marked["dur"]).to_numpy()})
            holds_ops = np.searchsorted(ops, out["end"], side="right") > np.searchsorted(ops, out["start"])
            return out[holds_ops].sort_values("start").reset_index(drop=True)
        optimizer = annotations[annotations["name"].str.startswith("Optimizer.step#")].sort_values("ts")
        ends = (optimizer["ts"] + optimizer["dur"]).to_numpy()
        starts = np.r_[ops[:1], ends[:-1]] if len(ends) and len(ops) else np.array([])
        return pd.DataFrame({"step": np.arange(len(starts)), "start": starts, "end": ends[:len(starts)]})

    @cached_property
    def window(self) -> tuple[float, float]:
        """The profiled span used as 100%: first step start to last step end (the whole trace if it has no steps)."""
        if len(self.step_windows):
            return float(self.step_windows["start"].min()), float(self.step_windows["end"].max())
        ev = self.events[self.events["cat"].isin(["cpu_op", "kernel"])]
        return float(ev["ts"].min()), float((ev["ts"] + ev["dur"]).max())


def load_trace(path) -> Trace:
    """Read one Chrome trace JSON (`.json` or `.json.gz`) written by torch.profiler."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        raw = json.load(f)
    if not isinstance(raw, dict) or "traceEvents" not in raw:
        raise ValueError(f"{path}: not a Chrome trace (no 'traceEvents'); pass a torch.profiler trace JSON")
    info = raw.get("distributedInfo") or {}
    complete, memory, frames = [], [], []
    for e in raw["traceEvents"]:
        ph = e.get("ph")
        if ph == "X" and "dur" in e:
            (frames if e.get("cat") == "python_function" else complete).append(e)
        elif ph == "i" and e.get("name") == "[memory]":
            memory.append(e)
    return Trace(path=path, rank=int(info.get("rank", 0)), world_size=int(info.get("world_size", 1)),
                 backend=info.get("backend"), process_groups=list(info.get("pg_config") or []),
                 events=_events_frame(complete), memory_events=_memory_frame(memory),
                 frames=pd.DataFrame({"tid": [str(e.get("tid")) for e in frames],
                                      "ts": np.array([float(e["ts"]) for e in frames]),
                                      "end": np.array([float(e["ts"]) + float(e["dur"]) for e in frames]),
                                      "name": [e.get("name", "") for e in frames]}))


def find_traces(path) -> list[Path]:
    """Trace files at PATH: the file itself, or every `*trace*.json[.gz]` below a run directory.

    Taught in lab 02.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such trace file or run directory")
    return sorted(p for p in path.rglob("*trace*.json*")
                  if p.name.endswith((".json", ".json.gz")) and "memory" not in p.name)


def load_traces(path) -> list[Trace]:
    """All traces of a run directory (or one trace file), ordered by rank."""
    files = find_traces(path)
    if not files:
        raise FileNotFoundError(f"{path}: no profiler trace (*trace*.json or .json.gz) found; run the driver with "
                                f"--profile --profile-step-start N --profile-step-end M")
    return sorted((load_trace(f) for f in files), key=lambda t: (t.rank, str(t.path)))


# ---------------------------------------------------------------------------------------------------- tables

def steps(trace: Trace) -> pd.DataFrame:
    """Profiled steps: step number, start (ms from the first profiled step) and duration (ms)."""
    w = trace.step_windows
    t0 = w["start"].min() if len(w) else 0.0
    return pd.DataFrame({"step": w["step"], "start_ms": (w["start"] - t0) / 1e3,
                         "duration_ms": (w["end"] - w["start"]) / 1e3})


def operators(trace: Trace) -> pd.DataFrame:
    """CPU operators by self time: operator, category, calls, self_ms, total_ms, self_share (of all self time)."""
    ops = trace.events[trace.events["cat"] == "cpu_op"]
    table = ops.groupby("name").agg(calls=("dur", "size"), self_ms=("self_dur", "sum"), total_ms=("dur", "sum"))
    table[["self_ms", "total_ms"]] /= 1e3
    table = table.reset_index().rename(columns={"name": "operator"})
    table.insert(1, "category", table["operator"].map(operator_category))
    table["self_share"] = table["self_ms"] / table["self_ms"].sum() if len(table) else []
    return table.sort_values("self_ms", ascending=False, ignore_index=True)


def kernels(trace: Trace) -> pd.DataFrame:
    """GPU kernels by time: kernel, category, tensor_core, calls, total_ms, mean_us, share. Empty for a CPU trace."""
    k = trace.events[trace.events["cat"] == "kernel"]
    table = k.groupby("name").agg(calls=("dur", "size"), total_ms=("dur", "sum"), mean_us=("dur", "mean"))
    table["total_ms"] /= 1e3
    table = table.reset_index().rename(columns={"name": "kernel"})
    table.insert(1, "category", table["kernel"].map(kernel_category))
    table.insert(2, "tensor_core", table["kernel"].map(lambda n: bool(_TENSOR_CORE.search(n))))
    table["share"] = table["total_ms"] / table["total_ms"].sum() if len(table) else []
    return table.sort_values("total_ms", ascending=False, ignore_index=True)


def breakdown(trace: Trace) -> pd.DataFrame:
    """Time by category (matmul, attention, elementwise, normalization, communication, memory, other): time_ms, share.

    From GPU kernels (and memcpy/memset) on a GPU trace; from CPU operators' self time (on every thread, gloo's
    worker threads included as communication) on a CPU trace.
    """
    ev = trace.events
    if trace.device == "cuda":
        gpu = ev[ev["cat"].isin(["kernel", "gpu_memcpy", "gpu_memset"])]
        cats = np.where(gpu["cat"] == "kernel", gpu["name"].map(kernel_category), "memory")
        times = gpu["dur"]
    else:
        ops = ev[(ev["cat"] == "cpu_op") | _is_comm_activity(ev)]
        cats = ops["name"].map(operator_category)
        times = ops["self_dur"].fillna(ops["dur"])
    total = pd.Series(times.to_numpy(), index=cats).groupby(level=0).sum()
    table = pd.DataFrame({"category": list(CATEGORIES)})
    table["time_ms"] = table["category"].map(total).fillna(0.0) / 1e3
    table["share"] = table["time_ms"] / table["time_ms"].sum() if table["time_ms"].sum() else 0.0
    return table


def tensor_core_share(trace: Trace) -> float | None:
    """Fraction of GPU kernel time in tensor-core kernels (None for a CPU trace, which has no kernels)."""
    k = kernels(trace)
    if k.empty:
        return None
    return float(k.loc[k["tensor_core"], "total_ms"].sum() / k["total_ms"].sum())


def communication(traces: Trace | Sequence[Trace], tensor: int = 1, pipeline: int = 1,
                  context: int = 1) -> pd.DataFrame:
    """Communication per rank, collective and parallel group: calls, time_ms (time data moved), elements.

    Each call's group is read, most reliable first, from: its process-group record (NCCL writes `record_param_comms`
    with Megatron's group description, or a group found in the trace's process-group table); the Megatron code that
    made the call (its Python frames, when the profiler ran with_stack=True as the driver does: the MoE token
    dispatcher and its all-to-all -> ep, tensor_parallel -> tp, p2p_communication -> pp, the gradient buffers -> dp,
    embedding-gradient sync -> embedding, gradient norm -> model, timers -> world); the record's ranks against the run's layout; else the layout alone (`tensor`,
    `pipeline`, `context`; data parallel is the rest of the world, labkit.megatron.sizes.data_parallel_size):
    point-to-point is pp (cp when only context parallelism passes keys and values round its ring), a collective is
    the only one of tp/dp wider than 1, and with both wider than 1 a collective on a flat (1-D) buffer is dp and on an
    activation is tp.
    The time comes from where the data moves (NCCL kernels, gloo's worker threads), matched back to its call.
    """
    rows = []
    for t in _as_list(traces):
        calls, activity = _communication(t, _layout(t, tensor, pipeline, context))
        keys = sorted(set(zip(activity["collective"], activity["group"]))
                      | set(zip(calls["collective"], calls["group"])))
        for collective, group in keys:
            a = activity[(activity["collective"] == collective) & (activity["group"] == group)]
            c = calls[(calls["collective"] == collective) & (calls["group"] == group)]
            rows.append({"rank": t.rank, "collective": collective, "group": group, "calls": len(c),
                         "time_ms": _union_length(a["ts"], a["ts"] + a["dur"]) / 1e3,
                         "elements": int(c["elements"].sum())})
    return pd.DataFrame(rows, columns=["rank", "collective", "group", "calls", "time_ms", "elements"])


def communication_calls(trace: Trace, tensor: int = 1, pipeline: int = 1, context: int = 1) -> pd.DataFrame:
    """One row per communication call on a rank: operator, collective, group, elements (of its first tensor),
    start_ms (from the first profiled step) and dispatch_ms (time in the call itself, not the transfer)."""
    calls, _ = _communication(trace, _layout(trace, tensor, pipeline, context))
    return pd.DataFrame({"rank": trace.rank, "operator": calls["name"], "collective": calls["collective"],
                         "group": calls["group"], "elements": calls["elements"],
                         "start_ms": (calls["ts"] - trace.window[0]) / 1e3, "dispatch_ms": calls["dur"] / 1e3},
                        columns=["rank", "operator", "collective", "group", "elements", "start_ms", "dispatch_ms"]
                        ).sort_values("start_ms", ignore_index=True)


def communication_by_group(traces: Trace | Sequence[Trace], tensor: int = 1, pipeline: int = 1,
                           context: int = 1) -> pd.DataFrame:
    """Communication time per rank and parallel group (tp/dp/pp/...): time_ms, calls, and share of the profiled span.

    Taught in labs 07 and 10.
    """
    table = communication(traces, tensor, pipeline, context)
    spans = {t.rank: (t.window[1] - t.window[0]) / 1e3 for t in _as_list(traces)}
    out = table.groupby(["rank", "group"], as_index=False).agg(time_ms=("time_ms", "sum"), calls=("calls", "sum"))
    out["share"] = out["time_ms"] / out["rank"].map(spans)
    return out


def compute_communication(traces: Trace | Sequence[Trace]) -> pd.DataFrame:
    """Per rank, the profiled steps split as TensorBoard's distributed view does (ms and shares).

    computation: only computing; overlapping: computing while communicating; communication: only communicating;
    other: neither (host overhead, waiting, idle). Computing is GPU kernels on a GPU trace, and on a CPU trace the CPU
    operators that are not communication and do not wait on it; communicating is NCCL kernels, or gloo's work.
    """
    rows = []
    for t in _as_list(traces):
        lo, hi = t.window
        compute = _clip(_merge(*_compute_intervals(t)), lo, hi)
        _, comm_ev = _communication(t, Layout(data=t.world_size))
        comm = _clip(_merge(comm_ev["ts"].to_numpy(), (comm_ev["ts"] + comm_ev["dur"]).to_numpy()), lo, hi)
        span = hi - lo
        both = _intersection_length(compute, comm)
        c, m = _length(compute), _length(comm)
        row = {"rank": t.rank, "steps": len(t.step_windows), "span_ms": span / 1e3,
               "computation_ms": (c - both) / 1e3, "overlapping_ms": both / 1e3,
               "communication_ms": (m - both) / 1e3, "other_ms": (span - c - m + both) / 1e3}
        for part in ("computation", "overlapping", "communication", "other"):
            row[f"{part}_share"] = row[f"{part}_ms"] / row["span_ms"] if span else 0.0
        rows.append(row)
    return pd.DataFrame(rows)


def memory_curve(trace: Trace) -> pd.DataFrame:
    """Allocated and reserved memory over the profiled steps, from the trace's `[memory]` events.

    Columns: time_ms (from the first profiled step's start), step, allocated_mb, reserved_mb. The device is the GPU
    when the trace holds GPU memory events, else the CPU (whose allocator counts bytes allocated since profiling
    began, so levels are relative; differences and peaks within a step are what to read).
    """
    m = trace.memory_events
    if m.empty:
        return pd.DataFrame(columns=["time_ms", "step", "allocated_mb", "reserved_mb"])
    device_type = 1 if (m["device_type"] == 1).any() else 0
    m = m[m["device_type"] == device_type].sort_values("ts")
    w = trace.step_windows
    start = w["start"].min() if len(w) else m["ts"].min()
    out = pd.DataFrame({"time_ms": (m["ts"] - start) / 1e3, "step": _step_of(trace, m["ts"]),
                        "allocated_mb": m["allocated"] / 2**20, "reserved_mb": m["reserved"] / 2**20})
    return out.reset_index(drop=True)


def memory_per_step(trace: Trace) -> pd.DataFrame:
    """Per profiled step (MB): allocated at its start, peak, growth (peak - start) and saved (allocated when the
    first backward pass begins - start).

    Growth is what a step holds at once beyond what it started with; saved is what the forward pass kept for the
    backward pass (activations, for the step's first micro-batch). Activation checkpointing lowers both.
    """
    curve = memory_curve(trace)
    ev = trace.events
    autograd = (ev["cat"] == "cpu_op") & ev["name"].str.startswith("autograd::engine::evaluate_function")
    backward = np.sort(ev.loc[autograd, "ts"].to_numpy())
    origin = trace.step_windows["start"].min() if len(trace.step_windows) else 0.0
    rows = []
    for s in trace.step_windows.itertuples():
        start_ms = (s.start - origin) / 1e3
        before = curve[curve["time_ms"] < start_ms]
        inside = curve[curve["step"] == s.step]
        if len(before):
            at_start = float(before["allocated_mb"].iloc[-1])
        elif len(inside):  # nothing sampled before the first step: its first sample is the level it starts from
            at_start = float(inside["allocated_mb"].iloc[0])
        else:
            continue
        peak = float(inside["allocated_mb"].max()) if len(inside) else at_start
        first_backward = backward[(backward >= s.start) & (backward <= s.end)][:1]
        saved = None
        if len(first_backward):
            upto = curve[curve["time_ms"] <= (first_backward[0] - origin) / 1e3]
            saved = float(upto["allocated_mb"].iloc[-1]) - at_start if len(upto) else None
        rows.append({"step": int(s.step), "start_mb": at_start, "peak_mb": peak, "growth_mb": peak - at_start,
                     "saved_mb": saved})
    return pd.DataFrame(rows, columns=["step", "start_mb", "peak_mb", "growth_mb", "saved_mb"])


# torch.profiler._memory_profiler's category order (its `_CATEGORY_TO_INDEX`, None last); a test pins it to torch's.
MEMORY_TIMELINE_CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
                              "autograd_detail", "unknown")


def memory_timeline(path) -> pd.DataFrame:
    """A memory timeline written by `profiler.export_memory_timeline(PATH.json[.gz])`, one column per category (MB).

    Columns: time_ms (from the first sample), then one column per category of MEMORY_TIMELINE_CATEGORIES, and total_mb.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        raw = json.load(f)
    if not (isinstance(raw, list) and len(raw) == 2):
        raise ValueError(f"{path}: not a memory timeline ([times, sizes]); write it with "
                         f"profiler.export_memory_timeline('...json')")
    times, sizes = np.asarray(raw[0], dtype=float), np.asarray(raw[1], dtype=float).reshape(len(raw[0]), -1)
    # Column 0 is a base the exporter never fills; the categories follow in torch's order.
    by_category = sizes[:, 1:1 + len(MEMORY_TIMELINE_CATEGORIES)] / 2**20
    out = pd.DataFrame(by_category, columns=[f"{c}_mb" for c in MEMORY_TIMELINE_CATEGORIES])
    out.insert(0, "time_ms", (times - times.min()) / 1e3 if len(times) else [])
    out["total_mb"] = out[[f"{c}_mb" for c in MEMORY_TIMELINE_CATEGORIES]].sum(axis=1)
    return out


def find_memory_timelines(path) -> list[Path]:
    """Memory timeline files (`*memory*.json[.gz]`) at PATH: the file itself or below a run directory."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*memory*.json*") if p.name.endswith((".json", ".json.gz")))


def summary(traces: Trace | Sequence[Trace], tensor: int = 1, pipeline: int = 1, top: int = 10,
            context: int = 1) -> dict:
    """Everything above in one JSON-ready dict: per rank steps, step time, breakdown, compute/communication, memory."""
    traces = _as_list(traces)
    split = compute_communication(traces).set_index("rank")
    groups = communication_by_group(traces, tensor, pipeline, context)
    ranks = []
    for t in traces:
        st, mem = steps(t), memory_per_step(t)
        parts = breakdown(t)
        ranks.append({
            "rank": t.rank, "path": str(t.path), "device": t.device, "backend": t.backend,
            "profiled_steps": st["step"].tolist(),
            "step_ms": round(float(st["duration_ms"].mean()), 3) if len(st) else None,
            "breakdown": {r.category: round(float(r.share), 4) for r in parts.itertuples()},
            "tensor_core_share": tensor_core_share(t),
            "compute_communication": {k: round(float(split.loc[t.rank, f"{k}_share"]), 4)
                                      for k in ("computation", "overlapping", "communication", "other")},
            "communication_ms_by_group": {r.group: round(float(r.time_ms), 3)
                                          for r in groups[groups["rank"] == t.rank].itertuples()},
            "peak_memory_growth_mb": round(float(mem["growth_mb"].max()), 3) if len(mem) else None,
            "saved_for_backward_mb": round(float(mem["saved_mb"].max()), 3) if mem["saved_mb"].notna().any() else None,
            "top_operators": operators(t).head(top)[["operator", "category", "calls", "self_ms"]]
            .round({"self_ms": 3}).to_dict("records"),
        })
    return {"world_size": traces[0].world_size, "traces": len(traces), "ranks": ranks}


# ---------------------------------------------------------------------------------------------------- naming

def operator_category(name: str) -> str:
    """Category of a CPU operator (or a communication op name) among CATEGORIES."""
    if _is_comm_name(name):
        return "communication"
    base = name.split("::")[-1]
    base = re.sub(r"(Backward\d*|_backward(_data)?)$", "", base)
    base = base.rstrip("_") if base != "_" else base
    for category, pattern in _OPERATOR_CATEGORIES:
        if re.search(pattern, base, re.I):
            return category
    return "other"


def kernel_category(name: str) -> str:
    """Category of a GPU kernel name among CATEGORIES."""
    for category, pattern in _KERNEL_CATEGORIES:
        if re.search(pattern, name, re.I):
            return category
    return "other"


def collective_of(name: str) -> str | None:
    """The collective an op, annotation or NCCL kernel name stands for (all_reduce, send_recv, ...), else None."""
    if not _is_comm_name(name):
        return None
    key = name.split(":")[-1].lower().replace("devkernel", "").replace("kernel", "")
    for collective, pattern in _COLLECTIVE_PATTERNS:
        if re.search(pattern, key):
            return collective
    return None


def group_of_description(description: str | None) -> str | None:
    """Parallel group of a Megatron process-group description (e.g. TENSOR_MODEL_PARALLEL_GROUP -> tp)."""
    for group, pattern in _GROUP_DESCRIPTIONS:
        if description and re.search(pattern, description):
            return group
    return None


# ---------------------------------------------------------------------------------------------------- internals

def _events_frame(events: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame({
        "name": [e.get("name", "") for e in events],
        "cat": [e.get("cat", "") for e in events],
        "pid": [str(e.get("pid")) for e in events],
        "tid": [str(e.get("tid")) for e in events],
        "ts": np.array([float(e["ts"]) for e in events]),
        "dur": np.array([float(e["dur"]) for e in events]),
        "args": [e.get("args") or {} for e in events],
    })
    frame["self_dur"], frame["has_comm_child"] = _nesting(frame)
    return frame


def _nesting(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Self time of each CPU operator (its time minus its direct children's, per thread), and whether it encloses a
    communication op (so it waits on the network rather than computes)."""
    self_dur = np.full(len(frame), np.nan)
    has_comm = np.zeros(len(frame), dtype=bool)
    cpu = frame[(frame["cat"] == "cpu_op") | ((frame["cat"] == "user_annotation") & _is_comm_activity(frame))]
    comm = cpu["name"].map(_is_comm_name).to_numpy()
    for _, idx in cpu.groupby(["pid", "tid"]).indices.items():
        rows = cpu.index.to_numpy()[idx]
        order = np.lexsort((-frame["dur"].to_numpy()[rows], frame["ts"].to_numpy()[rows]))
        rows, is_comm = rows[order], comm[idx][order]
        ts, dur = frame["ts"].to_numpy()[rows], frame["dur"].to_numpy()[rows]
        own = dur.copy()
        stack: list[int] = []
        for i in range(len(rows)):
            while stack and ts[i] >= ts[stack[-1]] + dur[stack[-1]]:
                stack.pop()
            if stack:
                own[stack[-1]] -= dur[i]
                if is_comm[i]:
                    for j in stack:
                        has_comm[rows[j]] = True
            stack.append(i)
        self_dur[rows] = np.maximum(own, 0.0)
    return self_dur, has_comm


def _memory_frame(events: list[dict]) -> pd.DataFrame:
    args = [e.get("args") or {} for e in events]
    return pd.DataFrame({
        "ts": np.array([float(e["ts"]) for e in events]),
        "allocated": np.array([float(a.get("Total Allocated", 0)) for a in args]),
        "reserved": np.array([float(a.get("Total Reserved", 0)) for a in args]),
        "bytes": np.array([float(a.get("Bytes", 0)) for a in args]),
        "device_type": np.array([int(a.get("Device Type", 0)) for a in args]),
    })


def _is_comm_name(name: str) -> bool:
    return name.startswith(("c10d::", "gloo:", "nccl:", "nccl")) or name == "record_param_comms"


def _is_comm_activity(ev: pd.DataFrame) -> pd.Series:
    """Events during which data moves: NCCL kernels on a GPU, gloo's work (annotated `gloo:*`) on a CPU."""
    return ((ev["cat"] == "kernel") & ev["name"].str.startswith("nccl")) | \
        ((ev["cat"] == "user_annotation") & ev["name"].str.startswith("gloo:"))


# Megatron-core code that makes a call, by the Python frame that names it (innermost first), to its parallel group.
_CALLER_GROUPS = [
    ("embedding", r"finalize_model_grads\.py\(\d+\): _allreduce_(embedding_grad|word_embedding_grads|"
                  r"position_embedding_grads)$"),
    ("pp", r"finalize_model_grads\.py\(\d+\): _allreduce_conditional_embedding_grads$"),
    ("tp", r"finalize_model_grads\.py\(\d+\): _allreduce_non_tensor_model_parallel_grads$"),
    ("tp", r"megatron/core/tensor_parallel/"),
    ("pp", r"megatron/core/pipeline_parallel/p2p_communication\.py"),
    ("dp", r"megatron/core/distributed/|megatron/core/optimizer/distrib_optimizer\.py"),
    ("model", r"megatron/core/optimizer/"),
    ("world", r"megatron/core/timers\.py"),
]
# The MoE token dispatcher moves tokens with tensor_parallel's mapping functions over the expert groups, so a call
# made under it is expert traffic whatever frame lies inside; so is the backward pass of those mappings' all-to-all,
# which autograd runs without the dispatcher's frames (megatron-core's only all-to-all users are the MoE layers).
_MOE_DISPATCHER = re.compile(r"megatron/core/transformer/moe/(?:token_dispatcher|fused_a2a)\.py")
_TENSOR_PARALLEL_MAPPINGS = re.compile(r"megatron/core/tensor_parallel/mappings\.py")


def _layout(trace: Trace, tensor: int, pipeline: int, context: int) -> Layout:
    """The run's layout over the trace's world; sizes that do not divide it are a ValueError naming them."""
    try:
        data = sizes.data_parallel_size(trace.world_size, tensor, context, pipeline)
    except sizes.SizeError as exc:
        raise ValueError(f"{trace.path}: {exc}; give the run's tensor, context and pipeline sizes") from None
    return Layout(tensor=tensor, context=context, data=data, pipeline=pipeline)


def _communication(trace: Trace, layout: Layout) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(calls, activity) of a trace: the c10d calls with collective, elements and group, and the events during which
    data moves (NCCL kernels, gloo's work; the calls themselves when there are none) with the group of their call."""
    key = ("communication", layout)
    if key in trace.cache:
        return trace.cache[key]
    ev = trace.events
    calls = ev[(ev["cat"] == "cpu_op") & ev["name"].str.startswith("c10d::")]
    calls = calls.assign(collective=calls["name"].map(collective_of)).dropna(subset=["collective"]).sort_values("ts")
    shapes = [_first_shape(a.get("Input Dims")) for a in calls["args"]]
    calls = calls.assign(shape=[tuple(sh) if sh else None for sh in shapes], elements=[_numel(sh) for sh in shapes])
    records = ev[ev["name"] == "record_param_comms"]
    calls = calls.assign(group=[_call_group(trace, row, records, layout) for row in calls.itertuples()])
    activity = ev[_is_comm_activity(ev)]
    if activity.empty:
        activity = calls
    else:
        activity = activity.assign(collective=activity["name"].map(collective_of)).dropna(subset=["collective"])
        activity = activity.sort_values("ts")
        activity = activity.assign(group=_activity_groups(trace, activity, calls, layout))
    trace.cache[key] = calls, activity
    return calls, activity


def _call_group(trace: Trace, call, records: pd.DataFrame, layout: Layout) -> str:
    inside = records[(records["tid"] == call.tid) & (records["ts"] >= call.ts) & (records["ts"] <= call.ts + call.dur)]
    record = inside["args"].iloc[-1] if len(inside) else None
    if record is not None:
        group = group_of_description(_record_description(trace, record))
        if group:
            return group
    group = _caller_group(trace, call)
    if group:
        return group
    if record is not None:
        ranks = record.get("Process Group Ranks")
        if isinstance(ranks, str):
            ranks = [int(r) for r in re.findall(r"\d+", ranks)]
        return _group_of_ranks(trace.rank, trace.world_size, ranks, layout) if ranks else "unknown"
    return _group_of_layout(call.collective, call.shape, layout)


def _record_description(trace: Trace, record: dict) -> str | None:
    name = record.get("Process Group Name")
    return record.get("Process Group Description") or next(
        (pg.get("pg_desc") for pg in trace.process_groups if str(pg.get("pg_name")) == str(name)), None)


def _caller_group(trace: Trace, call) -> str | None:
    f = trace.frames
    if f.empty:
        return None
    around = f[(f["tid"] == call.tid) & (f["ts"] <= call.ts) & (f["end"] >= call.ts + call.dur)]
    if around["name"].str.contains(_MOE_DISPATCHER).any() or (
            call.collective == "all_to_all" and around["name"].str.contains(_TENSOR_PARALLEL_MAPPINGS).any()):
        return "ep"
    for name in around.sort_values("ts", ascending=False)["name"]:
        for group, pattern in _CALLER_GROUPS:
            if re.search(pattern, name):
                return group
    return None


def _group_of_layout(collective: str, shape, layout: Layout) -> str:
    if collective == "send_recv":
        return "cp" if layout.pipeline == 1 and layout.context > 1 else "pp"
    if layout.tensor > 1 and layout.data > 1:
        return "tp" if shape is not None and len(shape) >= 2 else "dp"
    if layout.tensor > 1:
        return "tp"
    if layout.data > 1:
        return "dp"
    return "pp" if layout.pipeline > 1 else "unknown"


def _activity_groups(trace: Trace, activity: pd.DataFrame, calls: pd.DataFrame, layout: Layout) -> list[str]:
    """The group of each activity event, through the call it serves: for an NCCL kernel, the call around the runtime
    launch with the same correlation id; for gloo work inside a call (send/recv), that call; for gloo work on a worker
    thread, the earliest earlier call of the same collective (and shape, where known) not matched yet, as gloo runs
    each group's work in order."""
    runtime = trace.events[trace.events["cat"].isin(["cuda_runtime", "cuda_driver"])]
    launches = {a.get("correlation"): (ts, tid) for a, ts, tid in zip(runtime["args"], runtime["ts"], runtime["tid"])}
    ends = calls["ts"] + calls["dur"]
    matched: set = set()
    groups = []
    for row in activity.itertuples():
        if row.cat == "kernel":
            ts, tid = launches.get(row.args.get("correlation"), (None, None))
            around = calls[(calls["tid"] == tid) & (calls["ts"] <= ts) & (ends >= ts)] if ts is not None else calls[:0]
        else:
            around = calls[(calls["tid"] == row.tid) & (calls["ts"] <= row.ts) & (ends >= row.ts + row.dur)]
        if around.empty and row.cat != "kernel":
            earlier = calls[(calls["collective"] == row.collective) & (calls["ts"] <= row.ts)
                            & ~calls.index.isin(matched)]
            shape = _first_shape(row.args.get("Input Dims"))
            same_shape = earlier[earlier["shape"].map(lambda s: s == tuple(shape))] if shape else earlier[:0]
            around = (same_shape if len(same_shape) else earlier)[:1]
        if len(around):
            matched.add(around.index[-1])
            groups.append(around["group"].iloc[-1])
        else:
            shape = _first_shape(row.args.get("Input Dims"))
            groups.append(_group_of_layout(row.collective, shape, layout))
    return groups


def _group_of_ranks(rank: int, world: int, ranks: Iterable[int], layout: Layout) -> str:
    """Which of Megatron's groups (labkit.spec.layout's rank order) a set of ranks is, for this rank."""
    ranks = sorted(ranks)
    groups = {kind: layout.group(rank, kind) for kind in ("tp", "cp", "dp", "pp")}
    groups["world"] = list(range(world))
    return next((g for g, members in groups.items() if len(members) > 1 and members == ranks), "unknown")


def _first_shape(dims) -> list[int] | None:
    """The first tensor shape in a profiler "Input Dims" value (which nests lists for tensor-list arguments)."""
    if not isinstance(dims, list):
        return None
    if dims and all(isinstance(d, int) for d in dims):
        return dims
    for d in dims:
        shape = _first_shape(d)
        if shape:
            return shape
    return None


def _numel(shape) -> int:
    return int(np.prod(shape)) if shape else 0


def _compute_intervals(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    ev = trace.events
    if trace.device == "cuda":
        busy = ev[ev["cat"].isin(["kernel", "gpu_memcpy", "gpu_memset"]) & ~_is_comm_activity(ev)]
    else:
        busy = ev[(ev["cat"] == "cpu_op") & ~ev["name"].map(_is_comm_name) & ~ev["has_comm_child"]]
    return busy["ts"].to_numpy(), (busy["ts"] + busy["dur"]).to_numpy()


def _step_of(trace: Trace, ts: pd.Series) -> np.ndarray:
    w = trace.step_windows
    out = np.full(len(ts), -1)
    for s in w.itertuples():
        out[((ts >= s.start) & (ts <= s.end)).to_numpy()] = s.step
    return out


def _merge(starts, ends) -> np.ndarray:
    """Union of intervals as a sorted (n, 2) array of disjoint intervals."""
    starts, ends = np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    if not len(starts):
        return np.empty((0, 2))
    order = np.argsort(starts)
    starts, ends = starts[order], ends[order]
    running_end = np.maximum.accumulate(ends)
    new = np.r_[True, starts[1:] > running_end[:-1]]
    group = np.cumsum(new) - 1
    merged_ends = pd.Series(running_end).groupby(group).max().to_numpy()
    return np.column_stack([starts[new], merged_ends])


def _clip(intervals: np.ndarray, lo: float, hi: float) -> np.ndarray:
    clipped = np.clip(intervals, lo, hi)
    return clipped[clipped[:, 1] > clipped[:, 0]] if len(clipped) else clipped


def _length(intervals: np.ndarray) -> float:
    return float((intervals[:, 1] - intervals[:, 0]).sum()) if len(intervals) else 0.0


def _union_length(starts, ends) -> float:
    return _length(_merge(starts, ends))


def _intersection_length(a: np.ndarray, b: np.ndarray) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        total += max(0.0, hi - lo)
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return total


def _as_list(traces) -> list[Trace]:
    return [traces] if isinstance(traces, Trace) else list(traces)

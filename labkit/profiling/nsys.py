"""Nsight Systems reports -> tables: where a captured step's GPU time goes, per rank.

Reads the SQLite file `nsys export --type sqlite REPORT.nsys-rep` writes (the profile section's jobs write it beside
each report, `nsys profile --export=sqlite`) with the standard library's sqlite3. The tables and columns are NVIDIA's
(Nsight Systems documentation, "SQLite Export Schema Reference"), created only when the capture holds such events:

- CUPTI_ACTIVITY_KIND_KERNEL: start, end (ns), deviceId, streamId, demangledName and shortName (ids into StringIds);
- CUPTI_ACTIVITY_KIND_MEMCPY: start, end, bytes, copyKind (CUPTI's CUpti_ActivityMemcpyKind: 10 is peer to peer);
- CUPTI_ACTIVITY_KIND_MEMSET: start, end, bytes;
- NVTX_EVENTS: start, end, eventType (59 push/pop ranges, 60 start/end ranges), text, or textId into StringIds;
- StringIds: id, value.

One report is one rank's process (rankR.sqlite, as the jobs name them). Per rank it gives the time per kernel class
(`kernel_time`), computation against NCCL communication and how much of the communication runs under computation
(`overlap`), and the steps of the capture range from the driver's NVTX ranges (`steps`: `iteration N`, with
`forward`, `backward` and `optimizer` inside), as DataFrames, and `figure` draws the first two with plotly:

    from labkit.profiling import nsys
    reports = nsys.load_reports("runs/RUN/logs/nsys")     # every rank*.sqlite there
    nsys.kernel_time(reports); nsys.overlap(reports); nsys.steps(reports); nsys.figure(reports).show()
"""
from __future__ import annotations

import contextlib
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

KERNEL_CLASSES = (
    ("p2p", r"^nccl\w*(SendRecv|_Send|_Recv)"),  # ncclDevKernel_SendRecv (pipeline sends, all-to-all)
    ("collective", r"^nccl"),  # ncclDevKernel_AllReduce_Sum_f32_RING_LL, ..._AllGather_..., ..._ReduceScatter_...
    ("attention", r"flash|fmha|attention|sdpa|softmax"),  # FlashAttention, cutlass fmha, cuDNN's sdpa, softmax
    ("gemm", r"gemm|cutlass|cublas|xmma|nvjet|gmma|matmul|splitk"),  # cuBLAS / cuBLASLt / CUTLASS GEMMs
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|reduce_kernel|triton_|norm|dropout|fill|copy|"
                    r"foreach|multi_tensor|adam|CatArray|index"),  # PyTorch's TensorIterator kernels and the like
)
"""Kernel name (demangled) -> class, the first pattern that matches (case-insensitive); "other" when none does.
The patterns follow labkit.profiling.trace's for torch.profiler's kernels, with NCCL split into collectives and
point-to-point."""
CLASSES = ("gemm", "attention", "elementwise", "collective", "p2p", "memory", "other")
"""Every class a report's activities fall in; memory is memcpy and memset (peer-to-peer copies count as p2p)."""
COMMUNICATION = ("collective", "p2p")
"""The classes that are communication; every other one is computation."""
PEER_TO_PEER_COPY = 10
"""CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: a copy between two GPUs."""
NVTX_RANGES = (59, 60)
"""NVTX_EVENTS.eventType of push/pop and start/end ranges (NVIDIA's NvtxPushPopRange and NvtxStartEndRange)."""
STEP = "iteration "
"""The driver's NVTX range of one captured iteration is named `iteration N` (labkit.train.profiling)."""
_RANK = re.compile(r"rank(\d+)")


@dataclass
class Report:
    """One rank's capture."""
    path: Path
    """The SQLite file."""
    rank: int
    """The global rank: from the file name (rankR.sqlite), else its place in the list read."""
    activities: pd.DataFrame
    """GPU activities: start_ns, end_ns, name, kind (kernel, memcpy, memset), class (CLASSES)."""
    nvtx: pd.DataFrame
    """NVTX ranges: start_ns, end_ns, text."""


def kernel_class(name: str) -> str:
    """The class of a kernel by its demangled name (KERNEL_CLASSES)."""
    for cls, pattern in KERNEL_CLASSES:
        if re.search(pattern, name, re.I):
            return cls
    return "other"


def _tables(db: sqlite3.Connection) -> set[str]:
    return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def load(path: str | Path, rank: int | None = None) -> Report:
    """One report's GPU activities and NVTX ranges; `rank` where the file name does not say it."""
    path = Path(path)
    if path.suffix == ".nsys-rep":
        raise ValueError(f"{path}: a report, not its SQLite export; run `nsys export --type sqlite {path}` and read "
                         f"{path.with_suffix('.sqlite')}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    named = _RANK.search(path.stem)
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        tables = _tables(db)
        if "CUPTI_ACTIVITY_KIND_KERNEL" not in tables:
            raise ValueError(f"{path}: no CUPTI_ACTIVITY_KIND_KERNEL table, so no kernel ran inside the capture range "
                             "(was the cuda trace on, and did the run reach the range's steps?)")
        parts = [pd.read_sql_query(
            "SELECT k.start AS start_ns, k.end AS end_ns, s.value AS name, 'kernel' AS kind "
            "FROM CUPTI_ACTIVITY_KIND_KERNEL AS k JOIN StringIds AS s ON s.id = k.demangledName", db)]
        if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
            parts.append(pd.read_sql_query(
                "SELECT start AS start_ns, end AS end_ns, CASE copyKind WHEN ? THEN 'peer-to-peer copy' ELSE 'memcpy' "
                "END AS name, 'memcpy' AS kind FROM CUPTI_ACTIVITY_KIND_MEMCPY", db, params=(PEER_TO_PEER_COPY,)))
        if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
            parts.append(pd.read_sql_query("SELECT start AS start_ns, end AS end_ns, 'memset' AS name, "
                                           "'memset' AS kind FROM CUPTI_ACTIVITY_KIND_MEMSET", db))
        nvtx = pd.DataFrame(columns=["start_ns", "end_ns", "text"])
        if "NVTX_EVENTS" in tables:
            columns = {row[1] for row in db.execute("PRAGMA table_info(NVTX_EVENTS)")}
            text = "COALESCE(n.text, s.value)" if "textId" in columns else "n.text"
            join = "LEFT JOIN StringIds AS s ON s.id = n.textId" if "textId" in columns else ""
            nvtx = pd.read_sql_query(
                f"SELECT n.start AS start_ns, n.end AS end_ns, {text} AS text FROM NVTX_EVENTS AS n {join} "
                f"WHERE n.eventType IN ({', '.join('?' * len(NVTX_RANGES))}) AND n.end IS NOT NULL", db,
                params=NVTX_RANGES)
    activities = pd.concat(parts, ignore_index=True)
    activities["class"] = [("p2p" if name == "peer-to-peer copy" else "memory") if kind != "kernel"
                           else kernel_class(name) for name, kind in zip(activities["name"], activities["kind"])]
    return Report(path, int(named.group(1)) if named else (rank or 0),
                  activities.sort_values("start_ns", ignore_index=True), nvtx.sort_values("start_ns",
                                                                                         ignore_index=True))


def load_reports(paths) -> list[Report]:
    """Reports from SQLite files and directories (every *.sqlite in one), ordered by rank."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files = []
    for path in map(Path, paths):
        found = sorted(path.glob("*.sqlite")) if path.is_dir() else [path]
        if path.is_dir() and not found:
            raise FileNotFoundError(f"{path}: no .sqlite reports (nsys export --type sqlite REPORT.nsys-rep)")
        files += found
    return sorted((load(f, rank=i) for i, f in enumerate(files)), key=lambda r: r.rank)


def _steps_of(report: Report) -> pd.DataFrame:
    ranges = report.nvtx[report.nvtx["text"].fillna("").str.startswith(STEP)]
    iterations = pd.to_numeric(ranges["text"].str.removeprefix(STEP), errors="coerce")
    return ranges.assign(iteration=iterations).dropna(subset=["iteration"])


def window(report: Report) -> tuple[int, int]:
    """The span the tables cover (ns): the captured iterations' (their NVTX ranges), else all the GPU activity's."""
    steps = _steps_of(report)
    if len(steps):
        return int(steps["start_ns"].min()), int(steps["end_ns"].max())
    return int(report.activities["start_ns"].min()), int(report.activities["end_ns"].max())


def _clipped(frame: pd.DataFrame, start: int, end: int) -> np.ndarray:
    """[start, end) intervals of the frame's rows, cut to the window, empty ones dropped."""
    spans = np.clip(frame[["start_ns", "end_ns"]].to_numpy(dtype=np.int64), start, end)
    return spans[spans[:, 1] > spans[:, 0]]


def _union(spans: np.ndarray) -> np.ndarray:
    """Intervals merged into disjoint, sorted ones."""
    merged: list[list[int]] = []
    for s, e in spans[np.argsort(spans[:, 0], kind="stable")] if len(spans) else []:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return np.array(merged, dtype=np.int64).reshape(-1, 2)


def _length(union: np.ndarray) -> int:
    return int((union[:, 1] - union[:, 0]).sum())


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the intersection of two merged interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i, 1], b[j, 1]) - max(a[i, 0], b[j, 0]))
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return int(total)


MS = 1e6
"""Nanoseconds per millisecond."""


def kernel_time(reports) -> pd.DataFrame:
    """Per rank and class (CLASSES): time_ms (the activities' durations summed over the window; concurrent streams
    add up), count, and share of the rank's summed time."""
    rows = []
    for report in _as_list(reports):
        start, end = window(report)
        for cls in CLASSES:
            spans = _clipped(report.activities[report.activities["class"] == cls], start, end)
            rows.append({"rank": report.rank, "class": cls, "time_ms": float((spans[:, 1] - spans[:, 0]).sum()) / MS,
                         "count": len(spans)})
    table = pd.DataFrame(rows)
    totals = table.groupby("rank")["time_ms"].transform("sum")
    return table.assign(share=(table["time_ms"] / totals.where(totals > 0)).fillna(0.0))


def overlap(reports) -> pd.DataFrame:
    """Per rank, over the window (ms): computation (the union of every non-communication activity), communication
    (NCCL kernels and peer-to-peer copies), overlap (communication while computation runs), exposed communication
    (communication - overlap), idle (no GPU activity), and overlap_share (overlap / communication)."""
    rows = []
    for report in _as_list(reports):
        start, end = window(report)
        talking = report.activities["class"].isin(COMMUNICATION)
        compute = _union(_clipped(report.activities[~talking], start, end))
        comm = _union(_clipped(report.activities[talking], start, end))
        both = _common(compute, comm)
        busy = _length(compute) + _length(comm) - both
        rows.append({"rank": report.rank, "window_ms": (end - start) / MS, "compute_ms": _length(compute) / MS,
                     "communication_ms": _length(comm) / MS, "overlap_ms": both / MS,
                     "exposed_communication_ms": (_length(comm) - both) / MS, "idle_ms": (end - start - busy) / MS,
                     "overlap_share": both / _length(comm) if _length(comm) else 0.0})
    return pd.DataFrame(rows)


def steps(reports) -> pd.DataFrame:
    """The captured iterations per rank, from the driver's NVTX ranges (host time, ms): iteration, start_ms (from the
    rank's first captured iteration), duration_ms, and the forward, backward and optimizer ranges inside it
    (every micro-batch's summed). A report without them (Megatron-LM names no iterations) has no rows."""
    rows = []
    for report in _as_list(reports):
        found = _steps_of(report)
        first = found["start_ns"].min() if len(found) else 0
        for step in found.itertuples():
            inside = report.nvtx[(report.nvtx["start_ns"] >= step.start_ns) & (report.nvtx["end_ns"] <= step.end_ns)]
            row = {"rank": report.rank, "iteration": int(step.iteration), "start_ms": (step.start_ns - first) / MS,
                   "duration_ms": (step.end_ns - step.start_ns) / MS}
            for part in ("forward", "backward", "optimizer"):
                spans = inside[inside["text"] == part]
                row[f"{part}_ms"] = float((spans["end_ns"] - spans["start_ns"]).sum()) / MS
            rows.append(row)
    return pd.DataFrame(rows, columns=["rank", "iteration", "start_ms", "duration_ms", "forward_ms", "backward_ms",
                                       "optimizer_ms"])


CLASS_COLORS = {"gemm": "#1f77b4", "attention": "#9467bd", "elementwise": "#ff7f0e", "collective": "#d62728",
                "p2p": "#e377c2", "memory": "#7f7f7f", "other": "#bcbd22"}
SPLIT_COLORS = {"compute only": "#2ca02c", "overlapped communication": "#17becf",
                "exposed communication": "#d62728", "idle": "#c7c7c7"}


def figure(reports):
    """Two panels of horizontal bars, one per rank: the time per kernel class, and the window split into computation
    alone, communication under computation, exposed communication and idle time."""
    from plotly.subplots import make_subplots

    reports = _as_list(reports)
    classes, split = kernel_time(reports), overlap(reports)
    labels = [f"rank {r}" for r in split["rank"]]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.08,
                        subplot_titles=("GPU time per kernel class (ms)", "computation vs communication (ms)"))
    for cls in CLASSES:
        part = classes[classes["class"] == cls]
        fig.add_bar(name=cls, y=[f"rank {r}" for r in part["rank"]], x=part["time_ms"], orientation="h",
                    marker_color=CLASS_COLORS[cls], legendgroup="classes", row=1, col=1)
    parts = {"compute only": split["compute_ms"] - split["overlap_ms"], "overlapped communication": split["overlap_ms"],
             "exposed communication": split["exposed_communication_ms"], "idle": split["idle_ms"]}
    for name, values in parts.items():
        fig.add_bar(name=name, y=labels, x=values, orientation="h", marker_color=SPLIT_COLORS[name],
                    legendgroup="split", row=1, col=2)
    return fig.update_layout(barmode="stack", title="Nsight Systems capture per rank")


def summary(reports) -> dict:
    """Everything above as plain data (labkit profile nsys --json)."""
    reports = _as_list(reports)
    return {"reports": [str(r.path) for r in reports],
            "kernel_time": kernel_time(reports).to_dict(orient="records"),
            "overlap": overlap(reports).to_dict(orient="records"),
            "steps": steps(reports).to_dict(orient="records")}


def _as_list(reports) -> list[Report]:
    return [reports] if isinstance(reports, Report) else list(reports)

"""Watch a job and explain how it ended: FASOP's get_result.sh (github.com/AvatarHwang/FASOP), done properly.

report(job) gathers, per node, the last lines of out/err/gpu; the job info echoed into the logs (by the job script and
by the training driver) compared with the spec, mismatches flagged; the iteration-time table; and, for a job that did
not complete, its cause. format_report() prints it with termcolor; widget() shows it in a notebook and refreshes it
until the job ends.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from labkit.jobs.job import State
from labkit.jobs.render import INFO_KEYS

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)")
_LOSS = re.compile(r"lm loss:\s*([0-9.eE+-]+|nan|inf)", re.I)
_ECHOED = re.compile(r"^(NODE|NODE_RANK|NPROC_PER_NODE|MASTER_ADDR|MASTER_PORT|" + "|".join(INFO_KEYS) + r"): (.*)$")
_WORLD = re.compile(r"using world size: (\d+), data-parallel size: (\d+),.*?tensor-model-parallel size: (\d+), "
                    r"pipeline-model-parallel size: (\d+)")
_BENIGN_STDERR = re.compile(r"warn|^\s*$|^\s*return func\(|^\s*warnings\.warn|^\[?W\d{4} |^W\d{4}|^\s*\^+\s*$|"
                            r"Unable to save .* indexes|^INFO|^\[INFO", re.I)

# Spec figures and the names the job script (KEY: value) and the driver's log use for them.
_CHECKS = (("WORLD_SIZE", "world_size"), ("TENSOR_MP_SIZE", "tensor"), ("PIPELINE_MP_SIZE", "pipeline"),
           ("DP_SIZE", "data"), ("GLOBAL_BATCH_SIZE", "global_batch"), ("MICRO_BATCH_SIZE", "micro_batch"),
           ("PARTITION", "partition"), ("NUM_LAYERS", "num_layers"), ("HIDDEN_SIZE", "hidden_size"),
           ("NNODES", "nnodes"))


def tail_file(path: Path, lines: int = 10, max_bytes: int = 256_000) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.replace("\r", "\n").splitlines()[-lines:] if lines else []


def _read(path: Path, max_bytes: int = 4_000_000) -> str:
    return "\n".join(tail_file(path, lines=10**9, max_bytes=max_bytes))


@dataclass
class IterationLog:
    """The interval lines of a Megatron log: one row per logged iteration."""
    iterations: pd.DataFrame


def parse_iterations(paths: list[Path]) -> IterationLog:
    rows: dict[int, dict] = {}
    for path in paths:
        for line in _read(Path(path)).splitlines():
            match = _ITERATION.search(line)
            if not match:
                continue
            elapsed, loss = _ELAPSED.search(line), _LOSS.search(line)
            row = {"iteration": int(match.group(1)), "train_iters": int(match.group(2)),
                   "elapsed_ms": float(elapsed.group(1)) if elapsed else None,
                   "lm_loss": float(loss.group(1)) if loss else None, "node": Path(path).stem}
            # Every rank of the last stage prints the line; keep one, preferring a line that carries the loss.
            if row["iteration"] not in rows or (rows[row["iteration"]]["lm_loss"] is None and row["lm_loss"] is not None):
                rows[row["iteration"]] = row
    columns = ["iteration", "train_iters", "elapsed_ms", "lm_loss", "node"]
    return IterationLog(pd.DataFrame([rows[i] for i in sorted(rows)], columns=columns))


def last_iteration(job) -> int:
    outs = [files["out"] for files in job.node_logs().values() if "out" in files]
    found = [int(m.group(1)) for path in outs for line in tail_file(path, 50) for m in [_ITERATION.search(line)] if m]
    return max(found, default=0)


def job_info(job) -> dict[str, dict[str, str]]:
    """Per node: the KEY: value lines the job script echoed, plus what the driver reports about its layout."""
    info: dict[str, dict[str, str]] = {}
    for node, files in job.node_logs().items():
        values: dict[str, str] = {}
        for line in tail_file(files.get("out", Path("/nonexistent")), lines=10**6, max_bytes=2_000_000):
            echoed = _ECHOED.match(line)
            if echoed and echoed.group(1) not in values:
                values[echoed.group(1)] = echoed.group(2).strip()
            world = _WORLD.search(line)
            if world:
                for key, value in zip(("LOG_WORLD_SIZE", "LOG_DP_SIZE", "LOG_TENSOR_MP_SIZE", "LOG_PIPELINE_MP_SIZE"),
                                      world.groups()):
                    values[key] = value
        info[node] = values
    return info


def expected_info(spec) -> dict[str, str]:
    return {"WORLD_SIZE": str(spec.world_size), "TENSOR_MP_SIZE": str(spec.parallel.tensor),
            "PIPELINE_MP_SIZE": str(spec.parallel.pipeline), "DP_SIZE": str(spec.data_parallel),
            "GLOBAL_BATCH_SIZE": str(spec.batch.global_), "MICRO_BATCH_SIZE": str(spec.batch.micro),
            "PARTITION": spec.partition_string, "NUM_LAYERS": str(spec.model.num_layers),
            "HIDDEN_SIZE": str(spec.model.hidden_size),
            "NNODES": str(sum(g.count for g in spec.cluster_or_default().nodes))}


def mismatches(spec, info: dict[str, dict[str, str]]) -> list[str]:
    """Where a node's logs disagree with the spec: 'n2: DP_SIZE is 2 in the log, 4 in the spec'."""
    expected = expected_info(spec)
    problems = []
    for node, values in sorted(info.items()):
        for key, want in expected.items():
            for source in (key, f"LOG_{key}"):
                if source in values and values[source] != want:
                    where = "the driver's log" if source.startswith("LOG_") else "the job script"
                    problems.append(f"{node}: {key} is {values[source]} in {where}, {want} in the spec")
    return problems


# --- causes ------------------------------------------------------------------------------------------------------
_OOM_CUDA = re.compile(r"CUDA out of memory|OutOfMemoryError|ERROR: out of memory|CUBLAS_STATUS_ALLOC_FAILED", re.I)
_OOM_KILLED = re.compile(r"oom[-_ ]kill|Out Of Memory|Killed process|Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9\b|"
                         r"exit code 137|^Killed$", re.I | re.M)
_NAN = re.compile(r"ERROR:.*\bnan\b|lm loss:\s*nan|number of nan iterations:\s*[1-9]", re.I)
_COMM = re.compile(r"NCCL error|nccl\w*Error|ProcessGroupNCCL.*(?:error|timeout)|gloo.*(?:error|exception|timed out)|"
                   r"Connection (?:closed|reset) by peer|DistNetworkError|DistStoreError|RendezvousTimeoutError|"
                   r"Socket Timeout|connect\(\) timed out", re.I)
_NO_FILE = re.compile(r"No such file|not found|does not exist|FileNotFoundError|cannot open|has no ", re.I)


@dataclass
class LogText:
    name: str
    text: str


def _texts(job) -> list[LogText]:
    texts = []
    for node, files in job.node_logs().items():
        for kind in ("err", "out"):
            if kind in files:
                texts.append(LogText(f"{node}.{kind}", _read(files[kind])))
    for path in job.batch_logs() + [job.record.logs / "runner.out"]:
        if path.exists():
            texts.append(LogText(path.name, _read(path)))
    return texts


def _first(pattern: re.Pattern, texts: list[LogText]) -> str | None:
    for log in texts:
        for number, line in enumerate(log.text.splitlines(), 1):
            if pattern.search(line):
                return f"{log.name}:{number}: {line.strip()[:300]}"
    return None


def explain(job) -> str | None:
    """Why the job did not complete: out of memory, NaN loss, NCCL/gloo error, time limit, cancelled, bad data path,
    node failure, error output on stderr; None while it runs or after it completed."""
    status = job.status(refresh=False)
    state = status.state
    if not state.finished or state == State.COMPLETED:
        return None
    texts = _texts(job)
    spec = job.spec
    if state == State.TIMEOUT or _first(re.compile(r"DUE TO TIME LIMIT"), texts):
        return f"time limit: the job ran past its limit of {spec.job.time_limit or 'the partition default'}"
    if state == State.CANCELLED:
        if status.reason and "Dependency" in status.reason:
            return f"cancelled: a job it depends on did not complete ({status.reason})"
        return "cancelled" + (f" ({status.reason})" if status.reason and status.reason != "None" else "")
    if state == State.NODE_FAIL:
        return "node failure: Slurm lost a node of the job" + (f" ({status.reason})" if status.reason else "")
    evidence = _first(_OOM_CUDA, texts)
    if evidence:
        return f"out of memory (GPU): {evidence}"
    evidence = _first(_OOM_KILLED, texts)
    if state == State.OUT_OF_MEMORY or evidence:
        return "out of memory: killed by the kernel" + (f": {evidence}" if evidence else "")
    evidence = _first(_NAN, texts)
    if evidence:
        return f"NaN loss: {evidence}"
    if spec.data.path and not spec.data.mock:
        evidence = _first(re.compile(f"{re.escape(spec.data.path)}.*(?:{_NO_FILE.pattern})|"
                                     f"(?:{_NO_FILE.pattern}).*{re.escape(spec.data.path)}", re.I), texts)
        if evidence:
            return f"bad data path {spec.data.path!r}: {evidence}"
    evidence = _first(_COMM, texts)
    if evidence:
        return f"NCCL/gloo communication error: {evidence}"
    for log in texts:
        if log.name.endswith(".err"):
            for number, line in enumerate(log.text.splitlines(), 1):
                if not _BENIGN_STDERR.search(line):
                    return f"error output on stderr: {log.name}:{number}: {line.strip()[:300]}"
    evidence = _first(re.compile(r"^ERROR: .*|srun: error: .*"), texts)
    if evidence:
        return f"failed: {evidence}"
    return f"failed with exit code {status.exit_code}" if status.exit_code else "failed"


# --- the report --------------------------------------------------------------------------------------------------
@dataclass
class Report:
    run_id: str
    job_ids: list[str]
    state: State
    cause: str | None
    tails: dict[str, dict[str, list[str]]]
    info: dict[str, dict[str, str]]
    mismatches: list[str]
    iterations: pd.DataFrame
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "job_ids": self.job_ids, "state": str(self.state), "cause": self.cause,
                "mismatches": self.mismatches, "info": self.info, "tails": self.tails,
                "iterations": self.iterations.to_dict(orient="records")}


def report(job, lines: int = 5) -> Report:
    state = job.state
    outs = [files["out"] for files in job.node_logs().values() if "out" in files]
    info = job_info(job)
    return Report(run_id=job.record.run_id, job_ids=job.job_ids, state=state, cause=job.cause(),
                  tails=job.tail(lines), info=info, mismatches=mismatches(job.spec, info),
                  iterations=parse_iterations(outs).iterations)


_STATE_COLOURS = {State.COMPLETED: "green", State.RUNNING: "cyan", State.PENDING: "yellow"}


def format_report(rep: Report, color: bool = True) -> str:
    from termcolor import colored

    def paint(text: str, colour: str | None = None, bold: bool = False) -> str:
        if not color:
            return text
        return colored(text, colour, attrs=["bold"] if bold else None, force_color=True)

    def banner(title: str) -> str:
        return paint(f"******************* {title} *******************", "blue", bold=True)

    out = [banner(f"run {rep.run_id} (job {', '.join(rep.job_ids)})"),
           "state: " + paint(str(rep.state), _STATE_COLOURS.get(rep.state, "red"), bold=True)]
    if rep.cause:
        out.append("cause: " + paint(rep.cause, "red"))
    for kind, title in (("out", "last output"), ("err", "last error output"), ("gpu", "last GPU samples")):
        out.append(banner(title))
        for node, files in sorted(rep.tails.items()):
            out.append(paint(f"==> {node}.{kind} <==", bold=True))
            for line in files.get(kind, []):
                bad = kind == "err" and not _BENIGN_STDERR.search(line)
                out.append(paint(line, "red") if bad else line)
    out.append(banner("job info"))
    first = next(iter(sorted(rep.info.items())), (None, {}))[1]
    for key, value in first.items():
        out.append(f"{key}: {value}")
    for problem in rep.mismatches:
        out.append(paint(f"MISMATCH {problem}", "red", bold=True))
    if not rep.mismatches and first:
        out.append(paint("job info matches the spec", "green"))
    out.append(banner("iteration time"))
    for row in rep.iterations.itertuples():
        seconds = "-" if row.elapsed_ms is None or pd.isna(row.elapsed_ms) else f"{row.elapsed_ms / 1000:.4f} s"
        loss = "" if row.lm_loss is None or pd.isna(row.lm_loss) else f"  lm loss {row.lm_loss:.6f}"
        out.append(f"iteration {row.iteration} : {seconds}{loss}")
    return "\n".join(out)


def widget(job, interval_s: float = 2.0, lines: int = 5):
    """An ipywidgets view of the report that refreshes every `interval_s` while the job runs, then stops."""
    import html

    import ipywidgets as widgets

    view = widgets.HTML()
    stop = threading.Event()

    def render() -> State:
        rep = report(job, lines=lines)
        text = format_report(rep, color=False)
        colour = {"COMPLETED": "green", "RUNNING": "teal", "PENDING": "orange"}.get(str(rep.state), "red")
        view.value = (f"<b style='color:{colour}'>{html.escape(str(rep.state))}</b>"
                      f"<pre style='font-size:11px'>{html.escape(text)}</pre>")
        return rep.state

    def loop() -> None:
        while not stop.is_set():
            if render().finished:
                return
            stop.wait(interval_s)

    render()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    view.stop = stop.set
    view.refresher = thread
    return view

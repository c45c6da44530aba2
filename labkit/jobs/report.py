"""A job's report, as FASOP's get_result.sh prints one (github AvatarHwang/FASOP), done properly.

report(job) gathers, per node, the last lines of out/err/gpu; the job info echoed into the logs (by the job script and
by the training driver) compared with the spec, mismatches flagged; the iteration-time table; and, for a job that did
not complete, its cause (labkit.jobs.diagnose). format_report() prints it with termcolor; widget() shows it in a
notebook and refreshes it until the job ends.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import pandas as pd

from labkit.jobs.diagnose import BENIGN_STDERR, mismatches
from labkit.jobs.job import Job, tail_file
from labkit.jobs.state import State
from labkit.logs.job_info import node_info
from labkit.logs.parse import records


# --- the report --------------------------------------------------------------------------------------------------
@dataclass
class Report:
    """What `labkit status` prints about one run."""
    run_id: str
    """The run's directory name under runs/."""
    job_ids: list[str]
    """The scheduler's ids of its job(s)."""
    state: State
    """Its state when the report was made."""
    cause: str | None
    """Why it did not complete; None while it runs or after it completed."""
    tails: dict[str, dict[str, list[str]]]
    """{node: {"out" | "err" | "gpu": its last lines}}."""
    info: dict[str, dict[str, str]]
    """{node: the job info its log echoed}, the driver's parallel sizes as LOG_WORLD_SIZE, ..."""
    mismatches: list[str]
    """Where a node's job info disagrees with the spec."""
    iterations: pd.DataFrame
    """One row per logged iteration (labkit.jobs.job.ITERATION_FIELDS)."""
    attempts: list[dict]
    """How each earlier attempt of a requeued job ended (attempt, outcome, exit_code, reason, cause, logs); the
    tails and job info are the latest attempt's."""

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "job_ids": self.job_ids, "state": str(self.state), "cause": self.cause,
                "attempts": self.attempts, "mismatches": self.mismatches, "info": self.info, "tails": self.tails,
                "iterations": records(self.iterations)}


def report(job: Job, lines: int = 5) -> Report:
    """What the monitor shows of a job: its state and cause, each node's last `lines` lines, the job information each
    node printed checked against the spec, and the iterations so far.

    Taught in labs 01 and 07.
    """
    state = job.state
    info = {node: node_info(tail_file(files["out"], lines=10**6, max_bytes=2_000_000) if "out" in files else [])
            for node, files in job.node_logs().items()}
    return Report(run_id=job.record.run_id, job_ids=job.job_ids, state=state, cause=job.cause(),
                  tails=job.tail(lines), info=info, mismatches=mismatches(job.spec, info),
                  iterations=job.iterations(),
                  attempts=[{k: v for k, v in a.items() if k != "time"} for a in job.record.attempts()])


_STATE_COLOURS = {State.COMPLETED: "green", State.RUNNING: "cyan", State.PENDING: "yellow"}


def format_report(rep: Report, color: bool | None = None) -> str:
    """The report as text. Coloured as termcolor decides by default (off with NO_COLOR or ANSI_COLORS_DISABLED, on with
    FORCE_COLOR, else off for TERM=dumb and when stdout is not a terminal); `color=True` colours it unless NO_COLOR is
    set (https://no-color.org), `color=False` never.

    Taught in labs 01 and 07.
    """
    from termcolor import colored

    if color is not None:
        color = color and not os.environ.get("NO_COLOR")

    def paint(text: str, colour: str | None = None, bold: bool = False) -> str:
        if color is False:
            return text
        return colored(text, colour, attrs=["bold"] if bold else None, force_color=color)

    def banner(title: str) -> str:
        return paint(f"******************* {title} *******************", "blue", bold=True)

    out = [banner(f"run {rep.run_id} (job {', '.join(rep.job_ids)})"),
           "state: " + paint(str(rep.state), _STATE_COLOURS.get(rep.state, "red"), bold=True)]
    if rep.cause:
        out.append("cause: " + paint(rep.cause, "red"))
    for attempt in rep.attempts:
        out.append(f"earlier attempt: {paint(attempt['outcome'], 'yellow')}: {attempt['cause']} (logs: "
                   f"{attempt['logs']})")
    for kind, title in (("out", "last output"), ("err", "last error output"), ("gpu", "last GPU samples")):
        out.append(banner(title))
        for node, files in sorted(rep.tails.items()):
            out.append(paint(f"==> {node}.{kind} <==", bold=True))
            for line in files.get(kind, []):
                bad = kind == "err" and not BENIGN_STDERR.search(line)
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


def widget(job: Job, interval_s: float = 2.0, lines: int = 5):
    """An ipywidgets view of the report that refreshes every `interval_s` while the job runs, then stops.

    Taught in labs 01 and 07.
    """
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

"""Why a job ended as it did, and whether its logs agree with its spec: plain functions over a status, a spec and log
text, with no job or scheduler behind them (labkit.jobs.job reads the files and hands them over)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from labkit.jobs.render import job_info
from labkit.jobs.state import Attempt, State, Status
from labkit.logs.parse import checkpoint_events

# stderr lines that say nothing about a failure: warnings, their source lines and carets, log-level prefixes.
BENIGN_STDERR = re.compile(r"warn|^\s*$|^\s*return func\(|^\s*warnings\.warn|^\[?W\d{4} |^W\d{4}|^\s*\^+\s*$|"
                           r"Unable to save .* indexes|^INFO|^\[INFO", re.I)


_OOM_CUDA = re.compile(r"CUDA out of memory|OutOfMemoryError|ERROR: out of memory|CUBLAS_STATUS_ALLOC_FAILED", re.I)
# The kernel's OOM killer leaves its own trace (dmesg's "Killed process", Slurm's "Detected N oom_kill events",
# the cgroup's "Memory cgroup out of memory"); a bare SIGKILL (exit 137, -9, "Killed") may come from anyone.
_OOM_KILLED = re.compile(r"oom[-_ ]kill|Out Of Memory|Killed process|Memory cgroup out of memory", re.I)
_SIGKILL = re.compile(r"Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9\b|exit code 137|^Killed$", re.I | re.M)
_ARGPARSE_ERROR = re.compile(r"^\S.*: error: .+")  # the line after an argparse usage block says what was wrong
# squeue's reasons of a pending job, and what they mean to its owner.
PENDING_REASONS = {
    "Resources": "waiting for nodes to free up",
    "Priority": "jobs of higher priority are ahead of it",
    "Dependency": "waiting for the jobs it depends on",
    "BeginTime": "waiting for its start time",
    "ReqNodeNotAvail": "a node it asks for is down, drained or reserved",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "QOSMaxJobsPerUserLimit": "its owner already runs as many jobs as the QOS allows",
    "AssocGrpGRES": "its account has used up its GPU allowance",
    "JobHeldUser": "held by its owner (scontrol release)",
    "JobHeldAdmin": "held by an administrator",
}
_NAN = re.compile(r"ERROR:.*\bnan\b|lm loss:\s*nan|number of nan iterations:\s*[1-9]", re.I)
_COMM = re.compile(r"NCCL error|nccl\w*Error|ProcessGroupNCCL.*(?:error|timeout)|gloo.*(?:error|exception|timed out)|"
                   r"Connection (?:closed|reset) by peer|DistNetworkError|DistStoreError|RendezvousTimeoutError|"
                   r"Socket Timeout|connect\(\) timed out", re.I)
_NO_FILE = re.compile(r"No such file|not found|does not exist|FileNotFoundError|cannot open|has no ", re.I)
_TIME_LIMIT = re.compile(r"DUE TO TIME LIMIT")
_ERROR_LINE = re.compile(r"^ERROR: .*|srun: error: .*")
_DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded|database or disk is full")


@dataclass
class LogText:
    """One log's text, under the name a cause cites it by."""
    name: str
    """`NODE.err`, `NODE.out`, `slurm-JOBID.out` or `runner.out`."""
    text: str
    """Its text (the last few MB of a large log)."""


def _first(pattern: re.Pattern, texts: list[LogText]) -> str | None:
    for log in texts:
        for number, line in enumerate(log.text.splitlines(), 1):
            if pattern.search(line):
                return f"{log.name}:{number}: {line.strip()[:300]}"
    return None


def explain(status: Status, spec, texts: Iterable[LogText]) -> str | None:
    """Why a job waits (squeue's pending reason, explained) or did not complete: out of memory (the kernel's, told apart
    from a SIGKILL from elsewhere), NaN loss, NCCL/gloo error, time limit, cancelled, bad data path,
    node failure, error output on stderr; None while it runs or after it completed. `texts` (node err then out logs,
    then the scheduler's) is read only for a job that failed."""
    state = status.state
    if state == State.PENDING and status.reason and status.reason != "None":
        meaning = PENDING_REASONS.get(status.reason)
        return f"pending ({status.reason})" + (f": {meaning}" if meaning else "")
    if not state.finished or state == State.COMPLETED:
        return None
    texts = list(texts)
    if state == State.TIMEOUT or _first(_TIME_LIMIT, texts):
        return f"time limit: the job ran past its limit of {spec.job.time_limit or 'the partition default'}"
    if state == State.CANCELLED:
        if status.reason and "Dependency" in status.reason:
            return f"cancelled: a job it depends on did not complete ({status.reason})"
        stale = status.reason in PENDING_REASONS or status.reason == "None"  # why it waited, not why it ended
        return "cancelled" + (f" ({status.reason})" if status.reason and not stale else "")
    if state == State.NODE_FAIL:
        return "node failure: Slurm lost a node of the job" + (f" ({status.reason})" if status.reason else "")
    evidence = _first(_OOM_CUDA, texts)
    if evidence:
        return f"out of memory (GPU): {evidence}"
    evidence = _first(_OOM_KILLED, texts)
    if state == State.OUT_OF_MEMORY or evidence:
        return "out of memory: killed by the kernel" + (f": {evidence}" if evidence else "")
    evidence = _first(_SIGKILL, texts)
    if evidence:
        return ("killed (SIGKILL) by something other than the kernel's out-of-memory killer, which left no trace: a "
                f"user, the scheduler or a watchdog: {evidence}")
    evidence = _first(_NAN, texts)
    if evidence:
        return f"NaN loss: {evidence}"
    evidence = _first(_DISK_FULL, texts)
    if evidence:
        return f"disk full: {evidence}"
    if spec.data.path and not spec.data.mock:
        evidence = _first(re.compile(f"{re.escape(spec.data.path)}.*(?:{_NO_FILE.pattern})|"
                                     f"(?:{_NO_FILE.pattern}).*{re.escape(spec.data.path)}", re.I), texts)
        if evidence:
            return f"bad data path {spec.data.path!r}: {evidence}"
    evidence = _first(_COMM, texts)
    if evidence:
        return f"NCCL/gloo communication error: {evidence}"
    evidence = _first(_ARGPARSE_ERROR, [t for t in texts if t.name.endswith(".err")])
    if evidence:
        return f"refused its arguments: {evidence}"
    for log in texts:
        if log.name.endswith(".err"):
            for number, line in enumerate(log.text.splitlines(), 1):
                if not BENIGN_STDERR.search(line):
                    return f"error output on stderr: {log.name}:{number}: {line.strip()[:300]}"
    evidence = _first(_ERROR_LINE, texts)
    if evidence:
        return f"failed: {evidence}"
    ended = f"failed with exit code {status.exit_code}" if status.exit_code else "failed"
    return f"{ended}: {status.reason}" if status.reason else ended  # e.g. the local runner's account of its end


def explain_attempt(attempt: Attempt, texts: Iterable[LogText]) -> str:
    """How one attempt of a requeued job ended: Slurm's outcome, and what the driver did (the checkpoint it loaded at
    the start, the one it saved when it was stopped)."""
    what = {"REQUEUED": "requeued (scontrol requeue, or the job's own requeue before its time limit)",
            "NODE_FAIL": "node failure: Slurm lost a node of the job and requeued it",
            "PREEMPTED": "preempted by a job of higher priority, and requeued"}.get(attempt.outcome,
                                                                                    attempt.outcome.lower())
    events = checkpoint_events("\n".join(log.text for log in texts))
    notes = []
    if events["loaded"] is not None:
        notes.append(f"resumed from iteration {events['loaded']}")
    if events["stopped_on"]:
        notes.append(f"stopped on {events['stopped_on']}" + (
            f" after saving a checkpoint at iteration {events['saved']}" if events["saved"] is not None else ""))
    elif events["saved"] is not None:
        notes.append(f"last checkpoint at iteration {events['saved']}")
    return f"attempt {attempt.number}: {what}" + (f"; {'; '.join(notes)}" if notes else "")


def mismatches(spec, info: dict[str, dict[str, str]]) -> list[str]:
    """Where a node's logs disagree with the spec: 'n2: DP_SIZE is 2 in the log, 4 in the spec'."""
    expected = job_info(spec)
    problems = []
    for node, values in sorted(info.items()):
        for key, want in expected.items():
            for source in (key, f"LOG_{key}"):
                if source in values and values[source] != want:
                    where = "the driver's log" if source.startswith("LOG_") else "the job script"
                    problems.append(f"{node}: {key} is {values[source]} in {where}, {want} in the spec")
    return problems

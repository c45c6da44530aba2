"""SlurmBackend: sbatch the rendered scripts, follow the jobs, cancel them.

State: `squeue -h -t all -O` while the controller knows the job (with its restart count); once it ended,
`sacct -P -o JobID,State,ExitCode` when accounting exists, `scontrol -o show job` for what accounting lacks or has not
recorded yet, and finally the jobcomp file (a local Slurm may run without slurmdbd). One call of each serves every job
being polled. A requeued job's earlier attempts come from `sacct --duplicates` (or the jobcomp file), asked once per
requeue. Plain `-o`/`-O`/`-P` formats only: their JSON differs between Slurm versions.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

from labkit.jobs.job import Job
from labkit.jobs.render import check_job, default_layout, render_array
from labkit.jobs.record import RunRecord
from labkit.paths import runs_dir
from labkit.jobs.state import Attempt, State, Status, slurm_state
from labkit.jobs.watcher import SCHEDULER_BACKOFF
from labkit.spec import RunSpec, SpecError, load_spec

_FIELDS = re.compile(r"\b(JobId|ArrayJobId|ArrayTaskId|HetJobId|JobState|Reason|ExitCode)=(\S*)")


class SlurmError(RuntimeError):
    """Slurm refused a command; the message is Slurm's own text."""


def _run(args: list[str], check: bool = True, cwd: Path | None = None,
         env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=cwd, env=env)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]} not found: this host has no Slurm client (use the local backend, or "
                         "`make slurm-up` for a local Slurm)") from None
    if check and done.returncode != 0:
        raise SlurmError(done.stderr.strip() or done.stdout.strip() or f"{args[0]} exited with {done.returncode}")
    return done


def _unit_keys(slurm_id: str) -> list[str]:
    """A squeue/sacct job id -> the job ids we track: 10+1 -> [10]; 9_[1-3%2] -> [9_1, 9_2, 9_3]; 9_0 -> [9_0]."""
    slurm_id = slurm_id.split("+")[0]
    match = re.fullmatch(r"(\d+)_\[([^\]]*)\]", slurm_id)
    if not match:
        return [slurm_id]
    keys = []
    for part in match.group(2).split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        keys += [f"{match.group(1)}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return keys


def combine(statuses: list[Status]) -> Status:
    """One state for a job made of several units (het components, a master/slave pair), with the most restarts any
    of them counts."""
    if not statuses:
        return Status(State.UNKNOWN)
    return dataclasses.replace(_combined_state(statuses), restarts=max(s.restarts for s in statuses))


def _combined_state(statuses: list[Status]) -> Status:
    unfinished = [s for s in statuses if not s.state.finished]
    if unfinished:
        running = [s for s in unfinished if s.state == State.RUNNING]
        return (running or unfinished)[0]
    failed = [s for s in statuses if s.state != State.COMPLETED]
    order = [State.NODE_FAIL, State.OUT_OF_MEMORY, State.TIMEOUT, State.FAILED, State.CANCELLED, State.UNKNOWN]
    return sorted(failed, key=lambda s: order.index(s.state))[0] if failed else statuses[0]


def settle(queued: list[Status], recorded: list[Status]) -> list[Status]:
    """A unit squeue saw end, as its final record (sacct, scontrol, the jobcomp file) has it. slurmdbd learns of a
    job's end a moment after the controller: while the record still shows the unit unfinished, squeue's view stands,
    and a reason the record lacks (sacct has none yet for a job its dependency cancelled) is squeue's."""
    if queued and all(s.state.finished for s in queued) and not all(s.state.finished for s in recorded):
        return queued
    reasons = [s.reason for s in queued if s.reason and s.reason != "None"]
    if not reasons:
        return recorded
    return [s if s.reason and s.reason != "None" else Status(s.state, s.exit_code, reasons[0]) for s in recorded]


class SlurmBackend:
    name = "slurm"
    backoff = SCHEDULER_BACKOFF  # squeue and sacct load slurmctld and slurmdbd, shared by every user of the cluster

    def __init__(self, runs_dir: str | os.PathLike | None = None, layout: str | None = None,
                 torchrun: str | None = None):
        self.runs_dir = runs_dir
        self.layout = layout
        self.torchrun = torchrun
        self._config: dict[str, str] | None = None
        self._attempts: dict[str, list[Attempt]] = {}  # job id -> its ended attempts, once all are recorded

    # --- submission ----------------------------------------------------------------------------------------------
    def submit(self, spec: RunSpec | str | os.PathLike, after: Job | list[Job] | None = None,
               layout: str | None = None) -> Job:
        """Render, record and sbatch one run. `after`: start only once these jobs COMPLETED (afterok)."""
        return self._submit([spec], after, layout or self.layout)[0]

    def submit_array(self, specs: list, after: Job | list[Job] | None = None) -> list[Job]:
        """Several runs with the same nodes and job options as one Slurm job array; one Job (and run) per task."""
        return self._submit(specs, after, "multinode")

    def _submit(self, specs: list, after, layout: str | None) -> list[Job]:
        specs = [s if isinstance(s, RunSpec) else load_spec(s) for s in specs]
        layout = layout or default_layout(specs[0])
        errors = check_job(specs[0], layout)
        if errors:
            raise SpecError(errors)
        records = [RunRecord.create(spec, runs_dir(self.runs_dir)) for spec in specs]
        rendered = render_array(specs, [r.logs for r in records], layout=layout,
                                run_ids=[r.run_id for r in records], torchrun=self.torchrun)
        for record in records:
            for name, text in rendered.scripts.items():
                record.write_script(name, text)
        options = []
        after = [after] if isinstance(after, Job) else list(after or [])
        if after:
            options.append("--dependency=afterok:" + ":".join(i for job in after for i in job.job_ids))
        scripts = [records[0].path / name for name in rendered.scripts]
        try:
            first = self._sbatch(options, scripts[0])
            job_ids = [first]
            if layout == "pair":
                job_ids.append(self._sbatch(options + [f"--dependency=after:{first}",
                                                       f"--export=ALL,MASTER_JOB_ID={first}"], scripts[1]))
        except SlurmError as exc:
            for record in records:
                record.set_status(State.FAILED, cause=f"rejected by Slurm: {exc}")
            raise
        if len(specs) > 1:
            task_ids = [[f"{first}_{i}"] for i in range(len(specs))]
        else:
            task_ids = [job_ids]
        jobs = []
        for record, ids in zip(records, task_ids):
            record.attach(self.name, layout, ids)
            jobs.append(Job(self, ids, record))
        return jobs

    def _sbatch(self, options: list[str], script: Path) -> str:
        # The run directory becomes the job's working directory.
        # LABKIT_SUBMITTED: the script waits for job.json before it starts a node (templates/node.sh.j2).
        done = _run(["sbatch", "--parsable", *options, str(script)], cwd=script.parent,
                    env={**os.environ, "LABKIT_SUBMITTED": "1"})
        return done.stdout.strip().split(";")[0]

    def test_only(self, script: Path | str) -> str:
        """`sbatch --test-only`: Slurm's verdict on a script without queueing it (raises SlurmError if refused)."""
        return _run(["sbatch", "--test-only", str(script)]).stderr.strip()

    # --- following -----------------------------------------------------------------------------------------------
    def config(self) -> dict[str, str]:
        if self._config is None:
            text = _run(["scontrol", "show", "config"]).stdout
            self._config = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", text, re.M))
        return self._config

    def accounting(self) -> bool:
        return self.config().get("AccountingStorageType", "accounting_storage/none") != "accounting_storage/none"

    def poll(self, jobs: list[Job]) -> dict[Job, Status]:
        """The status of every job in `jobs` from one squeue call (and one call for those that ended); none when the
        controller does not answer."""
        if not jobs:
            return {}
        wanted = {i for job in jobs for i in job.job_ids}
        units: dict[str, list[Status]] = {}
        queue = _run(["squeue", "-h", "-t", "all", "-O", "JobID:|,State:|,Reason:|,RestartCnt:|",
                      "-j", ",".join(sorted(wanted))], check=False)
        if queue.returncode != 0 and "Invalid job id" not in queue.stderr:
            return {}  # the controller did not answer (busy, restarting): keep the states we know
        for line in queue.stdout.splitlines():
            slurm_id, state, reason, restarts = (line.split("|") + ["", "", "", ""])[:4]
            for key in _unit_keys(slurm_id.strip()):
                units.setdefault(key, []).append(Status(slurm_state(state), reason=reason.strip() or None,
                                                        restarts=int(restarts) if restarts.strip().isdigit() else 0))
        ended = {i for i in wanted if i not in units or all(s.state.finished for s in units[i])}
        if ended:
            for key, statuses in self._final_statuses(ended).items():
                queued = units.get(key, [])
                restarts = max((q.restarts for q in queued), default=0)  # the final records do not count them
                units[key] = [dataclasses.replace(u, restarts=restarts) for u in settle(queued, statuses)]
        unknown = Status(State.UNKNOWN, reason="unknown to squeue, scontrol and the job completion log")
        found = {job: [s for i in job.job_ids for s in units.get(i, [])] for job in jobs}
        polled = {job: combine(statuses) if statuses else unknown for job, statuses in found.items()}
        for job, status in polled.items():
            if status.restarts:
                status.ended_attempts = self._ended_attempts(job.job_id, status.restarts)
        return polled

    def _ended_attempts(self, job_id: str, restarts: int) -> list[Attempt]:
        """How the first `restarts` attempts of a requeued job ended: sacct --duplicates lists every attempt; without
        accounting, the job completion log has a line for each requeue (JobState=PENDING there: it was requeued).
        Asked once per new requeue; [] until the scheduler has recorded them all."""
        known = self._attempts.get(job_id, [])
        if len(known) >= restarts:
            return known[:restarts]
        outcomes: list[tuple[str, str | None, str | None]] = []
        if self.accounting():
            done = _run(["sacct", "-D", "-n", "-P", "-X", "-o", "JobID,State,ExitCode,Reason", "-j", job_id],
                        check=False)
            for line in done.stdout.splitlines():
                parts = (line.split("|") + ["", "", ""])[:4]
                if parts[0] in (job_id, f"{job_id}+0"):
                    outcomes.append((parts[1].split()[0] if parts[1].strip() else "", parts[2] or None,
                                     parts[3] or None))
        else:
            jobcomp = Path(self.config().get("JobCompLoc", ""))
            if self.config().get("JobCompType") == "jobcomp/filetxt" and jobcomp.is_file():
                for line in jobcomp.read_text(errors="replace").splitlines():
                    fields = dict(_FIELDS.findall(line))
                    if fields.get("JobId") == job_id:  # (a hetjob's first component has the job's id)
                        state = fields.get("JobState", "")
                        outcomes.append(("REQUEUED" if state == "PENDING" else state, fields.get("ExitCode"),
                                         fields.get("Reason")))
        ended = [Attempt(number, *outcome) for number, outcome in enumerate(outcomes[:restarts])]
        if len(ended) < restarts or any(not slurm_state(a.outcome).finished and a.outcome != "REQUEUED"
                                        for a in ended):
            return []  # slurmdbd has not recorded every requeue yet: ask again at the next poll
        self._attempts[job_id] = ended
        return ended

    def _final_statuses(self, ids: set[str]) -> dict[str, list[Status]]:
        """How the units squeue saw end (or no longer knows) ended: sacct's record; the controller's (scontrol) for
        those sacct lacks or has not yet seen end, since slurmdbd lags behind the controller; the jobcomp file for
        those the controller has dropped too."""
        found: dict[str, list[Status]] = {}
        unsettled = ids
        if self.accounting():
            done = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode,Reason", "-j", ",".join(sorted(ids))],
                        check=False)
            for line in done.stdout.splitlines():
                parts = line.split("|")
                if len(parts) >= 3:
                    for key in _unit_keys(parts[0]):
                        if key in ids:
                            found.setdefault(key, []).append(
                                Status(slurm_state(parts[1]), parts[2], parts[3] if len(parts) > 3 else None))
            unsettled = {i for i in ids if not found.get(i) or not all(s.state.finished for s in found[i])}
            if not unsettled:
                return found
        controller: dict[str, list[Status]] = {}
        self._collect(_run(["scontrol", "-o", "show", "job"], check=False).stdout.splitlines(), unsettled, controller)
        found.update(controller)
        missing = ids - set(found)
        jobcomp = self.config().get("JobCompLoc", "")
        if missing and self.config().get("JobCompType") == "jobcomp/filetxt" and Path(jobcomp).is_file():
            self._collect(Path(jobcomp).read_text(errors="replace").splitlines(), missing, found)
        return found

    @staticmethod
    def _collect(lines: list[str], ids: set[str], found: dict[str, list[Status]]) -> None:
        """Key=Value job lines (scontrol -o show job, the jobcomp file) -> statuses of the ids we follow."""
        for line in lines:
            fields = dict(_FIELDS.findall(line))
            if "JobId" not in fields or "JobState" not in fields:
                continue
            if fields.get("ArrayTaskId") and fields.get("ArrayJobId"):
                key = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}"
            else:
                key = fields.get("HetJobId") or fields["JobId"]
            if key in ids:
                found.setdefault(key, []).append(
                    Status(slurm_state(fields["JobState"]), fields.get("ExitCode"), fields.get("Reason")))

    def cancel(self, job: Job) -> bool:
        """scancel every unit of the job (a refusal raises SlurmError with Slurm's words)."""
        _run(["scancel", *job.job_ids])
        return True


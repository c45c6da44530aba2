"""SlurmBackend: sbatch the rendered scripts, follow the jobs, cancel them.

State: `squeue -h -t all -O` while the controller knows the job (with its restart count); once it ended,
`sacct -P -o JobID,State,ExitCode` when accounting exists, `scontrol -o show job` for what accounting lacks or has not
recorded yet, and finally the jobcomp file (a local Slurm may run without slurmdbd). One call of each serves every job
being polled. A requeued job's earlier attempts come from `sacct --duplicates` (or the jobcomp file), asked once per
requeue. Plain `-o`/`-O`/`-P` formats only: their JSON differs between Slurm versions.

The commands run where Slurm is: on this host, or over ssh on the login node a spec names in cluster.login
(labkit.jobs.remote: the runner also sends the job there and brings its logs back after each poll). A job's runner
is read from its job.json, so that any backend, in any process, follows it where it runs.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

from labkit.jobs.job import Job
from labkit.jobs.render import default_layout, render_array
from labkit.jobs.submission import submission_errors
from labkit.jobs.record import RunRecord
from labkit.jobs.remote import LocalRunner, RemoteError, SshRunner
from labkit.paths import runs_dir
from labkit.jobs.state import Attempt, State, Status, slurm_state
from labkit.jobs.watcher import SCHEDULER_BACKOFF
from labkit.spec import RunSpec, SpecError, load_spec

_FIELDS = re.compile(r"\b(JobId|ArrayJobId|ArrayTaskId|HetJobId|JobState|Reason|ExitCode)=(\S*)")


class SlurmError(RuntimeError):
    """Slurm refused a command; the message is Slurm's own text."""


class LoginError(SlurmError):
    """The login node of cluster.login could not be reached, or a transfer to or from it failed (ssh's words)."""


LOCAL = LocalRunner()


def _run(args: list[str], check: bool = True, cwd: Path | str | None = None, env: dict | None = None,
         runner: LocalRunner | SshRunner = LOCAL) -> subprocess.CompletedProcess:
    """A Slurm command where `runner` runs it (`env`: variables added to the environment)."""
    try:
        done = runner.run(args, cwd=cwd, env=env)
    except FileNotFoundError:
        if runner.login:
            raise SlurmError(f"{args[0]} not found on {runner.login} (cluster.login): the login node has no Slurm "
                             "client on the PATH of a non-interactive ssh login") from None
        raise SlurmError(f"{args[0]} not found: this host has no Slurm client (use the local backend, or "
                         "`labkit slurm up` for a local Slurm)") from None
    except RemoteError as exc:
        raise LoginError(str(exc)) from None
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
        self._configs: dict[LocalRunner | SshRunner, dict[str, str]] = {}  # runner -> its `scontrol show config`
        self._attempts: dict[str, list[Attempt]] = {}  # job id -> its ended attempts, once all are recorded
        self._logins: dict[tuple[str, str | None], SshRunner] = {}  # (login, remote dir) -> its runner
        self._runners: dict[Path, LocalRunner | SshRunner] = {}  # run directory -> where its job runs

    # --- where Slurm runs --------------------------------------------------------------------------------------
    def _ssh(self, login: str, remote_dir: str | None) -> SshRunner:
        if (login, remote_dir) not in self._logins:
            self._logins[login, remote_dir] = SshRunner(login, remote_dir)
        return self._logins[login, remote_dir]

    def runner_for(self, spec: RunSpec) -> LocalRunner | SshRunner:
        """Where a spec's job runs: over ssh on cluster.login, else on this host."""
        cluster = spec.cluster
        return self._ssh(cluster.login, cluster.remote_dir) if cluster is not None and cluster.login else LOCAL

    def runner_of(self, job: Job) -> LocalRunner | SshRunner:
        """Where a submitted job runs, as its job.json records it."""
        path = job.record.path
        if path not in self._runners:
            info = job.record.job_info
            self._runners[path] = self._ssh(info["login"], info.get("remote_dir")) if info.get("login") else LOCAL
        return self._runners[path]

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
        errors = submission_errors(specs[0], layout)
        if errors:
            raise SpecError(errors)
        runner = self.runner_for(specs[0])
        records = [RunRecord.create(spec, runs_dir(self.runs_dir)) for spec in specs]
        # Over ssh the job's directory is on the login node: its scripts name the log directory there, and the
        # Slurm client there finds torchrun on its own PATH.
        places = self._at_login(records, "not sent", lambda: [Path(runner.place(r.path)) for r in records])
        torchrun = self.torchrun or ("torchrun" if runner.login else None)
        there = self._at_login(records, "not sent", lambda: [runner.send_inputs(spec) for spec in specs])
        rendered = render_array(there, [place / "logs" for place in places], layout=layout,
                                run_ids=[r.run_id for r in records], torchrun=torchrun)
        for record in records:
            for name, text in rendered.scripts.items():
                record.write_script(name, text)
        self._at_login(records, "not sent", lambda: [runner.send(r.path, ["spec.yaml", *rendered.scripts])
                                                     for r in records])
        options = []
        after = [after] if isinstance(after, Job) else list(after or [])
        if after:
            options.append("--dependency=afterok:" + ":".join(i for job in after for i in job.job_ids))
        scripts = [places[0] / name for name in rendered.scripts]
        try:
            first = self._sbatch(options, scripts[0], runner)
            job_ids = [first]
            if layout == "pair":
                job_ids.append(self._sbatch(options + [f"--dependency=after:{first}",
                                                       f"--export=ALL,MASTER_JOB_ID={first}"], scripts[1], runner))
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
            record.attach(self.name, layout, ids, **runner.job_info(record.path))
            self._runners[record.path] = runner
        # A job whose job.json does not reach the login node starts nothing (it waits for it, then exits).
        self._at_login(records, "not started", lambda: [runner.send(r.path, ["job.json"]) for r in records])
        for record, ids in zip(records, task_ids):
            jobs.append(Job(self, ids, record))
        return jobs

    @staticmethod
    def _at_login(records: list[RunRecord], outcome: str, step):
        """A step of a submission over ssh; if the login node cannot be reached, the runs are recorded FAILED with
        ssh's reason and LoginError is raised."""
        try:
            return step()
        except RemoteError as exc:
            for record in records:
                record.set_status(State.FAILED, cause=f"{outcome}: {exc}")
            raise LoginError(str(exc)) from None

    def _sbatch(self, options: list[str], script: Path, runner: LocalRunner | SshRunner = LOCAL) -> str:
        # The run directory becomes the job's working directory.
        # LABKIT_SUBMITTED: the script waits for job.json before it starts a node (templates/node.sh.j2).
        done = _run(["sbatch", "--parsable", *options, str(script)], cwd=script.parent,
                    env={"LABKIT_SUBMITTED": "1"}, runner=runner)
        return done.stdout.strip().split(";")[0]

    def test_only(self, script: Path | str) -> str:
        """`sbatch --test-only`: Slurm's verdict on a script without queueing it (raises SlurmError if refused)."""
        return _run(["sbatch", "--test-only", str(script)]).stderr.strip()

    # --- following -----------------------------------------------------------------------------------------------
    def config(self, runner: LocalRunner | SshRunner = LOCAL) -> dict[str, str]:
        """`scontrol show config` of the Slurm that `runner` reaches (this host's by default), asked once."""
        if runner not in self._configs:
            text = _run(["scontrol", "show", "config"], runner=runner).stdout
            self._configs[runner] = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", text, re.M))
        return self._configs[runner]

    def accounting(self, runner: LocalRunner | SshRunner = LOCAL) -> bool:
        return self.config(runner).get("AccountingStorageType", "accounting_storage/none") \
            != "accounting_storage/none"

    def _jobcomp(self, runner: LocalRunner | SshRunner) -> str | None:
        """The job completion log's text, where Slurm keeps one (jobcomp/filetxt)."""
        if self.config(runner).get("JobCompType") != "jobcomp/filetxt" or not self.config(runner).get("JobCompLoc"):
            return None
        return runner.read_text(self.config(runner)["JobCompLoc"])

    def poll(self, jobs: list[Job]) -> dict[Job, Status]:
        """The status of every job in `jobs`, with one squeue call (and one call for those that ended) per Slurm they
        run on; a job over ssh also gets its logs copied back. None for a Slurm whose controller or login node does
        not answer."""
        polled: dict[Job, Status] = {}
        groups: dict[LocalRunner | SshRunner, list[Job]] = {}
        for job in jobs:
            groups.setdefault(self.runner_of(job), []).append(job)
        for runner, group in groups.items():
            try:
                polled.update(self._poll(runner, group))
                # Before the Job takes its status: an end is recorded with the cause and metrics of its logs.
                runner.fetch_logs([job.record.path for job in group])
            except (LoginError, RemoteError):
                polled = {job: status for job, status in polled.items() if job not in group}
        return polled

    def _poll(self, runner: LocalRunner | SshRunner, jobs: list[Job]) -> dict[Job, Status]:
        if not jobs:
            return {}
        wanted = {i for job in jobs for i in job.job_ids}
        units: dict[str, list[Status]] = {}
        queue = _run(["squeue", "-h", "-t", "all", "-O", "JobID:|,State:|,Reason:|,RestartCnt:|",
                      "-j", ",".join(sorted(wanted))], check=False, runner=runner)
        if queue.returncode != 0 and "Invalid job id" not in queue.stderr:
            return {}  # the controller did not answer (busy, restarting): keep the states we know
        for line in queue.stdout.splitlines():
            slurm_id, state, reason, restarts = (line.split("|") + ["", "", "", ""])[:4]
            for key in _unit_keys(slurm_id.strip()):
                units.setdefault(key, []).append(Status(slurm_state(state), reason=reason.strip() or None,
                                                        restarts=int(restarts) if restarts.strip().isdigit() else 0))
        ended = {i for i in wanted if i not in units or all(s.state.finished for s in units[i])}
        if ended:
            for key, statuses in self._final_statuses(ended, runner).items():
                queued = units.get(key, [])
                restarts = max((q.restarts for q in queued), default=0)  # the final records do not count them
                units[key] = [dataclasses.replace(u, restarts=restarts) for u in settle(queued, statuses)]
        unknown = Status(State.UNKNOWN, reason="unknown to squeue, scontrol and the job completion log")
        found = {job: [s for i in job.job_ids for s in units.get(i, [])] for job in jobs}
        polled = {job: combine(statuses) if statuses else unknown for job, statuses in found.items()}
        for job, status in polled.items():
            if status.restarts:
                status.ended_attempts = self._ended_attempts(job.job_id, status.restarts, runner)
        return polled

    def _ended_attempts(self, job_id: str, restarts: int, runner: LocalRunner | SshRunner = LOCAL) -> list[Attempt]:
        """How the first `restarts` attempts of a requeued job ended: sacct --duplicates lists every attempt; without
        accounting, the job completion log has a line for each requeue (JobState=PENDING there: it was requeued).
        Asked once per new requeue; [] until the scheduler has recorded them all."""
        known = self._attempts.get(job_id, [])
        if len(known) >= restarts:
            return known[:restarts]
        outcomes: list[tuple[str, str | None, str | None]] = []
        if self.accounting(runner):
            done = _run(["sacct", "-D", "-n", "-P", "-X", "-o", "JobID,State,ExitCode,Reason", "-j", job_id],
                        check=False, runner=runner)
            for line in done.stdout.splitlines():
                parts = (line.split("|") + ["", "", ""])[:4]
                if parts[0] in (job_id, f"{job_id}+0"):
                    outcomes.append((parts[1].split()[0] if parts[1].strip() else "", parts[2] or None,
                                     parts[3] or None))
        else:
            for line in (self._jobcomp(runner) or "").splitlines():
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

    def _final_statuses(self, ids: set[str], runner: LocalRunner | SshRunner = LOCAL) -> dict[str, list[Status]]:
        """How the units squeue saw end (or no longer knows) ended: sacct's record; the controller's (scontrol) for
        those sacct lacks or has not yet seen end, since slurmdbd lags behind the controller; the jobcomp file for
        those the controller has dropped too."""
        found: dict[str, list[Status]] = {}
        unsettled = ids
        if self.accounting(runner):
            done = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode,Reason", "-j", ",".join(sorted(ids))],
                        check=False, runner=runner)
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
        self._collect(_run(["scontrol", "-o", "show", "job"], check=False, runner=runner).stdout.splitlines(),
                      unsettled, controller)
        found.update(controller)
        missing = ids - set(found)
        if missing:
            self._collect((self._jobcomp(runner) or "").splitlines(), missing, found)
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
        _run(["scancel", *job.job_ids], runner=self.runner_of(job))
        return True


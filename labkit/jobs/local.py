"""LocalBackend, the embedded default when there is no sbatch: this host plays every node of the spec.

The rendered run.sh starts one node_main per node (the same function the sbatch scripts run under srun), so a local
run has the same torchrun command, the same LOGDIR/JOBID/NODE.out|err|gpu logs and the same Job API. The job id is
run.sh's pid; run.sh records its end (COMPLETED, FAILED, CANCELLED or TIMEOUT with the exit code) in
LOGDIR/JOBID/state, so a run can be followed and cancelled from another process too.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

from labkit.jobs.job import Job
from labkit.jobs.render import check_job, render
from labkit.jobs.record import RunRecord
from labkit.paths import runs_dir
from labkit.jobs.state import State, Status
from labkit.net import free_port
from labkit.spec import RunSpec, SpecError, load_spec


class LocalBackend:
    name = "local"

    def __init__(self, runs_dir: str | os.PathLike | None = None, torchrun: str | None = None):
        self.runs_dir = runs_dir
        self.torchrun = torchrun
        self._children: dict[str, subprocess.Popen] = {}

    def submit(self, spec: RunSpec | str | os.PathLike, after: Job | list[Job] | None = None) -> Job:
        spec = spec if isinstance(spec, RunSpec) else load_spec(spec)
        for job in [after] if isinstance(after, Job) else list(after or []):
            if job.wait(progress=False) != State.COMPLETED:
                raise RuntimeError(f"not started: it depends on {job!r}, which ended {job.state}")
        errors = check_job(spec, "local")
        if errors:
            raise SpecError(errors)
        # This host runs every node: a port that is free here, rather than a fixed one two local runs would share.
        spec = spec.replace(**{"job.master_port": free_port()})
        record = RunRecord.create(spec, runs_dir(self.runs_dir))
        script = record.write_script("run.sh", render(spec, record.logs, layout="local", run_id=record.run_id,
                                                      torchrun=self.torchrun).scripts["run.sh"])
        with open(record.logs / "runner.out", "x") as runner_log:
            process = subprocess.Popen(["bash", str(script)], cwd=record.path, stdout=runner_log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        job_id = str(process.pid)
        self._children[job_id] = process
        record.attach(self.name, "local", [job_id], host=socket.gethostname())
        job = Job(self, [job_id], record)
        job.update(Status(State.RUNNING))
        return job

    def poll(self, jobs: list[Job]) -> dict[Job, Status]:
        """Each job's status from the state file its run.sh writes, and whether run.sh still runs."""
        return {job: self._status(job) for job in jobs}

    def _status(self, job: Job) -> Status:
        child = self._children.get(job.job_id)
        if child is not None:
            child.poll()  # reap it, so that its pid does not linger as a zombie
        state_file = job.log_dir / "state"
        words = state_file.read_text().split() if state_file.exists() else []
        if words and words[0] != "RUNNING":
            exit_code = words[1] if len(words) > 1 else None
            return Status(State(words[0]), exit_code=f"{exit_code}:0" if exit_code else None)
        if self._alive(job):
            return Status(State.RUNNING)
        if words or job.log_dir.exists():  # started, but ended without recording how
            return Status(State.FAILED, reason="the local runner stopped without recording an end")
        return Status(State.PENDING)

    def _alive(self, job: Job) -> bool:
        """Whether the job's run.sh still runs (its pid could have been reused by another program since)."""
        try:
            cmdline = Path(f"/proc/{job.job_id}/cmdline").read_bytes()
            stat = Path(f"/proc/{job.job_id}/stat").read_text()
        except OSError:
            return False
        return str(job.record.path).encode() in cmdline and ") Z" not in stat

    def cancel(self, job: Job) -> None:
        if self._alive(job):
            os.killpg(int(job.job_id), signal.SIGTERM)  # run.sh records CANCELLED and stops its nodes

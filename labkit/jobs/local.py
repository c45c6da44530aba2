"""LocalBackend, the embedded default when there is no sbatch: this host plays every node of the spec.

The rendered run.sh starts one node_main per node (the same function the sbatch scripts run under srun), so a local
run has the same torchrun command, the same LOGDIR/JOBID/NODE.out|err|gpu logs and the same Job API. The job id is
run.sh's pid, and run.sh leads a process group (its own session) holding its nodes, torchrun and the workers; run.sh
records its end (COMPLETED, FAILED, CANCELLED or TIMEOUT with the exit code) in LOGDIR/JOBID/state, so a run can be
followed and cancelled from another process too. run.sh starts no node before labkit has recorded its job id in
job.json: a job never runs untracked.

When run.sh ended on its own but could not write that state file (the runs directory became read-only, the disk
filled up), its end is read from the evidence instead: run.sh's exit status (which its shell writes over the blanks
of logs/runner.exit, reserved when the job was submitted, so that it fits on a full disk; the labkit that started it
also has it from the child process), its own complaint in logs/runner.out, and each node log's last line ("node N:
torchrun exited with status S"). The recorded cause then says that the end could not be written, and why: the
complaint, or, where runner.out had no room left for it, the error the shell met trying the state file's directory
once more as it exited (also in runner.exit).
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

from labkit.extras import require
from labkit.jobs.job import Job, tail_file
from labkit.jobs.render import render
from labkit.jobs.submission import submission_errors
from labkit.jobs.record import RecordError, RunRecord
from labkit.paths import runs_dir
from labkit.jobs.state import State, Status
from labkit.jobs.watcher import Backoff
from labkit.net import free_port
from labkit.spec import RunSpec, SpecError, load_spec


class LocalBackend:
    name = "local"
    backoff = Backoff.every(1.0)  # a poll here reads a state file and reaps a child: no scheduler to spare

    def __init__(self, runs_dir: str | os.PathLike | None = None, torchrun: str | None = None):
        self.runs_dir = runs_dir
        self.torchrun = torchrun
        self._children: dict[str, subprocess.Popen] = {}

    def submit(self, spec: RunSpec | str | os.PathLike, after: Job | list[Job] | None = None) -> Job:
        if self.torchrun is None:  # this interpreter's torchrun runs the driver
            require("the local backend", "torch", "megatron")
        spec = spec if isinstance(spec, RunSpec) else load_spec(spec)
        for job in [after] if isinstance(after, Job) else list(after or []):
            if job.wait(progress=False) != State.COMPLETED:
                raise RuntimeError(f"not started: it depends on {job!r}, which ended {job.state}")
        errors = submission_errors(spec, "local")
        if errors:
            raise SpecError(errors)
        # This host runs every node: a port that is free here, rather than a fixed one two local runs would share.
        spec = spec.replace(**{"job.master_port": free_port()})
        record = RunRecord.create(spec, runs_dir(self.runs_dir))
        process = None
        try:
            script = record.write_script("run.sh", render(spec, record.logs, layout="local", run_id=record.run_id,
                                                          torchrun=self.torchrun).scripts["run.sh"])
            exit_file = record.reserve_log(RUNNER_EXIT, RUNNER_EXIT_BYTES)
            with record.new_log("runner.out") as runner_log:
                process = subprocess.Popen(["bash", "-c", _with_exit_status(exit_file), str(script)], cwd=record.path,
                                           stdout=runner_log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                           start_new_session=True, env={**os.environ, "LABKIT_LAUNCH_GATE": "1"})
            job_id = str(process.pid)  # also its process group's id (a new session)
            process.waited_by = os.getpid()  # (see _child_status)
            self._children[job_id] = process
            record.attach(self.name, "local", [job_id], host=socket.gethostname(), pgid=process.pid)
            process.stdin.write(b"start\n")
        except RecordError as exc:
            # Not recorded (a full disk), so not started: say so in the record if a line still fits, rather than
            # leave the run to read as abandoned by a labkit that stopped.
            with contextlib.suppress(RecordError):
                record.set_status(State.FAILED, cause=f"not started: labkit could not record its job ({exc})")
            raise
        finally:
            if process is not None:
                process.stdin.close()  # without "start" (or if this process dies first) run.sh exits at once
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
        end = _recorded_end(state_file)
        if end is None and self._alive(job):
            return Status(State.RUNNING)
        # run.sh may have recorded its end and exited since the state file was read: the file, read again now that
        # run.sh is gone, has the last word.
        end = end or _recorded_end(state_file)
        if end is not None:
            return end
        left = self._group(job, int(job.record.job_info.get("pgid", job.job_id)))
        if left:  # run.sh was killed on its own: its nodes, torchrun and workers still run
            return Status(State.RUNNING, reason=f"the local runner was killed; {len(left)} of its processes still "
                                                "run (`labkit cancel` stops them)")
        if job.log_dir.exists():  # started, but ended without recording how
            return self._unwritten_end(job) or Status(State.FAILED,
                                                      reason="the local runner stopped without recording an end")
        # Gone before it made its log directory: it started no node (not told to start, or it could not write).
        return Status(State.FAILED, reason="the local runner stopped before starting any node (see logs/runner.out)")

    def _unwritten_end(self, job: Job) -> Status | None:
        """How a run.sh that ended on its own, but could not write its state file, ended: from its exit status (this
        process's child's, else the one its shell wrote into logs/runner.exit), or, when neither is known but
        runner.out says a write failed, from every node's torchrun exit status. None without such evidence (run.sh
        was killed: it never tried to record an end)."""
        code = self._child_status(job)
        if code is not None and code < 0:
            return None  # killed by a signal, before it could record an end
        exit_code, error = _runner_exit(job.record.logs / RUNNER_EXIT)
        if code is None:
            code = exit_code
        complaint = _write_complaint(job.record.logs / "runner.out")
        nodes = _node_exits(job.log_dir)
        failed = next((status for status in nodes.values() if status), None)
        if code is not None:
            source = f"the runner's exit status {code}" + (" and the node logs" if nodes else "")
        elif complaint is not None and len(nodes) >= sum(g.count for g in job.spec.cluster_or_default().nodes):
            code, source = failed or 0, "every node's torchrun exit status"
        else:
            return None
        if code == 0 and failed:
            code = failed  # a node says it failed: not a completed run, whatever else says so
        state = RUNNER_ENDS.get(code, State.FAILED)
        written = job.log_dir / "state"
        why = complaint or f"{written.relative_to(job.record.path)} was not written" + (f": {error}" if error else "")
        return Status(state, exit_code=f"{code}:0", note=f"its end could not be recorded ({why}); it was read from "
                                                         f"{source}")

    def _child_status(self, job: Job) -> int | None:
        """run.sh's exit status when this process started it and it has ended (negative: the signal that killed it);
        None otherwise. A copy of this backend in a forked process (multiprocessing's fork) holds the same child
        object, but cannot wait for that child: Python reports such a child as having exited 0 (ECHILD), which is
        no evidence of anything."""
        child = self._children.get(job.job_id)
        if child is None or getattr(child, "waited_by", None) != os.getpid():
            return None
        return child.poll()

    def _alive(self, job: Job) -> bool:
        """Whether the job's run.sh still runs (its pid could have been reused by another program since)."""
        try:
            cmdline = Path(f"/proc/{job.job_id}/cmdline").read_bytes()
            stat = Path(f"/proc/{job.job_id}/stat").read_text()
        except OSError:
            return False
        return str(job.record.path).encode() in cmdline and ") Z" not in stat

    def cancel(self, job: Job, grace_s: float = 10.0) -> bool:
        """Stop the job's whole process group: SIGTERM (run.sh records CANCELLED and stops its nodes), then SIGKILL
        for what is left after `grace_s`. When run.sh itself was already gone, CANCELLED is recorded for it. True
        when this stopped the group; False when nothing of the job was running."""
        pgid = int(job.record.job_info.get("pgid", job.job_id))
        if not self._group(job, pgid):
            return False
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while self._group(job, pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not self._group(job, pgid):
                break
        if self._group(job, pgid):
            return False
        state_file = job.log_dir / "state"
        if _recorded_end(state_file) is None:
            tmp = state_file.with_name("state.tmp")
            # Not written on a read-only or full runs directory: the processes are stopped all the same.
            with contextlib.suppress(OSError):
                try:
                    state_file.parent.mkdir(parents=True, exist_ok=True)  # a run.sh killed before it made the directory
                    tmp.write_text("CANCELLED 137\n")
                    os.replace(tmp, state_file)
                finally:
                    tmp.unlink(missing_ok=True)  # left only when the write failed (a full disk)
        return True

    def _group(self, job: Job, pgid: int) -> list[int]:
        """The live processes of process group `pgid`, if it is this run's (its id could have been reused since);
        the child run.sh is reaped first when this process started it."""
        child = self._children.get(job.job_id)
        if child is not None:
            child.poll()
        members, ours = [], False
        marker = str(job.record.path).encode()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                if int(fields[2]) != pgid or fields[0] == "Z":
                    continue
                members.append(int(entry.name))
                ours = ours or marker in Path(entry.path, "cmdline").read_bytes() \
                    or marker in Path(entry.path, "environ").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
        return members if ours else []


RUNNER_EXIT = "runner.exit"
"""logs/runner.exit: run.sh's exit status, written in place by its shell as it exits (blank until then), and when
its state file still says RUNNING then, the error a write there meets."""
RUNNER_EXIT_BYTES = 256
RUNNER_ENDS = {0: State.COMPLETED, 143: State.CANCELLED, 124: State.TIMEOUT}
"""run.sh's exit status -> its end, as its finish() records them (any other status: FAILED)."""
_WRITE_COMPLAINT = re.compile(r"Read-only file system|No space left on device|Disk quota exceeded|Permission denied|"
                              r"Input/output error|write error")
_NODE_EXIT = re.compile(r"^node (\S+): torchrun exited with status (\d{1,3})$")


_ON_EXIT = r"""code=$? why=
if [ -n "${state_file:-}" ] && { read -r first <"$state_file"; } 2>/dev/null && [ "$first" = RUNNING ]; then
    why=$({ echo x >"$state_file.probe"; } 2>&1)
    rm -f -- "$state_file.probe"
fi
printf '%-WIDTH.WIDTHs\n' "$code ${why//$'\n'/ }" 2>/dev/null 1<>EXIT_FILE"""


def _with_exit_status(exit_file: Path) -> str:
    """`bash -c` code that runs the script named by $0 in this shell (so that its pid is the job id, as before), and
    writes its exit status over the reserved blanks of `exit_file` when it exits; if its state file ($state_file)
    still says RUNNING then, its end could not be written, and the error a write beside it meets follows the status."""
    on_exit = _ON_EXIT.replace("WIDTH", str(RUNNER_EXIT_BYTES - 1)).replace("EXIT_FILE", shlex.quote(str(exit_file)))
    return f"trap {shlex.quote(on_exit)} EXIT; . \"$0\""


def _runner_exit(path: Path) -> tuple[int | None, str | None]:
    """The exit status run.sh's shell wrote into logs/runner.exit, and the write error it met if its end could not be
    written (its last words, such as "No space left on device"); None while blank, or when it cannot be read."""
    try:
        code, _, error = path.read_text().strip().partition(" ")
    except (OSError, UnicodeDecodeError):
        return None, None
    if not (code.isdigit() and len(code) <= 3):
        return None, None
    return int(code), error.rsplit(": ", 1)[-1].strip() or None


def _write_complaint(runner_out: Path) -> str | None:
    """The runner's own line saying that it could not write something (its state file), as `runner.out:N: text`."""
    try:
        with open(runner_out, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64_000))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    found = [(n, line.strip()) for n, line in enumerate(lines, 1) if _WRITE_COMPLAINT.search(line)]
    n, line = next((hit for hit in found if "state" in hit[1]), found[0] if found else (None, None))
    return f"runner.out:{n}: {line[:300]}" if line else None


def _node_exits(log_dir: Path) -> dict[str, int]:
    """{node: torchrun's exit status} from the last lines of each NODE.out that has one."""
    exits = {}
    for out in sorted(log_dir.glob("*.out")):
        for line in reversed(tail_file(out, 5)):
            found = _NODE_EXIT.match(line.strip())
            if found:
                exits[found.group(1)] = int(found.group(2))
                break
    return exits


def _recorded_end(state_file: Path) -> Status | None:
    """The end run.sh recorded in its state file ("COMPLETED 0", "CANCELLED 143"...); None while it records none."""
    try:
        words = state_file.read_text().split()
    except OSError:
        return None
    if not words or words[0] == "RUNNING" or words[0] not in State.__members__:
        return None
    code = words[1] if len(words) > 1 else None
    return Status(State(words[0]), exit_code=f"{code}:0" if code else None)

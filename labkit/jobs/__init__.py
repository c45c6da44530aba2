"""Jobs: render the run spec into job scripts, submit them to Slurm or run them here, follow them, explain failures.

    backend = default_backend()          # SlurmBackend where sbatch exists, else LocalBackend
    job = backend.submit("examples/tiny-cpu.yaml")
    job.wait(); job.state; job.tail(); job.cause(); job.result()

Layers, each importing only those above it in this list: state (State, Status), render (spec -> scripts),
diagnose (status, spec, log text -> cause), record (the run record: stores what it is given), watcher (one poll for
every live job of a backend), job (Job, the Backend protocol), local, slurm and k8s (the backends), report (report and
widget of one job), dashboard (widgets over every recorded run), sweep (several runs together), cli.
"""
from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from labkit.jobs.state import State, Status

if TYPE_CHECKING:
    from labkit.jobs.job import Backend, Job
    from labkit.jobs.record import RunRecord

# Job, the backends and the run record read logs with pandas: they load on first use (__getattr__), because the
# command line imports this package (for labkit.jobs.cli) to build its parser and `labkit --help` needs none of them.
_ON_FIRST_USE = ("Backend", "Job", "LocalBackend", "SlurmBackend", "SlurmError", "RecordError", "RunRecord",
                 "K8sBackend", "K8sError")


def __getattr__(name: str):
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from labkit.jobs.job import Backend, Job
    from labkit.jobs.k8s import K8sBackend, K8sError
    from labkit.jobs.local import LocalBackend
    from labkit.jobs.record import RecordError, RunRecord
    from labkit.jobs.slurm import SlurmBackend, SlurmError

    return locals()[name]


def _local(**options) -> Backend:
    from labkit.jobs.local import LocalBackend

    return LocalBackend(**options)


def _slurm(**options) -> Backend:
    from labkit.jobs.slurm import SlurmBackend

    return SlurmBackend(**options)


def _k8s(**options) -> Backend:
    from labkit.jobs.k8s import K8sBackend

    return K8sBackend(**options)


BACKENDS = {"local": _local, "slurm": _slurm, "k8s": _k8s}  # name -> backend(**options)


def backend_named(name: str, **options) -> Backend:
    """The backend called `name` ("local", "slurm" or "k8s"), built with `options`.

    Taught in labs 00, 01, 02, 03, 04, 06, 07, 08, 09 and 10.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: use one of {', '.join(BACKENDS)}")
    return BACKENDS[name](**options)


def default_backend(**options) -> Backend:
    """Slurm when this host has sbatch, else the embedded local backend.

    Taught in lab 00.
    """
    return backend_named("slurm" if shutil.which("sbatch") else "local", **options)


def job_of(record: RunRecord, backend: Backend | None = None) -> Job:
    """The Job of a recorded run, in its last recorded state, attached to `backend` (by default a new one of the kind
    that ran it): for status and cancel from another process."""
    info = record.job_info
    if not info:
        last = record.last_status()
        why = f": {last['state']}, {last['cause']}" if last.get("cause") else ""
        raise RuntimeError(f"run {record.run_id} has no job (no job.json){why}")
    from labkit.jobs.job import Job

    last = record.last_status()
    # A completed run's recorded cause can only be a note: its end was read from other evidence than its own record.
    status = Status(State(last["state"]), last.get("exit_code"), last.get("reason"),
                    note=last.get("cause") if last["state"] == "COMPLETED" else None) \
        if last.get("state") in State.__members__ else None
    return Job(backend or backend_named(info["backend"]), info["job_ids"], record, status)


__all__ = ["Backend", "Job", "State", "Status", "LocalBackend", "SlurmBackend", "SlurmError", "K8sBackend", "K8sError",
           "RecordError", "backend_named", "default_backend", "job_of"]

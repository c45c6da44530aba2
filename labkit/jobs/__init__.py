"""Jobs: render the run spec into job scripts, submit them to Slurm or run them here, follow them, explain failures.

    backend = default_backend()          # SlurmBackend where sbatch exists, else LocalBackend
    job = backend.submit("examples/tiny-cpu.yaml")
    job.wait(); job.state; job.tail(); job.cause(); job.result()
"""
from __future__ import annotations

import shutil

from labkit.jobs.job import Job, State
from labkit.jobs.local import LocalBackend
from labkit.jobs.slurm import SlurmBackend, SlurmError

BACKENDS = {"local": LocalBackend, "slurm": SlurmBackend}


def backend_named(name: str, **options):
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: use one of {', '.join(BACKENDS)}")
    return BACKENDS[name](**options)


def default_backend(**options):
    """Slurm when this host has sbatch, else the embedded local backend."""
    return backend_named("slurm" if shutil.which("sbatch") else "local", **options)


__all__ = ["Job", "State", "LocalBackend", "SlurmBackend", "SlurmError", "backend_named", "default_backend"]

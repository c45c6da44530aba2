"""One watcher for every job this process follows, as submitit's InfoWatcher does: refreshing any job refreshes every
live job of its backend with one `backend.poll` (one squeue call, and one sacct call for those that ended), so that
following a sweep of N runs costs one scheduler query per refresh, not N.

It knows jobs only through `job.backend`, `job.status(refresh=False)` and `job.update(status)`; labkit.jobs.job
imports it, not the other way round.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from labkit.jobs.job import Job
    from labkit.jobs.state import State


class Watcher:
    """The jobs of this process (held weakly: a job nobody holds is no longer followed)."""

    def __init__(self):
        self._jobs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # an ordered set of jobs
        self._lock = threading.RLock()  # a notebook widget's thread refreshes beside the main one

    def watch(self, job: Job) -> None:
        with self._lock:
            self._jobs[job] = None

    def refresh(self, jobs: Iterable[Job]) -> None:
        """Poll `jobs` together with every other live job of their backends: one poll per backend."""
        with self._lock:
            for job in jobs:
                self._jobs[job] = None
            backends = {id(job.backend): job.backend for job in jobs}
            for backend in backends.values():
                live = [j for j in self._jobs if j.backend is backend and not j.status(refresh=False).state.finished]
                for job, status in (backend.poll(live) if live else {}).items():
                    job.update(status)

    def wait(self, jobs: Iterable[Job], timeout: float | None = None, poll_s: float = 1.0) -> dict[Job, State]:
        """Refresh until every job has ended or `timeout` seconds have passed; each job's state then."""
        jobs = list(jobs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.refresh(jobs)
            states = {job: job.status(refresh=False).state for job in jobs}
            if all(state.finished for state in states.values()):
                return states
            if deadline is not None and time.monotonic() > deadline:
                return states
            time.sleep(poll_s)


WATCHER = Watcher()

"""One watcher for every job this process follows, as submitit's InfoWatcher does: refreshing any job refreshes every
live job of its backend with one `backend.poll` (one squeue call, and one sacct call for those that ended), so that
following a sweep of N runs costs one scheduler query per refresh, not N.

It also paces those queries. A scheduler is asked soon after something happened to one of its jobs (one was
submitted, started, ended, was requeued), then less and less often while nothing changes, up to the backend's longest
interval: after a change, polls come 0, 2, 4, 8, 16 ... s later, as submitit's InfoWatcher calls sacct (its Slurm
jobs back off to 600 s; labkit's to 120 s, so that `labkit run --wait` notices an end within two minutes). Over one
hour of a job that runs quietly, that is 36 squeue calls instead of one a second (3,600). A job that has ended is never
asked about again: its final state is kept. `poll_s` (`labkit run --wait --poll 30`, `Sweep.wait(poll_s=30)`) asks
every that many seconds instead.

It knows jobs only through `job.backend`, `job.status(refresh=False)` and `job.update(status)`; labkit.jobs.job
imports it, not the other way round.
"""
from __future__ import annotations

import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from labkit.jobs.job import Job
    from labkit.jobs.state import State


@dataclass(frozen=True)
class Backoff:
    """How often the watcher asks one backend about its live jobs: after each poll, the next one waits as long as
    nothing has changed (since the latest submission or change of state), within [first_s, cap_s]."""
    first_s: float
    """The shortest interval: right after a job was submitted or changed state."""
    cap_s: float
    """The longest interval, once nothing has changed for a while."""

    def interval(self, quiet_s: float) -> float:
        """Seconds from one poll to the next when the latest change was `quiet_s` seconds before that poll."""
        return min(self.cap_s, max(self.first_s, quiet_s))

    @classmethod
    def every(cls, seconds: float) -> Backoff:
        """A fixed interval."""
        if not 0 < seconds < math.inf:
            raise ValueError(f"poll_s: must be a positive number of seconds, got {seconds}")
        return cls(seconds, seconds)


SCHEDULER_BACKOFF = Backoff(first_s=2.0, cap_s=120.0)
"""A batch scheduler's pace (a backend that names none gets it): 2 s after a change, doubling to two minutes."""


@dataclass
class _Pace:
    """When the watcher last asked one backend, and when the latest change among its jobs happened."""
    changed: float
    """Clock time of the latest submission or change of state."""
    polled: float | None = None
    """Clock time of the latest poll that was recorded; None: never polled."""
    unseen: bool = True
    """A job was added since the latest poll: the next refresh asks about it at once."""


class Watcher:
    """The jobs of this process (held weakly: a job nobody holds is no longer followed), and the pace of each
    backend's polls. `clock` and `sleep` are time.monotonic and time.sleep; a test gives its own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.clock = clock
        self.sleep = sleep
        self._jobs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # an ordered set of jobs
        self._paces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> _Pace
        self._lock = threading.RLock()  # a notebook widget's thread refreshes beside the main one

    def watch(self, job: Job) -> None:
        """Follow `job`; its backend is asked about it at the next refresh."""
        with self._lock:
            self._jobs[job] = None
            self._changed(job.backend, self.clock())

    def refresh(self, jobs: Iterable[Job], poll_s: float | None = None, force: bool = False) -> None:
        """Poll the backends of `jobs` that are due (all of them with `force`), each one once for every live job it
        runs. Due: a job of it was never polled or changed since its last poll, or its interval has passed (`poll_s`
        seconds, else its backoff)."""
        with self._lock:
            jobs = list(jobs)
            for job in jobs:
                if job not in self._jobs:
                    self.watch(job)
            backends = {id(job.backend): job.backend for job in jobs}
            for backend in backends.values():
                if force or self._due_in(backend, poll_s) <= 0:
                    self._poll(backend)

    def _poll(self, backend) -> None:
        now = self.clock()
        live = [j for j in self._jobs if j.backend is backend and not j.status(refresh=False).state.finished]
        changed = False
        for job, status in (backend.poll(live) if live else {}).items():
            before = job.status(refresh=False)
            job.update(status)  # may raise (a full disk): then this poll is not recorded, and the next one is due
            changed |= (status.state, status.restarts) != (before.state, before.restarts)
        pace = self._pace(backend, now)
        pace.polled, pace.unseen = now, False
        if changed:
            pace.changed = now

    def _pace(self, backend, now: float) -> _Pace:
        if backend not in self._paces:
            self._paces[backend] = _Pace(changed=now)
        return self._paces[backend]

    def _changed(self, backend, now: float) -> None:
        pace = self._pace(backend, now)
        pace.changed, pace.unseen = now, True

    def _due_in(self, backend, poll_s: float | None = None) -> float:
        """Seconds until `backend` should be polled again (0 or less: now)."""
        pace = self._pace(backend, self.clock())
        if pace.polled is None or pace.unseen:
            return 0.0
        backoff = Backoff.every(poll_s) if poll_s is not None else getattr(backend, "backoff", SCHEDULER_BACKOFF)
        return pace.polled + backoff.interval(pace.polled - pace.changed) - self.clock()

    def wait(self, jobs: Iterable[Job], timeout: float | None = None, poll_s: float | None = None,
             tick: Callable[[], None] | None = None, tick_s: float = 1.0) -> dict[Job, State]:
        """Refresh, as paced, until every job has ended or `timeout` seconds have passed; each job's state then.
        `poll_s`: poll every that many seconds instead of backing off. `tick`: called after every refresh and at least
        every `tick_s` seconds between polls (a progress bar reading the logs)."""
        if poll_s is not None:
            Backoff.every(poll_s)  # refuses a poll interval that is not positive, before any wait
        jobs = list(jobs)
        start = self.clock()
        while True:
            self.refresh(jobs, poll_s)
            if tick is not None:
                tick()
            states = {job: job.status(refresh=False).state for job in jobs}
            if all(state.finished for state in states.values()):
                return states
            now = self.clock()
            if timeout is not None and now - start >= timeout:
                return states
            with self._lock:
                pause = min(self._due_in(job.backend, poll_s) for job in jobs
                            if not job.status(refresh=False).state.finished)
            if tick is not None:
                pause = min(pause, tick_s)
            if timeout is not None:
                pause = min(pause, start + timeout - now)
            self.sleep(max(pause, 0.0))


WATCHER = Watcher()

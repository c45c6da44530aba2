"""Several variants of one run, submitted together and read back together: the comparisons the labs make (fp32 vs
fp16 vs bf16, recompute modes, batch sizes, parallel layouts).

    sweep = Sweep.submit(backend, {"fp32": base, "fp16": base.replace(precision="fp16")}, prefix="lab02")
    sweep.wait()              # every job ended; raises SweepFailed naming each run that did not complete, and why
    sweep.logs                # {"fp32": ParsedLog, "fp16": ParsedLog}, in the order given
    sweep.traces("fp16")      # its torch.profiler traces, when its spec asked for them (see `profiled`)

The jobs run at the same time: on a cluster each gets its own nodes; on a laptop they share its cores, so their
timings are comparable with each other but slower than one run alone. There, each training process gets an equal
share of the cores as OpenMP threads (at least one), unless a spec's `job.env` sets OMP_NUM_THREADS: left alone,
PyTorch gives every process a thread per core (torchrun sets one thread only when it starts several processes), and
processes spinning on more threads than the host has cores slow each other down a hundredfold.
"""
from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Mapping

from labkit.jobs.job import Job
from labkit.jobs.state import State
from labkit.jobs.watcher import WATCHER
from labkit.megatron.flags import FLAG as F
from labkit.spec import RunSpec

# Relative to the run directory, which is the job's working directory on both backends.
PROFILE_DIR = "tensorboard"
# Megatron's dropout flags at zero: runs that must give the same loss (one big micro-batch vs accumulated small ones)
# draw no random masks, whose layout depends on the micro-batch size.
NO_DROPOUT = (F.hidden_dropout.name, "0", F.attention_dropout.name, "0")


def with_flags(spec: RunSpec, *flags) -> RunSpec:
    """The spec with Megatron flags appended to `job.extra_args`, for settings the spec has no field for.

    Taught in lab 04.
    """
    return spec.replace(**{"job.extra_args": [*spec.job.extra_args, *(str(f) for f in flags)]})


def profiled(spec: RunSpec, first: int, last: int | None = None, ranks: tuple[int, ...] = (0,)) -> RunSpec:
    """The spec with torch.profiler over iterations `first`..`last` (numbered as in the log, inclusive) on `ranks`,
    and TensorBoard scalars (loss, loss scale, timers, memory), all written to the run directory's tensorboard/.

    Taught in labs 02, 03, 04, 07 and 10.
    """
    last = first if last is None else last
    iters = spec.train.iters
    if not 1 <= first <= last <= iters:
        raise ValueError(f"profiled iterations {first}..{last}: choose 1 <= first <= last <= train.iters ({iters})")
    outside = [r for r in ranks if not 0 <= r < spec.world_size]
    if not ranks or outside:
        raise ValueError(f"profiled ranks {list(ranks)}: choose ranks from 0 to {spec.world_size - 1} "
                         f"(the spec's world size is {spec.world_size})")
    # The driver's (and Megatron's) profile steps are 0-based: step k is iteration k + 1.
    spec = spec.replace(**{"train.timing_log_level": 2})  # the timers TensorBoard receives are level-2 timers
    # --use-pytorch-profiler: on GPUs --profile alone opens the CUDA profiler's range for Nsight instead
    return with_flags(spec, F.profile, F.use_pytorch_profiler, F.profile_step_start, first - 1, F.profile_step_end,
                      last, F.profile_ranks, *ranks, F.tensorboard_dir, PROFILE_DIR, F.log_timers_to_tensorboard,
                      F.log_memory_to_tensorboard)


def share_cores(specs: Mapping[str, RunSpec], cores: int | None = None) -> dict[str, RunSpec]:
    """The specs with OMP_NUM_THREADS = cores / (their processes, all together), at least 1, in `job.env`, for runs
    that share one host; a spec that sets OMP_NUM_THREADS itself keeps it."""
    processes = sum(spec.world_size for spec in specs.values())
    threads = max(1, (cores or os.cpu_count() or 1) // max(1, processes))
    return {name: spec if "OMP_NUM_THREADS" in spec.job.env
            else spec.replace(**{"job.env": {**spec.job.env, "OMP_NUM_THREADS": str(threads)}})
            for name, spec in specs.items()}


class SweepFailed(RuntimeError):
    """Some runs of a sweep did not complete; `causes` maps each one's name to why."""

    def __init__(self, causes: dict[str, str]):
        self.causes = causes
        super().__init__("; ".join(f"{name}: {cause}" for name, cause in causes.items()))


class Sweep:
    """Named jobs started together from one backend.

    Taught in lab 04.
    """

    def __init__(self, jobs: Mapping[str, Job]):
        self.jobs = dict(jobs)

    @classmethod
    def submit(cls, backend, specs: Mapping[str, RunSpec], prefix: str | None = None) -> "Sweep":
        """Submit every spec at once; with `prefix`, each run is named PREFIX-NAME (how run lists show it)."""
        if not specs:
            raise ValueError("specs: give at least one {name: RunSpec}")
        named = {name: spec.replace(name=f"{prefix}-{name}") if prefix else spec for name, spec in specs.items()}
        if backend.name == "local":
            named = share_cores(named)
        return cls({name: backend.submit(spec) for name, spec in named.items()})

    def wait(self, timeout: float | None = None, raise_on_failure: bool = True,
             poll_s: float | None = None) -> dict[str, State]:
        """Block until every job ends; each one's final state. Raises SweepFailed (with every cause) when one did not
        complete, unless raise_on_failure is False. The backend is asked about all the jobs at once, soon after one
        changes and less often while none does (`poll_s`: every that many seconds instead)."""
        ended = WATCHER.wait(self.jobs.values(), timeout, poll_s)
        states = {name: ended[job] for name, job in self.jobs.items()}
        failed = {name: job.cause() or str(states[name]) for name, job in self.jobs.items()
                  if states[name] != State.COMPLETED}
        if failed and raise_on_failure:
            raise SweepFailed(failed)
        return states

    @property
    def specs(self) -> dict[str, RunSpec]:
        return {name: job.spec for name, job in self.jobs.items()}

    @property
    def run_dirs(self) -> dict[str, Path]:
        return {name: job.record.path for name, job in self.jobs.items()}

    @cached_property
    def logs(self):
        """{name: ParsedLog} of every run (read once, after `wait`)."""
        return {name: job.result() for name, job in self.jobs.items()}

    def traces(self, name: str):
        """The torch.profiler traces of one run, ordered by rank."""
        from labkit.profiling.trace import load_traces

        if name not in self.jobs:
            raise KeyError(f"{name!r} is not one of the runs ({', '.join(self.jobs)})")
        if F.profile.name not in self.jobs[name].spec.job.extra_args:
            raise ValueError(f"run {name!r} was not profiled: submit labkit.jobs.sweep.profiled(spec, ...)")
        return load_traces(self.run_dirs[name])

    def __repr__(self) -> str:
        return f"Sweep({', '.join(f'{name}={job!r}' for name, job in self.jobs.items())})"

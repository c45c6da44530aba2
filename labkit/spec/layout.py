"""Where each rank of a run sits: Megatron's rank order, and pipeline stage -> ranks -> GPUs.

megatron-core's parallel_state numbers ranks with tensor parallelism fastest, then context, data and pipeline
parallelism (its default order "tp-cp-ep-dp-pp", expert parallelism being 1 for a dense GPT):
rank = tp + T * (cp + C * (dp + D * pp)). A pipeline stage therefore owns
one contiguous block of T*C*D ranks. Ranks fill the spec's node groups in the order they are listed, each node's GPUs in
turn, as torchrun numbers them (node rank x GPUs per node + local rank).

A stage whose ranks span GPU types runs at the pace of its slowest rank: every rank of the stage waits for the others in
its tensor- and data-parallel collectives. So the stage's GPU is the slowest type among its ranks, the one with the
lowest dense 16-bit peak in the catalog; `labkit validate` reports it and the estimator times the stage on it.

Everything here works on ranges of ranks and on runs of ranks of one GPU type, never on one entry per rank, so the
layout of a very large world costs no more than its node groups.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from labkit import catalog

GROUPS = ("tp", "cp", "dp", "pp")


class Coords(NamedTuple):
    """A rank's place in each parallel dimension."""
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Layout:
    """A split of the world into tensor x context x data x pipeline parallel ranks."""
    tensor: int = 1
    """Tensor-parallel size (Megatron --tensor-model-parallel-size): the fastest-varying dimension of the rank."""
    data: int = 1
    """Data-parallel size (derived by Megatron as world / (tensor x context x pipeline))."""
    pipeline: int = 1
    """Pipeline-parallel size (Megatron --pipeline-model-parallel-size): the slowest-varying dimension."""
    context: int = 1
    """Context-parallel size (Megatron --context-parallel-size): ranks that share each sequence; on GPUs only (the CPU
    driver refuses more than 1)."""

    @property
    def world_size(self) -> int:
        return self.tensor * self.context * self.data * self.pipeline

    @property
    def per_stage(self) -> int:
        """Ranks in one pipeline stage."""
        return self.tensor * self.context * self.data

    def rank(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tensor * (cp + self.context * (dp + self.data * pp))

    def coords(self, rank: int) -> Coords:
        rest, tp = divmod(rank, self.tensor)
        rest, cp = divmod(rest, self.context)
        pp, dp = divmod(rest, self.data)
        return Coords(tp, cp, dp, pp)

    def stage_ranks(self, stage: int) -> range:
        """The ranks of one pipeline stage: a contiguous block, pp being the slowest dimension."""
        return range(stage * self.per_stage, (stage + 1) * self.per_stage)

    def group(self, rank: int, kind: str) -> list[int]:
        """The ranks of the `kind` group ("tp", "cp", "dp" or "pp") that `rank` belongs to, in rank order."""
        if kind not in GROUPS:
            raise ValueError(f"group kind {kind!r}: expected tp, cp, dp or pp")
        at = self.coords(rank)._asdict()
        size = {"tp": self.tensor, "cp": self.context, "dp": self.data, "pp": self.pipeline}[kind]
        return [self.rank(**{**at, kind: i}) for i in range(size)]


def layout_of(spec) -> Layout:
    """The layout of a run spec (its tensor, derived data and pipeline sizes)."""
    return Layout(tensor=spec.parallel.tensor, context=spec.parallel.context, data=spec.data_parallel,
                  pipeline=spec.parallel.pipeline)


def rank_gpus(nodes) -> list[tuple[range, str]]:
    """Runs of consecutive ranks on one GPU type (catalog name where known), filling node groups in order."""
    runs: list[tuple[range, str]] = []
    start = 0
    for group in nodes:
        name = catalog.resolve_gpu_name(group.gpu) or group.gpu
        stop = start + group.count * group.gpus_per_node
        if runs and runs[-1][1] == name:
            start = runs.pop()[0].start
        if stop > start:
            runs.append((range(start, stop), name))
        start = stop
    return runs


def gpus_of(ranks: range, runs: list[tuple[range, str]], starts: list[int] | None = None) -> list[str]:
    """The GPU types the ranks run on, in rank order; ranks beyond the cluster (an invalid spec) on its last type.
    `starts`: the runs' first ranks, when the caller looks up many ranges in the same runs."""
    starts = [r.start for r, _ in runs] if starts is None else starts
    first = max(0, bisect.bisect_right(starts, ranks.start) - 1)
    names = []
    for r, name in runs[first:]:
        if r.start >= ranks.stop:
            break
        if r.stop > ranks.start:
            names.append(name)
    return names or [runs[-1][1]]


def slowest_gpu(names: Iterable[str]) -> str:
    """The GPU type a stage on several types runs at: its slowest, the lowest dense fp16 peak (then by name)."""
    names = sorted(set(names))
    if len(names) == 1:
        return names[0]
    return min(names, key=lambda n: (catalog.gpu(n).peak("fp16"), n))


def stage_gpus(nodes, layout: Layout, stages: Iterable[int] | None = None) -> list[str]:
    """The GPU each pipeline stage runs at (of `stages`; every stage when None)."""
    runs = rank_gpus(nodes)
    starts = [r.start for r, _ in runs]
    stages = range(layout.pipeline) if stages is None else stages
    return [slowest_gpu(gpus_of(layout.stage_ranks(s), runs, starts)) for s in stages]

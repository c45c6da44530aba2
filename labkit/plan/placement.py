"""Node placement: the order in which a cluster's nodes hold the pipeline stages, up to symmetry.

Megatron numbers ranks tensor-fastest, then data, then pipeline, and torchrun/Slurm number them in node order, so the
order of the nodes decides which GPUs run which stage. Two orders are the same layout when they differ only by
swapping nodes of the same kind (multiset permutations instead of n! orders), and, for a given tensor/data/pipeline
split, when every stage ends up with the same GPU kinds, spans as many nodes, and meets its neighbours over the same
kind of link: those orders cannot differ in any cost the estimator computes, so only one of them is evaluated.
FASOP tries the n cyclic rotations of one order instead, which misses orders such as A B A B... for two A100 nodes.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from labkit import catalog
from labkit.spec import ClusterSpec, NodeGroup
from labkit.spec.layout import Layout


@dataclass(frozen=True)
class NodeKind:
    gpu: str
    gpus_per_node: int
    inter_node_gbps: float | None = None
    intra_node_gbps: float | None = None

    def group(self, count: int) -> NodeGroup:
        return NodeGroup(gpu=self.gpu, count=count, gpus_per_node=self.gpus_per_node,
                         inter_node_gbps=self.inter_node_gbps, intra_node_gbps=self.intra_node_gbps)


def node_kinds(cluster: ClusterSpec) -> tuple[list[NodeKind], list[int]]:
    """The distinct kinds of node in a cluster and how many of each."""
    kinds: list[NodeKind] = []
    counts: list[int] = []
    for g in cluster.nodes:
        kind = NodeKind(catalog.resolve_gpu_name(g.gpu) or g.gpu, g.gpus_per_node, g.inter_node_gbps,
                        g.intra_node_gbps)
        if kind in kinds:
            counts[kinds.index(kind)] += g.count
        else:
            kinds.append(kind)
            counts.append(g.count)
    return kinds, counts


def order_count(counts: list[int]) -> int:
    """How many orders `distinct_orders` lists: the multinomial coefficient (sum counts)! / prod(count!)."""
    from math import factorial, prod

    return factorial(sum(counts)) // prod(factorial(n) for n in counts)


def distinct_orders(counts: list[int]) -> list[tuple[int, ...]]:
    """Every order of the nodes up to swapping nodes of the same kind (kind indices, one per node)."""
    if sum(1 for n in counts if n) <= 1:  # one kind: one order, however many nodes (no recursion per node)
        return [tuple(kind for kind, n in enumerate(counts) for _ in range(n))]
    total = sum(counts)
    out: list[tuple[int, ...]] = []
    order: list[int] = []
    left = list(counts)

    def extend():
        if len(order) == total:
            out.append(tuple(order))
            return
        for kind, n in enumerate(left):
            if n:
                left[kind] -= 1
                order.append(kind)
                extend()
                order.pop()
                left[kind] += 1

    extend()
    return out


def as_cluster(order: tuple[int, ...], kinds: list[NodeKind], base: ClusterSpec | None = None) -> ClusterSpec:
    """The cluster spec whose node groups list the nodes in this order (runs of one kind become one group)."""
    groups: list[NodeGroup] = []
    previous = None
    for kind in order:
        if kind == previous:
            groups[-1].count += 1
        else:
            groups.append(kinds[kind].group(1))
        previous = kind
    return ClusterSpec(nodes=groups, inter_node_gbps=base.inter_node_gbps if base else None,
                       intra_node_gbps=base.intra_node_gbps if base else None)


def stage_signature(order: tuple[int, ...], kinds: list[NodeKind], tensor: int, data: int, pipeline: int) -> tuple:
    """What a cost model can see of an order under a tensor/data/pipeline split: for each stage, the nodes it runs on
    as (kind, ranks of the stage on that node, shared with the previous stage?), and the kinds at the two ends (the
    tied-embedding all-reduce). Ranks are contiguous per stage, so a node can only be shared with a neighbour stage."""
    node_of_rank: list[int] = []
    for node, kind in enumerate(order):
        node_of_rank += [node] * kinds[kind].gpus_per_node
    layout = Layout(tensor=tensor, data=data, pipeline=pipeline)
    stages = []
    previous: set[int] = set()
    for s in range(pipeline):
        ranks = layout.stage_ranks(s)
        nodes = Counter(node_of_rank[ranks.start:ranks.stop])  # insertion-ordered by rank
        stages.append(tuple((order[n], k, n in previous) for n, k in nodes.items()))
        previous = set(nodes)
    if pipeline == 1:  # no sends and no embedding all-reduce: only which nodes hold the data-parallel ring matters
        return tuple(sorted(stages[0]))
    first, last = node_of_rank[0], node_of_rank[layout.world_size - 1]
    return tuple(stages), (order[first], order[last], first == last)


def placements(cluster: ClusterSpec, tensor: int, data: int, pipeline: int) -> list[tuple[int, ...]]:
    """One order per class of orders that no cost can tell apart, for this split; kinds as in `node_kinds`."""
    kinds, counts = node_kinds(cluster)
    seen: dict[tuple, tuple[int, ...]] = {}
    for order in distinct_orders(counts):
        seen.setdefault(stage_signature(order, kinds, tensor, data, pipeline), order)
    return list(seen.values())


def grouped_orders(kinds: list[NodeKind], counts: list[int]) -> list[tuple[int, ...]]:
    """The orders that keep each kind's nodes together (every order of the kinds as blocks)."""
    from itertools import permutations

    present = [k for k, n in enumerate(counts) if n]
    return [tuple(k for k in block for _ in range(counts[k])) for block in permutations(present)]

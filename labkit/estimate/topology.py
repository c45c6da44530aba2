"""How fast the links between ranks are, from the spec's cluster (node groups in placement order) and where each rank
sits (labkit.spec.layout: Megatron's rank order, and the GPU each pipeline stage runs at).

A group of ranks inside one node talks over that node's intra-node link; a group spanning nodes runs at the slowest
node's inter-node link, shared by the concurrent transfers leaving a node through its one network interface. Speeds
returned are bus bandwidths (Calibration.bus_gbps: what NCCL reaches on the link), in Gbit/s.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from labkit import catalog
from labkit.estimate.calibration import Calibration, resolve
from labkit.spec.layout import layout_of, stage_gpus


@dataclass(frozen=True)
class Slot:
    node: int
    gpu: str            # catalog name
    intra_gbps: float
    inter_gbps: float


class Topology:
    def __init__(self, spec, calibration: Calibration | None = None):
        self.calibration = cal = resolve(calibration)
        cluster = spec.cluster_or_default()
        self.layout = layout_of(spec)
        self.tensor, self.pipeline, self.data = self.layout.tensor, self.layout.pipeline, self.layout.data
        self._stage_gpus = stage_gpus(cluster.nodes, self.layout)
        slots, node = [], 0
        for group in cluster.nodes:
            name = catalog.resolve_gpu_name(group.gpu) or group.gpu
            gpu = catalog.gpu(name)
            intra = group.intra_node_gbps or cluster.intra_node_gbps or cal.intra_node_link(gpu)
            inter = group.inter_node_gbps or cluster.inter_node_gbps or gpu.inter_node_gbps
            for _ in range(group.count):
                slots += [Slot(node, name, float(intra), float(inter))] * group.gpus_per_node
                node += 1
        needed = self.layout.world_size
        if len(slots) < needed:  # a spec without enough GPUs was caught by validation; keep the last kind
            slots += [slots[-1]] * (needed - len(slots))
        self.slots = slots

    def rank(self, stage: int, dp: int, tp: int) -> int:
        return self.layout.rank(pp=stage, dp=dp, tp=tp)

    def stage_gpu(self, stage: int) -> str:
        """The stage's GPU type; a stage spread over several types runs at its slowest (labkit.spec.layout)."""
        return self._stage_gpus[stage]

    def group_gbps(self, ranks: list[int]) -> float:
        """Speed of a collective over `ranks` (one of several such groups running at once)."""
        if not self.crosses_nodes(ranks):
            return self.calibration.bus_gbps(min(self.slots[r].intra_gbps for r in ranks), inter_node=False)
        return self.calibration.bus_gbps(min(self.slots[r].inter_gbps for r in ranks), inter_node=True)

    def crosses_nodes(self, ranks: list[int]) -> bool:
        return len({self.slots[r].node for r in ranks}) > 1

    def tp_gbps(self, stage: int) -> float:
        return self.group_gbps([self.rank(stage, 0, k) for k in range(self.tensor)])

    def dp_gbps(self, stage: int) -> float:
        """A ring over the stage's data x context ranks, the group megatron-core reduces gradients over (context
        ranks hold the same weights and each computes gradients from its share of the sequence); the stage's t rings
        share each node's network interface."""
        return self._ring_gbps(stage, [self.layout.rank(pp=stage, cp=k, dp=j)
                                       for j in range(self.data) for k in range(self.layout.context)])

    def cp_gbps(self, stage: int) -> float:
        """A ring over the stage's context ranks, which pass keys and values round; the stage's t rings share each
        node's network interface."""
        return self._ring_gbps(stage, self.layout.group(self.layout.rank(pp=stage), "cp"))

    def _ring_gbps(self, stage: int, ranks: list[int]) -> float:
        gbps = self.group_gbps(ranks)
        if self.crosses_nodes(ranks):
            per_node = Counter(self.slots[self.rank(stage, 0, k)].node for k in range(self.tensor))
            gbps /= max(per_node.values())
        return gbps

    def pair_gbps(self, stage_a: int, stage_b: int) -> float:
        """Per-pair speed when every rank of stage_a sends to its peer (same tp, cp and dp) in stage_b at the same
        time."""
        pairs = list(zip(self.layout.stage_ranks(stage_a), self.layout.stage_ranks(stage_b)))
        crossing = Counter(self.slots[a].node for a, b in pairs if self.slots[a].node != self.slots[b].node)
        slowest, bus = float("inf"), self.calibration.bus_gbps
        for a, b in pairs:
            sa, sb = self.slots[a], self.slots[b]
            if sa.node == sb.node:
                gbps = bus(min(sa.intra_gbps, sb.intra_gbps), inter_node=False)
            else:
                gbps = bus(min(sa.inter_gbps, sb.inter_gbps), inter_node=True) / crossing[sa.node]
            slowest = min(slowest, gbps)
        return slowest

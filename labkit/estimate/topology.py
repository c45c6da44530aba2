"""How fast the links between ranks are, from the spec's cluster (node groups in placement order) and where each rank
sits (labkit.spec.layout: Megatron's rank order, and the GPU each pipeline stage runs at).

A group of ranks inside one NVLink domain talks over the domain's link (the catalog's or cluster's intra-node rate):
the domain is a node, except where the catalog gives nvlink_domain_gpus, as for GB200 NVL72, whose 18 trays of 4 GPUs
(nodes, to Slurm and to the spec) share one NVLink domain of 72, so that ranks on different trays of a rack still talk
over NVLink. A group spanning domains runs at the slowest node's inter-node link, shared by the concurrent transfers
leaving a node through its network interfaces. Speeds returned are bus bandwidths (Calibration.bus_gbps: what NCCL
reaches on the link), in Gbit/s; `group_link` says which link a group of ranks spans, for any group (tensor, context,
data, pipeline, or expert-parallel ones).

The expert layers of a mixture-of-experts model fold their own grid over the same ranks: megatron-core's expert
RankGenerator (parallel_state.initialize_model_parallel) orders them tp-ep-dp-pp with the expert-tensor size as tp,
rank = etp + ET x (ep + E x (edp + D_e x pp)), ET the expert-tensor, E the expert-parallel and D_e the
expert-data-parallel size (world / (ET x E x pipeline)). Pipeline stages are the same contiguous blocks as the dense
layers'; `expert_group` gives a stage's groups in that order.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from math import comb
from typing import Iterable

from labkit import catalog
from labkit.estimate.calibration import Calibration, resolve
from labkit.megatron import sizes
from labkit.megatron.shape import Shape
from labkit.spec.layout import layout_of, stage_gpus


@dataclass(frozen=True)
class Slot:
    node: int
    gpu: str            # catalog name
    intra_gbps: float   # the NVLink domain's (or node's PCIe) link rate
    inter_gbps: float   # the node's network
    domain: int         # the NVLink domain: the node, or several nodes where the catalog's nvlink_domain_gpus says so
    p2p_gbps: float | None = None  # the catalog's point-to-point rate inside the domain, where it has its own


@dataclass(frozen=True)
class Link:
    """The slowest link a group of ranks spans: "node" (one node), "nvlink" (several nodes of one NVLink domain) or
    "network" (several domains). link_gbps is the link's rate, bus_gbps what a collective reaches on it."""
    kind: str
    link_gbps: float
    bus_gbps: float

    @property
    def inter_node(self) -> bool:
        """Whether the group's traffic goes over the network (the link class Calibration.bus_gbps charges)."""
        return self.kind == "network"


class Topology:
    def __init__(self, spec, calibration: Calibration | None = None):
        self.calibration = cal = resolve(calibration)
        cluster = spec.cluster_or_default()
        self.layout = layout_of(spec)
        self.tensor, self.pipeline, self.data = self.layout.tensor, self.layout.pipeline, self.layout.data
        self.expert = spec.parallel.expert
        self.expert_tensor = sizes.expert_tensor_size(self.tensor, spec.parallel.expert_tensor)
        # ranks of one stage per expert-tensor x expert block (a spec whose sizes do not divide was refused)
        self.expert_data = max(1, self.layout.per_stage // (self.expert * self.expert_tensor))
        self._expert_links: dict = {}
        shape = Shape.of(spec.model)
        # the flex dispatcher's routing (topk of the experts), which decides how many copies of a token it sends
        self.flex_routing = ((shape.topk, shape.experts)
                             if shape.moe and spec.model.moe_token_dispatcher_type == "flex" else None)
        # DeepEP forwards over NVLink inside a node only, and crosses between nodes over the network even where they
        # share an NVLink domain: megatron-core 0.16.1 leaves multi-node NVLink to HybridEP
        # (TransformerConfig.moe_flex_dispatcher_backend; deepep is its default)
        self.flex_forwards_within = ("node" if self.flex_routing and
                                     (spec.model.moe_flex_dispatcher_backend or "deepep") == "deepep" else "domain")
        self._stage_gpus = stage_gpus(cluster.nodes, self.layout)
        slots, node, domain = [], 0, 0
        for group in cluster.nodes:
            name = catalog.resolve_gpu_name(group.gpu) or group.gpu
            gpu = catalog.gpu(name)
            intra = group.intra_node_gbps or cluster.intra_node_gbps or cal.intra_node_link(gpu)
            inter = group.inter_node_gbps or cluster.inter_node_gbps or gpu.inter_node_gbps
            # a group's nodes fill NVLink domains in turn (one node each, unless the catalog's domain spans nodes)
            nodes_per_domain = max(1, (gpu.nvlink_domain_gpus or 0) // group.gpus_per_node)
            for k in range(group.count):
                slot = Slot(node, name, float(intra), float(inter), domain + k // nodes_per_domain, gpu.p2p_gbps)
                slots += [slot] * group.gpus_per_node
                node += 1
            domain += -(-group.count // nodes_per_domain)
        needed = self.layout.world_size
        if len(slots) < needed:  # a spec without enough GPUs was caught by validation; keep the last kind
            slots += [slots[-1]] * (needed - len(slots))
        self.slots = slots

    def rank(self, stage: int, dp: int, tp: int) -> int:
        return self.layout.rank(pp=stage, dp=dp, tp=tp)

    def stage_gpu(self, stage: int) -> str:
        """The stage's GPU type; a stage spread over several types runs at its slowest (labkit.spec.layout)."""
        return self._stage_gpus[stage]

    def group_link(self, ranks: Iterable[int]) -> Link:
        """The slowest link the ranks span: their node's, their NVLink domain's, or the network, at the slowest rank's
        rate (one of several such groups running at once; `_ring_gbps` shares a node's network among them)."""
        slots = [self.slots[r] for r in ranks]
        if len({s.domain for s in slots}) > 1:
            rate = min(s.inter_gbps for s in slots)
            return Link("network", rate, self.calibration.bus_gbps(rate, inter_node=True))
        rate = min(s.intra_gbps for s in slots)
        kind = "nvlink" if len({s.node for s in slots}) > 1 else "node"
        return Link(kind, rate, self.calibration.bus_gbps(rate, inter_node=False))

    def group_gbps(self, ranks: list[int]) -> float:
        """Speed of a collective over `ranks` (one of several such groups running at once)."""
        return self.group_link(ranks).bus_gbps

    def crosses_nodes(self, ranks: list[int]) -> bool:
        return len({self.slots[r].node for r in ranks}) > 1

    def spans_nodes_of_one_domain(self, ranks: list[int]) -> bool:
        """Whether some of the ranks sit on different nodes of one NVLink domain (a GB200 or GB300 rack's trays)."""
        slots = [self.slots[r] for r in ranks]
        return len({(s.domain, s.node) for s in slots}) > len({s.domain for s in slots})

    def crosses_network(self, ranks: list[int]) -> bool:
        """Whether the ranks span NVLink domains, so that their traffic goes over the network."""
        return len({self.slots[r].domain for r in ranks}) > 1

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

    def _ring_gbps(self, stage: int, ranks: list[int], siblings: list[int] | None = None) -> float:
        """A ring over `ranks`, one of several alike (one per rank of `siblings`: by default the stage's first tensor
        group) that share each node's network interface when the ring crosses it."""
        gbps = self.group_gbps(ranks)
        if self.crosses_network(ranks):
            siblings = siblings if siblings is not None else [self.rank(stage, 0, k) for k in range(self.tensor)]
            per_node = Counter(self.slots[r].node for r in siblings)
            gbps /= max(per_node.values())
        return gbps

    def expert_group(self, stage: int, kind: str) -> list[int]:
        """The ranks of stage `stage`'s first group of `kind`, in megatron-core's expert rank order (see the module's
        docstring): "ep" the expert-parallel group (stride expert_tensor), "etp" one expert's tensor-parallel ranks,
        "tp_ep" both (the allgather dispatcher's group), "edp" the expert-data-parallel group that reduces the
        experts' gradients (stride expert_tensor x expert)."""
        base, et, e = stage * self.layout.per_stage, self.expert_tensor, self.expert
        if kind == "ep":
            return [base + et * j for j in range(e)]
        if kind == "etp":
            return [base + j for j in range(et)]
        if kind == "tp_ep":
            return [base + j for j in range(et * e)]
        if kind == "edp":
            return [base + et * e * j for j in range(self.expert_data)]
        raise ValueError(f"expert group kind {kind!r}: expected ep, etp, tp_ep or edp")

    def flex_crosses_network(self, ranks: list[int]) -> bool:
        """Whether the flex dispatcher sends between `ranks` over the network: they span NVLink domains, or, under
        DeepEP, nodes."""
        return len({getattr(self.slots[r], self.flex_forwards_within) for r in ranks}) > 1

    def alltoall_gbps(self, ranks: list[int], routing: tuple[int, int] | None = None,
                      forwards_within: str = "domain") -> float:
        """What an all-to-all over `ranks` reaches (labkit.estimate.timing.alltoall_time's rate, for the (n - 1)/n of
        its bytes that leave each rank): inside one NVLink domain its bus bandwidth (group_link). Across domains each
        rank sends (n - g)/n of its bytes over the network, g the group's ranks in its own domain, and every GPU of a
        node does so at once (each node's GPUs all belong to groups of this shape), so a rank has 1/(its node's GPUs)
        of the node's network; the rest goes over NVLink at the same time. The slower of the two sets the pace.
        An approximation of NCCL's all-to-all, which posts every send and receive at once.

        `routing` (topk, experts): an MoE layer's dispatch by the flex dispatcher, whose DeepEP and HybridEP kernels
        send a token once to each rank that holds any of its topk experts (the alltoall dispatcher sends one copy per
        expert), and once over the network to each other NVLink domain that does, fanning it out there over NVLink
        (DeepEP's "asymmetric-domain bandwidth forwarding", github deepseek-ai/DeepEP, whose domain is the node;
        HybridEP's is the NVLink domain, `forwards_within`). With the experts spread evenly
        over the ranks and routing balanced, a token reaches a rank, or a domain, holding h of the E experts with
        probability 1 - C(E - h, topk) / C(E, topk); the rate returned is the alltoall's topk copies over the time the
        fewer copies take, so that labkit.estimate.timing.alltoall_time reads the same for both dispatchers.
        `forwards_within` "node": the domains whose ranks the dispatcher forwards to over NVLink are nodes (DeepEP,
        Topology.flex_forwards_within), so that ranks on two trays of one NVL72 rack exchange over the network."""
        n = len(ranks)
        link = self.group_link(ranks)
        if n <= 1:
            return link.bus_gbps
        rank_hit = 1.0
        if routing:
            topk, experts = routing
            rank_hit = _hit(experts, experts // n, topk)
        slots = [self.slots[r] for r in ranks]
        within = "node" if routing and forwards_within == "node" else "domain"
        if len({getattr(s, within) for s in slots}) == 1:
            # (n - 1) x rank_hit copies where the alltoall sends topk x (n - 1) / n
            return link.bus_gbps * (topk / (n * rank_hit) if routing else 1.0)
        per_domain = Counter(getattr(s, within) for s in slots)
        gpus_per_node = Counter(s.node for s in self.slots)
        slowest, network_rate = float("inf"), min(x.inter_gbps for x in slots)
        for s in slots:
            inside = per_domain[getattr(s, within)]
            network = self.calibration.bus_gbps(network_rate, inter_node=True) / gpus_per_node[s.node]
            nvlink = self.calibration.bus_gbps(s.intra_gbps, inter_node=False)
            # shares of a token's topk copies: over the network, and over NVLink (its own domain's ranks)
            leaving, staying = (n - inside) / n, (inside - 1) / n
            if routing:
                leaving = sum(_hit(experts, experts * held // n, topk)
                              for domain, held in per_domain.items() if domain != getattr(s, within)) / topk
                # the ranks it reaches here, and those reached in other domains, passed on by their first rank
                staying = (inside - 1 + (n - inside) * (inside - 1) / inside) * rank_hit / topk
            seconds_per_bit = max(leaving / network, staying / nvlink)
            slowest = min(slowest, (n - 1) / n / seconds_per_bit)
        return slowest

    def expert_links(self, stage: int):
        """The links of stage `stage`'s token dispatch (labkit.estimate.timing.ExpertLinks): the all-to-all over its
        expert-parallel group, a ring over an expert's tensor-parallel ranks and one over the expert-tensor x expert
        group, each shared by the concurrent groups as `_ring_gbps` shares a node's network."""
        from labkit.estimate.timing import ExpertLinks

        if stage not in self._expert_links:
            self._expert_links[stage] = ExpertLinks(self.alltoall_gbps(self.expert_group(stage, "ep"),
                                                                       self.flex_routing, self.flex_forwards_within),
                                                    self._ring_gbps(stage, self.expert_group(stage, "etp")),
                                                    self._ring_gbps(stage, self.expert_group(stage, "tp_ep")))
        return self._expert_links[stage]

    def edp_gbps(self, stage: int) -> float:
        """A ring over the stage's expert-data-parallel ranks, the group megatron-core reduces expert gradients over;
        the stage's expert_tensor x expert rings share each node's network interface."""
        return self._ring_gbps(stage, self.expert_group(stage, "edp"), siblings=self.expert_group(stage, "tp_ep"))

    def pair_gbps(self, stage_a: int, stage_b: int) -> float:
        """Per-pair speed when every rank of stage_a sends to its peer (same tp, cp and dp) in stage_b at the same
        time: over their NVLink domain's link, or over the network, shared by the pairs leaving a node."""
        pairs = list(zip(self.layout.stage_ranks(stage_a), self.layout.stage_ranks(stage_b)))
        crossing = Counter(self.slots[a].node for a, b in pairs if self.slots[a].domain != self.slots[b].domain)
        slowest, bus = float("inf"), self.calibration.bus_gbps
        for a, b in pairs:
            sa, sb = self.slots[a], self.slots[b]
            if sa.domain == sb.domain and sa.p2p_gbps and sb.p2p_gbps:
                gbps = min(sa.p2p_gbps, sb.p2p_gbps)  # measured as sends, not as a collective's bus
            elif sa.domain == sb.domain:
                gbps = bus(min(sa.intra_gbps, sb.intra_gbps), inter_node=False)
            else:
                gbps = bus(min(sa.inter_gbps, sb.inter_gbps), inter_node=True) / crossing[sa.node]
            slowest = min(slowest, gbps)
        return slowest


def _hit(experts: int, held: int, topk: int) -> float:
    """The chance that a token's topk distinct experts, drawn evenly from `experts`, include one of `held` of them."""
    return 1 - comb(experts - held, topk) / comb(experts, topk)

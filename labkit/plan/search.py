"""Search the parallel layouts of one model on one cluster and rank them by the estimator's iteration time or price.

The space: tensor size (divisors of the GPUs of an NVLink domain that split the heads: a node's, or a GB200 NVL72
rack's 72 over its trays), pipeline and data sizes that use every GPU, for a mixture-of-experts model the
expert-parallel size (divisors of its experts, with the expert-tensor size, 1 or the tensor size, dividing the
stage's ranks; `expert_sizes`, pruned by memory first), micro-batch (divisors of global/data), interleaved virtual
stages (every count whose chunks split the layers evenly, down to NVIDIA's one layer per chunk), sequence
parallelism, recompute (none, selective, full), the distributed optimizer, and the node order (placement.py: one order
per class no cost can tell apart). Fields the input spec wrote are kept (inputs.Constraints). Each point gets the
exact min-max layer partition (partition.py) under the estimator's own per-stage costs, then
`labkit.estimate.estimate` of the resulting run spec gives its row. Sequence parallelism is on wherever tensor parallelism is, on GPUs (smaller pipeline messages and
activations, the same GEMMs); recompute and the distributed optimizer never make a step faster, they only save
memory, so they are tried only on layouts that do not fit without them, cheapest first; layouts that fit nowhere stay
in the table, marked oom.
"""
from __future__ import annotations

import heapq
import sys
import time
from dataclasses import dataclass, field, replace

from labkit import catalog
from labkit.estimate import (Shape, allreduce_time, bytes_per_param, estimate, memory_per_stage, p2p_time,
                             pipeline_lower_bound, stage_params, stage_time)
from labkit.estimate.estimator import (MEMORY_MARGIN, expert_params_per_stage, flash_attention, fp8_weights_of,
                                       graphed_iteration, profile_fits, profile_lookup, profiled_model)
from labkit.estimate.calibration import Calibration, resolve
from labkit.estimate.memory import GIB, OptimizerDtypes, step_only_bytes
from labkit.estimate.timing import ACTIVATION_BYTES, GRAD_REDUCE_BYTES, ExpertLinks, Pipeline
from labkit.estimate.topology import Topology
from labkit.megatron import rules, sharding, sizes
from labkit.megatron.flags import FLAG
from labkit.megatron.flops import SELECTIVE_DEFAULT
from labkit.plan.inputs import SEARCHED, Constraints
from labkit.plan.partition import min_max_partition
from labkit.plan.placement import as_cluster, grouped_orders, node_kinds, order_count, placements
from labkit.spec import ClusterSpec, ParallelSpec, RecomputeSpec, RunSpec
from labkit.spec.checks import rule_errors

FULL_RECOMPUTE = RecomputeSpec(granularity="full", method="uniform", num_layers=1)
SELECTIVE_RECOMPUTE = RecomputeSpec(granularity="selective")
OBJECTIVES = ("time", "cost")
MAX_ORDERS = 200
"""orders="auto" tries every node order up to symmetry when a cluster has at most this many, else the grouped ones."""


@dataclass
class Row:
    """One evaluated layout; the JSON keys of `labkit plan --json`."""
    mbs: int
    tp: int
    dp: int
    pp: int
    virtual_stages: int
    recompute: bool
    distributed_optimizer: bool     # optimizer states sharded: ZeRO stage 1 or more
    sequence_parallel: bool
    recompute_granularity: str | None  # selective or full; None without recompute
    cp: int                         # context-parallel size
    placement: list[str]            # GPU type of each node, in pipeline order
    partition: list[int]            # transformer layers per pipeline stage
    estimated_s: float
    pipeline_s: float               # the 1F1B schedule: compute, bubble and sends
    dp_allreduce_s: float
    embedding_allreduce_s: float
    price_per_step: float
    oom: bool
    memory_gb_per_stage: list[float]
    stage_times_s: list[float]
    breakdown: dict[str, float] = field(default_factory=dict)  # the estimator's seconds per part of the step
    idle_gpus: int = 0              # GPUs of stages without transformer layers (they hold only embedding/output)
    zero_stage: int = 0             # optimizer.zero_stage: 1 the distributed optimizer, 2 and 3 Megatron-FSDP
    within_budget: bool = True
    ep: int = 1                     # expert-parallel size (parallel.expert); 1 for a dense model
    etp: int = 0                    # expert-tensor size in effect (parallel.expert_tensor, else tp); tp when dense
    spec: RunSpec | None = field(default=None, repr=False)
    pipeline: Pipeline | None = field(default=None, repr=False)   # what pipeline_s was timed from, to draw it

    def to_dict(self) -> dict:
        out = {}
        for k, v in self.__dict__.items():
            if k in ("spec", "pipeline", "ep", "etp"):
                continue
            out[k] = v
            if k == "cp":  # beside tp, pp, dp and cp
                out["ep"], out["etp"] = self.ep, self.etp or self.tp
        out["partition_string"] = "-".join(str(n) for n in self.partition)
        return out


@dataclass
class Plan:
    rows: list[Row]                 # ranked: fitting and within budget first, then by the objective
    search_seconds: float
    configs_evaluated: int          # layouts the estimator evaluated
    configs_pruned: int             # layouts whose lower bound ruled them out of the top rows
    objective: str

    @property
    def best(self) -> Row | None:
        return self.rows[0] if self.rows else None

    def to_dict(self, top: int | None = None) -> dict:
        rows = self.rows[:top] if top else self.rows
        return {"objective": self.objective, "search_seconds": self.search_seconds,
                "configs_evaluated": self.configs_evaluated, "configs_pruned": self.configs_pruned, "rows": [r.to_dict() for r in rows],
                "spec": self.best.spec.to_dict() if self.best else None}


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def price_per_second(cluster: ClusterSpec, prices: dict[str, float] | None = None) -> float:
    """Price of the cluster per second (USD). Each GPU costs, per hour, what `prices` says for its type (labkit plan
    --price GPU=USD), else its node group's price_per_gpu_hour, else its cloud instance's price per node-hour / GPUs
    per instance from the catalog; NaN when one of them has no price."""
    prices = {catalog.resolve_gpu_name(name) or name: usd for name, usd in (prices or {}).items()}
    total = 0.0
    for g in cluster.nodes:
        gpu = catalog.gpu(g.gpu)
        per_gpu = prices.get(gpu.name, g.price_per_gpu_hour)
        if per_gpu is None and gpu.price_per_node_hour is not None:
            per_gpu = gpu.price_per_node_hour / (gpu.gpus_per_node or g.gpus_per_node)
        if per_gpu is None:
            return float("nan")
        total += per_gpu * g.gpus_per_node * g.count
    return total / 3600


# Context parallelism is searched only where each rank keeps at least this many tokens of a sequence: below it the
# ring's transfers outweigh the attention they split (Megatron-Core's own recipes start it at 8K-token sequences).
MIN_CONTEXT_TOKENS = 2048


def context_sizes(base: RunSpec, on_gpus: bool, flash: bool, constraints: Constraints = Constraints()) -> list[int]:
    """Context-parallel sizes to try: the spec's where it wrote one; else 1 and, on GPUs with flash or fused attention
    (context parallelism needs Transformer Engine), each power of two that leaves every rank MIN_CONTEXT_TOKENS or
    more and splits the sequence into 2 x size chunks (Megatron's load-balanced causal split)."""
    if constraints.context is not SEARCHED:
        return [constraints.context]
    s = base.model.seq_length
    return [1] + [c for c in (2, 4, 8, 16) if on_gpus and flash and s % (2 * c) == 0 and s // c >= MIN_CONTEXT_TOKENS]


def tensor_domain(cluster: ClusterSpec) -> int:
    """The most GPUs a tensor-parallel group may span on this cluster: those of one NVLink domain on every node group
    (a node's GPUs, or, where the catalog gives nvlink_domain_gpus, the domain's: GB200 NVL72's 72 over 18 trays of 4,
    as many of them as the group has), the smallest over the groups."""
    out = None
    for group in cluster.nodes:
        gpu = catalog.gpu(group.gpu)
        domain = group.gpus_per_node
        if gpu.nvlink_domain_gpus and gpu.nvlink_domain_gpus > group.gpus_per_node:
            domain = min(gpu.nvlink_domain_gpus // group.gpus_per_node, group.count) * group.gpus_per_node
        out = domain if out is None else min(out, domain)
    return out or 1


def splits(base: RunSpec, world: int, gpus_per_node: int, constraints: Constraints = Constraints(),
           contexts: list[int] | None = None):
    """(tensor, pipeline, data, context) sizes that use every GPU, split the heads and the batch, keep tensor groups
    in an NVLink domain (`gpus_per_node`: the GPUs of one, `tensor_domain`; a tensor size divides it, so that no
    group straddles two), and agree with the constraints; `contexts`: the context-parallel sizes to try (the spec's
    if None)."""
    m = base.model
    for c in contexts or [base.parallel.context]:
        for t in divisors(gpus_per_node):
            if m.num_attention_heads % t or m.query_groups % t or world % (t * c) or not constraints.allows("tensor", t):
                continue
            if constraints.sequence_parallel is True and t == 1:  # sequence parallelism splits over tensor ranks
                continue
            for p in divisors(sizes.data_parallel_size(world, t, c)):  # the pipeline x data ranks of t x c
                d = sizes.data_parallel_size(world, t, c, p)
                # a written ZeRO stage 2 or 3 runs without pipeline parallelism (labkit.spec.checks)
                fsdp = constraints.zero_stage is not SEARCHED and constraints.zero_stage >= 2
                if p <= m.num_layers and base.batch.global_ % d == 0 and constraints.allows("pipeline", p) \
                        and constraints.allows("data", d) and not (fsdp and p > 1):
                    yield t, p, d, c


def expert_sizes(base: RunSpec, shape: Shape, tensor: int, pipeline: int, data: int, context: int,
                 constraints: Constraints = Constraints(), memory_gb: float | None = None,
                 fully_sharded: bool = False, flash: bool = False,
                 fsdp_master_shards: bool = False) -> list[tuple[int, int]]:
    """(expert, expert_tensor) sizes to try at one split: (1, tensor) for a dense model. For a mixture-of-experts
    model, expert sizes that divide its experts, each with expert_tensor 1 (whole experts, as most MoE recipes run
    them) or the tensor size (Megatron-LM's default), whose product divides the stage's tensor x context x data ranks
    (megatron-core's expert grid, labkit.megatron.rules); expert size 1 keeps expert_tensor at the tensor size, and
    experts with biases need expert_tensor 1 (the rule book).

    Pruned by memory first (with `memory_gb`, the largest GPU's usable memory; a size the spec fixed is kept as it
    is): a size is dropped when even its least memory does not fit, the model state as sharded as the variants the
    planner tries go (the distributed optimizer, ZeRO-3 where `fully_sharded` and without pipeline parallelism) with
    one sequence per micro-batch under full recompute (or the recompute the spec fixed). Every size that fits is
    kept: a larger one holds less memory and reduces fewer expert gradients per rank (over a smaller
    expert-data-parallel group), a smaller one exchanges its tokens over nearer links; the lower bounds sort them.
    """
    if not shape.moe:
        return [(1, tensor)]
    wanted_tensor = constraints.expert_tensor
    flex = base.model.moe_token_dispatcher_type == "flex"
    by_tensor: dict[int, list[int]] = {}
    for etp in ([1] if shape.bias else sorted({1, tensor})):
        for ep in divisors(shape.experts):
            if ep == 1 and etp != (1 if shape.bias else tensor):
                continue  # without expert parallelism each expert is tensor-parallel like the rest of the layer
            if flex and ep * etp == 1:
                continue  # the flex dispatcher needs ranks to exchange tokens between (the rule book)
            if (tensor * context * data) % (ep * etp) or not constraints.allows("expert", ep):
                continue
            if wanted_tensor is not SEARCHED and sizes.expert_tensor_size(tensor, wanted_tensor) != etp:
                continue
            by_tensor.setdefault(etp, []).append(ep)
    if memory_gb is None or constraints.expert is not SEARCHED:
        return [(ep, etp) for etp, eps in by_tensor.items() for ep in eps]
    stages = ([0, 1] + ([2, 3] if pipeline == 1 and fully_sharded else [])) if data > 1 else [0]
    if constraints.zero_stage is not SEARCHED:
        stages = [constraints.zero_stage]
    elif base.optimizer.precision_aware:
        stages = [1]
    elif base.optimizer.fp8_param_gather:  # it gathers the distributed optimizer's or Megatron-FSDP's shards
        stages = [z for z in stages
                  if sharding.choose(z, base.optimizer.zero_backend, base.job.entrypoint).megatron_gathers] or [1]
    fixed = constraints.recompute is not SEARCHED
    plain = (constraints.recompute.granularity if constraints.recompute else None) if fixed else None
    limit = (1 - MEMORY_MARGIN) * memory_gb
    even = [shape.num_layers // pipeline + (i < shape.num_layers % pipeline) for i in range(pipeline)]

    most = max(stages)  # the most sharded stage tried, which holds the least
    fp8_weights = fp8_weights_of(replace(base, optimizer=replace(base.optimizer, zero_stage=most,
                                                                 distributed=most >= 1)))

    def fits(ep: int, etp: int, recompute: str | None) -> bool:
        return max(m.total for m in memory_per_stage(
            shape, even, tensor=tensor, data_parallel=data, micro_batch=1, num_micro_batches=1,
            precision=base.precision, recompute=recompute, sequence_parallel=tensor > 1, zero_stage=most,
            distributed_optimizer=most >= 1, flash_attention=flash, context=context, expert=ep,
            entrypoint=base.job.entrypoint, zero_backend=base.optimizer.zero_backend,
            expert_tensor=etp, optimizer=base.optimizer.name, grad_reduce_in_bf16=base.optimizer.grad_reduce_in_bf16,
            optimizer_dtypes=OptimizerDtypes.of(base.optimizer) if most == 1 else None,
            fp8_weights=fp8_weights, fsdp_master_shards=fsdp_master_shards)) <= limit

    recompute = plain if fixed else "full"
    return [(ep, etp) for etp, eps in by_tensor.items() for ep in eps if fits(ep, etp, recompute)]


def schedules(base: RunSpec, pipeline: int, data: int, virtual_stages=None,
              constraints: Constraints = Constraints()):
    """(micro-batch, virtual stages, accounted) for a split: micro-batches divide global/data; interleaving needs a
    micro-batch count that is a multiple of the pipeline size and an even split of the layers into pipeline x v
    chunks, or one once the embedding and the loss count as a layer each (`accounted`: Megatron-LM's
    --account-for-embedding/loss-in-pipeline-split, tried only where the layers alone do not split, as Llama 3.1
    405B's 126 layers over 16 x 8 chunks). `virtual_stages`: the counts to try; None: every one that splits
    (labkit.megatron.sizes.virtual_stage_counts)."""
    layers, batch = base.model.num_layers, base.batch.global_
    if constraints.virtual_stages is not SEARCHED:
        tried = (constraints.virtual_stages,)
    else:
        tried = sizes.virtual_stage_counts(layers, pipeline) if virtual_stages is None else virtual_stages
    for b in divisors(batch // data):
        if not constraints.allows("micro_batch", b):
            continue
        for v in tried:
            if v == 1:
                yield b, v, False
            elif pipeline > 1 and (batch // (b * data)) % pipeline == 0:
                accounted = next((a for a in (False, True) if _chunks_split(layers, pipeline, v, a)), None)
                if accounted is not None:
                    yield b, v, accounted


def _chunks_split(layers: int, pipeline: int, virtual_stages: int, accounted: bool) -> bool:
    """Whether megatron-core splits the layers over pipeline x virtual_stages chunks (labkit.megatron.sizes), with the
    embedding and the loss counted as layers when `accounted`."""
    try:
        sizes.chunk_layers(layers, pipeline, virtual_stages, account_for_embedding=accounted,
                           account_for_loss=accounted)
    except sizes.SizeError:
        return False
    return True


class _StageCosts:
    """The estimator's per-stage time as a function of the layers a stage holds, for the partition search."""

    def __init__(self, shape: Shape, precision: str, global_batch: int, lookup,
                 calibration: Calibration | None = None, flash: bool = False, overlap_dp: bool = False,
                 overlap_tp: bool = False, sequence_parallel: bool = False, stack: str | None = None,
                 on_gpus: bool = True, dispatcher: str | None = None, moe_comm_overlap: bool = False,
                 graphed_iteration: bool = False):
        self.shape, self.precision, self.global_batch, self.lookup = shape, precision, global_batch, lookup
        self.dispatcher = dispatcher  # an MoE model's token dispatcher, as the estimator reads the spec
        self.calibration, self.overlap_dp = resolve(calibration), overlap_dp
        # interleaved, the pipeline's sends overlap compute as the estimator plays them (NCCL, not gloo)
        self.overlap_p2p = on_gpus and self.calibration.stack(stack).overlap_p2p
        # as the estimator reads the spec
        self.kernels = {"flash_attention": flash, "tp_comm_overlap": overlap_tp, "stack": stack,
                        "moe_comm_overlap": moe_comm_overlap, "graphed_iteration": graphed_iteration}
        self.sequence_parallel = sequence_parallel  # on every layout with tensor > 1
        self._cache: dict = {}

    def stage_params(self, layers: tuple[int, ...], tensor: int, expert: int = 1,
                     expert_tensor: int | None = None) -> list[float]:
        """Each stage's parameters on one rank that the data-parallel group reduces: with expert parallelism, all but
        its experts' (reduced over the expert-data-parallel group, which estimate() adds)."""
        key = ("params", layers, tensor, expert, expert_tensor)
        if key not in self._cache:
            if not self.shape.moe:
                self._cache[key] = stage_params(self.shape, list(layers), tensor)
            else:
                total = stage_params(self.shape, list(layers), tensor, expert=expert, expert_tensor=expert_tensor)
                experts = expert_params_per_stage(self.shape, list(layers), tensor, expert, expert_tensor)
                self._cache[key] = [n - e for n, e in zip(total, experts)]
        return self._cache[key]

    def _expert(self, moe) -> dict:
        """stage_time's expert arguments from `moe`, (expert, expert_tensor, ExpertLinks) or None."""
        if moe is None or not self.shape.moe:
            return {}
        ep, etp, links = moe
        return {"expert": ep, "expert_tensor": etp, "expert_links": links, "dispatcher": self.dispatcher}

    def source(self, gpu: str, tensor: int):
        prof = self.lookup(gpu, tensor)
        return prof if profile_fits(prof, self.shape) else catalog.gpu(gpu)

    def per_layer(self, gpu: str, tensor: int, micro: int, recompute: str | None, tp_gbps: float,
                  context: int = 1, moe: tuple | None = None) -> list[float]:
        """Each layer's time on a stage; `moe`: (expert, expert_tensor, ExpertLinks) of an MoE model's layout."""
        key = ("layer", gpu, tensor, micro, recompute, tp_gbps, context, moe)
        if key not in self._cache:
            source = self.source(gpu, tensor)
            kw = dict(shape=self.shape, precision=self.precision, recompute=recompute, tp_gbps=tp_gbps,
                      calibration=self.calibration, sequence_parallel=self.sequence_parallel, context=context,
                      cp_gbps=tp_gbps, **self.kernels, **self._expert(moe))
            zero = stage_time(source, 0, micro, tensor, **kw).total_s
            layers = self.shape.num_layers
            measured = getattr(source, "layers_s", None)
            if measured and len(set(measured)) > 1:
                costs = [stage_time(source, 1, micro, tensor, first_layer=k, **kw).total_s - zero for k in range(layers)]
            else:
                costs = [stage_time(source, 1, micro, tensor, **kw).total_s - zero] * layers
            self._cache[key] = costs
        return self._cache[key]

    def ends(self, gpu: str, tensor: int, micro: int, recompute: str | None, tp_gbps: float, first: bool,
             last: bool, context: int = 1) -> float:
        key = ("ends", gpu, tensor, micro, recompute, tp_gbps, first, last, context)  # no layers: no experts
        if key not in self._cache:
            self._cache[key] = stage_time(self.source(gpu, tensor), 0, micro, tensor, shape=self.shape,
                                          precision=self.precision, recompute=recompute, tp_gbps=tp_gbps,
                                          first=first, last=last, calibration=self.calibration,
                                          sequence_parallel=self.sequence_parallel, context=context,
                                          cp_gbps=tp_gbps, **self.kernels).total_s
        return self._cache[key]


@dataclass(frozen=True)
class _Links:
    """What the estimator's Topology says about one node order under one tensor/pipeline/data split: each stage's
    GPU, tensor-parallel and data-parallel links, each boundary's link, and the first-to-last stage link of the tied
    embedding, with the per-message latency estimate() charges on each."""
    stage_gpus: tuple[str, ...]
    tp_gbps: tuple[float, ...]
    dp: tuple[tuple[float, float], ...]          # (Gbit/s, latency s) of each stage's data-parallel ring
    boundaries: tuple[tuple[float, float], ...]  # (Gbit/s, latency s) between stage i and i + 1
    ends: tuple[float, float]                    # (Gbit/s, latency s) between the first and the last stage
    experts: tuple[ExpertLinks | None, ...] = ()  # each stage's token-dispatch links (an MoE model's), else None
    edp: tuple[tuple[int, float, float], ...] = ()  # (ranks, Gbit/s, latency s) of each stage's expert-data ring

    @classmethod
    def of(cls, spec: RunSpec, calibration: Calibration | None = None) -> "_Links":
        topo, p = Topology(spec, calibration), spec.parallel.pipeline
        latency = topo.calibration.link_latency_s
        moe = bool(spec.model.num_experts)
        return cls(
            stage_gpus=tuple(topo.stage_gpu(i) for i in range(p)),
            tp_gbps=tuple(topo.tp_gbps(i) for i in range(p)),
            dp=tuple((topo.dp_gbps(i), latency) for i in range(p)),
            boundaries=tuple((topo.pair_gbps(i, i + 1), latency) for i in range(p - 1)),
            ends=(topo.pair_gbps(0, p - 1), latency),
            experts=tuple(topo.expert_links(i) if moe else None for i in range(p)),
            edp=tuple((topo.expert_data, topo.edp_gbps(i), latency) if moe else (1, 0.0, latency) for i in range(p)))

    def boundary_times(self, message_bytes: float) -> list[float]:
        return [p2p_time(message_bytes, gbps, latency) for gbps, latency in self.boundaries]


def _memory_caps(spec: RunSpec, shape: Shape, links: _Links, flash: bool,
                 fsdp_master_shards: bool = False) -> list[int]:
    """The most transformer layers each stage can hold within the estimator's memory verdict (`fsdp_master_shards`:
    the spec's stack's, Stack.fsdp_master_shards)."""
    p = spec.parallel.pipeline
    kw = dict(tensor=spec.parallel.tensor, data_parallel=spec.data_parallel, micro_batch=spec.batch.micro,
              num_micro_batches=spec.num_micro_batches, precision=spec.precision,
              recompute=spec.recompute.granularity if spec.recompute else None,
              recompute_layers=spec.recompute.num_layers if spec.recompute else 1,
              virtual_stages=spec.parallel.virtual_stages, distributed_optimizer=spec.optimizer.distributed,
              zero_stage=spec.optimizer.zero_stage, zero_backend=spec.optimizer.zero_backend,
              optimizer=spec.optimizer.name, flash_attention=flash, context=spec.parallel.context,
              grad_reduce_in_bf16=spec.optimizer.grad_reduce_in_bf16,
              optimizer_dtypes=OptimizerDtypes.of(spec.optimizer),
              overlap_grad_reduce=spec.kernels.overlap_grad_reduce, entrypoint=spec.job.entrypoint,
              expert=spec.parallel.expert, expert_tensor=spec.parallel.expert_tensor,
              evaluates=bool(spec.train.eval_interval), fp8_weights=fp8_weights_of(spec),
              fsdp_master_shards=fsdp_master_shards)
    zero, one = (memory_per_stage(shape, [n] * p, **kw) for n in (0, 1))
    # the cost of a layer from one to two per stage, where the model has that many (an MoE model's layer pattern
    # has no more); else from none to one, which counts full recompute's recomputed layer once more
    two = memory_per_stage(shape, [2] * p, **kw) if 2 * p <= shape.num_layers else None
    caps = []
    for i in range(p):
        limit = (1 - MEMORY_MARGIN) * catalog.gpu(links.stage_gpus[i]).memory_limit_gb
        if zero[i].total > limit or one[i].total > limit:
            caps.append(0)
            continue
        # the peak is the larger of two phases, each linear in the layers: a cap for each, the smaller holds
        cap = shape.num_layers
        for phase in ("forward_backward", "optimizer_step"):
            at_one = getattr(one[i], phase)
            slope = getattr(two[i], phase) - at_one if two else at_one - getattr(zero[i], phase)
            if slope > 0:
                cap = min(cap, 1 + int((limit - at_one) / slope))
        caps.append(cap)
    return caps


class _MemoryFloor:
    """A bound below the estimator's memory, to skip estimates of layouts that no split of the layers fits. Each stage
    holds its model state (weights, gradients and optimizer state at the table's bytes per parameter, which leaves out
    megatron-core's padding) and the activations its layers keep for the micro-batches 1F1B holds at its peak (a dense
    model's; an MoE model's are left out), the least the estimator could count."""

    def __init__(self, shape: Shape, flash: bool):
        self.shape, self.flash = shape, flash
        self._cache: dict = {}

    def may_fit(self, spec: RunSpec, stage_gpus: tuple[str, ...]) -> bool:
        """Whether some split of the layers could fit each stage's GPU under the layout of `spec`."""
        par = spec.parallel
        t, p = par.tensor, par.pipeline
        etp = sizes.expert_tensor_size(t, par.expert_tensor)
        per_param = self._bytes_per_param(spec, etp)
        ends, layer_params = self._params(t, p, par.expert, etp)
        activations = self._activations(spec)
        layers = 0
        for i, (gpu, end) in enumerate(zip(stage_gpus, ends)):
            room = (1 - MEMORY_MARGIN) * catalog.gpu(gpu).memory_limit_gb * GIB - end * per_param
            if room < 0:
                return False
            # 1F1B: stage i holds the activations of p - i micro-batches at its peak (more when interleaved)
            layers += room // (layer_params * per_param + min(p - i, spec.num_micro_batches) * activations)
        return layers >= self.shape.num_layers

    def _bytes_per_param(self, spec: RunSpec, etp: int) -> float:
        par, optimizer = spec.parallel, spec.optimizer
        shards = spec.data_parallel * par.context  # the distributed optimizer's ranks; more only lowers the floor
        if self.shape.moe:  # the experts' state shards over the expert-data-parallel ranks
            shards = max(shards, sizes.expert_data_parallel_size(par.tensor * shards, par.expert, etp))
        zero = optimizer.zero_stage
        # megatron-core's DDP and distributed optimizer: the table's row for the precision (fp32 gradients in bf16)
        own_row = sharding.choose(zero, optimizer.zero_backend).megatron_core
        # FSDP and DeepSpeed: as if every part were sharded (their stages differ in what they gather back, and when)
        dtypes = OptimizerDtypes.of(optimizer)
        per_param = sum(bytes_per_param(spec.precision, shards, zero >= 1, 0 if own_row else 3, optimizer.name,
                                        optimizer.grad_reduce_in_bf16, optimizer_dtypes=dtypes if own_row else None))
        if own_row:  # the step's fp32 gradient copies are freed before the activations are made
            per_param -= step_only_bytes(spec.precision, optimizer.grad_reduce_in_bf16, dtypes) / (
                shards if zero >= 1 else 1)
        fp8 = fp8_weights_of(spec)
        if fp8 is not None and fp8.replaces_bf16 and fp8.quantized < 2:  # as if every parameter were a linear weight
            per_param -= (2 - fp8.quantized) / (1 if own_row else shards)
        return per_param

    def _params(self, t: int, p: int, ep: int, etp: int) -> tuple[list[float], float]:
        """Each stage's parameters without layers (embedding, output), and the fewest parameters of one layer."""
        key = ("params", t, p, ep, etp)
        if key not in self._cache:
            experts = {"expert": ep, "expert_tensor": etp} if self.shape.moe else {}
            ends = stage_params(self.shape, [0] * p, t, **experts)
            # every layer on a stage of its own between an embedding-only and an output-only stage: its own parameters
            layers = stage_params(self.shape, [0] + [1] * self.shape.num_layers + [0], t, **experts)[1:-1]
            self._cache[key] = ends, min(layers)
        return self._cache[key]

    def _activations(self, spec: RunSpec) -> float:
        """Bytes one layer keeps per micro-batch: the estimator's memory of a one-stage model of two layers less that
        of one."""
        if self.shape.moe:
            return 0.0
        par, recompute = spec.parallel, spec.recompute
        kept = {"tensor": par.tensor, "micro_batch": spec.batch.micro, "context": par.context,
                "sequence_parallel": par.sequence_parallel, "recompute": recompute.granularity if recompute else None,
                "recompute_modules": tuple(recompute.modules) if recompute and recompute.modules else None}
        key = ("activations", *kept.values())
        if key not in self._cache:
            two, one = (memory_per_stage(self.shape, [layers], precision=spec.precision, flash_attention=self.flash,
                                         **kept)[0] for layers in (2, 1))
            self._cache[key] = (two.activations - one.activations) * GIB
        return self._cache[key]


def _split_and_bound(shape: Shape, precision: str, t: int, p: int, d: int, b: int, v: int, recompute: str | None,
                     links: _Links, costs: _StageCosts, caps: list[int] | None = None, sequence_parallel: bool = False,
                     context: int = 1, accounted: bool = False,
                     expert: tuple[int, int] = (1, None)) -> tuple[list[int] | None, float]:
    """The exact min-max split of a layout (None when no split fits the caps) and a lower bound on the estimator's
    iteration time with it: the 1F1B pipeline plus the all-reduces after it, without the optimizer step. Interleaved,
    the layers split as megatron-core splits them, the embedding and the loss counted as layers when `accounted`.
    `expert`: an MoE model's (expert, expert_tensor) sizes."""
    message = b * shape.seq_length / context * shape.hidden * ACTIVATION_BYTES.get(precision, 2)
    if sequence_parallel:
        message /= t
    boundaries = links.boundary_times(message)
    edges = [0.0, *boundaries, 0.0]
    per_layer, ends = [], []
    for i in range(p):
        gpu, tp_gbps = links.stage_gpus[i], links.tp_gbps[i]
        moe = (*expert, links.experts[i]) if shape.moe else None
        per_layer.append(costs.per_layer(gpu, t, b, recompute, tp_gbps, context, moe))
        ends.append(costs.ends(gpu, t, b, recompute, tp_gbps, i == 0, i == p - 1, context))
    if v > 1 or p == 1:
        chunks = sizes.chunk_layers(shape.num_layers, p, v, account_for_embedding=accounted, account_for_loss=accounted)
        return _bound(shape, precision, t, d, b, v, links, costs, per_layer, ends, boundaries,
                      [sum(row) for row in chunks], chunks, expert)
    steps = [e + edges[i] + edges[i + 1] for i, e in enumerate(ends)]
    best = None, float("inf")
    # every split below has the least possible slowest step; they differ in fill/drain and all-reduce sizes
    for balance in (None, ends):
        found = min_max_partition(per_layer, steps, caps, balance)
        if found is None:
            return best
        bounded = _bound(shape, precision, t, d, b, v, links, costs, per_layer, ends, boundaries, found.layers,
                         expert=expert)
        if bounded[1] < best[1]:
            best = bounded
    return best


def _bound(shape: Shape, precision: str, t: int, d: int, b: int, v: int, links: _Links, costs: _StageCosts,
           per_layer: list[list[float]], ends: list[float], boundaries: list[float],
           layers: list[int], chunks: list[list[int]] | None = None,
           expert: tuple[int, int | None] = (1, None)) -> tuple[list[int], float]:
    totals, start = [], 0
    for i, n in enumerate(layers):
        totals.append(ends[i] + sum(per_layer[i][start:start + n]))
        start += n
    shares = None
    if v > 1:
        # each chunk's layers in layer order (virtual stage u = chunk x p + stage), a stage's ends on its last chunk:
        # its first chunk then takes no more than the estimator gives it, and the bound stays below
        p, start = len(layers), 0
        times = [[0.0] * v for _ in range(p)]
        for u in range(p * v):
            n = chunks[u % p][u // p]
            times[u % p][u // p] = sum(per_layer[u % p][start:start + n]) + (ends[u % p] if u // p == v - 1 else 0.0)
            start += n
        shares = [[x / total if total else 1 / v for x in row] for row, total in zip(times, totals)]
    pipe_s = pipeline_lower_bound(totals, boundaries, costs.global_batch // (d * b), v, chunk_shares=shares,
                                  overlap_sends=costs.overlap_p2p)
    # the gradient and tied-embedding all-reduces that follow the last backward, no more than estimate() charges:
    # it reduces over data x context ranks and passes the context ring over its own link, where this bound takes the
    # data ranks and the tensor link
    grad_bytes = GRAD_REDUCE_BYTES.get(precision, 4)
    # overlapped with the backward (kernels.overlap_grad_reduce), or reduce-scattered as the backward goes (ZeRO
    # stages 2 and 3, tried without pipeline parallelism), the reduce may hide entirely: 0 stays a lower bound
    per_stage = zip(costs.stage_params(tuple(layers), t, *expert), links.dp)
    dp_s = 0.0 if costs.overlap_dp or len(layers) == 1 else max(allreduce_time(n * grad_bytes, d, gbps, latency)
                                            for n, (gbps, latency) in per_stage)
    if shape.moe and expert[0] > 1 and dp_s:
        # and the experts' gradients over the expert-data-parallel group, after the dense ones
        experts = expert_params_per_stage(shape, list(layers), t, *expert)
        dp_s = max(allreduce_time(n * grad_bytes, d, gbps, latency) + allreduce_time(e * grad_bytes, *edp)
                   for n, e, (gbps, latency), edp in zip(costs.stage_params(tuple(layers), t, *expert), experts,
                                                         links.dp, links.edp))
    embedding_s = (allreduce_time(shape.vocab * shape.hidden / t * grad_bytes, 2, *links.ends)
                   if len(layers) > 1 and shape.tied else 0.0)
    return layers, pipe_s + dp_s + embedding_s


def _balanced_partition(spec: RunSpec, shape: Shape, costs: _StageCosts, links: _Links,
                        caps: bool) -> list[int] | None:
    """The exact min-max split of a spec's layout, within memory when `caps` (None when nothing fits)."""
    par = spec.parallel
    master_shards = costs.calibration.stack(spec.kernels.stack).fsdp_master_shards
    layers, _ = _split_and_bound(shape, spec.precision, par.tensor, par.pipeline, spec.data_parallel, spec.batch.micro,
                                 par.virtual_stages, spec.recompute.granularity if spec.recompute else None, links,
                                 costs, _memory_caps(spec, shape, links, costs.kernels["flash_attention"],
                                                     master_shards) if caps else None,
                                 par.sequence_parallel, par.context, expert=(par.expert, par.expert_tensor))
    return layers


def fully_sharded_runs(base: RunSpec) -> bool:
    """Whether ZeRO stages 2 and 3 run for this spec's settings (the rule book's verdict on a one-stage layout of it at
    stage 3: labkit's driver runs them as FSDP2, whose conditions are Megatron-LM's and the driver's)."""
    world = base.world_size
    probe = replace(base, parallel=replace(base.parallel, tensor=1, pipeline=1, context=1, data=None, virtual_stages=1,
                                           partition=None, pipeline_layout=None, sequence_parallel=False,
                                           account_for_embedding_in_pipeline_split=False,
                                           account_for_loss_in_pipeline_split=False),
                    batch=replace(base.batch, micro=1, global_=world),
                    optimizer=replace(base.optimizer, zero_stage=3, distributed=True),
                    # the overlaps the planner sets by layout (`search`, `_with`) are not what it asks about, nor
                    # the flex dispatcher's need of expert ranks, which this probe (every expert on each rank) lacks
                    kernels=replace(base.kernels, overlap_param_gather=False, tp_comm_overlap=False),
                    model=replace(base.model, moe_token_dispatcher_type="alltoall", moe_flex_dispatcher_backend=None)
                    if base.model.moe_token_dispatcher_type == "flex" else base.model)
    return not rule_errors(probe, layout="local")


def _variants(spec: RunSpec, constraints: Constraints, fully_sharded: bool):
    """The layout and its memory-saving variants the constraints allow, least costly first: ZeRO stages sharding more
    and more over the data-parallel ranks (1 the distributed optimizer; 2 and 3, which communicate every micro-batch,
    only without pipeline parallelism and where `fully_sharded_runs`), then selective recompute, then full
    recompute."""
    recomputes = [None, SELECTIVE_RECOMPUTE, FULL_RECOMPUTE] if constraints.recompute is SEARCHED \
        else [constraints.recompute]
    # FSDP2 (labkit's driver) does not split experts over expert ranks, where Megatron-FSDP does
    fsdp2 = sharding.choose(3, spec.optimizer.zero_backend, spec.job.entrypoint).implementation == sharding.TORCH_FSDP2
    sharded = spec.parallel.pipeline == 1 and fully_sharded and not (fsdp2 and spec.parallel.expert > 1)
    stages = ([0, 1] + ([2, 3] if sharded else [])) if spec.data_parallel > 1 else [0]
    if constraints.zero_stage is not SEARCHED:
        stages = [constraints.zero_stage]
    elif spec.optimizer.precision_aware:  # it keeps the distributed optimizer's shards
        stages = [1] if constraints.distributed_optimizer in (SEARCHED, True) else []
    elif spec.optimizer.fp8_param_gather:  # it gathers the distributed optimizer's or Megatron-FSDP's shards
        stages = [z for z in stages
                  if sharding.choose(z, spec.optimizer.zero_backend, spec.job.entrypoint).megatron_gathers]
    elif constraints.distributed_optimizer is not SEARCHED:
        stages = [z for z in stages if (z >= 1) == constraints.distributed_optimizer]
    for recompute in recomputes:
        if not _graphs_allow(spec, recompute):
            continue
        for stage in stages:
            yield _with(spec, recompute=recompute, zero_stage=stage)


def _graphs_allow(spec: RunSpec, recompute) -> bool:
    """Whether the spec's CUDA graphs let a layout recompute as `recompute` asks (labkit.megatron.rules: full
    recompute only in a whole-iteration graph, no dropout in a graphed module that is recomputed)."""
    k, m = spec.kernels, spec.model
    granularity = recompute.granularity if recompute is not None else None
    modules = list(recompute.modules or SELECTIVE_DEFAULT) if granularity == "selective" else []
    dropout = {key: getattr(FLAG, key).default if getattr(m, key) is None else getattr(m, key)
               for key in ("attention_dropout", "hidden_dropout")}
    return not rules.graph_recompute_problems(str, impl=k.cuda_graph_impl, scopes=k.cuda_graph_scope,
                                              granularity=granularity, modules=modules, **dropout)


def _with(spec: RunSpec, recompute, zero_stage: int) -> RunSpec:
    # the parameter gather overlaps the all-gather of parameters that the distributed optimizer or Megatron-FSDP
    # shards; FSDP2 and DeepSpeed gather their own
    gather = spec.kernels.overlap_param_gather and \
        sharding.choose(zero_stage, spec.optimizer.zero_backend, spec.job.entrypoint).megatron_gathers
    # the MoE all-to-all's overlap where megatron-core's combined schedule runs it
    par = spec.parallel
    moe_overlap = spec.kernels.overlap_moe_expert_parallel_comm and not rules.overlap_layout_problems(
        str, expert=par.expert, pipeline=par.pipeline, virtual_stages=par.virtual_stages,
        granularity=recompute.granularity if recompute is not None else None)
    return replace(spec, recompute=recompute,
                   kernels=replace(spec.kernels, overlap_param_gather=gather,
                                   overlap_moe_expert_parallel_comm=moe_overlap),
                   optimizer=replace(spec.optimizer, zero_stage=zero_stage, distributed=zero_stage >= 1))


def _row(spec: RunSpec, est, order_names: list[str], price_s: float) -> Row:
    par, bd = spec.parallel, est.breakdown
    layers_per_stage = spec.layer_partition
    idle = sum(1 for n in layers_per_stage if n == 0) * par.tensor * par.context * spec.data_parallel
    return Row(mbs=spec.batch.micro, tp=par.tensor, dp=spec.data_parallel, pp=par.pipeline, cp=par.context,
               virtual_stages=par.virtual_stages, recompute=spec.recompute is not None,
               distributed_optimizer=spec.optimizer.distributed, zero_stage=spec.optimizer.zero_stage,
               sequence_parallel=par.sequence_parallel,
               recompute_granularity=spec.recompute.granularity if spec.recompute else None,
               breakdown={k: float(v) for k, v in bd.items()}, idle_gpus=idle, placement=order_names,
               partition=spec.layer_partition, estimated_s=est.iteration_time_s,
               pipeline_s=bd["compute"] + bd["bubble"] + bd["tp_comm"] + bd["ep_comm"] + bd["pp_comm"],
               dp_allreduce_s=bd["dp_comm"], embedding_allreduce_s=bd["embedding_comm"],
               price_per_step=price_s * est.iteration_time_s, oom=not est.fits_in_memory,
               memory_gb_per_stage=[round(x, 3) for x in est.memory_gb_per_stage],
               stage_times_s=est.stage_times_s, spec=spec, pipeline=est.pipeline, ep=par.expert,
               etp=sizes.expert_tensor_size(par.tensor, par.expert_tensor))


def search(base: RunSpec, *, objective: str = "time", max_step_s: float | None = None,
           max_price_per_step: float | None = None, top: int | None = None, profiles=None,
           virtual_stages=None, orders: str = "auto", progress: bool = False,
           calibration: Calibration | None = None, prices: dict[str, float] | None = None,
           constraints: Constraints | None = None) -> Plan:
    """Rank every layout of `base.model` on `base.cluster` for `base.batch.global_` sequences per step.

    objective "time": fastest step, among those within `max_price_per_step` if given; "cost": cheapest step, among
    those within `max_step_s` if given. `profiles` is passed to the estimator (see labkit.estimate.estimate).
    `virtual_stages`: the interleavings tried where the spec leaves them open; None: every even split
    (labkit.megatron.sizes.virtual_stage_counts).
    `top`: only the best `top` rows are wanted, so layouts whose pipeline time alone (a lower bound on the step time)
    cannot reach them are not estimated further: behind `top` rows within the budget, or behind `top` fitting rows
    and beyond the budget (an unmeetable budget costs no more estimates than no budget); and while `top` layouts fit,
    no variant is estimated whose memory floor (`_MemoryFloor`) no split of the layers fits. `orders`: "all" node orders up to symmetry, "grouped" (the nodes
    of each kind kept together), or "auto" (all when there are at most MAX_ORDERS, else grouped). `calibration`: the
    estimator's constants (see labkit.estimate.calibration), the shipped ones when None. `prices`: USD per GPU-hour by
    GPU type, over the spec's and the catalog's (see `price_per_second`). `constraints`: the layout fields to keep
    (labkit.plan.inputs.planning_input gives those a spec file wrote); the rest are searched.

    Taught in lab 06.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: {objective!r} is not one of {', '.join(OBJECTIVES)}")
    constraints = constraints or Constraints()
    started = time.perf_counter()
    cluster = base.cluster_or_default()
    kinds, counts = node_kinds(cluster)
    if orders == "auto":
        orders = "all" if order_count(counts) <= MAX_ORDERS else "grouped"
    world = sum(k.gpus_per_node * n for k, n in zip(kinds, counts))
    shape = Shape.of(base.model)
    lookup = profile_lookup(profiles, profiled_model(shape))
    profile_table = {}

    def cached_lookup(gpu, tensor):  # profiles are read once per search, not once per layout
        if (gpu, tensor) not in profile_table:
            profile_table[(gpu, tensor)] = lookup(gpu, tensor)
        return profile_table[(gpu, tensor)]

    cal = resolve(calibration)
    on_gpus = not any(catalog.gpu(k.gpu).is_cpu for k in kinds)  # the CPU driver has no sequence parallelism
    sequence_parallel = on_gpus if constraints.sequence_parallel is SEARCHED else constraints.sequence_parallel
    costs = _StageCosts(shape, base.precision, base.batch.global_, cached_lookup, cal,
                        flash=flash_attention(base.kernels.attention_backend, [g.gpu for g in cluster.nodes]),
                        overlap_dp=base.kernels.overlap_grad_reduce, overlap_tp=base.kernels.tp_comm_overlap,
                        sequence_parallel=sequence_parallel, stack=base.kernels.stack, on_gpus=on_gpus,
                        dispatcher=(base.model.moe_token_dispatcher_type or "allgather") if shape.moe else None,
                        moe_comm_overlap=base.kernels.overlap_moe_expert_parallel_comm,
                        graphed_iteration=graphed_iteration(base))
    flash = costs.kernels["flash_attention"]
    layout_splits = list(splits(base, world, tensor_domain(cluster), constraints,
                                context_sizes(base, on_gpus, flash, constraints)))
    fully_sharded = fully_sharded_runs(base)
    largest_gb = max(catalog.gpu(k.gpu).memory_limit_gb for k in kinds)
    cluster_price_s = price_per_second(cluster, prices)  # every layout uses every GPU: one price for all
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(layout_splits), desc="plan", unit="split", file=sys.stderr, leave=False)

    def parallel(t: int, p: int, d: int, c: int, v: int = 1, partition=None, accounted=False, ep: int = 1,
                 etp: int | None = None) -> ParallelSpec:
        sp = sequence_parallel and t > 1
        return ParallelSpec(tensor=t, pipeline=p, data=d, context=c, virtual_stages=v, partition=partition,
                            sequence_parallel=sp, account_for_embedding_in_pipeline_split=accounted,
                            account_for_loss_in_pipeline_split=accounted, expert=ep,
                            expert_tensor=None if etp is None or etp == t else etp)

    # First a lower bound on every layout's step time under its exact split: cheap, most layouts stop here. Only
    # what identifies a candidate is kept (its node order is rebuilt if it is estimated).
    bounded = []
    for t, p, d, c in layout_splits:
        sp = parallel(t, p, d, c).sequence_parallel
        experts = expert_sizes(base, shape, t, p, d, c, constraints, largest_gb, fully_sharded, flash,
                               cal.stack(base.kernels.stack).fsdp_master_shards)
        for order in (placements(cluster, t, d * c, p) if orders == "all" else grouped_orders(kinds, counts)):
            for ep, etp in experts:
                layout = parallel(t, p, d, c, ep=ep, etp=etp)
                links = _Links.of(replace(base, cluster=as_cluster(order, kinds, cluster), parallel=layout), cal)
                for b, v, accounted in schedules(base, p, d, virtual_stages, constraints):
                    layers, step_s = _split_and_bound(shape, base.precision, t, p, d, b, v, None, links, costs,
                                                      sequence_parallel=sp, context=c, accounted=accounted,
                                                      expert=(ep, layout.expert_tensor))
                    if constraints.partition is not SEARCHED:
                        layers = list(constraints.partition)
                    bound = step_s if objective == "time" else step_s * cluster_price_s
                    bounded.append((bound, step_s, order, (t, p, d, c, ep, etp, b, v, accounted, layers)))
        if bar is not None:
            bar.update()
    bounded.sort(key=lambda c: c[0])

    # Then the estimator on the most promising first, until no remaining layout can enter the top `top`.
    fixed_partition = constraints.partition is not SEARCHED
    floor = _MemoryFloor(shape, flash)

    def within_budget(step_s: float) -> bool:
        return ((max_step_s is None or step_s <= max_step_s)
                and (max_price_per_step is None or step_s * cluster_price_s <= max_price_per_step))

    def keep_best(heap: list[float], value: float) -> None:
        """`heap`: the best `top` objective values, negated."""
        if len(heap) < top:
            heapq.heappush(heap, -value)
        elif value < -heap[0]:
            heapq.heapreplace(heap, -value)

    def ranked(skip_unfit: bool) -> tuple[list[Row], int, int, int]:
        """The rows, the estimates made, the layouts pruned and the layouts that fit (up to `top`). `skip_unfit`: no
        estimate of a variant whose memory floor no split fits (its row would rank behind every fitting one)."""
        rows: list[Row] = []
        kept: list[float] = []     # fitting rows within the budget
        fitting: list[float] = []  # fitting rows
        evaluated = pruned = 0
        for i, (bound, step_s, order, (t, p, d, c, ep, etp, b, v, accounted, layers)) in enumerate(bounded):
            if top and len(kept) >= top and bound > -kept[0]:
                pruned += len(bounded) - i
                break
            if top and len(fitting) >= top and bound > -fitting[0] and not within_budget(step_s):
                pruned += 1  # beyond the budget, so behind `top` fitting rows already found
                continue
            placed = as_cluster(order, kinds, cluster)
            layout = parallel(t, p, d, c, v, layers if v == 1 and p > 1 else None, accounted, ep, etp)
            # tensor-parallel overlap hides sequence parallelism's transfers: on where the layout has them
            kernels = replace(base.kernels, tp_comm_overlap=base.kernels.tp_comm_overlap and layout.sequence_parallel)
            spec = replace(base, cluster=placed, batch=replace(base.batch, micro=b), recompute=None, parallel=layout,
                           kernels=kernels, optimizer=replace(base.optimizer, distributed=False, zero_stage=0))
            links = _Links.of(spec, cal)
            names = [kinds[k].gpu for k in order]
            for attempt in _variants(spec, constraints, fully_sharded):
                if skip_unfit and not floor.may_fit(attempt, links.stage_gpus):
                    continue
                rebalance = (attempt.parallel.virtual_stages == 1 and attempt.parallel.pipeline > 1
                             and not fixed_partition)
                if rebalance and (attempt.recompute is not None or attempt.optimizer.distributed):
                    attempt.parallel = replace(attempt.parallel,
                                               partition=_balanced_partition(attempt, shape, costs, links, caps=False))
                est = estimate(attempt, cached_lookup, calibration=cal)
                evaluated += 1
                if not est.fits_in_memory and rebalance:
                    # the fastest split overflows a stage: take the fastest split that fits, if there is one
                    split = _balanced_partition(attempt, shape, costs, links, caps=True)
                    if split is not None and split != attempt.parallel.partition:
                        attempt.parallel = replace(attempt.parallel, partition=split)
                        est = estimate(attempt, cached_lookup, calibration=cal)
                        evaluated += 1
                row = _row(attempt, est, names, cluster_price_s)
                row.within_budget = within_budget(row.estimated_s)
                rows.append(row)
                if est.fits_in_memory:
                    if top:
                        value = row.estimated_s if objective == "time" else row.price_per_step
                        keep_best(fitting, value)
                        if row.within_budget:
                            keep_best(kept, value)
                    break
        return rows, evaluated, pruned, len(fitting)

    rows, evaluated, pruned, fitting = ranked(skip_unfit=bool(top))
    if top and fitting < top:
        # the top rows include layouts out of memory, and nothing was pruned: estimate those the floor skipped too
        rows, more, pruned, _ = ranked(skip_unfit=False)
        evaluated += more

    primary = "estimated_s" if objective == "time" else "price_per_step"
    secondary = "price_per_step" if objective == "time" else "estimated_s"
    rows.sort(key=lambda r: (r.oom, not r.within_budget, getattr(r, primary), getattr(r, secondary)))
    return Plan(rows=_distinct(rows), search_seconds=time.perf_counter() - started, configs_evaluated=evaluated,
                configs_pruned=pruned, objective=objective)


def _distinct(rows: list[Row]) -> list[Row]:
    """One row per layout the estimator cannot tell apart: node orders that give every stage the same GPUs, the same
    layers and the same time are one row (the first, as ranked)."""
    seen, out = set(), []
    for row in rows:
        key = (row.tp, row.pp, row.dp, row.cp, row.ep, row.etp, row.mbs, row.virtual_stages, row.sequence_parallel,
               row.recompute_granularity,
               row.zero_stage, tuple(row.spec.stage_gpus), tuple(row.partition), round(row.estimated_s, 9))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out

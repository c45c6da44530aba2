"""`estimate(spec)`: everything labkit predicts about a run before it is submitted, with the breakdown behind it."""
from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass, field

from labkit import catalog
from labkit.estimate import flops as F
from labkit.estimate.calibration import Calibration, resolve
from labkit.estimate.memory import (GIB, MOE_TOKEN_IMBALANCE, FP8Weights, OptimizerDtypes, expert_data_parallel,
                                    memory_per_stage, moe_pattern)
from labkit.estimate.params import active_params, mlp_params, params_with_padding, stage_params, total_params
from labkit.estimate.profiles import Profile, find_profile
from labkit.estimate.timing import (ACTIVATION_BYTES, GRAD_REDUCE_BYTES, Pipeline, allreduce_time, combined,
                                    data_parallel_time, optimizer_step_time, p2p_time, stage_time)
from labkit.estimate.topology import Topology
from labkit.megatron import rules, sharding
from labkit.megatron.flops import SELECTIVE_DEFAULT, megatron_logged_flops, model_flops
from labkit.megatron.shape import Shape
from labkit.spec import load_spec

# Memory the estimate does not itemise (CUDA context, NCCL buffers, allocator fragmentation) is kept as this fraction
# of each GPU's usable memory: a stage fits when its itemised total stays below (1 - margin) x the GPU's memory.
# Measured by benchmarks/gpu_check.sh on an H200 (megatron-core 0.16.1, four runs of 9-72 GB): the caching allocator
# reserved 2.6-5.7% more than its peak allocation; the CUDA context and NCCL's buffers add about 1 GiB, 1.3% of an
# 80 GB card. 7% covers both; it was 10%, which ruled out layouts NVIDIA trains on 80 GB H100s.
MEMORY_MARGIN = 0.07


@dataclass
class Estimate:
    params: int                         # the model with its vocabulary unpadded
    flops_per_iteration: float          # executed (with recompute), SC21 eq. (3)'s F
    model_flops_per_iteration: float    # without recompute, the MFU numerator
    iteration_time_s: float
    tflops_per_gpu: float               # executed FLOPs per second per GPU
    mfu: float
    hfu: float
    memory_gb_per_stage: list[float]
    fits_in_memory: bool
    breakdown: dict[str, float]
    stage_times_s: list[float]          # forward + backward of one micro-batch per stage
    stage_gpus: list[str]
    stage_sources: list[str]            # "profile ..." or "analytic ..."
    memory_detail: list[dict] = field(default_factory=list)
    memory_limit_gb_per_stage: list[float] = field(default_factory=list)
    params_per_stage: list[float] = field(default_factory=list)
    num_gpus: int = 1
    tokens_per_iteration: int = 0
    tokens: float | None = None
    training_days: float | None = None
    pipeline: Pipeline | None = None    # the schedule the pipeline time comes from: pipeline.events() draws it
    params_with_padding: int = 0        # the model as Megatron builds it, its vocabulary padded
    active_params: int = 0              # what one token passes through: every expert of an MoE model but its top-k
    padded_vocab_size: int = 0          # Megatron's padded vocabulary at this tensor size
    megatron_logged_tflops_per_gpu: float = 0.0  # what Megatron-LM's log prints: causal model FLOPs per GPU-second
    flash_attention: bool = False       # the attention kernel keeps no s x s scores (kernels.attention_backend)
    exposed_comm_s: dict[str, float] = field(default_factory=dict)  # per kind, what computation does not hide
    hidden_comm_s: dict[str, float] = field(default_factory=dict)   # per kind, what overlap hides behind computation
    assumptions: list[str] = field(default_factory=list)  # what the estimate took for granted, in words

    def to_dict(self) -> dict:
        out = {
            "params": self.params,
            "active_params": self.active_params,
            "params_with_padding": self.params_with_padding,
            "padded_vocab_size": self.padded_vocab_size,
            "flops_per_iteration": self.flops_per_iteration,
            "model_flops_per_iteration": self.model_flops_per_iteration,
            "iteration_time_s": self.iteration_time_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "megatron_logged_tflops_per_gpu": self.megatron_logged_tflops_per_gpu,
            "flash_attention": self.flash_attention,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "memory_gb_per_stage": self.memory_gb_per_stage,
            "fits_in_memory": self.fits_in_memory,
            "memory_margin": MEMORY_MARGIN,
            "memory_limit_gb_per_stage": self.memory_limit_gb_per_stage,
            "breakdown": {**self.breakdown, "exposed_comm_s": dict(self.exposed_comm_s),
                          "hidden_comm_s": dict(self.hidden_comm_s)},
            "stage_times_s": self.stage_times_s,
            "stage_gpus": self.stage_gpus,
            "stage_sources": self.stage_sources,
            "boundary_times_s": list(self.pipeline.boundary_times_s) if self.pipeline else [],
            "memory_detail": self.memory_detail,
            "params_per_stage": self.params_per_stage,
            "num_gpus": self.num_gpus,
            "tokens_per_iteration": self.tokens_per_iteration,
            "assumptions": list(self.assumptions),
        }
        if self.tokens is not None:
            out["tokens"] = self.tokens
            out["training_days"] = self.training_days
        return out


def _add_host_passes(chunk_times: list[list], gpus: list[str], seconds: float) -> None:
    """Charge each model chunk's forward and backward pass on a CPU the host time the training loop spends around
    it (Calibration.cpu_host_s_per_pass, half to each): what megatron-core's schedule does around a pass beyond its
    layers, which a GPU's asynchronous launches hide but a CPU runs in line, and which a profile of the layers' passes
    does not time. A residual measured by benchmarks/bench_host_overhead.py, not traced to its parts."""
    for i, row in enumerate(chunk_times):
        if catalog.gpu(gpus[i]).is_cpu:
            row[:] = [dataclasses.replace(ct, forward_s=ct.forward_s + seconds / 2,
                                          backward_s=ct.backward_s + seconds / 2) for ct in row]


def _add_main_grad_accumulation(chunk_times: list[list], spec, shape: Shape, gpus: list[str]) -> None:
    """Charge each model chunk's backward for megatron-core's gradient accumulation without its fused kernel.

    megatron-core's DDP (and the distributed optimizer on it) adds each parameter's gradient to its main_grad buffer
    in the backward post-hook of every micro-batch (distributed_data_parallel.py, `param.main_grad.add_(param.grad)`):
    a memory-bound pass that reads the gradient (the parameters' dtype) and the buffer and writes the buffer (fp32, as
    the reduction, labkit.estimate.timing.GRAD_REDUCE_BYTES). Transformer Engine's (or Apex's) weight-gradient GEMMs
    accumulate into main_grad themselves (gradient_accumulation_fusion; labkit.train.model.fusions), which the
    estimate assumes on GPUs, charging nothing there: what still takes the hook (the embedding's gradient, norms,
    biases) is a small share of the parameters. labkit's driver on CPUs has no fused kernel and runs the pass for
    every parameter. The buffer's zeroing once per step is not charged.
    """
    p, v, t = spec.parallel.pipeline, spec.parallel.virtual_stages, spec.parallel.tensor
    order = [spec.chunk_partition[u % p][u // p] for u in range(p * v)]  # chunk c of stage i is virtual stage c p + i
    expert = dict(expert=spec.parallel.expert, expert_tensor=spec.parallel.expert_tensor) if shape.moe else {}
    gradient = 4 if spec.precision == "fp32" else 2
    buffer = 2 if spec.optimizer.bf16_gradients else GRAD_REDUCE_BYTES.get(spec.precision, 4)
    for u, params in enumerate(stage_params(shape, order, t, **expert)):
        i, k = u % p, u // p
        seconds = params * (gradient + 2 * buffer) / (catalog.gpu(gpus[i]).memory_bw_gb_s * 1e9)
        chunk_times[i][k] = dataclasses.replace(chunk_times[i][k], backward_s=chunk_times[i][k].backward_s + seconds)


def profile_lookup(profiles, model: str | None):
    """Normalise `profiles` (None, a mapping keyed by (gpu, tensor), or a callable) into lookup(gpu, tensor)."""
    if profiles is None:
        return lambda gpu, tensor: find_profile(model, gpu, tensor) if model else None
    if callable(profiles) and not isinstance(profiles, dict):
        return profiles
    table = {}
    for (gpu, tensor), prof in dict(profiles).items():
        table[(catalog.resolve_gpu_name(gpu) or gpu, int(tensor))] = prof
    return lambda gpu, tensor: table.get((catalog.resolve_gpu_name(gpu) or gpu, int(tensor)))


def profiled_model(shape: Shape) -> str | None:
    """The preset whose profiles stand for this model: the one with the same layer and vocabulary (the layer count
    aside, profiles being per layer), so a model written field by field finds its preset's profiles, and a preset
    whose sizes the spec changed does not."""
    return _presets_by_layer().get(_layer(shape))


def _layer(shape: Shape) -> tuple:
    """What a layer's measured time depends on: its matrices (hidden, key/value width, MLP) and kinds, and the
    vocabulary of the ends. The head count alone moves no FLOPs, so a profile serves any split of the same width."""
    return (shape.hidden, shape.hidden * shape.groups // shape.heads, shape.ffn_size, shape.swiglu, shape.vocab,
            shape.norm, shape.positions, shape.bias)


@functools.cache
def _presets_by_layer() -> dict[tuple, str]:
    table: dict[tuple, str] = {}
    for name in catalog.models():
        table.setdefault(_layer(Shape.of(load_spec({"model": {"preset": name}}).model)), name)
    return table


def profile_fits(prof: Profile | None, shape: Shape) -> bool:
    """Whether a per-layer profile was measured at this model's sequence length (or says nothing about it)."""
    return prof is not None and (prof.seq_length is None or prof.seq_length == shape.seq_length)


def estimate(spec, profiles=None, *, tokens: float | None = None, overlap_dp: bool = False, stack=None,
             grad_reduce_bytes: int | None = None, calibration: Calibration | None = None) -> Estimate:
    """Predict parameters, FLOPs, memory per stage and iteration time of a RunSpec.

    `profiles`: None looks up labkit/data/profiles for the spec's model preset; or a mapping {(gpu, tensor): Profile};
    or a callable (gpu, tensor) -> Profile | None. Stages without a profile use analytic FLOPs / (peak x efficiency).
    `overlap_dp`: gradient all-reduce overlapped with the last micro-batch's backward (Megatron --overlap-grad-reduce),
    as `kernels.overlap_grad_reduce` in the spec also asks.
    `stack`: the training software, a name in the calibration's stacks or a Stack; by default the spec's
    kernels.stack, else the calibration's default_stack ("megatron-core").
    `grad_reduce_bytes`: bytes per gradient element in the data-parallel all-reduce when the software differs from
    Megatron's choice for the precision (DeepSpeed's fp32_allreduce reduces fp16 gradients as 4-byte floats).
    `calibration`: the fitted constants (efficiencies, bus fractions, latencies, stacks); default_calibration() when
    None.

    A mixture-of-experts model (model.num_experts) is estimated at its active FLOPs with its experts split over
    parallel.expert ranks (each over parallel.expert_tensor ranks): memory per rank holds num_experts / expert of each
    MoE layer's experts, whose gradients and optimizer state the distributed optimizer shards over the
    expert-data-parallel ranks (labkit.estimate.memory.model_state_bytes); each MoE layer adds its token dispatch
    (labkit.estimate.timing.expert_dispatch_time) over the links its expert groups span (Topology.expert_links),
    charged as "ep_comm" in the breakdown and as exposed communication of kind "ep"; the experts' gradients are
    reduced over the expert-data-parallel group, after the dense ones, in the data-parallel time.

    Taught in labs 01, 05, 06, 07 and 10.
    """
    cal = resolve(calibration)
    latency = cal.link_latency_s
    stack_given = stack is not None
    stack = cal.stack(stack if stack_given else spec.kernels.stack)
    shape = Shape.of(spec.model)
    par, b = spec.parallel, spec.batch
    t, p, d, v, c = par.tensor, par.pipeline, spec.data_parallel, par.virtual_stages, par.context
    ep, etp = (par.expert, par.expert_tensor) if shape.moe else (1, None)
    dispatcher = (spec.model.moe_token_dispatcher_type or "allgather") if shape.moe else None
    overlap_dp = overlap_dp or spec.kernels.overlap_grad_reduce
    m = spec.num_micro_batches
    # the all-to-all's overlap pairs two micro-batches: a step of one has nothing to hide it behind
    moe_overlap = spec.kernels.overlap_moe_expert_parallel_comm and m > 1
    expert = {"expert": ep, "expert_tensor": etp, "dispatcher": dispatcher, "moe_comm_overlap": moe_overlap,
              "graphed_iteration": graphed_iteration(spec)}
    partition = spec.layer_partition
    recompute = spec.recompute.granularity if spec.recompute is not None else None
    recompute_modules = spec.recompute.modules if spec.recompute is not None else None
    precision = spec.precision
    topo = Topology(spec, cal)
    lookup = profile_lookup(profiles, profiled_model(shape))
    flash = flash_attention(spec.kernels.attention_backend, [topo.stage_gpu(i) for i in range(p)])

    # Per-stage compute of one micro-batch: each model chunk's layers (the model's first chunk with the embedding, its
    # last with the loss), in layer order: chunk c of stage i is virtual stage c x p + i.
    chunks = spec.chunk_partition
    sources_by_stage, gpus = [], []
    for i in range(p):
        name = topo.stage_gpu(i)
        prof = lookup(name, t)
        if not profile_fits(prof, shape) and t > 1:
            prof = lookup(name, 1)  # a single-GPU profile, split over the tensor ranks
        sources_by_stage.append(prof if profile_fits(prof, shape) else catalog.gpu(name))
        gpus.append(name)
    chunk_times = [[None] * v for _ in range(p)]
    first_layer = 0
    for u in range(p * v):
        i, k = u % p, u // p
        layers = chunks[i][k]
        chunk_times[i][k] = stage_time(sources_by_stage[i], layers, b.micro, t, shape=shape, precision=precision,
                                       first=u == 0, last=u == p * v - 1, recompute=recompute,
                                       first_layer=first_layer, tp_gbps=topo.tp_gbps(i), stack=stack,
                                       calibration=cal, flash_attention=flash, context=c, cp_gbps=topo.cp_gbps(i),
                                       tp_comm_overlap=spec.kernels.tp_comm_overlap,
                                       sequence_parallel=par.sequence_parallel,
                                       expert_links=topo.expert_links(i) if shape.moe else None,
                                       recompute_modules=recompute_modules, **expert)
        first_layer += layers
    on_gpus = not any(catalog.gpu(gpu).is_cpu for gpu in gpus)
    shard = sharding.of_spec(spec)
    # the host time was measured on megatron-core's DDP and distributed optimizer; DeepSpeed's and FSDP2's loops differ
    host_timed = not on_gpus and shard.implementation in (sharding.DDP, sharding.DISTRIBUTED_OPTIMIZER)
    if host_timed:
        _add_main_grad_accumulation(chunk_times, spec, shape, gpus)
        _add_host_passes(chunk_times, gpus, cal.cpu_host_s_per_pass)
    stages = [combined(row) for row in chunk_times]
    sources = [st.source for st in stages]
    shares = None
    if v > 1:
        shares = tuple(tuple(ct.total_s / st.total_s if st.total_s else 1 / v for ct in row)
                       for row, st in zip(chunk_times, stages))

    # Pipeline boundaries: each micro-batch's activations forward and their gradients back.
    message = b.micro * shape.seq_length / c * shape.hidden * ACTIVATION_BYTES.get(precision, 2)
    if par.sequence_parallel:
        message /= t
    # a message's latency: the calibration's, or the device's own where the catalog gives a longer one (gloo on CPUs)
    message_latency = max([latency] + [catalog.gpu(g).message_latency_s or 0.0 for g in gpus])
    boundaries = [p2p_time(message, topo.pair_gbps(i, i + 1), message_latency + stack.p2p_message_s)
                  for i in range(p - 1)]
    # interleaved, the last stage's chunk c feeds the first stage's chunk c + 1
    wrap = (p2p_time(message, topo.pair_gbps(p - 1, 0), message_latency + stack.p2p_message_s) if v > 1 and p > 1
            else 0.0)
    # interleaved on GPUs, NCCL's sends and receives overlap compute; gloo's block (labkit.train.model)
    pipeline = Pipeline(tuple(s.total_s for s in stages), tuple(boundaries), m, v, messages=stack.p2p_messages,
                        backward_shares=tuple(s.backward_share for s in stages), wrap_time_s=wrap,
                        chunk_shares=shares, overlap_sends=stack.overlap_p2p and on_gpus)
    pipe = pipeline.time()

    # After the last backward: gradient all-reduce per stage, tied-embedding all-reduce, optimizer step.
    per_stage_params = (stage_params(shape, partition, t, expert=ep, expert_tensor=etp) if shape.moe
                        else stage_params(shape, partition, t))
    # with expert parallelism the experts' gradients are reduced over the expert-data-parallel group, apart
    experts_by_stage = expert_params_per_stage(shape, partition, t, ep, etp)
    edp = expert_data_parallel(t, c, d, ep, etp) if shape.moe else 1
    # --grad-reduce-in-bf16 (or --main-grads-dtype bf16) reduces bf16 gradients, where Megatron-LM's bf16 default
    # reduces fp32 ones
    grad_bytes = grad_reduce_bytes or (2 if spec.optimizer.bf16_gradients else GRAD_REDUCE_BYTES.get(precision, 4))
    zero_stage = shard.stage
    fsdp2 = shard.implementation == sharding.TORCH_FSDP2
    if fsdp2:  # FSDP2 reduce-scatters in the parameters' dtype
        grad_bytes = 4 if precision == "fp32" else 2
    dp_exposed, dp_total = [], []
    for i, params in enumerate(per_stage_params):
        # megatron-core reduces gradients over data x context ranks (its intra data-and-context-parallel group)
        experts = experts_by_stage[i]
        dp_options = dict(zero_stage=zero_stage, grad_bytes=grad_bytes, param_bytes=4 if precision == "fp32" else 2,
                          micro_batches=m, layers=partition[i], overlap_grad_reduce=overlap_dp,
                          overlap_param_gather=spec.kernels.overlap_param_gather, zero3_exposed=stack.zero3_exposed)
        exposed_s, total_s = data_parallel_time(
            params - experts if experts else params, d * c, topo.dp_gbps(i), latency,
            forward_s=stages[i].forward_s, backward_s=stages[i].backward_s, **dp_options)
        if experts:
            # DDP's expert buckets follow the dense ones on the same stream (distributed_data_parallel.py,
            # `self.bucket_groups + self.expert_parallel_bucket_groups`): they hide behind what compute the dense
            # transfers left, the backward's first
            hidden = total_s - exposed_s
            backward_left = max(0.0, stages[i].backward_s - hidden)
            forward_left = max(0.0, stages[i].forward_s - max(0.0, hidden - stages[i].backward_s))
            more_exposed, more_total = data_parallel_time(experts, edp, topo.edp_gbps(i), latency,
                                                          forward_s=forward_left, backward_s=backward_left,
                                                          **dp_options)
            exposed_s, total_s = exposed_s + more_exposed, total_s + more_total
        dp_exposed.append(exposed_s)
        dp_total.append(total_s)
    dp_comm = max(dp_exposed)
    embedding_comm = 0.0
    if p > 1 and shape.tied:
        # the tied copy's gradient is reduced as the model keeps it, outside the data-parallel gradient buffers
        embedding_bytes = shape.padded_vocab(t) * shape.hidden / t * GRAD_REDUCE_BYTES.get(precision, 4)
        embedding_comm = allreduce_time(embedding_bytes, 2, topo.pair_gbps(0, p - 1), latency)
    shards = d * c if zero_stage else 1  # megatron-core shards over data x context ranks
    expert_shards = edp if zero_stage else 1  # ... and the experts over the expert-data-parallel ranks
    optimizer = max(optimizer_step_time((params - experts) / shards + experts / expert_shards if experts
                                        else params / shards, catalog.gpu(gpus[i]).memory_bw_gb_s, precision)
                    + (cal.cpu_host_s_per_step if host_timed and catalog.gpu(gpus[i]).is_cpu else 0.0)
                    for i, (params, experts) in enumerate(zip(per_stage_params, experts_by_stage)))

    iteration = pipe.total_s + dp_comm + embedding_comm + optimizer
    k = pipe.bottleneck_stage
    bottleneck = stages[k]
    tp_share = bottleneck.tp_comm_s / bottleneck.total_s if bottleneck.total_s else 0.0
    ep_share = bottleneck.ep_comm_s / bottleneck.total_s if bottleneck.total_s else 0.0
    breakdown = {
        "compute": pipe.busy_s * (1 - tp_share - ep_share) if ep_share else pipe.busy_s * (1 - tp_share),
        "bubble": pipe.bubble_s,
        "tp_comm": pipe.busy_s * tp_share,
        "ep_comm": pipe.busy_s * ep_share,
        "pp_comm": pipe.pp_comm_s,
        "dp_comm": dp_comm,
        "embedding_comm": embedding_comm,
        "optimizer": optimizer,
    }
    # communication the computation does not hide, per kind (the TP and EP shares are on the bottleneck stage's path)
    exposed = {"tp": breakdown["tp_comm"], "ep": breakdown["ep_comm"], "pp": pipe.pp_comm_s, "dp": dp_comm,
               "embedding": embedding_comm}
    # and what it hides: the bottleneck stage's tensor-parallel transfers before overlap, its pipeline sends beyond
    # those on the critical path, the data-parallel traffic of the stage that exposes the most
    tp_all = bottleneck.tp_comm_before_overlap_s * m
    sends = 2 * m * v * sum(boundaries[max(0, k - 1):k + 1]) if p > 1 else 0.0
    worst = dp_exposed.index(dp_comm)
    hidden = {"tp": max(0.0, tp_all - exposed["tp"]), "ep": 0.0, "pp": max(0.0, sends - pipe.pp_comm_s),
              "dp": max(0.0, dp_total[worst] - dp_comm), "embedding": 0.0}

    # FLOPs and utilisation.
    num_gpus = t * c * p * d
    executed = F.hardware_flops(shape, b.global_, recompute, recompute_modules)
    model = model_flops(shape, b.global_)
    peak_total = sum(catalog.gpu(topo.slots[r].gpu).peak(precision) for r in range(num_gpus))
    tflops = F.achieved_tflops(executed, iteration, num_gpus)
    # Megatron-LM counts the logits over its padded vocabulary
    padded = dataclasses.replace(shape, vocab=shape.padded_vocab(t))
    logged = F.achieved_tflops(megatron_logged_flops(padded, b.global_), iteration, num_gpus)

    # Memory. FSDP2's units follow the layers labkit's driver builds: Transformer Engine's on GPUs (as the estimate
    # assumes them throughout), whose output layer FSDP2 gathers on its own, megatron-core's local ones on CPUs
    transformer_impl = rules.transformer_impl(argparse.Namespace(transformer_impl=None),
                                              rules.Runtime(cuda=on_gpus, transformer_engine=on_gpus))
    fp8_weights = fp8_weights_of(spec)
    mem = memory_per_stage(shape, partition, tensor=t, data_parallel=d, micro_batch=b.micro, num_micro_batches=m,
                           precision=precision, recompute=recompute,
                           recompute_layers=spec.recompute.num_layers if spec.recompute else 1,
                           sequence_parallel=par.sequence_parallel, virtual_stages=v,
                           distributed_optimizer=spec.optimizer.distributed, optimizer=spec.optimizer.name,
                           zero_stage=zero_stage, zero_backend=spec.optimizer.zero_backend,
                           flash_attention=flash, context=c, chunks=chunks,
                           grad_reduce_in_bf16=spec.optimizer.grad_reduce_in_bf16, overlap_grad_reduce=overlap_dp,
                           expert=ep, expert_tensor=etp, recompute_modules=recompute_modules,
                           entrypoint=spec.job.entrypoint, transformer_impl=transformer_impl,
                           optimizer_dtypes=OptimizerDtypes.of(spec.optimizer),
                           evaluates=bool(spec.train.eval_interval), fp8_weights=fp8_weights,
                           fsdp_master_shards=stack.fsdp_master_shards, moe_overlap=moe_overlap)
    limits = [catalog.gpu(g).memory_limit_gb for g in gpus]
    fits = all(s.total <= (1 - MEMORY_MARGIN) * lim for s, lim in zip(mem, limits))

    assumptions = [f"software stack {stack.name}" + ("" if stack_given else " (kernels.stack)" if spec.kernels.stack
                                                     else " (the default; set kernels.stack for another)")]
    if zero_stage:
        runs = f"ZeRO stage {zero_stage} as {sharding.DESCRIPTIONS[shard.implementation]}" \
               f" ({'labkit' if spec.job.entrypoint != sharding.MEGATRON_LM else 'Megatron-LM'}'s)"
        if fsdp2:
            units = ("each transformer layer, the embedding and the output layer (the final norm with the root)"
                     if transformer_impl != "local" else
                     "each transformer layer and the embedding (the final norm and the output layer with the root)")
            runs += f": gathered unit by unit, {units}"
            if stack.fsdp_master_shards and precision != "fp32":
                runs += (f"; as the {stack.name} stack runs it, the fp32 shards are the master weights, gathered in "
                         "bf16, their gradients reduced in fp32")
        assumptions.append(runs)
    # FSDP's stage 3 gathers parameters in every micro-batch, in the forward and again in the backward, having freed
    # each layer after its forward; stage 2 keeps them gathered and gathers once per step, after the optimizer's
    gathers = 2 if zero_stage == 3 else 0
    if gathers and m > 1:
        gathered_gb = max(per_stage_params) * (4 if precision == "fp32" else 2) / 1e9
        assumptions.append(f"the parameters are all-gathered in each of the {m} micro-batches, in its forward and "
                           f"again in its backward: "
                           f"{gathers * m} all-gathers of {gathered_gb:.3g} GB per step, which with the gradients' "
                           f"reduce-scatters take {sum(dp_total) / p:.3g} s of data-parallel transfers, "
                           f"{dp_comm:.3g} s exposed (fewer, larger micro-batches gather less)")
    if spec.recompute is not None and spec.recompute.granularity == "selective":
        assumptions.append("selective recompute of " + ", ".join(recompute_modules or SELECTIVE_DEFAULT))
    if host_timed:
        assumptions.append(f"the CPU's host time around the layers: {1e3 * cal.cpu_host_s_per_pass:g} ms per model "
                           f"chunk and micro-batch, half in its forward, half in its backward, and "
                           f"{1e3 * cal.cpu_host_s_per_step:g} ms per step (calibration.yaml cpu_host_s_per_pass, "
                           "cpu_host_s_per_step, measured on one machine)")
    if spec.optimizer.precision_aware:
        o = spec.optimizer
        gradients = "fp16" if precision == "fp16" else "bf16" if o.bf16_gradients else "fp32"  # the buffer's dtype
        master = o.main_params_dtype
        if master == "fp32" and precision == "mxfp8":
            master += " (megatron-core's)"
        elif master == "fp32" and precision not in ("fp32", "fp16"):
            master += " as the 16 bits bf16 lacks"
        assumptions.append(f"the optimizer state as Transformer Engine's FusedAdam keeps it (optimizer.precision_aware):"
                           f" gradients {gradients}, master weights {master}, exp_avg {o.exp_avg_dtype}, exp_avg_sq "
                           f"{o.exp_avg_sq_dtype}")
    if fp8_weights is not None:
        assumptions.append(_fp8_weights_assumption(spec, fp8_weights))
    if spec.kernels.cuda_graph_impl != "none":
        scope = ", ".join(spec.kernels.cuda_graph_scope or ["each transformer layer"])
        assumptions.append(f"CUDA graphs ({spec.kernels.cuda_graph_impl}: {scope}); the static buffers they keep "
                           "are not counted in memory")
    if shape.moe:
        assumptions.append(f"tokens spread over the experts {MOE_TOKEN_IMBALANCE:g} x evenly "
                           "(labkit.estimate.memory.MOE_TOKEN_IMBALANCE), none dropped")
        if dispatcher == "flex" and ep > 1:
            assumptions.append(_flex_assumption(topo, [topo.expert_group(i, "ep") for i in range(p)]))
        if ep > 1 and moe_overlap:
            assumptions.append("the experts' all-to-all hidden behind another micro-batch's forward and backward "
                               "(kernels.overlap_moe_expert_parallel_comm), exposed only where it outlasts them, "
                               "the pipeline's warm-up and cool-down included; one more layer's activations held, "
                               "a forward's beside its backward partner's")
        # a stage timed from a profile of its GPU has its host's launches in the profile's time
        analytic = [gpu for gpu, source in zip(gpus, sources_by_stage) if not isinstance(source, Profile)]
        launch_ms = {gpu: 1e3 * cal.moe_launch_s(stack, gpu) for gpu in dict.fromkeys(analytic)}
        if on_gpus and any(launch_ms.values()):
            rates = ", ".join(f"{ms:.2g} ms on {gpu}" for gpu, ms in launch_ms.items())
            assumptions.append("no host launch cost per expert: the whole iteration is one CUDA graph"
                               if graphed_iteration(spec) else
                               f"the host launches each MoE layer's kernels at {rates} per local expert and "
                               "micro-batch (calibration.yaml: moe_launch_s_per_local_expert, fitted on Blackwell "
                               "with the router and the dispatch's preprocessing in CUDA graphs as NVIDIA's recipes "
                               "run them, at the GPU's moe_launch_scale, 1 where it has none)")

    tokens_per_iteration = b.global_ * shape.seq_length
    days = tokens / tokens_per_iteration * iteration / F.SECONDS_PER_DAY if tokens is not None else None
    return Estimate(
        params=total_params(shape),
        active_params=active_params(shape),
        flops_per_iteration=executed,
        model_flops_per_iteration=model,
        iteration_time_s=iteration,
        tflops_per_gpu=tflops,
        mfu=F.utilization(model, iteration, peak_total),
        hfu=F.utilization(executed, iteration, peak_total),
        memory_gb_per_stage=[s.total for s in mem],
        fits_in_memory=fits,
        breakdown=breakdown,
        stage_times_s=[s.total_s for s in stages],
        stage_gpus=gpus,
        stage_sources=sources,
        memory_detail=[s.to_dict() for s in mem],
        memory_limit_gb_per_stage=limits,
        params_per_stage=per_stage_params,
        num_gpus=num_gpus,
        tokens_per_iteration=tokens_per_iteration,
        tokens=tokens,
        training_days=days,
        pipeline=pipeline,
        params_with_padding=params_with_padding(shape, t),
        padded_vocab_size=shape.padded_vocab(t),
        megatron_logged_tflops_per_gpu=logged,
        flash_attention=flash,
        exposed_comm_s=exposed,
        hidden_comm_s=hidden,
        assumptions=assumptions,
    )


def expert_params_per_stage(shape: Shape, partition: list[int], tensor: int = 1, expert: int = 1,
                            expert_tensor: int | None = None) -> list[float]:
    """The experts' parameters on one rank of each pipeline stage that DDP keeps apart, in its expert buffer: those of
    its MoE layers' num_experts / expert local experts, each split over the expert-tensor ranks; none without expert
    parallelism, where they share the dense buffer (labkit.estimate.memory._layer_parameters says why)."""
    if not shape.moe or expert <= 1:
        return [0.0] * len(partition)
    etp = tensor if expert_tensor is None else expert_tensor
    per_layer = shape.experts / expert * mlp_params(shape, shape.expert_ffn_size, etp)
    out, first = [], 0
    for layers in partition:
        out.append(sum(moe_pattern(shape)[first:first + layers]) * per_layer)
        first += layers
    return out


def flash_attention(backend: str, gpus: list[str]) -> bool:
    """Whether the attention kernel keeps no s x s scores: flash and fused do not; unfused and local (the 2021-22
    stack, and what runs on a CPU) do; auto is what megatron-core picks with Transformer Engine, flash or fused
    attention on GPUs from Ampere on (those with bf16), unfused before; sdpa (labkit's driver) is PyTorch's
    scaled_dot_product_attention, whose flash and memory-efficient kernels keep none on any GPU, while on a CPU its
    math kernel keeps them wherever dropout is on."""
    if backend in ("flash", "fused"):
        return True
    found = [catalog.gpu(g) for g in gpus]
    if backend == "sdpa":
        return bool(found) and not any(g.is_cpu for g in found)
    if backend != "auto":
        return False
    return bool(found) and all(g.bf16 and not g.is_cpu for g in found)


def graphed_iteration(spec) -> bool:
    """Whether the whole training iteration replays as one CUDA graph (kernels.cuda_graph_impl local with
    cuda_graph_scope full_iteration): the host launches no kernel per layer."""
    k = spec.kernels
    return k.cuda_graph_impl == "local" and "full_iteration" in (k.cuda_graph_scope or [])


def fp8_weights_of(spec) -> FP8Weights | None:
    """What Transformer Engine holds of a GPU run's linear layers' weights (labkit.estimate.memory.FP8Weights): with
    FP8 parameters where the spec keeps them (labkit.megatron.sharding.fp8_param_gather), a transpose beside each
    FP8 one unless every GPU of the run takes FP8 GEMMs in any layout (a mixed cluster is counted at its larger);
    None on CPUs, which have no Transformer Engine."""
    gpus = [catalog.gpu(g) for g in spec.stage_gpus]
    if any(g.is_cpu for g in gpus):
        return None
    return FP8Weights.of(spec.precision, sharding.fp8_param_gather(spec), all(g.fp8_gemm_any_layout for g in gpus))


def _flex_assumption(topo: Topology, groups: list[list[int]]) -> str:
    """What the estimate assumes of the flex dispatcher's forwarding over the stages' expert-parallel `groups`."""
    text = "the flex dispatcher sends a token once to each rank holding any of its experts"
    if not any(topo.flex_crosses_network(g) for g in groups):
        return text
    if topo.flex_forwards_within == "domain":
        return text + (", and once over the network to each other NVLink domain, where NVLink fans it out (HybridEP's "
                       "forwarding)")
    text += ", and once over the network to each other node, where NVLink fans it out (DeepEP's forwarding"
    if any(topo.spans_nodes_of_one_domain(g) for g in groups):
        text += (", which megatron-core 0.16.1 runs inside a node only, also on a multi-node NVLink rack: use hybridep "
                 "there")
    return text + ")"


def _fp8_weights_assumption(spec, weights: FP8Weights) -> str:
    """The estimate's words for FP8Weights, saying whether optimizer.fp8_param_gather was written or defaulted."""
    each = f"{weights.quantized:.3g} byte{'' if weights.quantized == 1 else 's'} each"
    if weights.replaces_bf16:
        said = "" if spec.optimizer.fp8_param_gather is not None else \
            ", the default where Megatron-LM can, as NVIDIA's recipes set it"
        transpose = " with its transpose" if spec.precision == "fp8" and weights.quantized == 2 else ""
        return (f"the linear layers' weights kept in {spec.precision.upper()} at {each}{transpose} "
                f"(--fp8-param-gather: optimizer.fp8_param_gather{said}), no bf16 copy")
    if spec.optimizer.fp8_param_gather is False:
        why = " (optimizer.fp8_param_gather false)"
    elif spec.precision != "nvfp4":
        why = " (optimizer.fp8_param_gather keeps no bf16 copy under the distributed optimizer or Megatron-FSDP)"
    else:
        why = ""
    return (f"the linear layers' weights in bf16 with Transformer Engine's cached {spec.precision.upper()} copy, "
            f"{each} beside their 2{why}")


__all__ = ["Estimate", "estimate", "MEMORY_MARGIN", "GIB"]

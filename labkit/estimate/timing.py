"""Iteration time from its parts: per-stage compute, tensor-parallel all-reduces, an MoE layer's token dispatch (the
expert-parallel all-to-all, `expert_dispatch_time`), pipeline send/recv, the 1F1B schedule, data-parallel gradient
all-reduce, the tied-embedding all-reduce and the optimizer step.

Link speeds are Gbit/s per direction. Ring collectives over n ranks move 2 (n-1)/n M bytes per rank for an all-reduce
(SC21 §3; NCCL's bus-bandwidth convention) plus 2 (n-1) latency steps. What a collective reaches is its bus bandwidth,
a fraction of the link's rate (`Calibration.bus_gbps`): the catalog and cluster files hold link rates, topology.py
converts them.

Analytic compute of one transformer layer (no profile) is matrix-multiply FLOPs / (peak x efficiency) plus the
memory-bound kernels (layer norms, softmax, dropout, GELU, residual adds), which stream the layer's activations
(Korthikanti et al. Table 2 bytes) through memory `memory_passes` times at the GPU's memory bandwidth. How many passes,
and what each tensor-parallel all-reduce and pipeline message costs on top of moving its bytes, depend on the training
software rather than the hardware: a `Stack` holds them.

The pipeline (see `pipeline_time`) is Megatron's 1F1B schedule played out operation by operation
(`schedule_1f1b`): stage i runs min(p - i - 1, m) warm-up forwards, then alternates one forward and one backward,
then drains; an operation starts when its stage is free and its input has arrived. Each stage sends what it computed
before it moves on (Megatron pairs each send with the opposite receive, so the stage is held for one transfer time C
per forward and per backward). With k > 1 blocking transfers per neighbour per micro-batch (DeepSpeed's pipeline engine
issues four, k = 2), a receive also holds a busy receiver for (k - 1) C. Where the slowest stage is the last one, or
stages are equal, this gives the critical-path form AMP, Alpa and Metis use,
    T = (m - 1) max_i T'_i + sum_i T_i + 2 sum_j C_j,    T'_i = T_i + k (C_in + C_out)
(T_i one micro-batch's forward + backward on stage i, C_j one boundary's send); where an earlier stage is the slowest,
its warm-up forwards overlap the round trip through the later stages and T is shorter than that form.

With v > 1 model chunks per stage the same player runs Megatron's interleaved 1F1B (Narayanan et al. SC21,
arXiv:2104.04473, section 2.2): stage i holds the model chunks i, p + i, 2p + i, ..., each 1/v of its work, and runs
(p - i - 1) x 2 + (v - 1) p warm-up forwards. The fill and drain shrink by v (for equal stages the bubble is
(p - 1)/v stage times against m, SC21's (p - 1)/(v m)) while every micro-batch crosses v times as many boundaries.
Interleaved on GPUs, Megatron overlaps these transfers with compute (megatron-core's
`forward_backward_pipelining_with_interleaving` with `overlap_p2p_comm`, on by default in Megatron-LM and in labkit's
driver on NCCL): each send and receive is posted asynchronously and waited for only when its data is needed, so a
stage is not held while its output travels (`overlap_sends`); the sends one stage posts still leave one after the
other, so a stage whose transfers outlast its work is paced by them. gloo and 1F1B without interleaving block.
Without that overlap (gloo on CPUs), the interleaved schedule's steady phase runs each forward and backward as a pair
and only then exchanges with its neighbours in one batched call (`send_forward_backward_recv_forward_backward`): the
forward's output leaves after the backward that follows it, and the next pair starts once both of its inputs have
arrived, so unequal chunks on neighbouring stages pace each other pair by pair (the deeper warm-up, (p - i - 1) x 2,
is what keeps this from adding to the bubble of equal stages).
Chunks need not be equal: where the layers do not split evenly over p x v chunks, Megatron-LM's
--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split give the first chunk of the first
stage and the last chunk of the last one a layer fewer, and --pipeline-model-parallel-layout places any count in each
chunk (labkit.megatron.sizes.chunk_layers); the player then gives each chunk its own share of its stage's time
(`chunk_shares`), the embedding's and the loss's time on the chunks that hold them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from labkit.estimate.calibration import Calibration, Stack, resolve
from labkit.megatron.flops import (SELECTIVE_DEFAULT, attention_core_forward_flops, layer_forward_flops,
                                   logits_forward_flops, recomputed_forward_flops)
from labkit.estimate.memory import LOW_PRECISION, MOE_TOKEN_IMBALANCE, activation_bytes_per_layer, moe_pattern
from labkit.megatron import sizes
from labkit.megatron.shape import Shape
from labkit.estimate.profiles import Profile

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GRAD_REDUCE_BYTES = {"fp32": 4, "bf16": 4, "fp16": 2}  # Megatron reduces bf16 runs' gradients in fp32


def _bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


def allreduce_time(nbytes: float, n: int, gbps: float, latency_s: float) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks on links of `gbps` Gbit/s, `latency_s` per ring step."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / _bytes_per_s(gbps) + 2 * (n - 1) * latency_s


def p2p_time(nbytes: float, gbps: float, latency_s: float) -> float:
    """One point-to-point message (a pipeline send/recv)."""
    return nbytes / _bytes_per_s(gbps) + latency_s if nbytes > 0 else 0.0


def alltoall_time(nbytes: float, n: int, gbps: float, latency_s: float) -> float:
    """All-to-all over `n` ranks, each of which holds `nbytes` spread evenly over all of them (its own share included):
    (n - 1)/n of them leave each rank, at `gbps`, what an all-to-all reaches over the group's links (see
    labkit.estimate.topology.Topology.alltoall_gbps), plus one `latency_s`: NCCL posts the n - 1 sends and receives
    as one group (megatron/core/tensor_parallel/mappings.py, all_to_all: torch.distributed.all_to_all_single)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / _bytes_per_s(gbps) + latency_s


def gather_time(nbytes: float, n: int, gbps: float, latency_s: float) -> float:
    """Ring all-gather over `n` ranks of `nbytes` from each (or its reverse, a reduce-scatter to `nbytes` each): n - 1
    pieces pass each link, n - 1 latency steps; half of an all-reduce of n x nbytes."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * nbytes / _bytes_per_s(gbps) + (n - 1) * latency_s


class ExpertLinks(NamedTuple):
    """The links an MoE layer's token dispatch runs on (Gbit/s): an all-to-all over the expert-parallel group
    (`alltoall_time`'s rate), a ring over each expert's tensor-parallel group (expert_tensor ranks), a ring over the
    expert-tensor x expert group (the allgather dispatcher's)."""
    alltoall_gbps: float
    expert_tensor_gbps: float
    tensor_expert_gbps: float


def expert_dispatch_time(shape: Shape, tokens: float, tensor: int, expert: int, expert_tensor: int | None,
                         precision: str, links: ExpertLinks, latency_s: float, dispatcher: str | None = None,
                         recompute: str | None = None, recompute_modules: tuple[str, ...] | list[str] | None = None
                         ) -> float:
    """Seconds one MoE layer spends moving tokens to and from its experts, forward and backward, for `tokens` tokens
    of one micro-batch on one context rank (each tensor rank holds 1/tensor of them: megatron-core's MoE layer runs
    with sequence parallelism). megatron-core 0.16.1 (megatron/core/transformer/moe/token_dispatcher.py):
    - alltoall (MoEAlltoAllTokenDispatcher): each rank sends each of its tokens to its topk experts' ranks, an
      all-to-all of tokens x topk x hidden activations over the expert-parallel group (token_dispatch), then
      all-gathers what it received over the expert's tensor-parallel ranks (dispatch_postprocess,
      gather_from_sequence_parallel_region); the combine runs the reverse, a reduce-scatter and an all-to-all
      (combine_preprocess, token_combine). The flex dispatcher (DeepEP, HybridEP) fuses the same exchange and sends
      a token once to each rank, and once over the network to each other node (DeepEP) or NVLink domain (HybridEP),
      holding any of its experts:
      timed as alltoall at the rate Topology.alltoall_gbps gives it for that routing (`links.alltoall_gbps`).
    - allgather (MoEAllGatherTokenDispatcher, Megatron-LM's default): every rank all-gathers the tokens (not topk
      copies: each rank picks those of its own experts) over the expert-tensor x expert group, and the combine
      reduce-scatters them back; no topk factor, which is why the MoE README suggests it for large topk.
    The backward runs each collective's reverse (an all-to-all's is an all-to-all, an all-gather's a reduce-scatter),
    full recompute (or selective with the moe module) runs the forward's again. Each rank's traffic is scaled by
    MOE_TOKEN_IMBALANCE (1: drop-less and balanced). megatron-core leaves these transfers exposed unless
    --overlap-moe-expert-parallel-comm (stage_time's `moe_comm_overlap`; the MoE README: "EP All-to-All can consume
    30-40% of training time without optimization").
    0 for a dense model, and without expert or expert-tensor parallelism."""
    if not shape.moe:
        return 0.0
    etp = sizes.expert_tensor_size(tensor, expert_tensor)
    if expert * etp <= 1:
        return 0.0
    local = tokens / tensor  # this rank's share of the sequence
    width = shape.hidden * ACTIVATION_BYTES.get(precision, 2)  # dispatched in the activations' dtype
    if dispatcher == "allgather":
        one = gather_time(local * width * MOE_TOKEN_IMBALANCE, etp * expert, links.tensor_expert_gbps, latency_s)
    else:
        sent = local * shape.topk * MOE_TOKEN_IMBALANCE * width
        one = (alltoall_time(sent, expert, links.alltoall_gbps, latency_s)
               + gather_time(sent, etp, links.expert_tensor_gbps, latency_s))
    forwards = 2 if recompute == "full" or (recompute == "selective" and "moe" in (recompute_modules or ())) else 1
    return 2 * (forwards + 1) * one  # dispatch and combine, each forward (again when recomputed) and backward


def data_parallel_time(params: float, n: int, gbps: float, latency_s: float, *, zero_stage: int = 0,
                       grad_bytes: int = 4, param_bytes: int = 2, forward_s: float = 0.0, backward_s: float = 0.0,
                       micro_batches: int = 1, layers: int = 1, overlap_grad_reduce: bool = False,
                       overlap_param_gather: bool = False, zero3_exposed: float = 0.0) -> tuple[float, float]:
    """(exposed, total) seconds per step of one pipeline stage's data-parallel traffic over `n` ranks, by ZeRO stage;
    `forward_s`, `backward_s`: one micro-batch's compute on the stage, which the overlapped transfers hide behind.
    A reduce-scatter or an all-gather is half a ring all-reduce.
    - 0: one all-reduce of the gradients after the last micro-batch (overlapped with its backward bucket by bucket
      with --overlap-grad-reduce).
    - 1 (the distributed optimizer): a reduce-scatter of the gradients, then an all-gather of the updated parameters
      (during the next forward with --overlap-param-gather), both counted in gradient-sized messages as the fitted
      H100 rows were.
    - 2 (Megatron-FSDP optim_grads): a reduce-scatter of each micro-batch's gradients as its backward produces them
      (megatron_fsdp.py reduces every micro-batch once gradients are sharded, always overlapped), hidden behind that
      backward and the next micro-batch's forward; then the all-gather of the updated 16-bit parameters.
    - 3 (optim_grads_params): per micro-batch, an all-gather of the parameters layer by layer in the forward and again
      in the backward, prefetched behind the computation except the first layer's, and the reduce-scatter of the
      gradients in the backward. Rajbhandari et al.'s 1.5x the all-reduce's volume, per micro-batch; at least
      `zero3_exposed` of it stays exposed (the stack's, Stack.zero3_exposed).
    PyTorch FSDP2 on labkit's driver moves the same: its stage 2 keeps the parameters gathered and gathers the updated
    ones once per step, after the optimizer's (labkit.train.model.gather_zero2_weights).
    """
    reduce_s = allreduce_time(params * grad_bytes, n, gbps, latency_s)
    if zero_stage == 0:
        return (max(0.0, reduce_s - backward_s) if overlap_grad_reduce else reduce_s), reduce_s
    scatter_s = reduce_s / 2
    gather_s = allreduce_time(params * param_bytes, n, gbps, latency_s) / 2 if zero_stage >= 2 else reduce_s / 2
    if zero_stage == 3:
        first = gather_s / max(1, layers)
        exposed = max(first, gather_s - forward_s) + max(first, gather_s + scatter_s - backward_s)
        total = 2 * gather_s + scatter_s
        return micro_batches * max(exposed, zero3_exposed * total), micro_batches * total
    exposed_gather = max(0.0, gather_s - forward_s) if overlap_param_gather else gather_s
    if zero_stage == 2:
        last = max(0.0, scatter_s - backward_s)
        others = (micro_batches - 1) * max(0.0, scatter_s - backward_s - forward_s)
        return last + others + exposed_gather, micro_batches * scatter_s + gather_s
    exposed_scatter = max(0.0, scatter_s - backward_s) if overlap_grad_reduce else scatter_s
    return exposed_scatter + exposed_gather, reduce_s


@dataclass
class StageTime:
    """One micro-batch on one pipeline stage, seconds."""
    forward_s: float      # compute
    backward_s: float     # compute, including any recomputed forward
    tp_comm_s: float      # tensor-parallel all-reduces (forward and backward) not already inside a measured profile
    source: str = "analytic"
    tp_comm_before_overlap_s: float = 0.0  # the same transfers in full, before tp_comm_overlap hides some
    ep_comm_s: float = 0.0  # MoE layers' token dispatch and combine (expert_dispatch_time), exposed

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.tp_comm_s + self.ep_comm_s

    @property
    def backward_share(self) -> float:
        compute = self.forward_s + self.backward_s
        return self.backward_s / compute if compute > 0 else BACKWARD_SHARE


def stage_time(source, layers: int, micro_batch: int, tensor: int = 1, *, shape: Shape, precision: str = "bf16",
               first: bool = False, last: bool = False, recompute: str | None = None, first_layer: int = 0,
               tp_gbps: float | None = None, stack: Stack | str | None = None,
               calibration: Calibration | None = None, flash_attention: bool = False, context: int = 1,
               cp_gbps: float | None = None, tp_comm_overlap: bool = False,
               sequence_parallel: bool = False, expert: int = 1, expert_tensor: int | None = None,
               expert_links: ExpertLinks | None = None, dispatcher: str | None = None,
               recompute_modules: tuple[str, ...] | list[str] | None = None, moe_comm_overlap: bool = False,
               graphed_iteration: bool = False) -> StageTime:
    """Forward + backward of one micro-batch through one pipeline stage.

    `source` is a Profile (measured forward seconds; its time already contains the tensor-parallel all-reduces it
    was measured with) or a GPU (catalog.GPU or its name), for which compute is FLOPs / (peak x efficiency) and the
    tensor-parallel all-reduces (2 forward + 2 backward per layer of b s h activations) are added from `tp_gbps`
    (a bus bandwidth, see `Calibration.bus_gbps`). The stack adds its memory-bound passes (a third in the forward)
    and its fixed cost per all-reduce. Full recompute adds one more forward of the transformer layers to the
    backward; selective re-runs its `recompute_modules` (attention's core by default; the GEMMs of each module,
    labkit.megatron.flops.recomputed_forward_flops, at the layer's rates; norms and activations are charged no
    time), with a recomputed MLP's tensor-parallel all-reduce and a recomputed MoE layer's dispatch again.
    `calibration` (default: the shipped one) gives the efficiency, link fractions and stacks.

    With `flash_attention` no memory-bound pass touches the s x s scores. fp8 runs the linear layers' GEMMs at the
    GPU's FP8 peak and attention's core at bf16. `context` ranks share each sequence: each does 1/context of the
    work and passes its keys and values round a ring (`cp_gbps`), once forward and twice backward per layer. With
    `tp_comm_overlap` the tensor-parallel transfers run beside the GEMMs that produce and consume them (Transformer
    Engine's userbuffers): a fitted fraction of them stays exposed (`Calibration.tp_overlap_exposed`), and all of what
    outlasts the stage's GEMM time. With `sequence_parallel` the LayerNorms and dropouts work on 1/tensor of the
    sequence (fewer memory-bound bytes); each all-reduce becomes an all-gather plus a reduce-scatter, which move the
    same bytes (Korthikanti et al., arXiv:2205.05198, section 4.2.2).

    A mixture-of-experts model: compute is its active FLOPs (labkit.megatron.flops: the router, topk experts and the
    shared experts per token), the model's mean layer; each rank computes its experts on the tokens routed to them,
    topk x its own tokens when balanced, so expert parallelism moves the work between ranks without changing it.
    Its MoE layers keep the tensor-parallel transfers of attention (and of the shared experts) and add the token
    dispatch over the expert groups (`expert_dispatch_time` with `expert`, `expert_tensor`, `expert_links` and the
    model's `dispatcher`), charged as `ep_comm_s`; their memory-bound passes stream an MoE layer's activations.
    With `moe_comm_overlap` (--overlap-moe-expert-parallel-comm) megatron-core's combined 1F1B schedule runs one
    micro-batch's forward beside another's backward, each one's dispatch and combine under the other's compute: only
    what outlasts the stage's compute stays exposed. With `graphed_iteration` (a whole-iteration CUDA graph) the host
    launches nothing per layer, and the MoE layers' launch cost below is not paid.
    """
    cal = resolve(calibration)
    stack = cal.stack(stack)
    tokens = micro_batch * shape.seq_length
    moe_share = sum(moe_pattern(shape)) / shape.num_layers if shape.moe else 0.0
    # layers whose MLP side is tensor-parallel: dense ones, and MoE ones with shared experts
    mlp_share = 1.0 - moe_share * (0.0 if shape.shared_ffn else 1.0)
    ep_comm = 0.0
    if moe_share and layers:
        etp = sizes.expert_tensor_size(tensor, expert_tensor)
        links = expert_links or ExpertLinks(*[tp_gbps or 100.0] * 3)
        ep_comm = layers * moe_share * expert_dispatch_time(shape, tokens / context, tensor, expert, etp, precision,
                                                            links, cal.link_latency_s, dispatcher, recompute,
                                                            recompute_modules)
    layer_flops = layer_forward_flops(shape, tokens)
    core = attention_core_forward_flops(shape, tokens)
    recomputed = recomputed_forward_flops(shape, tokens, recompute, recompute_modules)
    recomputes_core = recompute == "selective" and "core_attn" in (recompute_modules or SELECTIVE_DEFAULT)
    recompute_fraction = recomputed / layer_flops

    if isinstance(source, Profile):
        layer_s, ends_s = source.forward_s(first_layer, layers, micro_batch, embedding=first, output=last)
        comm = 0.0
        if source.tensor != tensor:
            # a profile taken at another tensor size: its compute splits by the ratio; the all-reduces are added
            layer_s *= source.tensor / tensor
            ends_s *= source.tensor / tensor
            comm = _tp_comm(layers, tokens, shape, tensor, precision, recompute, tp_gbps or 100.0, stack,
                            cal.link_latency_s, mlp_share, recompute_modules)
        forward = layer_s + ends_s
        backward = source.backward_factor_at(micro_batch) * forward + recompute_fraction * layer_s
        if moe_comm_overlap:  # see below
            ep_comm = max(0.0, ep_comm - (forward + backward))
        return StageTime(forward, backward, comm, source=f"profile {source.model}/{source.gpu}/tp{source.tensor}",
                         tp_comm_before_overlap_s=comm, ep_comm_s=ep_comm)

    from labkit import catalog

    gpu = source if isinstance(source, catalog.GPU) else catalog.gpu(source)
    rate = gpu.peak(precision) * 1e12 * cal.gemm_efficiency(gpu.name, precision)
    core_rate = gpu.peak("bf16" if precision in LOW_PRECISION else precision) * 1e12 * cal.gpu_efficiency(gpu.name)
    bandwidth = gpu.memory_bw_gb_s * 1e9
    activations = activation_bytes_per_layer(shape, micro_batch, tensor, sequence_parallel and tensor > 1,
                                             precision=precision, flash_attention=flash_attention, context=context)
    if moe_share:  # the model's mean layer
        activations += moe_share * (activation_bytes_per_layer(
            shape, micro_batch, tensor, sequence_parallel and tensor > 1, precision=precision,
            flash_attention=flash_attention, context=context, moe=True, expert_tensor=expert_tensor) - activations)
    memory_s = stack.memory_passes * activations / bandwidth
    # Attention's core: its GEMMs are as thin as a head (d wide), so they run below the layer GEMMs' efficiency; the
    # unfused kernels compute every score, a flash kernel skips the causal mask's upper half.
    head_dim = shape.head_dim
    kernel = "flash" if flash_attention else "unfused"
    attention_rate = core_rate * cal.attention_core_share(kernel, head_dim, gpu)
    core_s = core * (0.5 if flash_attention else 1.0) / attention_rate
    linear_s = (layer_flops - core) / rate
    layer_gemm_s = (linear_s + core_s) / tensor / context
    if recompute == "selective":  # the core at its own rate, the other modules' GEMMs at the layer's
        other = recomputed - (core if recomputes_core else 0.0)
        recompute_fraction = ((core_s if recomputes_core else 0.0) + other / rate) / (linear_s + core_s)
    layer_s = layers * (layer_gemm_s + memory_s / 3) * stack.compute_scale
    ends_s = 0.0
    if last:
        ends_s = logits_forward_flops(shape, tokens) / tensor / context / core_rate
        if stack.memory_passes:  # the cross-entropy reads and writes the fp32 logits, forward and backward
            ends_s += 4 * (4 * tokens * shape.vocab / tensor / context) / 3 / bandwidth
        ends_s *= stack.compute_scale
    forward = layer_s + ends_s
    backward = 2 * forward + recompute_fraction * layer_s
    launch_s = 0.0
    if moe_share and layers and not gpu.is_cpu and not graphed_iteration:
        # megatron-core's alltoall dispatcher copies each layer's tokens-per-expert counts to the host before its
        # all-to-all (token_dispatcher.py, preprocess): the GPU drains, then runs the layer's permutation, grouped GEMMs
        # and their FP8 casts as fast as the host launches them, a cost per micro-batch that grows with the experts a
        # rank holds and not with its tokens (the MoE README's "CPU Overhead Bottleneck"; calibration.yaml says where
        # the rate comes from). A third of it in the forward, as for the compute.
        local_experts = shape.experts / expert
        launch_s = layers * moe_share * local_experts * cal.moe_launch_s(stack, gpu.name)
        forward += launch_s / 3
        backward += 2 * launch_s / 3
    if flash_attention:
        # a flash kernel's backward recomputes the scores (Q K^T) it never stored beside its four other products: 2.5
        # times its forward's FLOPs where the rest of the layer takes 2 (Dao, arXiv:2205.14135, Algorithm 4)
        backward += 0.5 * layers * core_s / tensor / context * stack.compute_scale
    if tp_gbps is None:
        tp_gbps = cal.bus_gbps(cal.intra_node_link(gpu), inter_node=False)
    comm = _tp_comm(layers, tokens // context, shape, tensor, precision, recompute, tp_gbps, stack,
                    cal.link_latency_s, mlp_share, recompute_modules)
    full = comm
    if tp_comm_overlap:
        # the forward and backward GEMMs hide the chunks in flight, all but a fitted fraction (Calibration.
        # tp_overlap_exposed), and at most their own time
        comm = max(cal.tp_overlap_exposed * comm, comm - 3 * layers * layer_gemm_s * stack.compute_scale)
    if context > 1:
        # each rank's K and V chunk (GQA-sized) visits the other context - 1 ranks: a ring of p2p transfers, once
        # forward and twice backward (K, V and their gradients). Transformer Engine's p2p context parallelism
        # (AttnFuncWithCPAndKVP2P) sends the next chunk while attention's core runs on the one held, so a transfer
        # shows only where it outlasts one step of the core (1/context of this rank's share)
        kv = 2 * (tokens / context) * shape.groups * shape.head_dim / tensor
        step = p2p_time(kv * ACTIVATION_BYTES.get(precision, 2), cp_gbps or tp_gbps, cal.link_latency_s)
        core_step_s = core_s / tensor / context / context * stack.compute_scale
        comm += layers * 3 * (context - 1) * max(0.0, step - core_step_s)
        full += layers * 3 * (context - 1) * step
    if moe_comm_overlap:
        # the other micro-batch's forward and backward run while this one's tokens travel (megatron-core's
        # combined_1f1b schedule); the GPU's compute is the cover, the host's launches are not
        ep_comm = max(0.0, ep_comm - (forward + backward - launch_s))
    return StageTime(forward, backward, comm, source=f"analytic {gpu.name}", tp_comm_before_overlap_s=full,
                     ep_comm_s=ep_comm)


def combined(chunks: list[StageTime]) -> StageTime:
    """One pipeline stage's time from its model chunks' (each chunk's layers, the embedding or the loss with them)."""
    return StageTime(sum(c.forward_s for c in chunks), sum(c.backward_s for c in chunks),
                     sum(c.tp_comm_s for c in chunks), source=chunks[0].source,
                     tp_comm_before_overlap_s=sum(c.tp_comm_before_overlap_s for c in chunks),
                     ep_comm_s=sum(c.ep_comm_s for c in chunks))


def _tp_comm(layers: int, tokens: int, shape: Shape, tensor: int, precision: str, recompute: str | None,
             gbps: float, stack: Stack, latency_s: float, mlp_share: float = 1.0,
             recompute_modules: tuple[str, ...] | list[str] | None = None) -> float:
    """Megatron's 2 forward + 2 backward all-reduces of b s h activations per layer (2 more for a recomputed forward,
    1 for a recomputed dense MLP or MoE layer's shared experts): one each for attention and the MLP. `mlp_share`: the
    layers whose MLP side is tensor-parallel (an MoE layer's routed experts exchange their tokens over the expert
    groups instead, see `expert_dispatch_time`; its shared experts are a tensor-parallel MLP)."""
    if tensor <= 1:
        return 0.0
    message = tokens * shape.hidden * ACTIVATION_BYTES.get(precision, 2)
    modules = set(recompute_modules or ()) if recompute == "selective" else set()
    dense_share = 1.0 - sum(moe_pattern(shape)) / shape.num_layers if shape.moe else 1.0
    recomputed_mlps = (dense_share if "mlp" in modules else 0.0) + (
        mlp_share - dense_share if modules & {"moe", "shared_experts"} else 0.0)
    per_layer = (1 + mlp_share) * (2 + (1 if recompute == "full" else 0)) + recomputed_mlps
    return layers * per_layer * (allreduce_time(message, tensor, gbps, latency_s) + stack.tp_allreduce_s)


@dataclass
class PipelineTime:
    """One step's pipeline, seconds, as the schedule plays it out.

    total_s: first operation's start to last operation's end.
    busy_s: the bottleneck stage's own work, m x T_k.
    bubble_s: fill and drain while the bottleneck waits.
    pp_comm_s: sends and receives on the critical path.
    bottleneck_stage: k, the stage with the most work and transfers per micro-batch.
    """
    total_s: float
    busy_s: float
    bubble_s: float
    pp_comm_s: float
    bottleneck_stage: int


class Event(NamedTuple):
    """One forward or backward of one model chunk of one micro-batch on one pipeline stage. Its time includes the
    send that follows it and, with blocking transfers, the receives that hold the stage (see the module docstring).

    stage: the pipeline stage (0 first); chunk: the model chunk on that stage (0 to v - 1, the virtual stage
    chunk x p + stage), 0 without interleaving; micro_batch: 0 to m - 1; op: "forward" or "backward";
    start_s, end_s: seconds from the step's start.
    """
    stage: int
    chunk: int
    micro_batch: int
    op: str
    start_s: float
    end_s: float


def pipeline_time(stage_times: list[float], boundary_times: list[float], num_micro_batches: int,
                  virtual_stages: int = 1, messages: int = 1, backward_shares: list[float] | None = None,
                  wrap_time: float = 0.0, chunk_shares: list[list[float]] | None = None,
                  overlap_sends: bool = False) -> PipelineTime:
    """1F1B (interleaved when virtual_stages > 1) over stages with per-micro-batch times `stage_times` (forward +
    backward) and per-micro-batch, one-way send times `boundary_times` (one per boundary, len = stages - 1), played
    out by `schedule_1f1b`; `messages`: transfers per neighbour per micro-batch in the steady state (k in the
    module's formula); `backward_shares`: each stage's backward as a share of its time (BACKWARD_SHARE where not
    given); `wrap_time`: interleaved only, the send from the last stage back to the first between model chunks;
    `chunk_shares`: interleaved only, each stage's chunks' shares of its time (1/v each where None);
    `overlap_sends`: interleaved only, sends and receives overlap compute (see the module docstring)."""
    p, m, v = len(stage_times), num_micro_batches, max(1, virtual_stages)
    total = schedule_span(stage_times, boundary_times, m, messages, backward_shares, v, wrap_time, chunk_shares,
                          overlap_sends)
    steady = steady_times(stage_times, boundary_times, messages, v, wrap_time, overlap_sends)
    k = max(range(p), key=lambda i: steady[i])
    busy = m * stage_times[k]
    pp_comm = min((m - 1) * (steady[k] - stage_times[k]) + 2 * sum(boundary_times), total - busy)
    return PipelineTime(total_s=total, busy_s=busy, bubble_s=total - busy - pp_comm, pp_comm_s=pp_comm,
                        bottleneck_stage=k)


def steady_times(stage_times: list[float], boundary_times: list[float], messages: int = 1, virtual_stages: int = 1,
                 wrap_time: float = 0.0, overlap_sends: bool = False) -> list[float]:
    """Each stage's time per micro-batch once the pipeline is full: its work and its transfers to both neighbours
    (each model chunk's, interleaved, the wrap-around send included; interleaved and blocking, the longer of a
    pair's two sends, which leave side by side); with `overlap_sends`, the longer of work and transfers."""
    v = max(1, virtual_stages)
    wrap = wrap_time if v > 1 else 0.0
    edges = [wrap, *boundary_times, wrap]
    sends = [messages * _held_by_sends(edges[i], edges[i + 1], v, overlap_sends) for i in range(len(stage_times))]
    if overlap_sends and v > 1:
        return [max(t, out) for t, out in zip(stage_times, sends)]
    return [t + out for t, out in zip(stage_times, sends)]


def _held_by_sends(back_s: float, ahead_s: float, virtual_stages: int, overlap_sends: bool) -> float:
    """A stage's send time per micro-batch once the pipeline is full, with sends of `back_s` to the stage before and
    `ahead_s` to the one after, for each of its `virtual_stages` chunks: one after the other, except in the blocking
    interleaved schedule, whose steady pair sends both side by side (see `_play_1f1b`)."""
    v = max(1, virtual_stages)
    return v * (max(back_s, ahead_s) if v > 1 and not overlap_sends else back_s + ahead_s)


def schedule_span(stage_times: list[float], boundary_times: list[float], num_micro_batches: int, messages: int = 1,
                  backward_shares: list[float] | None = None, virtual_stages: int = 1, wrap_time: float = 0.0,
                  chunk_shares: list[list[float]] | None = None, overlap_sends: bool = False) -> float:
    """First start to last end of `schedule_1f1b`, without playing out every micro-batch of a long step.

    Every operation starts at the max of its inputs' ends plus fixed times, so the schedule is a max-plus linear
    system: once its transient is over, each further micro-batch adds the system's cycle time, here the slowest
    stage's steady time per micro-batch (its work and its transfers) (Heidergott, Olsder and van der Woude, Max Plus
    at Work, 2006, ch. 3). The span is played out for two micro-batch counts p apart that share m's remainder
    modulo p; where they already differ by p cycle times, the rest of the step adds a cycle time per micro-batch.
    Else (the transient lasts longer, or the cycle time is another, as the interleaved schedule's can be) the span is
    played out p micro-batches further at a time until two successive groups add the same time, which the rest of
    the step then adds per group; a step of up to MAX_PLAYED_MICRO_BATCHES is played out whole where no period
    shows, so time and memory stay bounded by the layout, not by the batch.
    """
    p, m, v = len(stage_times), num_micro_batches, max(1, virtual_stages)
    args = (messages, backward_shares, virtual_stages, wrap_time)

    def span(micro_batches: int) -> float:
        return _play_1f1b(stage_times, boundary_times, micro_batches, *args, events=None, chunk_shares=chunk_shares,
                          overlap_sends=overlap_sends)

    start = 2 * p + (m - 2 * p) % p  # at least two groups of warm-up, and m's remainder
    if m <= start + p:
        return span(m)
    cycle = max(steady_times(stage_times, boundary_times, messages, v, wrap_time, overlap_sends))
    first, second = span(start), span(start + p)
    if abs(second - first - p * cycle) <= 1e-9 * second:
        return first + (m - start) * cycle
    if m <= MAX_PLAYED_MICRO_BATCHES:
        return span(m)
    played, group = start + p, second - first
    while played + p < min(m, MAX_PLAYED_MICRO_BATCHES):
        first, second, played = second, span(played + p), played + p
        if abs(second - first - group) <= 1e-9 * second:
            break
        group = second - first
    return second + (m - played) // p * (second - first)  # start, and so played, shares m's remainder modulo p


MAX_PLAYED_MICRO_BATCHES = 4096
"""Longest step schedule_span plays out operation by operation; longer ones are extrapolated from their period."""


def bubble_fraction(events: list[Event]) -> float:
    """Idle share of the stages' time between the first start and the last end of a schedule's events.

    Taught in lab 07.
    """
    stages = max(e.stage for e in events) + 1
    span = max(e.end_s for e in events) - min(e.start_s for e in events)
    busy = sum(e.end_s - e.start_s for e in events)
    return 1 - busy / (stages * span)


# Of a micro-batch's forward + backward, without recompute: the backward computes two GEMMs per forward one.
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Pipeline:
    """What a pipeline's time is computed from; `time()` and `events()` are the same schedule, so a drawing of
    `events()` ends where the estimate's pipeline time does.

    stage_times_s: forward + backward of one micro-batch per stage (all its model chunks).
    boundary_times_s: one send between stage i and i + 1.
    num_micro_batches: m.
    virtual_stages: model chunks per stage (v); > 1 plays out Megatron's interleaved 1F1B.
    messages: blocking transfers per neighbour per micro-batch (k in the module docstring).
    backward_shares: each stage's backward as a share of its time; BACKWARD_SHARE where None.
    wrap_time_s: interleaved only, one send from the last stage to the first (chunk c to chunk c + 1).
    chunk_shares: interleaved only, each stage's model chunks' shares of its time, [stage][chunk] (chunk c of stage i
        is virtual stage c x p + i); None: 1/v each, the even split.
    overlap_sends: interleaved only, sends and receives overlap compute, as Megatron's interleaved schedule does on
        GPUs (see the module docstring); False: each send holds its stage.
    """
    stage_times_s: tuple[float, ...]
    boundary_times_s: tuple[float, ...]
    num_micro_batches: int
    virtual_stages: int = 1
    messages: int = 1
    backward_shares: tuple[float, ...] | None = None
    wrap_time_s: float = 0.0
    chunk_shares: tuple[tuple[float, ...], ...] | None = None
    overlap_sends: bool = False

    def time(self) -> PipelineTime:
        return pipeline_time(list(self.stage_times_s), list(self.boundary_times_s), self.num_micro_batches,
                             self.virtual_stages, self.messages,
                             list(self.backward_shares) if self.backward_shares else None, self.wrap_time_s,
                             self._shares(), self.overlap_sends)

    def events(self) -> list[Event]:
        """Every forward and backward of every model chunk, ordered by end time; see `schedule_1f1b`."""
        return schedule_1f1b(list(self.stage_times_s), list(self.boundary_times_s), self.num_micro_batches,
                             self.messages, list(self.backward_shares) if self.backward_shares else None,
                             self.virtual_stages, self.wrap_time_s, self._shares(), self.overlap_sends)

    def _shares(self) -> list[list[float]] | None:
        return [list(row) for row in self.chunk_shares] if self.chunk_shares else None


def pipeline_lower_bound(stage_times: list[float], boundary_times: list[float], num_micro_batches: int,
                         virtual_stages: int = 1, messages: int = 1,
                         chunk_shares: list[list[float]] | None = None, overlap_sends: bool = False) -> float:
    """A bound that pipeline_time never goes below, in O(stages): some stage k cannot start before the first
    micro-batch's first-chunk forwards (and sends) before it are done, then does m forwards and backwards of all its
    chunks with their sends, and its last gradient (a first-chunk backward) still has to go back through the stages
    before it. `messages` and the interleaved wrap-around send only lengthen the schedule, so the bound leaves them
    out. `chunk_shares` and `overlap_sends` as in `pipeline_time`: with overlap, a stage's work and its sends run
    side by side."""
    m, v = num_micro_batches, max(1, virtual_stages)
    send = [0.0, *boundary_times, 0.0]
    best = upstream = 0.0
    for k, t in enumerate(stage_times):
        sends = _held_by_sends(send[k], send[k + 1], v, overlap_sends)
        best = max(best, upstream + m * (max(t, sends) if overlap_sends and v > 1 else t + sends))
        first_chunk = t * chunk_shares[k][0] if chunk_shares else t / v
        upstream += first_chunk + send[k + 1] + send[k]  # a first-chunk forward with its send, later its backward
    return best


def _warmup(stage: int, stages: int, micro_batches: int, chunks: int) -> int:
    """The forwards a stage runs before its first backward (megatron.core.pipeline_parallel.schedules)."""
    if chunks == 1:
        return min(stages - stage - 1, micro_batches)
    return min((stages - stage - 1) * 2 + (chunks - 1) * stages, micro_batches * chunks)


@functools.lru_cache(maxsize=4096)
def _stage_order(stage: int, stages: int, micro_batches: int, chunks: int) -> tuple[tuple[bool, int, int], ...]:
    """(is_forward, micro_batch, chunk) in the order Megatron's 1F1B (chunks 1) or interleaved 1F1B runs them on a
    stage (megatron.core.pipeline_parallel.schedules): warm-up forwards, then one forward and one backward, then the
    remaining backwards. Interleaved, micro-batches go through the chunks in groups of `stages`, forwards from the
    first chunk to the last and backwards from the last to the first. Cached: a plan plays the same orders out for
    many layouts."""
    total = micro_batches * chunks

    def op(forward: bool, k: int) -> tuple[bool, int, int]:
        chunk = (k // stages) % chunks
        return forward, (k // (stages * chunks)) * stages + k % stages, chunk if forward else chunks - 1 - chunk

    warmup = _warmup(stage, stages, micro_batches, chunks)
    order = [op(True, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op(True, warmup + k), op(False, k)]
    order += [op(False, k) for k in range(total - warmup, total)]
    return tuple(order)


def schedule_1f1b(stage_times: list[float], boundary_times: list[float], num_micro_batches: int,
                  messages: int = 1, backward_shares: list[float] | None = None, virtual_stages: int = 1,
                  wrap_time: float = 0.0, chunk_shares: list[list[float]] | None = None,
                  overlap_sends: bool = False) -> list[Event]:
    """Every forward and backward of one 1F1B step (interleaved when virtual_stages > 1), ordered by end time.

    Each stage runs its operations in Megatron's order (`_stage_order`); an operation starts when its stage is free
    and its input has arrived: a forward needs the previous model chunk's forward of the micro-batch (chunk c on stage
    i follows chunk c on stage i - 1, and chunk c on the last stage feeds chunk c + 1 on the first over `wrap_time`),
    a backward the next chunk's backward (or, on the model's last chunk, its own forward). A chunk's work is its
    share of its stage's (`chunk_shares[stage][chunk]`, 1/v each where None); its time includes the send that follows
    it (see the module docstring), unless `overlap_sends` (interleaved only): then the send leaves after the work,
    behind the stage's earlier sends, while the stage moves on.
    """
    events: list[Event] = []
    _play_1f1b(stage_times, boundary_times, num_micro_batches, messages, backward_shares, virtual_stages, wrap_time,
               events, chunk_shares, overlap_sends)
    events.sort(key=lambda e: e.end_s)
    return events


def _play_1f1b(stage_times: list[float], boundary_times: list[float], num_micro_batches: int, messages: int,
               backward_shares: list[float] | None, virtual_stages: int, wrap_time: float,
               events: list[Event] | None, chunk_shares: list[list[float]] | None = None,
               overlap_sends: bool = False) -> float:
    """Play `schedule_1f1b` out; appends each operation to `events` unless it is None. Returns the last end."""
    p, m, v = len(stage_times), num_micro_batches, max(1, virtual_stages)
    if len(boundary_times) != max(0, p - 1):
        raise ValueError(f"boundary_times: need {max(0, p - 1)} values (one per stage boundary), got {len(boundary_times)}")
    if v > 1 and m % p:
        raise ValueError(f"the interleaved schedule needs the micro-batch count ({m}) to be a multiple of stages in "
                         f"the pipeline ({p})")
    shares = backward_shares or [BACKWARD_SHARE] * p
    if chunk_shares is not None and (len(chunk_shares) != p or any(len(row) != v for row in chunk_shares)):
        raise ValueError(f"chunk_shares: need {p} rows (one per stage) of {v} shares (one per model chunk)")
    split = chunk_shares or [[1 / v] * v] * p
    send = [0.0, *boundary_times, 0.0]  # send[i]: the link between stage i - 1 and stage i
    last = p * v - 1                    # the model's last chunk, as a virtual stage u = chunk x p + stage
    hold = messages - 1                 # receives beyond the first that hold a busy receiver
    # link[u]: the send between virtual stage u and u + 1 (none after the model's last chunk)
    link = [send[u % p + 1] if u % p < p - 1 else (wrap_time if u < last else 0.0) for u in range(p * v)]
    # [u]: one forward (backward) of virtual stage u = chunk x p + stage, its chunk's share of the stage's work
    forward_work = [stage_times[u % p] * (1 - shares[u % p]) * split[u % p][u // p] for u in range(p * v)]
    backward_work = [stage_times[u % p] * shares[u % p] * split[u % p][u // p] for u in range(p * v)]
    forward_done = [[None] * m for _ in range(p * v)]   # [u][j]: when virtual stage u's forward of j ended
    backward_done = [[None] * m for _ in range(p * v)]
    orders = [_stage_order(i, p, m, v) for i in range(p)]
    warmups = [_warmup(i, p, m, v) for i in range(p)]
    position, free = [0] * p, [0.0] * p
    overlap = overlap_sends and v > 1
    paired = v > 1 and not overlap_sends  # the steady phase's forward + backward, then one batched exchange
    sent = [0.0] * p  # overlapped: when the stage's last posted send has left
    held: list[tuple[int, int, float] | None] = [None] * p  # paired: the forward whose output waits for its backward
    remaining = 2 * p * m * v

    def input_of(forward: bool, u: int, j: int) -> tuple[float | None, float]:
        """When virtual stage u's input for micro-batch j arrived (None: not yet), and the link it came over."""
        if forward:
            return (0.0, 0.0) if u == 0 else (forward_done[u - 1][j], link[u - 1])
        return (forward_done[u][j], 0.0) if u == last else (backward_done[u + 1][j], link[u])
    while remaining:
        progressed = False
        for i in range(p):
            order = orders[i]
            while position[i] < len(order):
                forward, j, c = order[position[i]]
                u = c * p + i
                arrived, into = input_of(forward, u, j)
                work = forward_work[u] if forward else backward_work[u]
                out = link[u] if forward else (link[u - 1] if u > 0 else 0.0)
                if arrived is None:
                    break
                steady = position[i] - warmups[i]  # the steady phase alternates forward, backward from here
                pairs_with = (order[position[i] + 1] if paired and forward and 0 <= steady < 2 * (m * v - warmups[i])
                              else None)
                if pairs_with is not None:  # the pair's backward input came in the same exchange as this input
                    _, k, c_back = pairs_with
                    if not (c_back * p + i == last and (u, j) == (last, k)):  # else: the loss of this very forward
                        paired_input, _ = input_of(False, c_back * p + i, k)
                        if paired_input is None:
                            break
                        arrived = max(arrived, paired_input)
                start = max(free[i], arrived - hold * into) + hold * into
                end = start + work
                if overlap:  # the output leaves behind the stage's earlier sends; the stage moves on
                    sent[i] = max(sent[i], end) + out
                    delivered = sent[i]
                elif pairs_with is not None and u != last:  # the output leaves with the backward's, after it
                    delivered = None
                    held[i] = (u, j, out)
                elif held[i] is not None:  # this backward closes a pair: both outputs leave now, side by side
                    held_u, held_j, held_out = held[i]
                    forward_done[held_u][held_j] = end + held_out
                    held[i] = None
                    delivered = end + out
                    end += max(out, held_out)
                else:
                    end = delivered = end + out
                (forward_done if forward else backward_done)[u][j] = delivered
                free[i] = end
                if events is not None:
                    events.append(Event(i, c, j, "forward" if forward else "backward", start, end))
                position[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked; stage orders are inconsistent")
    return max(free)


def optimizer_step_time(params: float, memory_bw_gb_s: float, precision: str = "bf16") -> float:
    """Adam's update streams weights, gradient, master copy and both moments through memory once each way.

    Bytes per parameter read + written: fp32 (4+4+4+4) + (4+4+4); mixed (2+4+4+4+4) + (2+4+4+4).
    """
    per_param = 28 if precision == "fp32" else 32
    return params * per_param / (memory_bw_gb_s * 1e9)

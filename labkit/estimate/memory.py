"""Memory per GPU of each pipeline stage: weights, gradients, optimizer state and activations. Sizes in GiB (2^30 bytes,
what nvidia-smi and the GPU catalog call GB).

Model state, bytes per parameter (Megatron-LM README "Distributed Optimizer", commit 01ad96e51b; Adam):
    fp32          4 weight + 4 grad + 8 (m, v)                              = 16, distributed optimizer 8 + 8/d
    bf16 mixed    2 weight + 4 fp32 grad + 12 (fp32 master, m, v)          = 18, distributed optimizer 6 + 12/d
    fp16 mixed    2 weight + 2 grad + 16 (fp32 master, fp32 grad, m, v)    = 20, distributed optimizer 4 + 16/d
bf16 with --grad-reduce-in-bf16 keeps bf16 gradients and counts as fp16 does. megatron-core 0.16 shards the
distributed optimizer over data x context ranks (d above is their product) and pads DDP's buffers: `model_state_bytes`
counts the bytes exactly as it allocates them (tests/test_memory_vs_megatron_core.py checks it against the real
objects).
ZeRO (Rajbhandari et al., arXiv 1910.02054) counts mixed-precision Adam as 2 + 2 + 12 = 16: stage 1 -> 4 + 12/d,
stage 2 -> 2 + 14/d, stage 3 -> 16/d, which is what DeepSpeed's engine holds. SGD keeps one momentum instead of
Adam's two moments (4 bytes fewer). Megatron's own stages keep Megatron's dtypes: stage 1 is the distributed
optimizer above (bf16: 6 + 12/d); stages 2 and 3 are Megatron-FSDP on Megatron-LM (bf16: 2 + 16/d, then 18/d, plus the
unsharded buffers it works in while a layer computes: `fsdp_model_state_bytes`) and PyTorch FSDP2 on labkit's driver
(bf16: 20/d at both stages between steps, its gathered layers beside: `torch_fsdp2_model_state_bytes`).

Activations per transformer layer per micro-batch, 16-bit (Korthikanti et al., arXiv 2205.05198, Table 2):
    no recompute         s b h (10 + 24/t + 5 a s/(h t))      (t = 1 gives 34 + 5as/h)
    + sequence parallel  s b h (34 + 5 a s/h) / t
    selective recompute  s b h (10 + 24/t), with SP 34 s b h / t
    full recompute       2 s b h per layer (/t with SP), plus one layer's full activations while it is recomputed
`activation_bytes_per_layer` counts the tensors megatron-core 0.16.1 really saves, term by term, which gives the table
for a GPT layer with Megatron-LM's fused kernels (plus the norms' fp32 statistics) and departs from it where the
layer departs: SwiGLU (the fused kernel keeps the 2f-wide input and the MLP-out GEMM the f-wide product, 6 f/h),
rotary embeddings and grouped K/V (Q, K and V as the core attention keeps them), flash attention (no scores), FP8
(1-byte GEMM inputs), fp32 (4-byte activations, 1-byte masks), dropout 0 (no masks), and the CPU's unfused kernels.
tests/test_activation_memory.py counts the bytes on the CPU and finds it within 2%.
Mixture of experts (megatron-core's MoELayer; the MoE README's memory table, megatron/core/transformer/moe/README.md:
"EP ... Weight Memory 1/N in MoELayer", activations "~1 (varies with EP balancing)"): a rank holds num_experts /
expert of each MoE layer's experts, each split over expert_tensor ranks, beside the dense parameters split over the
tensor ranks as before; with expert parallelism DDP keeps the experts in a buffer of their own whose gradients and
distributed-optimizer state shard over the expert-data-parallel ranks, world / (expert_tensor x expert x pipeline)
(megatron/core/distributed/distributed_data_parallel.py, `expert_parallel_params`, intra_expt_dp_group). An MoE
layer's activations add the router's scores, topk copies of each token dispatched to the experts (drop-less and
balanced: MOE_TOKEN_IMBALANCE, the capacity factor of GShard, arXiv:2006.16668, and Switch, arXiv:2101.03961, when
above 1) and the experts' intermediate activations, and the shared experts' (DeepSeekMoE, arXiv:2401.06066).
Under 1F1B stage i holds min(p - i, m) micro-batches in flight; the interleaved schedule multiplies the first stage's
count by 1 + (p - 1)/(p v). The first stage adds the token ids and positions (8 s b per micro-batch) and the embedding
dropout mask (s b h, with dropout), the last stage the fp32 logits, 4 s b h (1 + V/h) / t.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from labkit.estimate.params import stage_params
from labkit.megatron.flops import SELECTIVE_DEFAULT
from labkit.megatron.shape import Shape
from labkit.megatron import sharding, sizes

# numpy loads with the first buffer laid out, not with this module: the command line imports it (through
# labkit.estimate) to build its parser, and `labkit --help` needs none of it.
if TYPE_CHECKING:
    import numpy as np

GIB = 2 ** 30

# Bytes per parameter: (weight, gradient, optimizer state); the optimizer share is what the distributed optimizer splits.
_MODEL_STATE = {
    "fp32": (4, 4, 8),
    "bf16": (2, 4, 12),
    "fp16": (2, 2, 16),
    # FP8, MXFP8 and NVFP4 train under --bf16: bf16 weights with fp32 gradients and master copy; what Transformer
    # Engine holds of the linear layers' weights in low precision is FP8Weights' (GPUs only)
    "fp8": (2, 4, 12),
    "mxfp8": (2, 4, 12),
    "nvfp4": (2, 4, 12),
}
LOW_PRECISION = ("fp8", "mxfp8", "nvfp4")
"""Precisions whose GEMMs run on 8- or 4-bit inputs inside bf16 training (Transformer Engine's recipes): bf16
weights (beside or, with FP8 parameters, in place of their quantized copies: FP8Weights) and non-GEMM work, 1-byte
GEMM inputs kept for the backward (FP8 and MXFP8; NVFP4's backward GEMMs run in
MXFP8 or bf16, and its saved inputs are counted at a byte too)."""
_ZERO_MIXED = (2, 2, 12)


@lru_cache(maxsize=256)
def moe_pattern(shape: Shape) -> tuple[int, ...]:
    """shape.moe_layers (1 for each MoE layer, 0 for each dense one), worked out once per shape: the planner asks for
    it per layer and layout."""
    return shape.moe_layers


@dataclass
class StageMemory:
    """One GPU of one pipeline stage, in GiB."""
    weights: float
    gradients: float
    optimizer: float
    activations: float
    in_flight: float  # micro-batches whose activations are held at the peak
    step_only: float = 0.0
    """Of `optimizer`, what only the optimizer step holds (ModelState.step_only): its fp32 working copies, freed
    before the next forward, so that they and the activations are never held at once."""
    step_transient: float = 0.0
    """Of `step_only`, what the step itself frees as it ends (Transformer Engine's FusedAdam's fp32 working copies);
    the rest, megatron-core's fp32 copies of 16-bit gradients, is held until the next zero_grad."""
    evaluation: float = 0.0
    """What a validation forward holds: one layer's activations and, on the last stage, the logits. Megatron-LM's
    evaluate and labkit's driver's run it after an optimizer step, before the next zero_grad frees the step's gradient
    copies; 0 without train.eval_interval."""

    @property
    def forward_backward(self) -> float:
        """The forward and backward passes: the model state without the step's copies, and the activations."""
        return self.weights + self.gradients + self.optimizer - self.step_only + self.activations

    @property
    def optimizer_step(self) -> float:
        """The optimizer step and what follows it until the next zero_grad: all the model state, then, without the
        step's own working copies, an evaluation's forward where the run evaluates."""
        return self.weights + self.gradients + self.optimizer + max(0.0, self.evaluation - self.step_transient)

    @property
    def total(self) -> float:
        """The peak: the larger of the two phases."""
        return max(self.forward_backward, self.optimizer_step)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def bytes_per_param(precision: str, data_parallel: int = 1, distributed_optimizer: bool = False, zero_stage: int = 0,
                    optimizer: str = "adam", grad_reduce_in_bf16: bool = False,
                    context: int = 1, optimizer_dtypes: OptimizerDtypes | None = None) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter on one GPU, the table's idea without megatron-core's padding
    (`model_state_bytes` has it). The distributed optimizer shards over data x context ranks; `grad_reduce_in_bf16`
    (Megatron-LM's --grad-reduce-in-bf16) keeps bf16 gradients, and the step fp32 copies of them, as fp16 does;
    `optimizer_dtypes` (the precision-aware optimizer, with the distributed optimizer) stores the optimizer's part in
    its dtypes (OptimizerDtypes).

    Taught in labs 02 and 09.
    """
    if precision not in _MODEL_STATE:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(_MODEL_STATE)}")
    d = max(1, data_parallel)
    if zero_stage:
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage: {zero_stage} is not 0, 1, 2 or 3")
        weight, grad, opt = _MODEL_STATE["fp32"] if precision == "fp32" else _ZERO_MIXED
        if optimizer == "sgd":
            opt -= 4
        return (weight / d if zero_stage == 3 else weight, grad / d if zero_stage >= 2 else grad, opt / d)
    if optimizer_dtypes is not None:
        weight, grad, opt, _ = _state_dtypes(precision, grad_reduce_in_bf16, optimizer, optimizer_dtypes)
        return weight, grad, opt / (d * max(1, context))
    weight, grad, opt = _MODEL_STATE[precision]
    if grad_reduce_in_bf16 and precision in ("bf16", *LOW_PRECISION):
        grad, opt = 2, opt + 4
    if optimizer == "sgd":
        opt -= 4
    return weight, grad, opt / (d * max(1, context)) if distributed_optimizer else opt


# --- Model state as megatron-core 0.16.1 allocates it -----------------------------------------------------------------
# The table above is the idea; the bytes a rank holds differ in three ways, each followed exactly below:
# - DDP (megatron/core/distributed/param_and_grad_buffer.py, _ParamAndGradBuffer) keeps every gradient of a model
#   chunk in one contiguous buffer, fp32 when grad_reduce_in_fp32 (Megatron-LM: bf16 unless --grad-reduce-in-bf16;
#   fp16 keeps 16-bit gradients unless --accumulate-allreduce-grads-in-fp32), else in the parameters' dtype. With the
#   distributed optimizer the 16-bit parameters move into a buffer of the same layout, each parameter starts at a
#   multiple of 64 elements and each bucket is padded to a multiple of lcm(data x context ranks, 128).
# - The distributed optimizer (megatron/core/optimizer/distrib_optimizer.py) gives each rank of the data x context
#   group (get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True), optimizer/__init__.py)
#   one equal slice of every bucket, and keeps fp32 main parameters and Adam's moments for the parameter elements
#   inside it: the padding costs weights and gradients, never optimizer state, so slices differ by a few elements.
# - A 16-bit gradient buffer makes the optimizer step allocate fp32 copies of the gradients it updates
#   (`main_param.grad = model_grad.float()`, optimizer.py and distrib_optimizer.py); they are counted with the
#   optimizer state as Megatron-LM's README counts them, and held from the step to the next iteration's zero_grad,
#   which sets them to None (set_to_none, _zero_grad_group_helper) before its forward: Megatron-LM's train_step and
#   labkit's driver call it first thing. So they never coexist with activations (ModelState.step_only).
# Not counted: the scalar Adam step counters and fp16 loss-scaler scalars (a few bytes per tensor).
PARAM_ALIGNMENT = 64
"""With the distributed optimizer each parameter starts at a multiple of 64 elements (128 bytes of 16-bit values)."""
BUCKET_ALIGNMENT = 128
"""... and each bucket ends at a multiple of lcm(data x context ranks, 128) elements, so it splits evenly."""
DEFAULT_BUCKET_ELEMENTS = 40_000_000
"""DDP's bucket size with --overlap-grad-reduce: max(40M, 1M x data-parallel ranks) elements
(distributed_data_parallel.py); without overlap each chunk's buffer is one bucket."""


@dataclass(frozen=True)
class ModelState:
    """Bytes of model state one GPU holds, as megatron-core allocates them."""
    weights: int
    """The parameters: with the distributed optimizer DDP's padded parameter buffer, else the parameters themselves."""
    gradients: int
    """DDP's gradient buffers (`grad_data`), padded like the parameter buffer."""
    optimizer: int
    """For the parameter elements this rank updates: fp32 main parameters (16-bit training), Adam's exp_avg and
    exp_avg_sq (SGD's momentum), and fp32 copies of 16-bit gradients."""
    step_only: int = 0
    """Of `optimizer`, the step's fp32 working copies: megatron-core's of 16-bit gradients, freed by the next
    iteration's zero_grad before its forward (see the notes above), and the precision-aware optimizer's of its
    low-precision states (`step_transient`)."""
    step_transient: int = 0
    """Of `step_only`, what the step frees as it ends: Transformer Engine's FusedAdam's working copies (local to its
    step)."""
    weights_working: int = 0
    """Of `weights`, Megatron-FSDP's temporary unsharded parameters (ZeRO-3): the layers all-gathered for the one
    being computed and those prefetched."""
    gradients_working: int = 0
    """Of `gradients`, Megatron-FSDP's temporary unsharded gradient buckets (ZeRO-2 and 3) awaiting reduce-scatter."""


def _layer_parameters(shape: Shape, layer: int, tensor: int, expert: int, expert_tensor: int) -> tuple[
        list[tuple[int, int]], list[tuple[int, int]]]:
    """(the parameters of transformer layer `layer` that DDP keeps in its dense buffer, those it keeps in its expert
    buffer), each in registration order, as (elements on one rank, rows: the first dimension, which FSDP2 shards).

    Attention (megatron-core's SelfAttention): input norm, output projection (row-parallel), QKV (heads x head_dim
    queries, 2 x groups x head_dim keys and values, column-parallel), Qwen3's per-head query and key norms. The MLP
    side: its norm, then a dense MLP, or an MoE layer (megatron-core's MoELayer registers its router, then its
    experts, then its shared experts): the router's experts x hidden weight (replicated), each of this rank's
    num_experts / expert experts as Transformer Engine's grouped linear layers register them (every local expert's
    fc1 weight, then every one's fc2 weight, each split over the expert-tensor ranks), and the shared experts as a
    dense MLP split over the tensor ranks. The experts' parameters go to the expert buffer when expert parallelism is
    on: their `allreduce` attribute is False only then (megatron/core/extensions/transformer_engine.py,
    TEGroupedLinear: `not (is_expert and self.expert_parallel)`, expert_parallel being expert size > 1), and DDP
    gives such parameters a buffer of their own over the expert-data-parallel group (distributed_data_parallel.py,
    `expert_parallel_params`)."""
    h, t, d = shape.hidden, tensor, shape.head_dim
    norm = [(h, h)] if shape.norm == "RMSNorm" else [(h, h), (h, h)]
    head_norm = [(d, d)] if shape.norm == "RMSNorm" else [(d, d), (d, d)]
    bias = (lambda n: [(n, n)]) if shape.bias else (lambda n: [])
    qkv = d * (shape.heads + 2 * shape.groups) // t
    attention = [*norm, (shape.heads * d * h // t, h), *bias(h), (qkv * h, qkv), *bias(qkv)]
    if shape.qk_layernorm:
        attention += head_norm * 2

    def fc1(width: int, split: int) -> list[tuple[int, int]]:  # column-parallel: 2 x width under SwiGLU
        width_in = (2 if shape.swiglu else 1) * width // split
        return [(width_in * h, width_in), *bias(width_in)]

    def fc2(width: int, split: int) -> list[tuple[int, int]]:  # row-parallel, its bias whole
        return [(h * width // split, h), *bias(h)]

    def mlp(width: int, split: int) -> list[int]:
        return fc1(width, split) + fc2(width, split)

    if not moe_pattern(shape)[layer]:
        return attention + norm + mlp(shape.ffn_size, t), []
    local = shape.experts // expert
    experts = fc1(shape.expert_ffn_size, expert_tensor) * local + fc2(shape.expert_ffn_size, expert_tensor) * local
    dense = attention + norm + [(shape.experts * h, shape.experts)]
    shared = mlp(shape.shared_ffn, t) if shape.shared_ffn else []
    if expert > 1:
        return dense + shared, experts
    return dense + experts + shared, []


def chunk_parameters(shape: Shape, layers: int, tensor: int = 1, pre_process: bool = True, post_process: bool = True,
                     pipeline: int = 1, *, first_layer: int = 0, expert: int = 1,
                     expert_tensor: int | None = None) -> list[tuple[int, bool]]:
    """(elements, shared embedding) of each parameter of one model chunk on one tensor rank that DDP keeps in its
    (dense) buffer, in the order megatron-core's GPTModel with the local layer spec registers them: word and position
    embeddings (first chunk), per layer the input norm, attention projection, QKV, MLP norm, MLP in and out (weights
    before biases; an MoE layer's router, experts and shared experts, see `_layer_parameters`), then the final norm
    and output layer (last chunk). The chunk holds layers first_layer .. first_layer + layers - 1 (which of them are
    MoE: shape.moe_layers). With tied embeddings over several stages the word embedding and its copy in the output
    layer are flagged `shared_embedding` (LanguageModule.setup_embeddings_and_output_layer): DDP buckets them alone.
    Transformer Engine's layers fuse each norm into the next linear layer: the same tensors, registered in another
    order, which moves where a few alignment gaps fall but not the buffer's size. With expert parallelism (`expert`
    > 1) the experts' weights are not here but in `chunk_expert_parameters`."""
    h, t = shape.hidden, tensor
    etp = sizes.expert_tensor_size(tensor, expert_tensor)
    vocab = shape.padded_vocab(t) // t
    shared = shape.tied and pipeline > 1
    sizes_ = []
    if pre_process:
        sizes_.append((vocab * h, shared and not post_process))
        if shape.positions == "learned_absolute":
            sizes_.append((shape.seq_length * h, False))
    if not shape.moe:  # every layer alike
        sizes_ += [(n, False) for n, _ in _layer_parameters(shape, 0, t, 1, etp)[0]] * layers
    else:
        for layer in range(first_layer, first_layer + layers):
            sizes_ += [(n, False) for n, _ in _layer_parameters(shape, layer, t, expert, etp)[0]]
    if post_process:
        sizes_ += [(n, False) for n in ([h] if shape.norm == "RMSNorm" else [h, h])]
        if not shape.tied or not pre_process:
            sizes_.append((vocab * h, shared))
    return sizes_


def chunk_expert_parameters(shape: Shape, layers: int, *, first_layer: int = 0, expert: int = 1,
                            expert_tensor: int = 1) -> list[tuple[int, bool]]:
    """(elements, False) of each parameter of one model chunk on one rank that DDP keeps in its expert buffer: the
    local experts of its MoE layers when expert parallelism is on (`_layer_parameters`), none otherwise."""
    if not shape.moe or expert <= 1:
        return []
    out = []
    for layer in range(first_layer, first_layer + layers):
        out += [(n, False) for n, _ in _layer_parameters(shape, layer, 1, expert, expert_tensor)[1]]
    return out


@lru_cache(maxsize=4096)
def _layer_linear_weights(shape: Shape, layer: int, tensor: int, expert: int, expert_tensor: int) -> int:
    """Elements on one rank of transformer layer `layer`'s linear layers' weights: attention's QKV and output
    projection, the dense MLP's or the local experts' and shared experts' fc1 and fc2, the GEMMs Transformer Engine
    runs in FP8. Read off `_layer_parameters`: its two-dimensional parameters (more elements than rows) but the
    router's, which megatron-core keeps as a plain parameter outside Transformer Engine."""
    dense, experts = _layer_parameters(shape, layer, tensor, expert, expert_tensor)
    router = shape.experts * shape.hidden if moe_pattern(shape)[layer] else 0
    return sum(n for n, rows in dense + experts if n > rows) - router


def linear_weight_elements(shape: Shape, layers: int, *, first_layer: int = 0, tensor: int = 1, expert: int = 1,
                           expert_tensor: int | None = None) -> int:
    """`_layer_linear_weights` over a model chunk's layers first_layer .. first_layer + layers - 1 (the embedding and
    output layer are megatron-core's own, outside Transformer Engine: never FP8)."""
    etp = sizes.expert_tensor_size(tensor, expert_tensor)
    if not shape.moe:
        return layers * _layer_linear_weights(shape, 0, tensor, 1, etp)
    return sum(_layer_linear_weights(shape, layer, tensor, expert, etp)
               for layer in range(first_layer, first_layer + layers))


def stage_linear_weight_elements(shape: Shape, chunks: list[int], first_layers: list[int], *, tensor: int = 1,
                                 expert: int = 1, expert_tensor: int | None = None) -> int:
    """`linear_weight_elements` over a stage's model chunks (`chunks` their layers, `first_layers` their first)."""
    return sum(linear_weight_elements(shape, layers, first_layer=first, tensor=tensor, expert=expert,
                                      expert_tensor=expert_tensor) for first, layers in zip(first_layers, chunks))


@dataclass(frozen=True)
class FP8Weights:
    """What Transformer Engine holds of the linear layers' weights under FP8, MXFP8 or NVFP4 on GPUs. Without
    --fp8-param-gather the weights stay bf16 and each TE layer keeps its quantized copy from one micro-batch to the
    next (megatron-core passes is_first_microbatch, and TE's Linear caches the cast as a "weight" workspace, refreshed
    on the first micro-batch of each step): both are held. With it the model is built under TE's fp8_model_init and
    the quantized weight is the parameter, cast from the distributed optimizer's fp32 master after each step: no bf16
    copy (Megatron-LM's help: "Keep the compute param in fp8"). Under MXFP8 the bf16 values it gathers live in the
    gradient buffer (--reuse-grad-buf-for-mxfp8-param-ag). Sizes as Transformer Engine's maintainers give them (github
    NVIDIA/TransformerEngine issue 1880): FP8 1 byte a weight where FP8 GEMMs take any layout, 2 with the transpose
    Hopper's TN-only GEMMs need; MXFP8 2, a copy in each of its two block layouts, each with an 8-bit scale per 32
    elements; NVFP4 two 4-bit copies, each with an 8-bit scale per 16. Per-tensor scales and amax histories are not
    counted."""
    quantized: float
    """Bytes per weight element of the quantized copy."""
    replaces_bf16: bool
    """--fp8-param-gather: the quantized weight is the parameter, no bf16 copy beside it."""

    @classmethod
    def of(cls, precision: str, fp8_param_gather: bool, any_layout: bool) -> FP8Weights | None:
        """For a precision (None outside FP8, MXFP8 and NVFP4), whether the run keeps FP8 parameters
        (labkit.megatron.sharding.fp8_param_gather), and whether its GPUs' FP8 GEMMs take any layout
        (catalog.GPU.fp8_gemm_any_layout: Blackwell)."""
        if precision not in LOW_PRECISION:
            return None
        quantized = {"fp8": 1.0 if any_layout else 2.0, "mxfp8": 2 * (1 + 1 / 32), "nvfp4": 2 * (0.5 + 1 / 16)}
        return cls(quantized[precision], fp8_param_gather and precision != "nvfp4")

    def bytes_per_element(self, param_bytes: int) -> float:
        """What one linear weight element holds in all, against `param_bytes` for the other parameters."""
        return self.quantized + (0 if self.replaces_bf16 else param_bytes)


@lru_cache(maxsize=4096)
def _grad_buffer(shape: Shape, layers: int, tensor: int, pre_process: bool, post_process: bool, pipeline: int,
                 shards: int, distributed: bool, bucket_size: int | None, first_layer: int = 0, expert: int = 1,
                 expert_tensor: int | None = None,
                 experts_buffer: bool = False) -> tuple[int, np.ndarray, np.ndarray]:
    """One model chunk's _ParamAndGradBuffer (the expert one when `experts_buffer`): (its elements, padding
    included; the [start, end) of each parameter; the [start, end) of each bucket). Parameters are laid out last to
    first, roughly in backward order."""
    import numpy as np

    divisor = math.lcm(shards, BUCKET_ALIGNMENT)
    spans, buckets = [], []
    start = bucket_start = end = 0

    def close(at: int) -> int:
        nonlocal bucket_start
        if distributed:
            at = -(-at // divisor) * divisor
        buckets.append((bucket_start, at))
        bucket_start = at
        return at

    if experts_buffer:
        parameters = chunk_expert_parameters(shape, layers, first_layer=first_layer, expert=expert,
                                             expert_tensor=sizes.expert_tensor_size(tensor, expert_tensor))
    else:
        parameters = chunk_parameters(shape, layers, tensor, pre_process, post_process, pipeline,
                                      first_layer=first_layer, expert=expert, expert_tensor=expert_tensor)
    for numel, shared in reversed(parameters):
        if distributed:
            start = -(-start // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        alone = shared and distributed  # so both stages shard the embedding alike before its all-reduce
        if alone and spans and spans[-1][1] > bucket_start:
            start = close(start)
        end = start + numel
        spans.append((start, end))
        start = close(end) if alone or (bucket_size is not None and end - bucket_start >= bucket_size) else end
    if spans and spans[-1][1] > bucket_start:
        close(end)
    numel = buckets[-1][1] if buckets else 0
    return numel, np.array(spans, dtype=np.int64).reshape(-1, 2), np.array(buckets, dtype=np.int64).reshape(-1, 2)


def _elements_below(spans: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Parameter elements (not padding) in [0, x) of a buffer whose parameters occupy `spans`, for each x."""
    import numpy as np

    if not len(spans):
        return np.zeros_like(x)
    starts, sizes = spans[:, 0], spans[:, 1] - spans[:, 0]
    before = np.concatenate([[0], np.cumsum(sizes)])  # elements of the parameters before each one
    i = np.searchsorted(starts, x, side="left")  # parameters starting below x; the last may end beyond it
    j = np.maximum(i - 1, 0)
    return np.where(i > 0, before[j] + np.minimum(x - starts[j], sizes[j]), 0)


@lru_cache(maxsize=4096)  # the planner asks for the same chunks again and again
def grad_buffer_elements(shape: Shape, layers: int, *, tensor: int = 1, pre_process: bool = True,
                         post_process: bool = True, pipeline: int = 1, shards: int = 1, distributed: bool = False,
                         bucket_size: int | None = None, first_layer: int = 0, expert: int = 1,
                         expert_tensor: int | None = None, experts_buffer: bool = False) -> tuple[int, np.ndarray]:
    """One model chunk's DDP buffer: (its elements, padding included; the parameter elements each of the `shards`
    ranks of the data x context group updates). Without the distributed optimizer every rank updates them all.
    `experts_buffer`: the chunk's expert buffer instead (expert parallelism: its local experts), whose `shards` are the
    expert-data-parallel ranks."""
    import numpy as np

    if not shape.moe:  # which layers the chunk holds matters only where some are MoE
        first_layer, expert, expert_tensor = 0, 1, None
    numel, spans, buckets = _grad_buffer(shape, layers, tensor, pre_process, post_process, pipeline, shards,
                                         distributed, bucket_size, first_layer, expert, expert_tensor, experts_buffer)
    total = int((spans[:, 1] - spans[:, 0]).sum())
    if not distributed:
        owned = np.full(shards, total, dtype=np.int64)
    else:
        owned = np.zeros(shards, dtype=np.int64)
        for lo, hi in buckets:  # rank r updates [lo + r S, lo + (r + 1) S) of each bucket, S = (hi - lo) / shards
            edges = lo + (hi - lo) // shards * np.arange(shards + 1)
            below = _elements_below(spans, edges)
            owned += below[1:] - below[:-1]
    owned.flags.writeable = False  # cached: shared by every caller
    return numel, owned


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
"""Bytes per element of the precision-aware optimizer's dtypes as Transformer Engine's FusedAdam stores them. fp8: a
Float8Tensor (fused_adam.py, _initialize_state) whose quantizer keeps a transpose beside the data on GPUs whose FP8
GEMMs take only the TN layout (quantizer.cpp, Float8Quantizer::create_tensor: Hopper and earlier), 2 bytes; 1 on
Blackwell, which labkit does not tell apart here. One fp32 scale per tensor is not counted."""


@dataclass(frozen=True)
class OptimizerDtypes:
    """Megatron's precision-aware optimizer (--use-precision-aware-optimizer; spec optimizer.precision_aware and its
    four dtypes). megatron-core 0.16.1 (optimizer/__init__.py, distrib_optimizer.py) hands Transformer Engine's
    FusedAdam the distributed optimizer's shards of the 16-bit weights themselves, with master_weights in
    `main_params` and the gradient buffer's shard as their `decoupled_grad` (no fp32 copies); FusedAdam
    (transformer_engine/pytorch/optimizers/fused_adam.py) stores exp_avg and exp_avg_sq in their dtypes and an fp32
    master beside bf16 weights as its 16 low bits (store_param_remainders). Its step works on fp32 copies of each
    state stored in fp16 or fp8, and of bf16 moments unless both are bf16 (fuse_unscale), held to the step's end.
    Except under MXFP8 with fp32 main parameters (use_precision_aware_optimizer_no_fp8_or_ds_fp8 false, where the
    optimizer's config carries the fp8 recipe, as Megatron-LM's and labkit's driver's do): megatron-core then keeps
    its own fp32 main parameters and the step's gradient copies, and FusedAdam only the moments."""
    main_grads: str = "fp32"
    main_params: str = "fp32"
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"

    @classmethod
    def of(cls, optimizer) -> OptimizerDtypes | None:
        """A spec's optimizer section's dtypes; None without precision_aware."""
        if not optimizer.precision_aware:
            return None
        return cls(optimizer.main_grads_dtype, optimizer.main_params_dtype, optimizer.exp_avg_dtype,
                   optimizer.exp_avg_sq_dtype)

    def step_copies(self) -> int:
        """Bytes per element of FusedAdam's fp32 working copies of its states during a step."""
        fused = self.exp_avg == self.exp_avg_sq == "bf16"  # the kernel unscales bf16 moments itself
        moments = sum(4 for dtype in (self.exp_avg, self.exp_avg_sq)
                      if dtype in ("fp16", "fp8") or (dtype == "bf16" and not fused))
        return moments + (4 if self.main_params == "fp16" else 0)


def _state_dtypes(precision: str, grad_reduce_in_bf16: bool, optimizer: str,
                  dtypes: OptimizerDtypes | None = None) -> tuple[int, int, int, int]:
    """(parameter, gradient, optimizer-state, step-only) bytes per element as Megatron keeps them; the optimizer state
    includes the step's fp32 working copies, which the last counts alone: megatron-core's of 16-bit gradients,
    held to the next zero_grad, and FusedAdam's of its low-precision states."""
    if precision not in _MODEL_STATE:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(_MODEL_STATE)}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer: {optimizer!r} is not adam or sgd")
    param_bytes = 4 if precision == "fp32" else 2
    bf16 = precision in ("bf16", *LOW_PRECISION)
    # Megatron-LM's validate_args: bf16 (and FP8, MXFP8 and NVFP4 inside it) reduces in fp32 unless
    # --grad-reduce-in-bf16 or --main-grads-dtype bf16; fp16 and fp32 keep the parameters' dtype.
    bf16_grads = grad_reduce_in_bf16 or (dtypes is not None and dtypes.main_grads == "bf16")
    grad_bytes = 2 if precision == "fp16" or (bf16 and bf16_grads) else 4
    copies = 4 if param_bytes == 2 and grad_bytes == 2 else 0
    if dtypes is None:
        main = 4 if param_bytes == 2 else 0
        return param_bytes, grad_bytes, main + {"adam": 8, "sgd": 4}[optimizer] + copies, copies
    moments = DTYPE_BYTES[dtypes.exp_avg] + DTYPE_BYTES[dtypes.exp_avg_sq]
    working = dtypes.step_copies()
    if dtypes.main_params == "fp32" and precision == "mxfp8":  # megatron-core's own main parameters and copies
        return param_bytes, grad_bytes, 4 + moments + copies + working, copies + working
    main = 2 if dtypes.main_params == "fp32" and bf16 else DTYPE_BYTES[dtypes.main_params]
    return param_bytes, grad_bytes, main + moments + working, working


def step_only_bytes(precision: str, grad_reduce_in_bf16: bool = False,
                    dtypes: OptimizerDtypes | None = None) -> int:
    """Bytes per updated element that only the optimizer step holds (`_state_dtypes`): megatron-core's fp32 copies of
    a 16-bit gradient buffer (fp16, or training under --bf16 with --grad-reduce-in-bf16), and with the precision-aware
    optimizer FusedAdam's fp32 working copies of its low-precision states (it reads the gradient buffer itself)."""
    return _state_dtypes(precision, grad_reduce_in_bf16, "adam", dtypes)[3]


def expert_data_parallel(tensor: int, context: int, data_parallel: int, expert: int = 1,
                         expert_tensor: int | None = None) -> int:
    """Ranks that hold the same experts (the expert-data-parallel group): a pipeline stage's tensor x context x data
    ranks over expert_tensor x expert, as megatron-core's initialize_model_parallel sizes its expert grid
    (labkit.megatron.sizes.expert_data_parallel_size)."""
    etp = sizes.expert_tensor_size(tensor, expert_tensor)
    return sizes.expert_data_parallel_size(tensor * context * data_parallel, expert, etp)


def chunk_first_layers(chunks: list[list[int]]) -> list[list[int]]:
    """The first transformer layer of each model chunk, [stage][chunk], with `chunks` the layers of each stage's
    chunks: chunk k of stage i is virtual stage k x stages + i, and the virtual stages hold consecutive layers."""
    p = len(chunks)
    v = max((len(row) for row in chunks), default=1)
    firsts = [[0] * len(row) for row in chunks]
    layer = 0
    for u in range(p * v):
        i, k = u % p, u // p
        if k < len(chunks[i]):
            firsts[i][k] = layer
            layer += chunks[i][k]
    return firsts


def model_state_bytes(shape: Shape, chunks: list[int], *, stage: int = 0, pipeline: int = 1, tensor: int = 1,
                      data_parallel: int = 1, context: int = 1, precision: str = "bf16",
                      distributed_optimizer: bool = False, grad_reduce_in_bf16: bool = False, optimizer: str = "adam",
                      overlap_grad_reduce: bool = False, rank: int | None = None, zero_stage: int = 0,
                      expert: int = 1, expert_tensor: int | None = None,
                      first_layers: list[int] | None = None, entrypoint: str = "labkit",
                      transformer_impl: str = "local", optimizer_dtypes: OptimizerDtypes | None = None,
                      fp8_weights: FP8Weights | None = None, fsdp_master_shards: bool = False) -> ModelState:
    """Weights, gradients and optimizer state in bytes on one GPU of pipeline stage `stage`, exactly as megatron-core
    0.16.1 allocates them (see the notes above). `chunks`: the transformer layers of each of the stage's model chunks
    (one without interleaving). `rank`: the GPU's rank in the data x context group; None: the one that updates the
    most elements (slices differ by a few alignment gaps). `zero_stage` 1 is the distributed optimizer; 2 and 3 are
    what `entrypoint` runs them as (labkit.megatron.sharding): PyTorch FSDP2 on labkit's driver
    (`torch_fsdp2_model_state_bytes`, whose units depend on `transformer_impl`, the driver's --transformer-impl: local
    on CPUs, transformer_engine on GPUs that have it), Megatron-FSDP on Megatron-LM, job.entrypoint megatron-lm
    (`fsdp_model_state_bytes`).

    Mixture of experts: each MoE layer's experts split over `expert` ranks (num_experts / expert each), each expert
    over `expert_tensor` ranks (None: the tensor size, Megatron-LM's default). With expert parallelism DDP keeps the
    experts in a buffer of their own, which the distributed optimizer shards over the expert-data-parallel ranks
    (world / (expert_tensor x expert x pipeline), `expert_data_parallel`) where the dense buffer shards over data x
    context (megatron/core/distributed/distributed_data_parallel.py: `expert_parallel_params` get their
    _ParamAndGradBuffer over intra_expt_dp_group; megatron/core/optimizer/__init__.py builds a distributed optimizer
    per group). `first_layers`: the first layer of each chunk, which says which of its layers are MoE; None: the
    chunks of every stage as this one's. `optimizer_dtypes`: the precision-aware optimizer's (OptimizerDtypes), None
    without it. `fp8_weights`: what Transformer Engine holds of the linear layers' weights under a low precision on
    GPUs (FP8Weights), None where it holds nothing of its own (other precisions, CPUs); the FP8 weights are counted
    from Transformer Engine's sizes, not megatron-core's objects (their uint8 buffer's own padding is left out).
    `fsdp_master_shards`: FSDP2 as PyTorch's own trainers run it (`torch_fsdp2_model_state_bytes`' master_shards).

    Taught in lab 09.
    """
    import numpy as np

    param_bytes, grad_bytes, per_element, copies = _state_dtypes(precision, grad_reduce_in_bf16, optimizer,
                                                                 optimizer_dtypes)
    if first_layers is None:
        first_layers = [(k * pipeline + stage) * layers for k, layers in enumerate(chunks)]
    if zero_stage in (2, 3) and sharding.choose(zero_stage, entrypoint=entrypoint).implementation == \
            sharding.TORCH_FSDP2:
        state = torch_fsdp2_model_state_bytes(shape, chunks, zero_stage, stage=stage, pipeline=pipeline,
                                              tensor=tensor, data_parallel=data_parallel, context=context,
                                              precision=precision, optimizer=optimizer, expert=expert,
                                              expert_tensor=expert_tensor, first_layers=first_layers,
                                              transformer_impl=transformer_impl, master_shards=fsdp_master_shards)
        if fp8_weights is None:
            return state
        # Megatron-LM keeps no FP8 parameters under FSDP2 (labkit.megatron.rules): Transformer Engine's cached copies
        linear = stage_linear_weight_elements(shape, chunks, first_layers, tensor=tensor, expert=expert,
                                              expert_tensor=expert_tensor)
        return replace(state, weights=int(state.weights + linear * fp8_weights.quantized))
    if zero_stage in (2, 3):
        return fsdp_model_state_bytes(shape, chunks, zero_stage, stage=stage, pipeline=pipeline, tensor=tensor,
                                      data_parallel=data_parallel, context=context, precision=precision,
                                      grad_reduce_in_bf16=grad_reduce_in_bf16, optimizer=optimizer,
                                      overlap_grad_reduce=overlap_grad_reduce, expert=expert,
                                      expert_tensor=expert_tensor, first_layers=first_layers, fp8_weights=fp8_weights)
    distributed_optimizer = distributed_optimizer or zero_stage == 1
    shards = data_parallel * context
    expert_shards = expert_data_parallel(tensor, context, data_parallel, expert, expert_tensor)
    bucket_size = max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * data_parallel) if overlap_grad_reduce else None
    weights = gradients = 0
    owned = np.zeros(shards, dtype=np.int64)
    owned_experts = np.zeros(expert_shards, dtype=np.int64)
    for k, layers in enumerate(chunks):
        first, last = stage == 0 and k == 0, stage == pipeline - 1 and k == len(chunks) - 1
        # DDP buckets only the first chunk of the first stage (distributed_data_parallel.py; Megatron-LM's get_model
        # disables bucketing for later chunks)
        buffers = [(False, shards, owned)] + ([(True, expert_shards, owned_experts)]
                                              if shape.moe and expert > 1 and layers else [])
        for experts_buffer, n, into in buffers:
            numel, mine = grad_buffer_elements(shape, layers, tensor=tensor, pre_process=first, post_process=last,
                                               pipeline=pipeline, shards=n, distributed=distributed_optimizer,
                                               bucket_size=bucket_size if stage == 0 and k == 0 else None,
                                               first_layer=first_layers[k], expert=expert,
                                               expert_tensor=expert_tensor, experts_buffer=experts_buffer)
            weights += numel * param_bytes  # without the distributed optimizer the buffer has no padding
            gradients += numel * grad_bytes
            into += mine
        if fp8_weights is not None:  # the FP8 weights in place of their bf16 share of the buffer, or beside it
            linear = linear_weight_elements(shape, layers, first_layer=first_layers[k], tensor=tensor, expert=expert,
                                            expert_tensor=expert_tensor)
            weights += linear * (fp8_weights.bytes_per_element(param_bytes) - param_bytes)
    updated = int(owned.max() if rank is None else owned[rank]) + int(owned_experts.max())
    return ModelState(weights=int(weights), gradients=gradients, optimizer=updated * per_element,
                      step_only=updated * copies,
                      step_transient=updated * (optimizer_dtypes.step_copies() if optimizer_dtypes else 0))


# --- Megatron-FSDP (megatron/core/distributed/fsdp/src/megatron_fsdp, megatron-core 0.16.1) ---------------------------
# ParamAndGradBuffer._init_each_parameter_group_buffers keeps, per parameter group, a 16-bit model-weight buffer, an
# fp32 main-weight buffer and a main-gradient buffer (fp32 when grad_reduce_in_fp32, Megatron-LM's bf16 default), each
# sharded over the data x context ranks or not by --data-parallel-sharding-strategy: optim_grads (ZeRO-2) shards the
# main weights and gradients, optim_grads_params (ZeRO-3) the model weights too. The optimizer states live beside the
# sharded main weights. Sharded buffers hold ceil(elements / ranks) per bucket (each rank's padding is a few elements,
# not counted). What is sharded is also worked on unsharded, in temporary buckets:
# - gradients (stages 2 and 3): each bucket's gradients are produced unsharded, then reduce-scattered every
#   micro-batch (megatron_fsdp.py, grad_reduce_every_bprop). GradReducePipeline.wait_for_previous_grad_reduce frees
#   a reduced bucket only once the queued ones exceed the suggested communication unit C, so up to C elements wait,
#   plus the bucket being reduced and the one being filled.
# - parameters (stage 3): AllGatherPipeline.all_gather_params gathers the layer about to compute and prefetches the
#   next until the prefetched elements reach C / 2; each is released after its forward (and again after backward).
# Buckets: with optim_grads_params each TransformerLayer is an FSDP unit (mcore_fsdp_adapter.py), its own bucket; the
# rest, like all of ZeRO-2's parameters, is split by the DDP bucket size (Megatron-LM's get_model: max(40M, 1M x
# data-parallel ranks) with --overlap-grad-reduce, else one bucket). C (MegatronFSDP.__init__,
# suggested_communication_unit_size): twice the mean FSDP unit with optim_grads_params, else the bucket size, else
# 1e9 elements, and never under 1e9 (`max(1_000_000_000, ...)`). Megatron-LM's defaults thus hold up to a billion
# gradient elements unsharded: the whole model's gradients for models below that.
FSDP_MIN_COMMUNICATION_UNIT = 1_000_000_000
"""Megatron-FSDP's floor on the suggested communication unit, in elements (megatron_fsdp.py)."""


def fsdp_model_state_bytes(shape: Shape, chunks: list[int], zero_stage: int, *, stage: int = 0, pipeline: int = 1,
                           tensor: int = 1, data_parallel: int = 1, context: int = 1, precision: str = "bf16",
                           grad_reduce_in_bf16: bool = False, optimizer: str = "adam",
                           overlap_grad_reduce: bool = False, expert: int = 1, expert_tensor: int | None = None,
                           first_layers: list[int] | None = None,
                           fp8_weights: FP8Weights | None = None) -> ModelState:
    """One GPU's model state under Megatron-FSDP at ZeRO stage 2 (optim_grads) or 3 (optim_grads_params), working
    buffers included (see the notes above), in bytes. With expert parallelism the local experts are sharded over the
    expert-data-parallel ranks (Megatron-FSDP's expert data-parallel shard group) and the rest over data x context;
    the working buffers are counted over both together. `fp8_weights` (model_state_bytes): with FP8 parameters the
    model-weight buffer, sharded and gathered, holds the linear layers' share at their quantized bytes; without,
    Transformer Engine's cached copies of the gathered weights are held beside it."""
    if zero_stage not in (2, 3):
        raise ValueError(f"zero_stage: Megatron-FSDP shards at stage 2 or 3, not {zero_stage}")
    param_bytes, grad_bytes, per_element, _ = _state_dtypes(precision, grad_reduce_in_bf16, optimizer)
    shards = data_parallel * context
    expert_shards = expert_data_parallel(tensor, context, data_parallel, expert, expert_tensor)
    etp = sizes.expert_tensor_size(tensor, expert_tensor)
    if first_layers is None:
        first_layers = [(k * pipeline + stage) * layers for k, layers in enumerate(chunks)]
    bucket_size = max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * shards) if overlap_grad_reduce else None
    weights = gradients = optimizer_state = gathered = unsharded = 0
    for k, layers in enumerate(chunks):
        first, last = stage == 0 and k == 0, stage == pipeline - 1 and k == len(chunks) - 1
        where = dict(first_layer=first_layers[k], expert=expert, expert_tensor=expert_tensor)
        sizes_ = [n for n, _ in chunk_parameters(shape, layers, tensor, first, last, pipeline, **where)]
        experts = sum(n for n, _ in chunk_expert_parameters(shape, layers, first_layer=first_layers[k],
                                                            expert=expert, expert_tensor=etp))
        dense = sum(sizes_)
        total = dense + experts
        shard = -(-dense // shards) + (-(-experts // expert_shards) if experts else 0)
        # one layer, the model's mean: its dense and expert parameters
        per_layer = (sum(n for n, _ in chunk_parameters(shape, 1, tensor, False, False, pipeline, **where))
                     + experts // max(1, layers))
        weight_bytes, cached = float(param_bytes), 0.0
        if fp8_weights is not None and total:
            linear = linear_weight_elements(shape, layers, first_layer=first_layers[k], tensor=tensor, expert=expert,
                                            expert_tensor=expert_tensor)
            if fp8_weights.replaces_bf16:  # the buffer's elements at their mean bytes
                weight_bytes += linear / total * (fp8_weights.quantized - param_bytes)
            else:
                cached = linear * fp8_weights.quantized
        if zero_stage == 3 and layers:
            # the largest bucket gathered at once: a layer, or the word embedding / output layer
            bucket, unit = max(per_layer, *sizes_), max(FSDP_MIN_COMMUNICATION_UNIT, 2 * per_layer)
            gathered += min(total, unit // 2 + 2 * bucket) * weight_bytes
        else:
            bucket = min(total, bucket_size or total)
            unit = max(FSDP_MIN_COMMUNICATION_UNIT, bucket_size or 0)
        unsharded += min(total, unit + 2 * bucket) * grad_bytes
        weights += (shard if zero_stage == 3 else total) * weight_bytes + cached
        gradients += shard * grad_bytes
        optimizer_state += shard * per_element
    return ModelState(weights=int(weights + gathered), gradients=int(gradients + unsharded),
                      optimizer=int(optimizer_state), weights_working=int(gathered), gradients_working=int(unsharded))


# --- PyTorch FSDP2 through megatron-core (labkit's driver at ZeRO stages 2 and 3) -------------------------------------
# megatron-core 0.16.1's TorchFullyShardedDataParallel (megatron/core/distributed/torch_fully_sharded_data_parallel.py)
# calls torch's fully_shard on every TransformerLayer, the LanguageModelEmbedding and, except with the local
# implementation (--transformer-impl local, labkit's driver on CPUs), the output layer (a ColumnParallelLinear); then on
# the whole chunk, the root unit, which keeps the rest: the final norm (and the output layer where it is no unit).
# fully_shard stores each parameter as its rows split over the data x context ranks, each rank's share padded to
# ceil(rows / ranks) rows (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, FSDPParam._init_sharded_param);
# gradients come back reduce-scattered into the same shards, in the parameters' dtype (no mixed-precision policy is
# passed). Megatron's optimizer for FSDP2 is its mixed-precision one without a distributed optimizer: fp32 main copies
# of the local shards, fp32 copies of their gradients and Adam's moments.
# Unsharded, while the backward runs unit k (torch 2.13's _fsdp_param_group.py; measured on the driver by
# benchmarks/bench_zero_memory.py): k's gathered parameters and its gradients; unit k - 1's parameters, prefetched
# (pre_backward's _backward_prefetch, into the all-gather's flat buffer); unit k + 1's reduce-scatter input, held until
# the next reduce-scatter (reduce_scatter_max_input_buffers = 1); and the root's parameters and gradients for the whole
# backward: its forward inputs are token ids, which need no gradient, so its reduce-scatter waits for the final
# callback. Stage 2 (reshard_after_forward=False, and on labkit's driver set_reshard_after_backward(False)) keeps every
# unit gathered: after each step the driver gathers the updated shards again (labkit.train.model.gather_zero2_weights),
# so the whole weights are held between steps, as ZeRO-2 holds them, and only the gradients are working buffers.
# Gathered parameters and reduce-scatter inputs carry the rows' padding, gradients do not.


def _fsdp2_backward_peak(units: list[tuple[int, int]], root: tuple[int, int], zero_stage: int, param_bytes: int,
                         grad_bytes: int) -> tuple[int, int]:
    """(gathered parameters, unsharded gradients) in elements at the point of the backward where FSDP2 holds the most
    bytes (see the notes above). `units`: each unit's (elements padded to a multiple of the ranks, elements) in
    forward order; `root`: the root unit's."""
    peak = (0, 0)
    for k in reversed(range(len(units))):
        if zero_stage == 2:
            gathered = sum(padded for padded, _ in units)  # no unit frees its parameters
        else:
            gathered = units[k][0] + (units[k - 1][0] if k else 0)
        gradients = units[k][1] + (units[k + 1][0] if k + 1 < len(units) else 0)
        here = (root[0] + gathered, root[1] + gradients)
        if here[0] * param_bytes + here[1] * grad_bytes > peak[0] * param_bytes + peak[1] * grad_bytes:
            peak = here
    return peak if units else root


def torch_fsdp2_model_state_bytes(shape: Shape, chunks: list[int], zero_stage: int, *, stage: int = 0,
                                  pipeline: int = 1, tensor: int = 1, data_parallel: int = 1, context: int = 1,
                                  precision: str = "bf16", optimizer: str = "adam", expert: int = 1,
                                  expert_tensor: int | None = None, first_layers: list[int] | None = None,
                                  transformer_impl: str = "local", master_shards: bool = False) -> ModelState:
    """One GPU's model state under PyTorch FSDP2 at ZeRO stage 2 (no resharding) or 3, in bytes (see the notes above):
    the shards it keeps between steps (and at stage 2 the whole parameters), and as working buffers what it holds
    unsharded only in the backward. `transformer_impl`: "local" (the output layer in the root unit) or
    "transformer_engine" (the output layer a unit of its own). `master_shards`: FSDP2 as PyTorch's own trainers run
    it (Stack.fsdp_master_shards): under a 16-bit precision the shards are fp32 parameters, the master weights, which
    a plain optimizer steps (no main copies, no gradient copies), gathered in bf16 (MixedPrecisionPolicy's
    param_dtype), their gradients reduced into fp32 shards (reduce_dtype); the unsharded gradients are counted at the
    fp32 of the reduce-scatter's input, a little over the bf16 gradient they are cast from."""
    if zero_stage not in (2, 3):
        raise ValueError(f"zero_stage: FSDP2 shards at stage 2 or 3, not {zero_stage}")
    # FSDP2 reduces in the parameters' dtype: Megatron's 16-bit optimizer then keeps fp32 copies of the gradients
    param_bytes, grad_bytes, per_element, copies = _state_dtypes(precision, True, optimizer)
    gathered_bytes = param_bytes
    if master_shards and precision != "fp32":
        param_bytes, grad_bytes, per_element, copies = 4, 4, {"adam": 8, "sgd": 4}[optimizer], 0
    shards = data_parallel * context
    etp = sizes.expert_tensor_size(tensor, expert_tensor)
    if first_layers is None:
        first_layers = [(k * pipeline + stage) * layers for k, layers in enumerate(chunks)]
    h = shape.hidden
    vocab = shape.padded_vocab(tensor) // tensor

    def sizes_of(parameters: list[tuple[int, int]]) -> tuple[int, int]:
        """(elements padded to whole rows per rank, over all ranks; elements) of (elements, rows) parameters."""
        padded = sum(-(-rows // shards) * shards * (numel // rows) for numel, rows in parameters)
        return padded, sum(numel for numel, _ in parameters)

    sharded = gathered = unsharded_grads = 0
    for k, layers in enumerate(chunks):
        first, last = stage == 0 and k == 0, stage == pipeline - 1 and k == len(chunks) - 1
        embedding = ([(vocab * h, vocab)] + ([(shape.seq_length * h, shape.seq_length)]
                                             if shape.positions == "learned_absolute" else [])) if first else []
        final_norm = [(h, h)] * (1 if shape.norm == "RMSNorm" else 2) if last else []
        output = [(vocab * h, vocab)] if last and not (shape.tied and first) else []
        layer_units = [sum(_layer_parameters(shape, layer, tensor, expert, etp), [])
                       for layer in range(first_layers[k], first_layers[k] + layers)]
        output_unit = transformer_impl != "local"
        units = ([embedding] if embedding else []) + layer_units + ([output] if output and output_unit else [])
        root = final_norm + ([] if output_unit else output)
        unit_sizes, root_sizes = [sizes_of(unit) for unit in units], sizes_of(root)
        sharded += (sum(padded for padded, _ in unit_sizes) + root_sizes[0]) // shards
        params, grads = _fsdp2_backward_peak(unit_sizes, root_sizes, zero_stage, gathered_bytes, grad_bytes)
        gathered += params
        unsharded_grads += grads
    return ModelState(weights=int(sharded * param_bytes + gathered * gathered_bytes),
                      gradients=int((sharded + unsharded_grads) * grad_bytes),
                      optimizer=int(sharded * per_element),
                      step_only=int(sharded * copies),
                      weights_working=0 if zero_stage == 2 else int(gathered * gathered_bytes),
                      gradients_working=int(unsharded_grads * grad_bytes))


MOE_TOKEN_IMBALANCE = 1.0
"""Tokens an expert rank receives over its even share (num_tokens x topk / expert ranks): the assumption behind every
MoE term here and in labkit.estimate.timing. 1.0 is drop-less routing with perfect balance, which NVIDIA's
Megatron-Bridge benchmarks force ("we force-balance the token distribution among experts and all benchmarks are
token-dropless", docs/performance-summary.md). A token-dropping run with --moe-expert-capacity-factor C pads each
expert to at most C times its share (GShard, arXiv:2006.16668, section 2.2; Switch Transformer, arXiv:2101.03961,
section 2.2), an unbalanced drop-less one receives more than its share on its busiest rank: either is this factor
above 1."""

ROUTER_BYTES_PER_SCORE = 12
"""Bytes the router keeps per token and expert (megatron/core/transformer/moe/router.py, TopKRouter.routing, and
moe_utils.py, topk_routing_with_score_function and compute_routing_scores_for_aux_loss, unfused): the fp32 softmax
scores of the top-k choice (4), the bool routing map (1), the probabilities scattered over every expert in the
activations' dtype (2), and the load-balancing loss's own fp32 scores (4) and routing map (1). A few hundred bytes
per token for Mixtral's 8 experts beside the hundreds of kilobytes of the rest of the layer."""


def activation_bytes_per_layer(shape: Shape, micro_batch: int, tensor: int = 1, sequence_parallel: bool = False,
                               recompute: str | None = None, precision: str = "bf16", flash_attention: bool = False,
                               context: int = 1, on_cpu: bool = False, moe: bool = False,
                               expert_tensor: int | None = None,
                               recompute_modules: tuple[str, ...] | list[str] | None = None) -> float:
    """Activation bytes one transformer layer keeps for the backward pass of one micro-batch, on one tensor rank.

    Each term is a tensor megatron-core 0.16.1's TransformerLayer saves; tests/test_activation_memory.py counts them
    on the CPU (`on_cpu=True`: the driver's local layer spec, no fused kernels) and finds this within 2%. Without
    `on_cpu` it is a GPU running Megatron-LM's defaults with Transformer Engine, which changes these terms:
    - dropout masks: CUDA's fused dropout keeps a bool mask (1 byte, Korthikanti's count); the CPU keeps its scaled
      noise in the activations' dtype.
    - norms: Transformer Engine's LayerNorm/RMSNorm keep the input and fp32 statistics per token (two, or one); on
      the CPU torch's LayerNorm keeps its statistics in the activations' dtype, and its RMSNorm, a composite there,
      two fp32 copies of the input and an fp32 statistic.
    - attention core: flash and fused attention (`flash_attention`: kernels.attention_backend flash, fused, or auto
      on Ampere and later) never write the s x s scores; they keep their output and an fp32 log-sum-exp per head and
      token (4a/h). Unfused on a GPU is Megatron's fused masked softmax (Megatron-LM's default
      --masked-softmax-fusion): its 16-bit output, dropout mask (1) and dropout output: Korthikanti's 5as/h. Elsewhere
      (the CPU, fp32) torch's softmax runs in fp32 (attention_softmax_in_fp32) behind an s x s causal mask built per
      layer. megatron-core's unfused DotProductAttention repeats grouped K and V to every head before saving them;
      fused attention and the selective checkpoint keep them grouped.
    - SwiGLU: Megatron-LM's default --bias-swiglu-fusion (megatron/core/fusions/fused_bias_swiglu.py) keeps only the
      2f-wide input; unfused (the CPU) also keeps the SiLU output and the linear half.
    - rotary embeddings: unfused (the CPU) a cos and a sin of s x d for Q and for K per layer; Megatron-LM's default
      --apply-rope-fusion keeps only the frequencies every layer shares.
    - FP8 (GPU only): Transformer Engine keeps 1-byte FP8 copies of the QKV, projection, MLP-in and MLP-out GEMM
      inputs for the weight-gradient GEMM instead of the 16-bit ones (transformer_engine/pytorch/module/linear.py,
      `_Linear.forward`: the quantized `inputmat` is what `ctx.save_for_backward` keeps, its row-wise data discarded
      "since it is not needed in backward pass"; layernorm_linear.py likewise keeps the quantized `ln_out`). Fused
      attention's output stays 16-bit beside the projection's FP8 copy.
    Sequence parallelism splits the norms, dropout and GEMM inputs outside the tensor-parallel regions over t as well
    (Korthikanti Table 2); context parallelism splits the sequence, and so every term, over its ranks. Heads of
    kv_channels other than hidden / heads (Qwen3) make Q, K, V and the projection input heads x head_dim wide.
    Per-head query and key norms (qk_layernorm) read views of the QKV output, which is kept anyway, and feed the
    rotary embedding, whose fused kernel keeps none of its input: they add only their statistics, not counted.

    `moe`: an MoE layer (megatron-core's MoELayer, megatron/core/transformer/moe/; the alltoall or allgather
    dispatcher with Transformer Engine's grouped GEMM, TEGroupedMLP) in place of the dense MLP. Its MLP side keeps:
    - the router's input (the MLP norm's output, which the shared experts' fc1 reads too) and, per token and expert,
      ROUTER_BYTES_PER_SCORE of logits, scores and routing maps;
    - the dispatched tokens: each of the rank's tokens goes to topk experts, so the rank's experts receive topk x
      its tokens (times MOE_TOKEN_IMBALANCE), all-gathered over the `expert_tensor` ranks of each expert (None: the
      tensor size, Megatron-LM's default); fc1 keeps that input (1 byte under FP8), the fused weighted SwiGLU its
      2 f_e-wide input and the fp32 routing probability of each copy, fc2 its f_e-wide input, f_e one expert's width
      split over the expert-tensor ranks (experts.py, TEGroupedMLP.forward; GShard's dispatch tensor, arXiv
      2006.16668, holds the same tokens). The permutations keep only indices, and with the probabilities applied in
      the activation ("memory efficient token permutation", the MoE README) the combine keeps nothing of width h;
    - the shared experts, as a dense MLP of their width (DeepSeekMoE, arXiv:2401.06066).
    Megatron-Core's MoE README ("Find the feasible parallel mapping") puts an MoE layer's peak activations under
    expert parallelism at "~1 (varies with EP balancing)": the dispatched tokens per rank do not shrink with the
    expert ranks, they grow with topk and with the imbalance.

    Selective recomputation (`recompute` "selective") keeps what its `recompute_modules` (megatron-core's
    --recompute-modules, core_attn when none) would have made, and recomputes it in the backward pass
    (TransformerLayer, MoELayer): core_attn drops the attention core's own tensors, keeping Q, K and V; mlp the dense
    MLP's (its input, the norm's output, stays as the checkpoint's input); moe an MoE layer's router, dispatched tokens
    and shared experts (its input stays); shared_experts the shared experts'; moe_act the experts' activation output,
    fc2's input; layernorm the outputs of the norms that are modules of their own (both on the CPU's local layers; on
    a GPU Transformer Engine fuses the input norm and a dense layer's MLP norm into the next GEMM, which megatron-core
    then leaves alone, so only an MoE layer's pre-MLP norm output, the router's input).

    Taught in lab 09.
    """
    s, b, h, a, t = shape.seq_length / context, micro_batch, shape.hidden, shape.heads, tensor
    e = 4 if precision == "fp32" else 2  # bytes of one activation (fp8 runs its non-GEMM work in bf16)
    split = t if sequence_parallel else 1
    if recompute == "full":
        return s * b * h * e / split  # the checkpoint keeps the layer's input
    fp8 = precision in LOW_PRECISION and not on_cpu
    gemm_input = 1 if fp8 else e
    mask = (e if on_cpu else 1) if shape.hidden_dropout else 0
    f = shape.ffn_size / h
    # Q and the projection input are heads x head_dim wide, K and V groups x head_dim: as wide as the hidden state and
    # groups / heads of it unless kv_channels says otherwise
    q, r = shape.heads * shape.head_dim / h, shape.groups * shape.head_dim / h
    rope = shape.positions == "rope"
    modules = set(recompute_modules or SELECTIVE_DEFAULT) if recompute == "selective" else set()
    core = "core_attn" not in modules  # recomputing the core attention keeps only its inputs
    unfused = core and not flash_attention

    # Per token and hidden unit, outside the tensor-parallel regions: each norm's input (and statistics), the QKV and
    # MLP-in GEMM inputs it feeds, the dropout masks after attention and MLP.
    if on_cpu:
        norm = 8 + 4 / h if shape.norm == "RMSNorm" else e + 2 * e / h
    else:
        norm = e + (4 if shape.norm == "RMSNorm" else 8) / h
    # The norms' outputs are the QKV GEMM's input and the MLP's (an MoE layer's router reads it in the activations'
    # dtype: its GEMM is not quantized); recomputed norms keep neither (see the docstring for which).
    recomputed_norms = "layernorm" in modules
    input_norm_out = 0.0 if recomputed_norms and on_cpu else gemm_input
    mlp_norm_out = 0.0 if recomputed_norms and (on_cpu or moe) else (e if moe else gemm_input)
    outside = 2 * (norm + mask) + input_norm_out + mlp_norm_out

    # Inside them, split over t: Q, K and V as the core attention keeps them, the projection input, the MLP. A view of
    # the QKV GEMM's output keeps all of it (1 + 2g/a); rotary embeddings make new Q and K; a grouped Q is reshaped
    # into a copy (get_query_key_value_tensors, when a rank holds several groups; the unfused core attention's own
    # reshape, always), and the unfused core attention repeats grouped K and V to every head.
    grouped = shape.groups < a
    if unfused and grouped:
        qkv = 3 * q  # a copied Q, K and V repeated: nothing keeps the QKV output
    else:
        qkv = (q if rope or (grouped and shape.groups > t) else 0) + (r if rope else 0) + q + 2 * r
    projection = (gemm_input + (e if fp8 and flash_attention and core else 0)) * q

    def activation_out(width: float) -> float:
        """What an MLP's activation function keeps beyond its input: its output, the MLP-out GEMM's input (unfused
        SwiGLU on the CPU also its SiLU output and linear half)."""
        return width * (gemm_input + (2 * e if on_cpu and shape.swiglu else 0))

    def mlp_kept(width: float) -> float:
        """An MLP of this width (a share of h): the activation's input and the MLP-out GEMM's."""
        return width * (2 * e if shape.swiglu else e) + activation_out(width)

    if not moe:
        inside = e * qkv + projection + (0.0 if "mlp" in modules else mlp_kept(f))
    elif "moe" in modules:  # the whole MoE side is recomputed from its input, the norm's output
        inside = e * qkv + projection
    else:
        shared = shape.shared_ffn and "shared_experts" not in modules
        inside = e * qkv + projection + (mlp_kept(shape.shared_ffn / h) if shared else 0.0)
        # outside: the shared experts' FP8 copy of their input, the router's scores
        outside += (gemm_input if fp8 and shared else 0) + shape.experts * ROUTER_BYTES_PER_SCORE / h
        # the dispatched tokens, per token of this rank (its sequence share under sequence parallelism)
        etp = sizes.expert_tensor_size(t, expert_tensor)
        f_e = shape.expert_ffn_size / h
        expert_mlp = mlp_kept(f_e) - (activation_out(f_e) if "moe_act" in modules else 0.0)
        outside += shape.topk * MOE_TOKEN_IMBALANCE * (etp * gemm_input + expert_mlp + 4 / h)

    # The core attention's own tensors, per score (a s x s per sequence) or per head and token, split over t.
    scores, per_layer = 0.0, 0.0
    if core and flash_attention:
        scores = 4 * a / h  # the log-sum-exp
    elif unfused:
        dropout = shape.attention_dropout > 0
        if not on_cpu and e == 2:  # Megatron's fused masked-softmax kernel
            per_score = e + (1 + e if dropout else 0)
        else:  # torch's softmax in fp32, then the dropout's noise and output, or the 16-bit probabilities
            per_score = 4 + ((e if on_cpu else 1) + e if dropout else (e if e != 4 else 0))
            per_layer += s * shape.seq_length  # the bool causal mask
        scores = per_score * a * shape.seq_length / h
    if rope and on_cpu:
        per_layer += 4 * s * shape.head_dim * e
    return s * b * h * (outside / split + (inside + scores) / t) + per_layer


def in_flight_micro_batches(stage: int, pipeline: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak under 1F1B: its warm-up forwards and the first
    steady step's. Interleaved (v > 1), the first stage's count, p + (p - 1) / v (Narayanan et al.,
    arXiv:2104.04473, section 2.2; megatron-core's warm-up, schedules.get_pp_rank_microbatches, plus one, in model
    chunks over v), scaled to later stages by the micro-batches each has in flight. Megatron-core's warm-up takes
    two chunks fewer a stage, so that later stages hold more than this scaling gives (its last stage the forwards of
    its earlier chunks); counted so, three GB200 Llama 3.1 405B rows of Megatron-Bridge 26.02-26.06 that trained
    would not fit by 5 GiB, so the bytes of a layer or the margin are pessimistic there, and this count is kept
    until they are measured. The MoE all-to-all's overlap runs the first steady step's forward in the warm-up
    instead, which leaves the count as it is (memory_per_stage's `moe_overlap`)."""
    held = min(pipeline - stage, num_micro_batches)
    if virtual_stages > 1:
        held *= 1 + (pipeline - 1) / (pipeline * virtual_stages)
    return min(held, num_micro_batches)


def memory_per_stage(shape: Shape, partition: list[int], *, tensor: int = 1, data_parallel: int = 1,
                     micro_batch: int = 1, num_micro_batches: int = 1, precision: str = "bf16",
                     recompute: str | None = None, recompute_layers: int = 1, sequence_parallel: bool = False,
                     virtual_stages: int = 1, distributed_optimizer: bool = False, zero_stage: int = 0,
                     zero_backend: str = "megatron", optimizer: str = "adam", flash_attention: bool = False,
                     context: int = 1, grad_reduce_in_bf16: bool = False, overlap_grad_reduce: bool = False,
                     chunks: list[list[int]] | None = None, expert: int = 1,
                     expert_tensor: int | None = None,
                     recompute_modules: tuple[str, ...] | list[str] | None = None,
                     entrypoint: str = "labkit", transformer_impl: str = "local",
                     optimizer_dtypes: OptimizerDtypes | None = None, evaluates: bool = False,
                     fp8_weights: FP8Weights | None = None, fsdp_master_shards: bool = False,
                     moe_overlap: bool = False) -> list[StageMemory]:
    """Peak memory of one GPU in each pipeline stage (GiB), without the CUDA context and allocator slack.

    Weights, gradients and optimizer state are megatron-core's (`model_state_bytes`, on the data x context rank that
    updates the most; `zero_stage` 1 the distributed optimizer, 2 and 3 FSDP2 on labkit's driver or Megatron-FSDP
    on Megatron-LM (`entrypoint`), with their working buffers; `transformer_impl` decides FSDP2's units;
    `optimizer_dtypes` the precision-aware optimizer's) unless
    `zero_backend` is deepspeed, whose ZeRO is counted from the bytes-per-parameter table.
    `chunks`: the transformer layers of each stage's model chunks; by default each stage's layers split evenly over
    `virtual_stages`. `expert`, `expert_tensor`: a mixture-of-experts model's expert-parallel and expert-tensor sizes
    (see `model_state_bytes`); each stage's MoE layers (shape.moe_layers, where its chunks fall) keep an MoE layer's
    activations (`activation_bytes_per_layer` with `moe`). `evaluates`: the run validates (train.eval_interval), a
    forward between an optimizer step and the next zero_grad (StageMemory.evaluation). `fp8_weights`: what
    Transformer Engine holds of the linear layers' weights (FP8Weights; None on CPUs and outside low precisions).
    `fsdp_master_shards`: FSDP2 as PyTorch's own trainers run it (Stack.fsdp_master_shards). `moe_overlap`: the MoE
    all-to-all's overlap (--overlap-moe-expert-parallel-comm), whose combined 1F1B steps run one micro-batch's forward
    beside another's backward layer by layer (combined_1f1b.py), the forward taking a layer's activations as the
    backward frees one: at most one layer's more than the in-flight count, the stage's largest.
    """
    p = len(partition)
    chunks = chunks or [[n // virtual_stages + (k < n % virtual_stages) for k in range(virtual_stages)]
                        for n in partition]
    firsts = chunk_first_layers(chunks)

    def model_state(i: int, params: float) -> tuple[float, float, float, float, float]:
        if zero_stage and sharding.choose(zero_stage, zero_backend, entrypoint).implementation == sharding.DEEPSPEED:
            weights, gradients, optimizer_state = (params * n for n in bytes_per_param(
                precision, data_parallel, zero_stage=zero_stage, optimizer=optimizer))
            if fp8_weights is not None:  # Transformer Engine's cached copies of the whole local linear weights
                weights += fp8_weights.quantized * stage_linear_weight_elements(
                    shape, chunks[i], firsts[i], tensor=tensor, expert=expert, expert_tensor=expert_tensor)
            return weights, gradients, optimizer_state, 0.0, 0.0
        state = model_state_bytes(shape, chunks[i], stage=i, pipeline=p, tensor=tensor, data_parallel=data_parallel,
                                  context=context, precision=precision, distributed_optimizer=distributed_optimizer,
                                  grad_reduce_in_bf16=grad_reduce_in_bf16, optimizer=optimizer,
                                  overlap_grad_reduce=overlap_grad_reduce, zero_stage=zero_stage, expert=expert,
                                  expert_tensor=expert_tensor, first_layers=firsts[i], entrypoint=entrypoint,
                                  transformer_impl=transformer_impl, optimizer_dtypes=optimizer_dtypes,
                                  fp8_weights=fp8_weights, fsdp_master_shards=fsdp_master_shards)
        return state.weights, state.gradients, state.optimizer, state.step_only, state.step_transient

    act_scale = 2 if precision == "fp32" else 1
    s, b, h, t = shape.seq_length / context, micro_batch, shape.hidden, tensor
    kernels = {"flash_attention": flash_attention, "context": context, "recompute_modules": recompute_modules}
    moe_kernels = {**kernels, "moe": True, "expert_tensor": expert_tensor}
    params_by_stage = (stage_params(shape, partition, tensor, expert=expert, expert_tensor=expert_tensor)
                       if shape.moe else stage_params(shape, partition, tensor))
    out = []
    for i, (layers, params) in enumerate(zip(partition, params_by_stage)):
        held = in_flight_micro_batches(i, p, num_micro_batches, virtual_stages)
        per_layer = activation_bytes_per_layer(shape, b, t, sequence_parallel, recompute, precision, **kernels)
        if not shape.moe:
            acts = held * layers * per_layer
        else:
            moe = sum(sum(moe_pattern(shape)[first:first + n]) for first, n in zip(firsts[i], chunks[i]))
            per_moe = activation_bytes_per_layer(shape, b, t, sequence_parallel, recompute, precision, **moe_kernels)
            acts = held * ((layers - moe) * per_layer + moe * per_moe)
        if moe_overlap and layers:  # the combined step's forward beside its backward partner
            acts += per_moe if shape.moe and moe else per_layer
        if recompute == "full" and layers:
            # the layers being recomputed hold their full activations during their backward
            full = activation_bytes_per_layer(shape, b, t, sequence_parallel, None, precision, **kernels)
            if shape.moe:
                full = max(full, activation_bytes_per_layer(shape, b, t, sequence_parallel, None, precision,
                                                            **moe_kernels))
            acts += min(recompute_layers, layers) * full
        if i == 0:
            mask = s * b * h if shape.hidden_dropout else 0
            acts += held * (8 * s * b + mask) * act_scale  # token ids/positions and the embedding dropout mask
        logits = 4 * s * b * h * (1 + shape.vocab / h) / t if i == p - 1 else 0.0  # fp32 logits and their gradient
        acts += logits
        evaluation = 0.0
        if evaluates:  # a forward without recompute, one layer's activations at a time
            one = activation_bytes_per_layer(shape, b, t, sequence_parallel, None, precision, **kernels)
            if shape.moe:
                one = max(one, activation_bytes_per_layer(shape, b, t, sequence_parallel, None, precision,
                                                          **moe_kernels))
            evaluation = (one if layers else 0.0) + logits
        weights, gradients, optimizer_state, step_only, step_transient = model_state(i, params)
        out.append(StageMemory(weights=weights / GIB, gradients=gradients / GIB, optimizer=optimizer_state / GIB,
                               activations=acts / GIB, in_flight=held, step_only=step_only / GIB,
                               step_transient=step_transient / GIB, evaluation=evaluation / GIB))
    return out

"""Memory per GPU of each pipeline stage: weights, gradients, optimizer state and activations. Sizes in GiB (2^30 bytes,
what nvidia-smi and the GPU catalog call GB).

Model state, bytes per parameter (Megatron-LM README "Distributed Optimizer", commit 01ad96e51b; Adam):
    fp32          4 weight + 4 grad + 8 (m, v)                              = 16, distributed optimizer 8 + 8/d
    bf16 mixed    2 weight + 4 fp32 grad + 12 (fp32 master, m, v)          = 18, distributed optimizer 6 + 12/d
    fp16 mixed    2 weight + 2 grad + 16 (fp32 master, fp32 grad, m, v)    = 20, distributed optimizer 4 + 16/d
ZeRO (Rajbhandari et al., arXiv 1910.02054) counts mixed-precision Adam as 2 + 2 + 12 = 16: stage 1 -> 4 + 12/d,
stage 2 -> 2 + 14/d, stage 3 -> 16/d. SGD keeps one momentum instead of Adam's two moments (4 bytes fewer).

Activations per transformer layer per micro-batch, 16-bit (Korthikanti et al., arXiv 2205.05198, Table 2):
    no recompute         s b h (10 + 24/t + 5 a s/(h t))      (t = 1 gives 34 + 5as/h)
    + sequence parallel  s b h (34 + 5 a s/h) / t
    selective recompute  s b h (10 + 24/t), with SP 34 s b h / t
    full recompute       2 s b h per layer (/t with SP), plus one layer's full activations while it is recomputed
The 10 is two norm inputs (4), the QKV and MLP inputs (4) and two dropout masks (2); the 24 is Q, K, V and the
projection input (8) and the MLP's saved tensors (16 = 4 f/h: the GELU input and the MLP-out input, each f wide).
Under SwiGLU megatron-core's fused bias_swiglu saves the 2f-wide MLP-in output and the MLP-out matrix the f-wide
product: 6 f/h. The 5as/h is the softmax output (2), its dropout mask (1) and dropout output (2). With dropout 0 no
mask is kept and the attention-over-values product reads the softmax output itself: 8 and 2as/h. (The unfused core
attention repeats grouped K/V to every head before the products that save them, so GQA keeps 8 too.)
fp32 training doubles the 2-byte tensors, which we approximate as twice the total.
Under 1F1B stage i holds min(p - i, m) micro-batches in flight; the interleaved schedule multiplies the first stage's
count by 1 + (p - 1)/(p v). The first stage adds the token ids and positions (8 s b per micro-batch) and the embedding
dropout mask (s b h, with dropout), the last stage the fp32 logits, 4 s b h (1 + V/h) / t.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from labkit.estimate.params import Shape, stage_params

GIB = 2 ** 30

# Bytes per parameter: (weight, gradient, optimizer state); the optimizer share is what the distributed optimizer splits.
_MODEL_STATE = {
    "fp32": (4, 4, 8),
    "bf16": (2, 4, 12),
    "fp16": (2, 2, 16),
    "fp8": (2, 4, 12),  # Megatron keeps bf16 weights with fp32 gradients and master copy; FP8 casts are transient
}
_ZERO_MIXED = (2, 2, 12)


@dataclass
class StageMemory:
    """One GPU of one pipeline stage, in GiB."""
    weights: float
    gradients: float
    optimizer: float
    activations: float
    in_flight: float  # micro-batches whose activations are held at the peak

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def bytes_per_param(precision: str, data_parallel: int = 1, distributed_optimizer: bool = False, zero_stage: int = 0,
                    optimizer: str = "adam") -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter on one GPU.

    Taught in lab 02.
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
    weight, grad, opt = _MODEL_STATE[precision]
    if optimizer == "sgd":
        opt -= 4
    return weight, grad, opt / d if distributed_optimizer else opt


def activation_bytes_per_layer(shape: Shape, micro_batch: int, tensor: int = 1, sequence_parallel: bool = False,
                               recompute: str | None = None, precision: str = "bf16", flash_attention: bool = False,
                               context: int = 1) -> float:
    """Activation bytes one transformer layer keeps for the backward pass of one micro-batch (Korthikanti Table 2).

    Unfused attention keeps the s x s scores (softmax output, its dropout mask and output: Korthikanti's 5as/h).
    Flash and fused attention never write them: they keep the output (counted with the projection) and a float32
    log-sum-exp per head and token (4a/h). Context parallelism splits the sequence, and so every term, over its ranks.
    """
    s, b, h, a, t = shape.seq_length / context, micro_batch, shape.hidden, shape.heads, tensor
    replicated = 10 if shape.hidden_dropout else 8
    sharded = 8 + (6 if shape.swiglu else 4) * shape.ffn_size / h  # 24 for the 4h GELU MLP
    scores = 4 * a / h if flash_attention else (5 if shape.attention_dropout else 2) * a * shape.seq_length / h
    if recompute == "full":
        value = 2 * s * b * h / (t if sequence_parallel else 1)
    elif recompute == "selective":
        value = s * b * h * ((replicated + sharded) / t if sequence_parallel else replicated + sharded / t)
    elif sequence_parallel:
        value = s * b * h * (replicated + sharded + scores) / t
    else:
        value = s * b * h * (replicated + sharded / t + scores / t)
    return value * (2 if precision == "fp32" else 1)


def in_flight_micro_batches(stage: int, pipeline: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak under 1F1B (interleaved when v > 1)."""
    held = min(pipeline - stage, num_micro_batches)
    if virtual_stages > 1:
        held *= 1 + (pipeline - 1) / (pipeline * virtual_stages)
    return min(held, num_micro_batches)


def memory_per_stage(shape: Shape, partition: list[int], *, tensor: int = 1, data_parallel: int = 1,
                     micro_batch: int = 1, num_micro_batches: int = 1, precision: str = "bf16",
                     recompute: str | None = None, recompute_layers: int = 1, sequence_parallel: bool = False,
                     virtual_stages: int = 1, distributed_optimizer: bool = False, zero_stage: int = 0,
                     optimizer: str = "adam", flash_attention: bool = False, context: int = 1) -> list[StageMemory]:
    """Peak memory of one GPU in each pipeline stage (GiB), without the CUDA context and allocator slack."""
    p = len(partition)
    weight_b, grad_b, opt_b = bytes_per_param(precision, data_parallel, distributed_optimizer, zero_stage, optimizer)
    act_scale = 2 if precision == "fp32" else 1
    s, b, h, t = shape.seq_length / context, micro_batch, shape.hidden, tensor
    kernels = {"flash_attention": flash_attention, "context": context}
    out = []
    for i, (layers, params) in enumerate(zip(partition, stage_params(shape, partition, tensor))):
        held = in_flight_micro_batches(i, p, num_micro_batches, virtual_stages)
        per_layer = activation_bytes_per_layer(shape, b, t, sequence_parallel, recompute, precision, **kernels)
        acts = held * layers * per_layer
        if recompute == "full" and layers:
            # the layers being recomputed hold their full activations during their backward
            full = activation_bytes_per_layer(shape, b, t, sequence_parallel, None, precision, **kernels)
            acts += min(recompute_layers, layers) * full
        if i == 0:
            mask = s * b * h if shape.hidden_dropout else 0
            acts += held * (8 * s * b + mask) * act_scale  # token ids/positions and the embedding dropout mask
        if i == p - 1:
            acts += 4 * s * b * h * (1 + shape.vocab / h) / t  # fp32 logits and their gradient
        out.append(StageMemory(weights=params * weight_b / GIB, gradients=params * grad_b / GIB,
                               optimizer=params * opt_b / GIB, activations=acts / GIB, in_flight=held))
    return out

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
`activation_bytes_per_layer` counts the tensors megatron-core 0.16.1 really saves, term by term, which gives the table
for a GPT layer with Megatron-LM's fused kernels (plus the norms' fp32 statistics) and departs from it where the
layer departs: SwiGLU (the fused kernel keeps the 2f-wide input and the MLP-out GEMM the f-wide product, 6 f/h),
rotary embeddings and grouped K/V (Q, K and V as the core attention keeps them), flash attention (no scores), FP8
(1-byte GEMM inputs), fp32 (4-byte activations, 1-byte masks), dropout 0 (no masks), and the CPU's unfused kernels.
tests/test_activation_memory.py counts the bytes on the CPU and finds it within 2%.
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
                               context: int = 1, on_cpu: bool = False) -> float:
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
    (Korthikanti Table 2); context parallelism splits the sequence, and so every term, over its ranks.
    """
    s, b, h, a, t = shape.seq_length / context, micro_batch, shape.hidden, shape.heads, tensor
    e = 4 if precision == "fp32" else 2  # bytes of one activation (fp8 runs its non-GEMM work in bf16)
    split = t if sequence_parallel else 1
    if recompute == "full":
        return s * b * h * e / split  # the checkpoint keeps the layer's input
    fp8 = precision == "fp8" and not on_cpu
    gemm_input = 1 if fp8 else e
    mask = (e if on_cpu else 1) if shape.hidden_dropout else 0
    f, r = shape.ffn_size / h, shape.groups / a
    rope = shape.positions == "rope"
    core = recompute != "selective"  # selective recomputation keeps only the core attention's inputs
    unfused = core and not flash_attention

    # Per token and hidden unit, outside the tensor-parallel regions: each norm's input (and statistics), the QKV and
    # MLP-in GEMM inputs it feeds, the dropout masks after attention and MLP.
    if on_cpu:
        norm = 8 + 4 / h if shape.norm == "RMSNorm" else e + 2 * e / h
    else:
        norm = e + (4 if shape.norm == "RMSNorm" else 8) / h
    outside = 2 * (norm + gemm_input + mask)

    # Inside them, split over t: Q, K and V as the core attention keeps them (a view of the QKV output keeps all of
    # it; rotary embeddings make new Q and K), the projection input, the MLP.
    repeat = unfused and shape.groups < a
    q = 1 if rope else 0
    k = 1 if repeat else r if rope else 0
    v = 1 if repeat else 0
    qkv_output = 0 if rope and repeat else 1 + 2 * r
    projection = gemm_input + (e if fp8 and flash_attention and core else 0)
    if shape.swiglu:
        mlp = f * (2 * e + (2 * e if on_cpu else 0) + gemm_input)
    else:
        mlp = f * (e + gemm_input)  # the activation's input and the MLP-out GEMM's
    inside = e * (q + k + v + qkv_output) + projection + mlp

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
        per_layer += 4 * s * (h / a) * e
    return s * b * h * (outside / split + (inside + scores) / t) + per_layer


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

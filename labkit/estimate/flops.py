"""FLOPs per iteration, achieved TFLOP/s, MFU/HFU and training time (SC21: arXiv:2104.04473; arXiv:2205.05198).

Only matrix multiplications are counted (2 FLOPs per multiply-add), forward + backward = 3 x forward.
- `hardware_flops` with full recompute is SC21 eq. (3), F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)): the formula of
  NVIDIA DLI's *Model Parallelism* workshop. Without recompute it is the model FLOPs of Korthikanti et al. §6, 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
- `model_flops` is the general form of the latter (GQA, SwiGLU, any FFN size); it is also Megatron-LM's logged formula
  of 2024 (commit e116d81ed7). `megatron_logged_flops` gives the other versions Megatron has printed.
"""
from __future__ import annotations

from labkit.estimate.params import Shape

SECONDS_PER_DAY = 86400.0


def layer_forward_flops(shape: Shape, tokens: float) -> float:
    """Forward FLOPs of one transformer layer over `tokens` = micro_batch x seq_length tokens (non-causal attention)."""
    h, f, s = shape.hidden, shape.ffn_size, shape.seq_length
    qkv = h * (h + 2 * h * shape.groups / shape.heads)
    mlp = h * f * (3 if shape.swiglu else 2)
    attention = 2 * s * h  # QK^T and attention x V, per token
    return 2 * tokens * (qkv + h * h + mlp + attention)


def logits_forward_flops(shape: Shape, tokens: float) -> float:
    return 2 * tokens * shape.hidden * shape.vocab


def attention_core_forward_flops(shape: Shape, tokens: float) -> float:
    """The part selective recompute runs again: QK^T and attention x V."""
    return 2 * tokens * 2 * shape.seq_length * shape.hidden


def model_flops(shape: Shape, global_batch: int) -> float:
    """Model FLOPs of one iteration (no recompute): the MFU numerator."""
    tokens = global_batch * shape.seq_length
    return 3 * (shape.num_layers * layer_forward_flops(shape, tokens) + logits_forward_flops(shape, tokens))


def megatron_logged_flops(shape: Shape, global_batch: int) -> float:
    """The FLOPs Megatron-LM's training loop divides by time for its logged `throughput per GPU (TFLOP/s/GPU)`
    (`num_floating_point_operations` in megatron/training/training.py since 2025): model FLOPs with causal attention,
    so QK^T and attention x V count half of `model_flops`' full s x s, over the padded vocabulary."""
    tokens = global_batch * shape.seq_length
    causal_attention = attention_core_forward_flops(shape, tokens) / 2
    layer = layer_forward_flops(shape, tokens) - causal_attention
    return 3 * (shape.num_layers * layer + 2 * tokens * shape.hidden * shape.padded_vocab())


def hardware_flops(shape: Shape, global_batch: int, recompute: str | None = "full") -> float:
    """FLOPs actually executed: full recompute runs every layer's forward twice, selective re-runs attention's core."""
    tokens = global_batch * shape.seq_length
    extra = 0.0
    if recompute == "full":
        extra = shape.num_layers * layer_forward_flops(shape, tokens)
    elif recompute == "selective":
        extra = shape.num_layers * attention_core_forward_flops(shape, tokens)
    return model_flops(shape, global_batch) + extra


def flops_96(B: float, s: float, l: float, h: float, V: float) -> float:
    """SC21 eq. (3) as typed in the workshop notebook (full recompute).

    Taught in lab 05.
    """
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def flops_72(B: float, s: float, l: float, h: float, V: float) -> float:
    """Model FLOPs without recompute, Korthikanti et al. §6.

    Taught in lab 05.
    """
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def megatron_logged_flops(shape: Shape, global_batch: int, version: str = "2025") -> float:
    """What Megatron-LM's `throughput per GPU` numerator was at a given time.

    2023: 60 B s l h^2 (1 + g/(5a) + s/(5h) + V/(10 l h)) (commit 2748e7c7d4, MHA-only MLP of 4h);
    2024: the general model FLOPs (commit e116d81ed7, non-causal attention);
    2025: as 2024 but the causal mask halves the attention-score FLOPs (commit 8873b55d6a), so long sequences log less.
    """
    B, s, l, h, V = global_batch, shape.seq_length, shape.num_layers, shape.hidden, shape.vocab
    if version == "2023":
        g, a = shape.groups, shape.heads
        return 60 * B * s * l * h * h * (1 + g / (5 * a) + s / (5 * h) + V / (10 * l * h))
    if version == "2024":
        return model_flops(shape, global_batch)
    if version == "2025":
        return model_flops(shape, global_batch) - 3 * l * attention_core_forward_flops(shape, B * s) / 2
    raise ValueError(f"version: {version!r} is not one of 2023, 2024, 2025")


def achieved_tflops(flops_per_iteration: float, iteration_time_s: float, num_gpus: int) -> float:
    """TFLOP/s per GPU, as the workshop computes it (157.7 for its 18B model at 32.09 s on 16 GPUs).

    Taught in lab 05.
    """
    return flops_per_iteration / iteration_time_s / num_gpus / 1e12


def utilization(flops_per_iteration: float, iteration_time_s: float, peak_tflops_total: float) -> float:
    """Fraction of peak: MFU with model FLOPs, HFU with executed FLOPs; `peak_tflops_total` sums every GPU's peak.

    Taught in lab 05.
    """
    return flops_per_iteration / iteration_time_s / (peak_tflops_total * 1e12)


def training_days(tokens: float, params: float, num_gpus: int, tflops_per_gpu: float, recompute: bool = True) -> float:
    """SC21 eq. (4): 8 T P / (N X) with full recompute, 6 T P / (N X) without; in days.

    Taught in lab 05.
    """
    factor = 8 if recompute else 6
    return factor * tokens * params / (num_gpus * tflops_per_gpu * 1e12) / SECONDS_PER_DAY

"""FLOPs per iteration, achieved TFLOP/s, MFU/HFU and training time (SC21: arXiv:2104.04473; arXiv:2205.05198).

Only matrix multiplications are counted (2 FLOPs per multiply-add), forward + backward = 3 x forward. The model's own
FLOPs, and what Megatron-LM logs, are counted in labkit.megatron.flops; this module adds what a run executes and what
it achieves.
- `hardware_flops` with full recompute is SC21 eq. (3), F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)): the formula of
  NVIDIA DLI's *Model Parallelism* workshop. Without recompute it is the model FLOPs of Korthikanti et al.
  §6, 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
- `model_flops` (labkit.megatron.flops) is the general form of the latter (GQA, SwiGLU, any FFN size).
"""
from __future__ import annotations

from labkit.megatron.flops import model_flops, recomputed_forward_flops
from labkit.megatron.shape import Shape

SECONDS_PER_DAY = 86400.0


def hardware_flops(shape: Shape, global_batch: int, recompute: str | None = "full",
                   modules: tuple[str, ...] | list[str] | None = None) -> float:
    """FLOPs actually executed: full recompute runs every layer's forward twice, selective re-runs its `modules`
    (attention's core by default; labkit.megatron.flops.recomputed_forward_flops)."""
    tokens = global_batch * shape.seq_length
    extra = shape.num_layers * recomputed_forward_flops(shape, tokens, recompute, modules)
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

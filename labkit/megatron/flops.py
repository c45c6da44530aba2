"""The FLOPs of one training iteration of Megatron's GPT, counted as Megatron-LM counts them: matrix multiplications
only (2 FLOPs per multiply-add), backward = 2 x forward (SC21: arXiv:2104.04473; Korthikanti et al.: arXiv:2205.05198).

`model_flops` is the general form (GQA, SwiGLU, any MLP width), Megatron-LM's logged formula of 2024 (commit
e116d81ed7); `megatron_logged_flops` gives each version Megatron-LM has printed as `throughput per GPU (TFLOP/s/GPU)`,
which the driver logs too. The estimator adds recompute and utilisation on top (labkit.estimate.flops).
"""
from __future__ import annotations

from labkit.megatron.shape import Shape


def mlp_forward_flops(shape: Shape, tokens: float, moe: bool = False) -> float:
    """Forward FLOPs of one layer's MLP side over `tokens`: a dense MLP, or an MoE layer's router (hidden x experts),
    the top-k experts each token goes to and the shared experts every token passes (Megatron-LM's
    num_floating_point_operations counts the same terms)."""
    h, matrices = shape.hidden, (3 if shape.swiglu else 2)
    if not moe:
        return 2 * tokens * h * shape.ffn_size * matrices
    per_token = h * shape.experts + shape.topk * h * shape.expert_ffn_size * matrices
    if shape.shared_ffn:
        per_token += h * shape.shared_ffn * matrices
    return 2 * tokens * per_token


def layer_forward_flops(shape: Shape, tokens: float, moe: bool | None = None) -> float:
    """Forward FLOPs of one transformer layer over `tokens` = micro_batch x seq_length tokens (non-causal attention):
    a dense layer, an MoE layer, or with `moe` None the mean layer of the model (its MoE and dense layers in the
    proportion of shape.moe_layers), so that num_layers x this is the whole model's."""
    h, s, inner = shape.hidden, shape.seq_length, shape.heads * shape.head_dim
    qkv = h * (inner + 2 * shape.groups * shape.head_dim)
    attention = 2 * s * inner  # QK^T and attention x V, per token
    if moe is None and shape.moe:
        share = sum(shape.moe_layers) / shape.num_layers
        mlp = share * mlp_forward_flops(shape, tokens, True) + (1 - share) * mlp_forward_flops(shape, tokens, False)
    elif moe is None:
        mlp = mlp_forward_flops(shape, tokens)
    else:
        mlp = mlp_forward_flops(shape, tokens, moe)
    return 2 * tokens * (qkv + inner * h + attention) + mlp


def logits_forward_flops(shape: Shape, tokens: float) -> float:
    return 2 * tokens * shape.hidden * shape.vocab


def attention_core_forward_flops(shape: Shape, tokens: float) -> float:
    """The part selective recompute runs again: QK^T and attention x V."""
    return 2 * tokens * 2 * shape.seq_length * shape.heads * shape.head_dim


SELECTIVE_DEFAULT = ("core_attn",)
"""megatron-core's --recompute-modules when selective granularity names none (TransformerConfig.recompute_modules)."""


def recomputed_forward_flops(shape: Shape, tokens: float, granularity: str | None,
                             modules: tuple[str, ...] | list[str] | None = None) -> float:
    """Forward FLOPs the backward pass runs again, per mean layer of the model (as layer_forward_flops): a whole layer
    under full recompute; under selective the modules' own (megatron-core 0.16.1's TransformerLayer and MoELayer,
    `recompute_modules`): core_attn QK^T and attention x V; mlp the dense layers' MLP; moe an MoE layer's router,
    experts and shared experts; shared_experts the shared experts alone; layernorm and moe_act recompute elementwise
    work only (norms, the experts' activation), no matrix multiplication."""
    if granularity == "full":
        return layer_forward_flops(shape, tokens)
    if granularity != "selective":
        return 0.0
    chosen = set(modules or SELECTIVE_DEFAULT)
    moe_share = sum(shape.moe_layers) / shape.num_layers
    extra = attention_core_forward_flops(shape, tokens) if "core_attn" in chosen else 0.0
    if "mlp" in chosen:
        extra += (1 - moe_share) * mlp_forward_flops(shape, tokens)
    if "moe" in chosen:
        extra += moe_share * mlp_forward_flops(shape, tokens, moe=True)
    elif "shared_experts" in chosen and shape.shared_ffn:
        extra += moe_share * 2 * tokens * shape.hidden * shape.shared_ffn * (3 if shape.swiglu else 2)
    return extra


def model_flops(shape: Shape, global_batch: int) -> float:
    """Model FLOPs of one iteration (no recompute): the MFU numerator.

    Taught in lab 10.
    """
    tokens = global_batch * shape.seq_length
    return 3 * (shape.num_layers * layer_forward_flops(shape, tokens) + logits_forward_flops(shape, tokens))


def megatron_logged_flops(shape: Shape, global_batch: int, version: str = "2025") -> float:
    """What Megatron-LM's `throughput per GPU` numerator was at a given time.

    2023: 60 B s l h^2 (1 + g/(5a) + s/(5h) + V/(10 l h)) (commit 2748e7c7d4, MHA-only MLP of 4h);
    2024: the general model FLOPs (commit e116d81ed7, non-causal attention);
    2025: as 2024 but the causal mask halves the attention-score FLOPs (commit 8873b55d6a), so long sequences log less.
    Neither counts an MoE layer's router GEMM (hidden x experts per token; num_floating_point_operations in
    megatron/training/training.py counts the routed and shared experts only), which model_flops does.
    """
    B, s, l, h, V = global_batch, shape.seq_length, shape.num_layers, shape.hidden, shape.vocab
    if version == "2023":
        g, a = shape.groups, shape.heads
        return 60 * B * s * l * h * h * (1 + g / (5 * a) + s / (5 * h) + V / (10 * l * h))
    routers = 3 * sum(shape.moe_layers) * 2 * B * s * h * (shape.experts or 0)
    if version == "2024":
        return model_flops(shape, global_batch) - routers
    if version == "2025":
        return model_flops(shape, global_batch) - routers - 3 * l * attention_core_forward_flops(shape, B * s) / 2
    raise ValueError(f"version: {version!r} is not one of 2023, 2024, 2025")

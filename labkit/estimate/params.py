"""Parameter counts: the GPT formula of NVIDIA DLI's *Model Parallelism* workshop and the model as Megatron-LM builds
it (GQA, SwiGLU, RMSNorm, rotary positions, bias-free layers, untied embeddings, vocabulary padding).

SC21 eq. (2) (Narayanan et al., arXiv 2104.04473): P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)). Written out it is
l (12h^2 + 13h) + (V + s) h: per layer the QKV, projection and two MLP matrices (12h^2) with their biases (9h) and two
layer norms (4h); then word and position embeddings. The general form below keeps that bookkeeping and adds the final
norm the formula leaves out, so a plain GPT counts gpt_params + 2h (GPT-2 small: 124,439,808, as published) and a
Llama counts its published number. `params_with_padding` and `rank_params` count the vocabulary as Megatron pads it.
"""
from __future__ import annotations

from labkit.megatron.shape import Shape
from labkit.spec import RunSpec


def gpt_params(l: int, h: int, s: int, V: int) -> int:
    """SC21 eq. (2), the formula the workshop notebook types in; exact integer arithmetic.

    Taught in lab 05.
    """
    return 12 * l * h * h + 13 * l * h + (V + s) * h


def attention_params(shape: Shape, tensor: int = 1) -> float:
    """Self-attention of one layer on one tensor rank, with its input norm: QKV (heads x head_dim queries, 2 x
    groups x head_dim keys and values, column-parallel) and the output projection (row-parallel), their biases, and
    Qwen3's per-head query and key norms (replicated)."""
    h, d = shape.hidden, shape.head_dim
    qkv_out = (shape.heads + 2 * shape.groups) * d
    split = h * qkv_out + shape.heads * d * h
    replicated = shape.norm_params + (2 * shape.norm_params * d // h if shape.qk_layernorm else 0)
    if shape.bias:
        split += qkv_out
        replicated += h  # projection bias
    return split / tensor + replicated


def mlp_params(shape: Shape, width: int, tensor: int = 1) -> float:
    """One MLP of this width on one tensor rank: in (2 x width under SwiGLU, column-parallel) and out (row-parallel),
    with their biases (the out bias replicated)."""
    h = shape.hidden
    mlp_in = 2 * width if shape.swiglu else width
    split, replicated = h * mlp_in + width * h, 0
    if shape.bias:
        split += mlp_in
        replicated += h
    return split / tensor + replicated


def moe_params(shape: Shape, tensor: int = 1, expert: int = 1, expert_tensor: int = 1,
               experts: int | None = None) -> float:
    """The MLP side of one MoE layer on one rank (megatron-core's MoELayer): the router's weight (experts x hidden,
    replicated), `experts` of the routed experts (all of them unless given: topk for the active count) split over
    `expert` ranks and `expert_tensor` ranks each, and the shared experts, tensor-parallel like a dense MLP."""
    routed = shape.experts if experts is None else experts
    router = shape.experts * (shape.hidden + 1 if shape.bias else shape.hidden)  # megatron-core's Router: its bias too
    n = router + routed / expert * mlp_params(shape, shape.expert_ffn_size, expert_tensor)
    if shape.shared_ffn:
        n += mlp_params(shape, shape.shared_ffn, tensor)
    return n


def layer_params(shape: Shape, tensor: int = 1, moe: bool = False, expert: int = 1, expert_tensor: int | None = None,
                 active: bool = False) -> float:
    """Parameters of one transformer layer held by one rank: attention, then the MLP's norm and a dense MLP, or an
    MoE layer (`moe`) whose experts split over `expert` x `expert_tensor` ranks (expert_tensor: tensor unless given);
    `active`: only the top-k experts a token passes through.

    Column-parallel matrices (QKV, MLP in: 2f wide under SwiGLU) and their biases split over the tensor ranks;
    row-parallel matrices (projection, MLP out) split too, but their biases and the norms are replicated on every rank.
    """
    n = attention_params(shape, tensor) + shape.norm_params
    if not moe:
        return n + mlp_params(shape, shape.ffn_size, tensor)
    etp = tensor if expert_tensor is None else expert_tensor
    return n + moe_params(shape, tensor, expert, etp, experts=shape.topk if active else None)


def layers_params(shape: Shape, first: int, count: int, tensor: int = 1, expert: int = 1,
                  expert_tensor: int | None = None, active: bool = False) -> float:
    """The layers first .. first + count - 1 on one rank, each dense or MoE as shape.moe_layers says."""
    pattern = shape.moe_layers[first:first + count]
    dense, moe = pattern.count(0), pattern.count(1)
    out = 0.0
    if dense:
        out += dense * layer_params(shape, tensor)
    if moe:
        out += moe * layer_params(shape, tensor, True, expert, expert_tensor, active)
    return out


def embedding_params(shape: Shape, tensor: int = 1, vocab: int | None = None) -> float:
    """Word embedding (split over tensor ranks by vocabulary) plus learned positions (replicated; none with rope).
    `vocab`: the rows of the table, the model's vocabulary unless given (Megatron's padded one)."""
    positions = shape.seq_length * shape.hidden if shape.positions == "learned_absolute" else 0
    return (vocab or shape.vocab) * shape.hidden / tensor + positions


def output_params(shape: Shape, tensor: int = 1, vocab: int | None = None) -> float:
    """The output projection's own weights: zero when tied to the word embedding."""
    return 0.0 if shape.tied else (vocab or shape.vocab) * shape.hidden / tensor


def total_params(shape: Shape) -> int:
    """The whole model with its vocabulary unpadded: gpt_params(l, h, s, V) + the final norm for a plain GPT (MHA, 4h
    GELU MLP, tied embeddings), the published count of a Llama, and every expert of an MoE model.

    Taught in lab 10.
    """
    return round(sum(stage_params(shape, [shape.num_layers], vocab=shape.vocab)))


def active_params(shape: Shape) -> int:
    """The parameters one token passes through, vocabulary unpadded: all of a dense model; of an MoE model the
    router, the shared experts and the top-k routed experts of each MoE layer (the "active" count model cards give:
    Mixtral-8x7B 12.9 B of 46.7 B).

    Taught in lab 10.
    """
    return round(sum(stage_params(shape, [shape.num_layers], vocab=shape.vocab, active=True)))


def params_with_padding(shape: Shape, tensor: int = 1) -> int:
    """The whole model as Megatron builds it at this tensor size, with the padded vocabulary."""
    return round(sum(stage_params(shape, [shape.num_layers], vocab=shape.padded_vocab(tensor))))


def stage_params(shape: Shape, partition: list[int], tensor: int = 1, vocab: int | None = None, expert: int = 1,
                 expert_tensor: int | None = None, active: bool = False) -> list[float]:
    """Parameters held by one GPU of each pipeline stage (one tensor rank, one expert rank), as Megatron builds them.

    The first stage holds the embeddings; the last holds the final norm and the output layer, which with tied
    embeddings and more than one stage is a second copy of the word embedding (Megatron keeps both in sync with an
    all-reduce). `vocab`: the vocabulary counted, Megatron's padded one for this tensor size unless given. The stages
    hold consecutive layers in order, so an MoE pattern's dense layers fall where they are (interleaved chunks are
    counted as if consecutive: exact when every layer is alike).
    """
    p = len(partition)
    vocab = vocab or shape.padded_vocab(tensor)
    out = []
    first = 0
    for i, layers in enumerate(partition):
        n = layers_params(shape, first, layers, tensor, expert, expert_tensor, active)
        first += layers
        if i == 0:
            n += embedding_params(shape, tensor, vocab)
        if i == p - 1:
            n += shape.norm_params + output_params(shape, tensor, vocab)
            if shape.tied and p > 1:
                n += vocab * shape.hidden / tensor
        out.append(n)
    return out


def rank_params(spec: RunSpec, tensor_rank: int, pipeline_rank: int) -> int:
    """The parameters of one (tensor, pipeline) rank as Megatron logs them: `number of parameters on (tensor,
    pipeline) model parallel rank (t, p): N`.

    The first pipeline rank holds the word embedding (and the learned position table), the last the final norm and the
    output layer (with tied embeddings and more than one stage, a copy of the word embedding); each rank's layers split
    their column- and row-parallel matrices over the tensor ranks and keep whole copies of the norms and row-parallel
    biases, so every tensor rank of a stage holds the same count. Interleaved chunks of a rank are summed.
    """
    t, p = spec.parallel.tensor, spec.parallel.pipeline
    if not (0 <= tensor_rank < t and 0 <= pipeline_rank < p):
        raise ValueError(f"rank ({tensor_rank}, {pipeline_rank}) is outside tensor {t} x pipeline {p}")
    return round(stage_params(Shape.of(spec.model), spec.layer_partition, t)[pipeline_rank])

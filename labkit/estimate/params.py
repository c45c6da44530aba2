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


def layer_params(shape: Shape, tensor: int = 1) -> float:
    """Parameters of one transformer layer held by one tensor-parallel rank.

    Column-parallel matrices (QKV, MLP in: 2f wide under SwiGLU) and their biases split over `tensor`; row-parallel
    matrices (projection, MLP out) split too, but their biases and the two norms are replicated on every rank.
    """
    h, f = shape.hidden, shape.ffn_size
    qkv_out = h + 2 * h * shape.groups // shape.heads
    mlp_in = 2 * f if shape.swiglu else f
    split = h * qkv_out + h * h + h * mlp_in + f * h
    replicated = 2 * shape.norm_params
    if shape.bias:
        split += qkv_out + mlp_in
        replicated += h + h  # projection and MLP-out biases
    return split / tensor + replicated


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
    GELU MLP, tied embeddings), and the published count of a Llama."""
    return round(sum(stage_params(shape, [shape.num_layers], vocab=shape.vocab)))


def params_with_padding(shape: Shape, tensor: int = 1) -> int:
    """The whole model as Megatron builds it at this tensor size, with the padded vocabulary."""
    return round(sum(stage_params(shape, [shape.num_layers], vocab=shape.padded_vocab(tensor))))


def stage_params(shape: Shape, partition: list[int], tensor: int = 1, vocab: int | None = None) -> list[float]:
    """Parameters held by one GPU of each pipeline stage (one tensor rank), as Megatron builds them.

    The first stage holds the embeddings; the last holds the final norm and the output layer, which with tied
    embeddings and more than one stage is a second copy of the word embedding (Megatron keeps both in sync with an
    all-reduce). `vocab`: the vocabulary counted, Megatron's padded one for this tensor size unless given.
    """
    p = len(partition)
    vocab = vocab or shape.padded_vocab(tensor)
    out = []
    for i, layers in enumerate(partition):
        n = layers * layer_params(shape, tensor)
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

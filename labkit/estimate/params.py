"""Parameter counts: the workshop's GPT formula and its general form (GQA, SwiGLU, untied embeddings).

SC21 eq. (2) (Narayanan et al., arXiv 2104.04473): P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)). Written out it is
l (12h^2 + 13h) + (V + s) h: per layer the QKV, projection and two MLP matrices (12h^2) with their biases (9h) and two
layer norms (4h); then word and position embeddings. The general form below keeps exactly that bookkeeping, so it
reduces to the formula for a plain GPT; like the formula it leaves out the final layer norm (2h) and Megatron's vocabulary
padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from labkit.spec import ModelSpec


@dataclass(frozen=True)
class Shape:
    """The model sizes every estimator needs, under the formulas' short names: a flat, hashable view of a ModelSpec,
    whose rules give the sizes in effect (`groups`, `ffn_size`)."""
    num_layers: int
    """Transformer layers l (ModelSpec.num_layers)."""
    hidden: int
    """Hidden size h (ModelSpec.hidden_size)."""
    heads: int
    """Attention heads (ModelSpec.num_attention_heads)."""
    seq_length: int
    """Sequence length s (ModelSpec.seq_length)."""
    vocab: int
    """Vocabulary size V (ModelSpec.vocab_size)."""
    query_groups: int | None = None
    """Key/value groups as written (ModelSpec.num_query_groups); None: one per head."""
    ffn: int | None = None
    """MLP hidden size as written (ModelSpec.ffn_hidden_size); None: 4h."""
    swiglu: bool = False
    """SwiGLU MLP (ModelSpec.swiglu)."""
    tied: bool = True
    """Output layer shares the word embedding (not ModelSpec.untie_embeddings)."""

    @cached_property
    def model(self) -> ModelSpec:
        """The same sizes as a ModelSpec."""
        return ModelSpec(num_layers=self.num_layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                         num_query_groups=self.query_groups, ffn_hidden_size=self.ffn, seq_length=self.seq_length,
                         vocab_size=self.vocab, swiglu=self.swiglu, untie_embeddings=not self.tied)

    @property
    def groups(self) -> int:
        return self.model.query_groups

    @property
    def ffn_size(self) -> int:
        return self.model.ffn_size

    @classmethod
    def of(cls, model: ModelSpec) -> "Shape":
        """From a ModelSpec (or anything with the same attribute names)."""
        return cls(num_layers=model.num_layers, hidden=model.hidden_size, heads=model.num_attention_heads,
                   seq_length=model.seq_length, vocab=model.vocab_size, query_groups=model.num_query_groups,
                   ffn=model.ffn_hidden_size, swiglu=bool(model.swiglu), tied=not model.untie_embeddings)


def gpt_params(l: int, h: int, s: int, V: int) -> int:
    """SC21 eq. (2), the formula the workshop notebook types in; exact integer arithmetic.

    Taught in lab 05.
    """
    return 12 * l * h * h + 13 * l * h + (V + s) * h


def layer_params(shape: Shape, tensor: int = 1) -> float:
    """Parameters of one transformer layer held by one tensor-parallel rank.

    Column-parallel matrices (QKV, MLP in) and their biases split over `tensor`; row-parallel matrices (projection,
    MLP out) split too, but their biases and the two layer norms are replicated on every rank.
    """
    h, f = shape.hidden, shape.ffn_size
    qkv_out = h + 2 * h * shape.groups // shape.heads
    mlp_in = 2 * f if shape.swiglu else f
    split = h * qkv_out + qkv_out + h * h + h * mlp_in + mlp_in + f * h
    replicated = h + h + 4 * h  # projection bias, MLP-out bias, two layer norms (weight and bias)
    return split / tensor + replicated


def embedding_params(shape: Shape, tensor: int = 1) -> float:
    """Word embedding (split over tensor ranks by vocabulary) plus learned positions (replicated)."""
    return shape.vocab * shape.hidden / tensor + shape.seq_length * shape.hidden


def output_params(shape: Shape, tensor: int = 1) -> float:
    """The output projection's own weights: zero when tied to the word embedding."""
    return 0.0 if shape.tied else shape.vocab * shape.hidden / tensor


def total_params(shape: Shape) -> int:
    """The whole model: equals gpt_params(l, h, s, V) for a plain GPT (MHA, 4h GELU MLP, tied embeddings)."""
    return round(shape.num_layers * layer_params(shape) + embedding_params(shape) + output_params(shape))


def stage_params(shape: Shape, partition: list[int], tensor: int = 1) -> list[float]:
    """Parameters held by one GPU of each pipeline stage (one tensor rank).

    The first stage holds the embeddings; the last holds the output layer, which with tied embeddings and more than one
    stage is a second copy of the word embedding (Megatron keeps both in sync with an all-reduce).
    """
    p = len(partition)
    out = []
    for i, layers in enumerate(partition):
        n = layers * layer_params(shape, tensor)
        if i == 0:
            n += embedding_params(shape, tensor)
        if i == p - 1:
            n += output_params(shape, tensor)
            if shape.tied and p > 1:
                n += shape.vocab * shape.hidden / tensor
        out.append(n)
    return out

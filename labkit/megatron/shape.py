"""The model sizes every FLOP, parameter and memory formula needs, under the formulas' short names (l, h, s, V), with
the sizes Megatron derives from them (labkit.megatron.sizes). The estimator builds one from a spec's model, the driver
from its parsed arguments, the log reader from a log's arguments block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from labkit.megatron import sizes
from labkit.megatron.flags import FLAG

if TYPE_CHECKING:
    from labkit.spec import ModelSpec


@dataclass(frozen=True)
class Shape:
    """The model sizes every estimator needs, under the formulas' short names: a flat, hashable view of a ModelSpec,
    with the sizes Megatron derives from it (`groups`, `ffn_size`, `padded_vocab`: labkit.megatron.sizes)."""
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
    """MLP hidden size as written (ModelSpec.ffn_hidden_size); None: Megatron-LM's default (4h, or about 8h/3 with
    SwiGLU)."""
    swiglu: bool = False
    """SwiGLU MLP (ModelSpec.swiglu)."""
    tied: bool = True
    """Output layer shares the word embedding (not ModelSpec.untie_embeddings)."""
    norm: str = FLAG.normalization.default
    """LayerNorm (weight and bias) or RMSNorm (weight only) (ModelSpec.normalization)."""
    positions: str = FLAG.position_embedding_type.default
    """Position encoding (ModelSpec.position_embedding_type); only learned_absolute is a table of weights."""
    bias: bool = True
    """Biases in the linear layers (ModelSpec.add_bias_linear)."""
    vocab_multiple: int = FLAG.make_vocab_size_divisible_by.default
    """Megatron pads the vocabulary to a multiple of this times the tensor size
    (ModelSpec.make_vocab_size_divisible_by)."""
    hidden_dropout: float = FLAG.hidden_dropout.default
    """Dropout after attention and MLP (ModelSpec.hidden_dropout); at 0 no mask is kept."""
    attention_dropout: float = FLAG.attention_dropout.default
    """Dropout of the attention probabilities (ModelSpec.attention_dropout); at 0 no mask is kept."""
    kv_channels: int | None = None
    """Width of one attention head as written (ModelSpec.kv_channels); None: hidden / heads."""
    qk_layernorm: bool = False
    """Queries and keys normalised per head (ModelSpec.qk_layernorm): two norms of one head's width per layer."""
    experts: int | None = None
    """Routed experts per MoE layer (ModelSpec.num_experts); None: a dense model."""
    topk: int = FLAG.moe_router_topk.default
    """Experts each token is routed to (ModelSpec.moe_router_topk)."""
    expert_ffn: int | None = None
    """One expert's MLP width as written (ModelSpec.moe_ffn_hidden_size); None: ffn_size."""
    shared_ffn: int | None = None
    """The shared experts' MLP width, all of them together (ModelSpec.moe_shared_expert_intermediate_size)."""
    moe_layer_freq: str | None = None
    """Which layers are MoE (ModelSpec.moe_layer_freq): N or a pattern; None: every layer of an MoE model."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head: kv_channels, or hidden / heads (Megatron-LM's default)."""
        return self.kv_channels or self.hidden // self.heads

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model."""
        return bool(self.experts)

    @property
    def expert_ffn_size(self) -> int:
        """One expert's MLP width in effect: moe_ffn_hidden_size, else the dense MLP's (Megatron-LM's
        validate_args)."""
        return sizes.moe_ffn_hidden_size(self.ffn_size, self.expert_ffn)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """1 for each MoE layer, 0 for each dense one (labkit.megatron.sizes.moe_layer_pattern); all 0 when dense."""
        if not self.moe:
            return (0,) * self.num_layers
        return tuple(sizes.moe_layer_pattern(self.moe_layer_freq, self.num_layers))

    @property
    def groups(self) -> int:
        """Key/value groups in effect."""
        return sizes.query_groups(self.heads, self.query_groups)

    @property
    def ffn_size(self) -> int:
        """MLP hidden size in effect."""
        return sizes.ffn_hidden_size(self.hidden, self.swiglu, self.ffn)

    def padded_vocab(self, tensor: int = 1) -> int:
        """Megatron's padded vocabulary: the next multiple of vocab_multiple x tensor."""
        return sizes.padded_vocab_size(self.vocab, self.vocab_multiple, tensor)

    @property
    def norm_params(self) -> int:
        """One normalization layer: RMSNorm has a weight, LayerNorm a weight and a bias."""
        return self.hidden if self.norm == "RMSNorm" else 2 * self.hidden

    @classmethod
    def of(cls, model: ModelSpec) -> "Shape":
        """From a ModelSpec (or anything with the same attribute names); what it leaves unset takes the defaults."""
        optional = {"norm": getattr(model, "normalization", None),
                    "positions": getattr(model, "position_embedding_type", None),
                    "bias": getattr(model, "add_bias_linear", None),
                    "vocab_multiple": getattr(model, "make_vocab_size_divisible_by", None),
                    "hidden_dropout": getattr(model, "hidden_dropout", None),
                    "attention_dropout": getattr(model, "attention_dropout", None),
                    "kv_channels": getattr(model, "kv_channels", None),
                    "qk_layernorm": getattr(model, "qk_layernorm", None),
                    "experts": getattr(model, "num_experts", None) or None,
                    "topk": getattr(model, "moe_router_topk", None),
                    "expert_ffn": getattr(model, "moe_ffn_hidden_size", None),
                    "shared_ffn": getattr(model, "moe_shared_expert_intermediate_size", None),
                    "moe_layer_freq": getattr(model, "moe_layer_freq", None)}
        return cls(num_layers=model.num_layers, hidden=model.hidden_size, heads=model.num_attention_heads,
                   seq_length=model.seq_length, vocab=model.vocab_size, query_groups=model.num_query_groups,
                   ffn=model.ffn_hidden_size, swiglu=bool(model.swiglu), tied=not model.untie_embeddings,
                   **{k: v for k, v in optional.items() if v is not None})

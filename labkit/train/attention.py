"""Attention's core without Transformer Engine: torch.nn.functional.scaled_dot_product_attention in megatron-core's
layers (kernels.attention_backend sdpa, or auto on GPUs without Transformer Engine: labkit.megatron.rules).

`SDPAttention` takes the place of megatron-core's DotProductAttention (megatron/core/transformer/
dot_product_attention.py) in a layer spec's `core_attention`: the same constructor, the same forward signature, the
same layout in and out (query [sq, b, np, hn], key and value [sk, b, ng, hn], context [sq, b, np * hn]), the same
scale (1 / sqrt(hn) unless softmax_scale is given) and the same dropout stream (megatron-core's CUDA RNG tracker,
forked as DotProductAttention forks it). What differs is the kernel: PyTorch picks FlashAttention-2 or the
memory-efficient kernel on GPUs (fp16/bf16), which never write the s x s scores, and its math or flash kernel on
CPUs (PyTorch's scaled_dot_product_attention documentation, "torch.nn.attention.SDPBackend"). Grouped keys and values
are not repeated to every head: `enable_gqa` lets the kernel read each group for its heads.

Not built here (megatron-core's DotProductAttention refuses the first three too): context parallelism, packed
sequences, an attention bias, and softmax variants (off-by-one, learnable) or sliding windows, which
scaled_dot_product_attention does not compute.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    """Drop-in core attention for megatron-core's layer specs (local or Transformer Engine), computed by
    torch.nn.functional.scaled_dot_product_attention."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        refused = {"context_parallel_size > 1": config.context_parallel_size > 1,
                   f"softmax_type {config.softmax_type}": config.softmax_type != "vanilla",
                   "window_size": config.window_size is not None}
        for what, present in refused.items():
            if present:
                raise ValueError(f"SDPAttention (kernels.attention_backend sdpa) does not compute {what}; use "
                                 "Transformer Engine's attention (flash or fused)")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # DotProductAttention divides the scale by the layer number under apply_query_key_layer_scaling and its
        # softmax multiplies it back before normalising: the probabilities are those of 1 / sqrt(hn) either way.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """query [sq, b, np, hn], key and value [sk, b, ng, hn] (ng groups of np / ng heads each), attention_mask
        megatron-core's boolean mask (True: masked out) or None -> context [sq, b, np * hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes no packed sequences and no attention bias (as DotProductAttention)")
        mask_type = attn_mask_type or self.attn_mask_type
        # megatron-core's mask marks what may not be attended; scaled_dot_product_attention's what may. A causal layer
        # given no mask gets the causal mask (FusedScaleMaskSoftmax builds the same one).
        mask = None if attention_mask is None else ~attention_mask
        causal = mask is None and mask_type == AttnMaskType.causal and query.size(0) > 1
        sq, b, heads, hn = query.shape
        # [s, b, n, hn] -> [b, n, s, hn]: views, the head dimension stays contiguous
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                  scale=self.softmax_scale, enable_gqa=k.size(1) != heads)

        if dropout and not self.config.sequence_parallel:
            # DotProductAttention's dropout draws from the tensor-parallel tracker's stream (each tensor rank holds
            # other heads); the kernels draw their Philox seed from the generator the fork swaps in.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, n, sq, hn] -> [sq, b, n * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

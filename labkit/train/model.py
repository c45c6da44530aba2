"""Build the megatron-core GPT for this rank: config, layer spec, pipeline chunks, mixed-precision and DDP wrappers."""
from __future__ import annotations

import copy
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module

from labkit.megatron import sizes
from labkit.megatron.flags import FLAG
from labkit.train.arguments import moe_layer_freq
from labkit.train.attention import SDPAttention


def transformer_config(args, timers=None) -> TransformerConfig:
    ffn = sizes.ffn_hidden_size(args.hidden_size, args.swiglu, args.ffn_hidden_size)  # Megatron-LM's default if unset
    args.ffn_hidden_size = ffn
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    nccl = args.distributed_backend == "nccl"
    recompute = args.recompute_granularity
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        qk_layernorm=args.qk_layernorm,
        ffn_hidden_size=ffn,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=args.add_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        transformer_impl=args.transformer_impl,  # as Megatron-LM's config from args; FSDP2's wrapping reads it
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        sequence_parallel=args.sequence_parallel,
        **moe_fields(args, ffn),
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        recompute_granularity=recompute,
        recompute_method=args.recompute_method if recompute == "full" else None,
        recompute_num_layers=args.recompute_num_layers if recompute == "full" else None,
        # None: megatron-core's default, core_attn (TransformerConfig.__post_init__)
        recompute_modules=args.recompute_modules if recompute == "selective" else None,
        # CPU runs initialise weights on the CPU (identically on every tensor-parallel rank, then split); GPUs in place.
        use_cpu_initialization=not torch.cuda.is_available(),
        **{name: on for name, (on, _) in fusions(args, torch.cuda.is_available()).items()},
        fp8=args.fp8_format,
        fp8_recipe=args.fp8_recipe,
        # built under Transformer Engine's fp8_model_init (megatron-core's TransformerBlock): FP8 weights, no bf16 copy
        fp8_param=args.fp8_param_gather,
        fp4=args.fp4_format,
        fp4_recipe=args.fp4_recipe,
        attention_backend=AttnBackend[args.attention_backend],
        # On NCCL as Megatron-LM: the interleaved schedule overlaps its sends and receives; otherwise each step's sends
        # and receives go as one batch (arguments.py refuses batching with two interleaved stages, which swaps
        # messages). gloo gets blocking sends and receives in posting order: its asynchronous send reads the tensor
        # when it runs, after the schedule has already freed the output it sends (NaN losses on the CPU).
        overlap_p2p_comm=args.overlap_p2p_comm and nccl,
        batch_p2p_comm=nccl and not args.overlap_p2p_comm,
        # A stage frees the data of the activation it sent on once the next stage has it (only its shape is kept).
        deallocate_pipeline_outputs=nccl,
        timers=timers,
        barrier_with_L1_time=True,
        cuda_graph_scope=[],  # no CUDA graphs are captured; megatron-core 0.16's default names a deprecated scope
    )


def moe_fields(args, ffn: int) -> dict:
    """The mixture-of-experts fields of TransformerConfig, as Megatron-LM's core_transformer_config_from_args copies
    them from its arguments (num_experts becomes num_moe_experts; each expert's MLP is --ffn-hidden-size wide unless
    --moe-ffn-hidden-size says otherwise; the experts' tensor size is the model's unless given). Without
    --num-experts: megatron-core's dense defaults."""
    experts = args.num_experts or None
    if experts is None:
        return {}
    return dict(
        num_moe_experts=experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=sizes.moe_ffn_hidden_size(ffn, args.moe_ffn_hidden_size),
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_layer_freq=moe_layer_freq(args.moe_layer_freq, args.num_layers),
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_flex_dispatcher_backend=args.moe_flex_dispatcher_backend,
        moe_grouped_gemm=args.moe_grouped_gemm,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=sizes.expert_tensor_size(args.tensor_model_parallel_size,
                                                             args.expert_tensor_parallel_size),
    )


def fusions(args, cuda: bool) -> dict[str, tuple[bool, str]]:
    """Megatron-LM's fused kernels: TransformerConfig field -> (on, why not). Each is on, as in Megatron-LM, unless its
    --no-...-fusion flag is given or this environment lacks its kernel. megatron-core 0.16 builds the bias fusions
    with torch.compile (megatron/core/jit.py), which needs Triton and a GPU; the others are CUDA extensions."""
    def has(module: str) -> bool:
        return importlib.util.find_spec(module) is not None

    te = args.transformer_impl == "transformer_engine"
    compiled = (cuda and has("triton"), "needs a GPU with Triton (torch.compile)")
    activation = (args.bias_swiglu_fusion, FLAG.no_bias_swiglu_fusion) if args.swiglu \
        else (args.bias_gelu_fusion, FLAG.no_bias_gelu_fusion)
    wanted = {
        "bias_activation_fusion": activation,
        "bias_dropout_fusion": (args.bias_dropout_fusion, FLAG.no_bias_dropout_fusion),
        "masked_softmax_fusion": (args.masked_softmax_fusion, FLAG.no_masked_softmax_fusion),
        "apply_rope_fusion": (args.apply_rope_fusion, FLAG.no_rope_fusion),
        "gradient_accumulation_fusion": (args.gradient_accumulation_fusion, FLAG.no_gradient_accumulation_fusion),
    }
    # megatron-core's experts weight their activations by the routing probabilities inside the fused kernel, which it
    # has for SwiGLU without biases alone (MLP.forward raises "Only support fusion of swiglu and quick_gelu with
    # per_token_scale" for GeLU, weighted_bias_swiglu_impl "Bias is not supported for weighted swiglu fusion")
    unfusable_experts = bool(getattr(args, "num_experts", None)) and not (args.swiglu and not args.add_bias_linear)
    available = {
        "bias_activation_fusion": (compiled[0] and (args.swiglu or args.add_bias_linear) and not unfusable_experts,
                                   compiled[1] if not compiled[0] else "GeLU without biases has no bias to fuse"
                                   if not (args.swiglu or args.add_bias_linear) else "megatron-core fuses an "
                                   "expert's routing weights with SwiGLU without biases only"),
        "bias_dropout_fusion": compiled,
        "masked_softmax_fusion": (cuda and has("scaled_masked_softmax_cuda"),
                                  "needs a GPU and the scaled_masked_softmax_cuda extension (Apex)"),
        "apply_rope_fusion": (te and args.position_embedding_type == "rope",
                              "needs Transformer Engine" if args.position_embedding_type == "rope"
                              else "no rotary positions"),
        "gradient_accumulation_fusion": (cuda and (te or has("fused_weight_gradient_mlp_cuda")), "needs a GPU with "
                                         "Transformer Engine or Apex's fused_weight_gradient_mlp_cuda"),
    }
    out = {}
    for name, (asked, flag) in wanted.items():
        can, reason = available[name]
        out[name] = (asked and can, reason if asked and not can else f"off by {flag}" if not asked else "")
    return out


def fusions_line(args, cuda: bool) -> str:
    """One log line saying which fused kernels this run uses, and why each other one is off."""
    parts = [f"{name.replace('_fusion', '').replace('apply_', '')} {'on' if on else f'off ({why})'}"
             for name, (on, why) in fusions(args, cuda).items()]
    return "> fused kernels: " + "; ".join(parts)


def layer_spec(args, config: TransformerConfig | None = None, vp_stage: int | None = None):
    """The decoder's layers as Megatron-LM's gpt_builders picks them: with experts, the block spec of this pipeline
    stage (chunk `vp_stage`) from `config` (built from `args` when not given), which makes each layer dense or MoE as
    --moe-layer-freq says; otherwise one layer spec for every layer. Transformer Engine's modules where it is the
    implementation, megatron-core's local ones elsewhere."""
    te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config or transformer_config(args), use_transformer_engine=te,
                                          normalization=args.normalization, vp_stage=vp_stage)
    elif te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return with_sdpa_attention(spec) if getattr(args, "sdpa_attention", False) else spec


def with_sdpa_attention(spec):
    """A copy of a layer spec (or a block spec's layers) whose self-attention computes its core with
    labkit.train.attention.SDPAttention, which takes DotProductAttention's (or TEDotProductAttention's) arguments."""
    spec = copy.deepcopy(spec)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        layer.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def attention_line(args) -> str:
    """One log line saying which kernel computes attention's core, and why."""
    if getattr(args, "sdpa_attention", False):
        return "> attention core: torch scaled_dot_product_attention (--sdpa-attention, or auto without Transformer " \
               "Engine on GPUs)"
    if args.transformer_impl == "transformer_engine":
        return f"> attention core: Transformer Engine, --attention-backend {args.attention_backend}"
    return "> attention core: megatron-core's DotProductAttention (s x s scores)"


_TE_NAMES_IN_MOE_UTILS = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                          "fused_permute_with_probs", "fused_sort_chunks_by_index",
                          "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute",
                          "te_general_gemm")


def define_moe_names_without_te() -> None:
    """megatron-core 0.16.1's moe_utils imports Transformer Engine's MoE kernels in a try block and, without Transformer
    Engine, leaves their names undefined, yet its router reads `te_general_gemm is not None` (a NameError in every MoE
    forward). Later megatron-core sets them to None when Transformer Engine is absent; so does this, which makes the
    router and the permutations take their plain PyTorch paths, as megatron-core intends.

    Taught in lab 10.
    """
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_NAMES_IN_MOE_UTILS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def fresh_expert_outputs(chunk: torch.nn.Module) -> None:
    """Experts with biases, each whole on one rank and not split over expert ranks (expert tensor and expert parallel
    size 1, megatron-core's own SequentialMLP): their second linear layer sums its output over its one-rank group with
    reduce_from_tensor_model_parallel_region, which returns its input unchanged, and the MLP then adds the bias to
    that output in place, which autograd refuses for a custom function's pass-through output (a RuntimeError in every
    forward). Summing over one rank is nothing: such a layer takes megatron-core's own path for experts that
    communicate explicitly, which hands on the product as it is. Layers of any other size are left as they are."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    for module in chunk.modules():
        if (type(module) is RowParallelLinear and module.is_expert and not module.explicit_expert_comm
                and module.bias is not None and module.skip_bias_add and module.tp_group.size() == 1):
            module.explicit_expert_comm = True


class _TorchFSDP2(TorchFullyShardedDataParallel):
    """megatron-core 0.16.1's FSDP2 wrapper as its finalize_model_grads calls it: that passes force_all_reduce to
    finish_grad_sync, which the wrapper inherits from _BaseDataParallel without the argument (a TypeError in every
    step). FSDP2 has reduce-scattered each gradient in its backward hooks by then: nothing is left to finish."""

    def finish_grad_sync(self, force_all_reduce: bool = False):
        pass


def gather_zero2_weights(args, model: list[torch.nn.Module]) -> None:
    """After an optimizer step at ZeRO stage 2 on FSDP2: free each unit's stale whole parameters and all-gather its
    updated shards, so that every rank holds the whole weights between steps, as ZeRO-2 does (PyTorch's
    FSDPModule.reshard and unshard: https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)."""
    if not args.use_torch_fsdp2 or args.torch_fsdp2_reshard_after_forward:
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for chunk in model for m in chunk.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.reshard()
    for unit in units:
        unit.unshard()


def build_model(args, config: TransformerConfig) -> list[torch.nn.Module]:
    """This rank's model chunks (one, or one per virtual pipeline stage), wrapped for precision and DDP (or FSDP2);
    bare under --deepspeed, which deepspeed_engine wraps."""
    if args.num_experts:
        define_moe_names_without_te()
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(args, config, stage),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            parallel_output=True,
            vp_stage=stage,
        ))
    for chunk in chunks:
        if args.num_experts:
            fresh_expert_outputs(chunk)
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    args.num_parameters = sum(p.nelement() for chunk in chunks for p in chunk.parameters())
    if torch.cuda.is_available():
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    if args.deepspeed:
        # DeepSpeed's engine wraps the bare model: it keeps the precision and reduces (and shards) the gradients
        return chunks
    if args.fp16 or args.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    if args.use_torch_fsdp2:
        # Megatron-LM's get_model: PyTorch FSDP2 shards each transformer layer and embedding, then the whole chunk
        fsdp_config = TorchFullyShardedDataParallelConfig(reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
        chunks = [_TorchFSDP2(config=config, ddp_config=fsdp_config, module=chunk) for chunk in chunks]
        if not args.torch_fsdp2_reshard_after_forward:
            # ZeRO stage 2 keeps whole weights: no unit frees its gathered parameters after its backward either, and
            # gather_zero2_weights gathers the updated shards after each step (ZeRO's all-gather, arXiv:1910.02054)
            from torch.distributed.fsdp import FSDPModule

            for unit in (m for chunk in chunks for m in chunk.modules() if isinstance(m, FSDPModule)):
                unit.set_reshard_after_backward(False, recurse=False)
        return chunks
    return [DistributedDataParallel(config=config, ddp_config=ddp_config(args), module=chunk,
                                    disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]


def ddp_config(args) -> DistributedDataParallelConfig:
    """megatron-core's DDP settings from the driver's arguments, as Megatron-LM's get_model makes them."""
    return DistributedDataParallelConfig(
        # Megatron-LM's validate_args: bf16 accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16 or
        # --main-grads-dtype bf16; fp16 keeps fp16 gradients (the optimizer step makes fp32 copies)
        grad_reduce_in_fp32=args.bf16 and not args.grad_reduce_in_bf16 and args.main_grads_dtype == "fp32",
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        fp8_param_gather=args.fp8_param_gather,
        reuse_grad_buf_for_mxfp8_param_ag=args.reuse_grad_buf_for_mxfp8_param_ag,
    )

"""Build the megatron-core GPT for this rank: config, layer spec, pipeline chunks, mixed-precision and DDP wrappers."""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module

from labkit.megatron import sizes
from labkit.megatron.flags import FLAG


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
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        recompute_granularity=recompute,
        recompute_method=args.recompute_method if recompute == "full" else None,
        recompute_num_layers=args.recompute_num_layers if recompute == "full" else None,
        # CPU runs initialise weights on the CPU (identically on every tensor-parallel rank, then split); GPUs in place.
        use_cpu_initialization=not torch.cuda.is_available(),
        **{name: on for name, (on, _) in fusions(args, torch.cuda.is_available()).items()},
        fp8=args.fp8_format,
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
    available = {
        "bias_activation_fusion": (compiled[0] and (args.swiglu or args.add_bias_linear),
                                   compiled[1] if not compiled[0] else "GeLU without biases has no bias to fuse"),
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


def layer_spec(args):
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=args.normalization)


class _TorchFSDP2(TorchFullyShardedDataParallel):
    """megatron-core 0.16.1's FSDP2 wrapper as its finalize_model_grads calls it: that passes force_all_reduce to
    finish_grad_sync, which the wrapper inherits from _BaseDataParallel without the argument (a TypeError in every
    step). FSDP2 has reduce-scattered each gradient in its backward hooks by then: nothing is left to finish."""

    def finish_grad_sync(self, force_all_reduce: bool = False):
        pass


def build_model(args, config: TransformerConfig) -> list[torch.nn.Module]:
    """This rank's model chunks (one, or one per virtual pipeline stage), wrapped for precision and DDP (or FSDP2);
    bare under --deepspeed, which deepspeed_engine wraps."""
    spec = layer_spec(args)
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=spec,
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
        return [_TorchFSDP2(config=config, ddp_config=fsdp_config, module=chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        # Megatron-LM's validate_args: bf16 accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16;
        # fp16 keeps fp16 gradients (the optimizer step makes fp32 copies)
        grad_reduce_in_fp32=args.bf16 and not args.grad_reduce_in_bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]

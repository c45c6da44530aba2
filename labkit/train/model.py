"""Build the megatron-core GPT for this rank: config, layer spec, pipeline chunks, mixed-precision and DDP wrappers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from labkit.megatron import sizes


def transformer_config(args, timers=None) -> TransformerConfig:
    ffn = sizes.ffn_hidden_size(args.hidden_size, args.swiglu, args.ffn_hidden_size)  # Megatron-LM's default if unset
    args.ffn_hidden_size = ffn
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
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
        # Fused kernels need Apex or Transformer Engine; correctness first, the TE layer spec brings its own fusions.
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        # gloo matches point-to-point messages between two ranks in posting order; batched send/recv pairs in both
        # directions (the interleaved schedule with two stages) can then swap activations and gradients.
        batch_p2p_comm=args.distributed_backend == "nccl",
        timers=timers,
        barrier_with_L1_time=True,
        cuda_graph_scope=[],  # no CUDA graphs are captured; megatron-core 0.16's default names a deprecated scope
    )


def layer_spec(args):
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=args.normalization)


def build_model(args, config: TransformerConfig) -> list[torch.nn.Module]:
    """This rank's model chunks (one, or one per virtual pipeline stage), wrapped for precision and DDP."""
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
    if args.fp16 or args.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.fp16 or args.bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]

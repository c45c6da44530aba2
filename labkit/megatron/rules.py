"""Megatron's rules on a run's arguments, written once: `problems` checks a parsed command line (labkit.megatron.flags'
names) and returns every broken rule, each naming its argument. The training driver (labkit.train.arguments) raises
the first; `labkit validate` and `labkit run` (labkit.spec.checks) render the spec's flags, run the same function and
report each problem under the spec field that rendered its flag, so a spec is accepted exactly when the driver
accepts its command line. Each problem words the arguments it mentions through the caller's `name` function: a spec
field (`parallel.tensor`) or a Megatron-LM flag (`--tensor-model-parallel-size`).

The rules are megatron-core 0.16.1's (TransformerConfig.__post_init__: heads and query groups split over the tensor
ranks; parallel_state.initialize_model_parallel: the world splits into tensor x context x pipeline x data;
DistributedOptimizer: Adam only), Megatron-LM core_v0.16.1's validate_args in megatron/training/arguments.py (the
global batch splits into micro-batches over the data-parallel ranks; the interleaved schedule needs a multiple of the
pipeline size of them; --use-torch-fsdp2's conditions), and labkit's driver's own limits (what it does not set up,
`Runtime.driver`). What a rule needs to know of the machine it runs on is a `Runtime`.

Not here: files (the dataset, tokenizer files, DeepSpeed's config), which the driver opens where it runs and the
spec's checks look for where the spec is written (leaving those under job.cluster_paths to the job script).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from labkit.megatron import sharding, sizes
from labkit.megatron.flags import FLAGS, OPTIMIZER_DTYPES

Name = Callable[[str], str]
"""Megatron argument (its argparse dest, e.g. "tensor_model_parallel_size") -> how the caller names it."""

FLAG_OF = {flag.dest or flag.key: flag.name for flag in FLAGS}
"""Megatron argument (argparse dest) -> the flag that sets it: --disable-bias-linear sets add_bias_linear."""


def flag_name(argument: str) -> str:
    """The Megatron-LM flag that sets an argument: the driver's `name`."""
    return FLAG_OF[argument]


@dataclass(frozen=True)
class Problem:
    """One broken rule."""
    argument: str
    """The Megatron argument at fault (argparse dest); the caller names it at the start of its message."""
    message: str
    """What is wrong and how to mend it, other arguments named through the caller's `name`."""


def shape_problems(name: Name, *, heads: int, hidden: int, groups: int | None, tensor: int,
                   kv_channels: int | None = None) -> list[Problem]:
    """Attention's heads and query groups split evenly over the tensor ranks, and the hidden size over the heads
    unless each head's width is written (`kv_channels`). `groups`: the query groups when written (grouped-query
    attention), else None."""
    problems = []
    if heads % tensor:
        problems.append(Problem("num_attention_heads", f"{heads} heads do not split over "
                                f"{name('tensor_model_parallel_size')} {tensor}; use a tensor size that divides "
                                f"{heads}"))
    if kv_channels is None and hidden % heads:
        problems.append(Problem("hidden_size", f"{hidden} is not divisible by {name('num_attention_heads')} {heads}; "
                                "each head needs an equal share"))
    if groups is not None:
        if heads % groups:
            problems.append(Problem("num_query_groups", f"{groups} does not divide {name('num_attention_heads')} "
                                    f"{heads}"))
        elif groups % tensor:
            problems.append(Problem("num_query_groups", f"{groups} query groups do not split over "
                                    f"{name('tensor_model_parallel_size')} {tensor}; use a tensor size that divides "
                                    f"{groups}"))
    return problems


def split_problems(name: Name, *, world: int, tensor: int, context: int, pipeline: int) -> list[Problem]:
    """The world's ranks split into tensor x context x pipeline x data (the data size is what is left)."""
    split = tensor * context * pipeline
    if world % split == 0:
        return []
    sizes = (f"{name('tensor_model_parallel_size')} {tensor} x {name('context_parallel_size')} {context} x "
             if context > 1 else f"{name('tensor_model_parallel_size')} {tensor} x ")
    return [Problem("pipeline_model_parallel_size", f"world size {world} is not divisible by {sizes}"
                    f"{name('pipeline_model_parallel_size')} {pipeline}; use sizes whose product divides {world}")]


def batch_problems(name: Name, *, global_batch: int, micro: int, data: int, pipeline: int,
                   interleaved: bool) -> list[Problem]:
    """The global batch splits into micro-batches over the data-parallel ranks; the interleaved schedule runs them in
    groups of the pipeline size (megatron-core's forward_backward_pipelining_with_interleaving)."""
    if global_batch % (micro * data):
        step = micro * data
        return [Problem("global_batch_size", f"{global_batch} is not divisible by {name('micro_batch_size')} {micro} "
                        f"x data-parallel {data} = {step}; use a multiple of {step}, e.g. "
                        f"{max(1, global_batch // step) * step}")]
    num_micro = global_batch // (micro * data)
    if interleaved and num_micro % pipeline:
        return [Problem("global_batch_size", f"the interleaved schedule needs the {num_micro} micro-batches to be a "
                        f"multiple of {name('pipeline_model_parallel_size')} {pipeline}; raise it to a multiple of "
                        f"{pipeline * micro * data}")]
    return []


def pairing_problems(name: Name, *, tensor: int, sequence_parallel: bool, tp_comm_overlap: bool,
                     overlap_param_gather: bool, overlap_grad_reduce: bool,
                     distributed_optimizer: bool) -> list[Problem]:
    """Settings that only work beside another (Megatron-LM's validate_args): sequence parallelism splits activations
    over the tensor ranks; Transformer Engine's tensor-parallel overlap pipelines sequence parallelism's all-gathers
    and reduce-scatters; the overlapped parameter gather gathers the distributed optimizer's shards, bucket by
    bucket as the overlapped gradient reduce-scatter made them."""
    problems = []
    if sequence_parallel and tensor == 1:
        problems.append(Problem("sequence_parallel", f"needs {name('tensor_model_parallel_size')} > 1 (it splits "
                                "activations across the tensor ranks); leave it out or raise the tensor size"))
    if tp_comm_overlap and not sequence_parallel:
        problems.append(Problem("tp_comm_overlap", "overlaps sequence parallelism's all-gathers and reduce-scatters; "
                                f"needs {name('sequence_parallel')} (with {name('tensor_model_parallel_size')} > 1), "
                                "or leave it out"))
    if overlap_param_gather and not distributed_optimizer:
        problems.append(Problem("overlap_param_gather", "gathers the distributed optimizer's parameter shards; needs "
                                f"{name('use_distributed_optimizer')}, or leave it out"))
    elif overlap_param_gather and not overlap_grad_reduce:
        problems.append(Problem("overlap_param_gather", f"needs {name('overlap_grad_reduce')} beside it (megatron-core "
                                "gathers the parameters bucket by bucket in the overlapped reduce's buckets), or "
                                "leave it out"))
    return problems


@dataclass(frozen=True)
class Runtime:
    """What the rules need to know of where the arguments run."""
    driver: bool = True
    """labkit's driver (python -m labkit.train), whose own limits apply too; False for Megatron-LM's pretrain_gpt.py,
    whose rules are megatron-core's and validate_args' only."""
    cuda: bool = False
    """GPUs with CUDA: NCCL, Transformer Engine and FP8 need them."""
    transformer_engine: bool = False
    """Transformer Engine importable (on GPUs): sequence parallelism, FP8, context parallelism, flash/fused attention
    and the tensor-parallel overlap need it."""
    fused_adam: bool = False
    """Transformer Engine's or Apex's FusedAdam importable: megatron-core reloads the distributed optimizer's
    reshardable torch_dist state in its layout only."""
    deepspeed: bool = True
    """The deepspeed package importable, for --deepspeed."""


POSITIVE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "log_interval",
            "distributed_timeout_minutes")
"""Arguments that count something and must be at least 1."""


def problems(args, world_size: int, runtime: Runtime, name: Name = flag_name) -> list[Problem]:
    """Every rule the parsed command line `args` (labkit.megatron.flags' build_parser, before the driver derives
    anything) breaks on `world_size` processes in `runtime`, in the order the driver checks them. The list is empty
    exactly when the driver starts (files aside, see the module's docstring)."""
    found = [Problem(key, f"must be positive, got {getattr(args, key)}") for key in POSITIVE if getattr(args, key) <= 0]
    if found:
        return found  # the rules below divide by these sizes
    for group in (_size_problems, _expert_problems, _recompute_problems, _pipeline_problems, _implementation_problems,
                  _sharding_problems, _graph_and_overlap_problems, _schedule_problems):
        found += group(args, world_size, runtime, name)
    return found


def _size_problems(args, world_size: int, runtime: Runtime, name: Name) -> list[Problem]:
    """The world's split, the batch's, attention's shape and the positions."""
    tp, cp, pp = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    found = split_problems(name, world=world_size, tensor=tp, context=cp, pipeline=pp)
    if not found:
        dp = sizes.data_parallel_size(world_size, tp, cp, pp)
        global_batch = args.micro_batch_size * dp if args.global_batch_size is None else args.global_batch_size
        found += batch_problems(name, global_batch=global_batch, micro=args.micro_batch_size, data=dp, pipeline=pp,
                                interleaved=bool(virtual_stages(args)))
    groups = args.num_query_groups
    if not args.group_query_attention:
        if groups not in (None, args.num_attention_heads):
            found.append(Problem("num_query_groups", f"needs {name('group_query_attention')}"))
        groups = None
    elif groups is None:
        found.append(Problem("num_query_groups", f"needed with {name('group_query_attention')}"))
    found += shape_problems(name, heads=args.num_attention_heads, hidden=args.hidden_size, groups=groups, tensor=tp,
                            kv_channels=args.kv_channels)
    if args.kv_channels is not None and args.kv_channels <= 0:
        found.append(Problem("kv_channels", f"must be positive, got {args.kv_channels}"))
    if args.max_position_embeddings is not None and args.seq_length > args.max_position_embeddings:
        found.append(Problem("seq_length", f"{args.seq_length} exceeds {name('max_position_embeddings')} "
                             f"{args.max_position_embeddings}"))
    found += context_split_problems(name, seq_length=args.seq_length, context=cp)
    if args.fp16 and args.bf16:
        found.append(Problem("fp16", f"conflicts with {name('bf16')}; choose one precision"))
    if args.fp8_format and not args.bf16:
        found.append(Problem("fp8_format", f"FP8 GEMMs run inside a bf16 model; add {name('bf16')}"))
    if args.fp4_format and not args.bf16:
        found.append(Problem("fp4_format", f"FP4 GEMMs run inside a bf16 model; add {name('bf16')}"))
    if args.fp4_format and args.fp8_format:
        found.append(Problem("fp4_format", f"conflicts with {name('fp8_format')}; choose one"))
    return found


MOE_ONLY = ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_grouped_gemm", "moe_router_pre_softmax")
"""Arguments that shape or run experts: without --num-experts megatron-core builds dense MLPs and would ignore them
(moe_ffn_hidden_size it refuses), so each is refused rather than silently dropped."""


def _expert_problems(args, world_size: int, runtime: Runtime, name: Name) -> list[Problem]:
    """Mixture of experts, as megatron-core 0.16.1 builds it: TransformerConfig.__post_init__ (experts, router,
    shared experts, biases), parallel_state.initialize_model_parallel (the experts' own grid, expert_tensor x expert x
    pipeline, over the same world), MoELayer (experts split evenly over the expert ranks; tensor parallelism trains
    with sequence parallelism) and get_gpt_decoder_block_spec (--moe-layer-freq)."""
    experts, ep = args.num_experts, args.expert_model_parallel_size
    etp = sizes.expert_tensor_size(args.tensor_model_parallel_size, args.expert_tensor_parallel_size)
    found = [Problem(key, f"must be positive, got {getattr(args, key)}")
             for key in ("expert_model_parallel_size", "expert_tensor_parallel_size", "num_experts",
                         "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
             if getattr(args, key) is not None and getattr(args, key) <= 0]
    if found:
        return found
    if experts is None:
        if ep > 1:
            found.append(Problem("expert_model_parallel_size", f"splits experts over ranks; needs {name('num_experts')} "
                                 "(a mixture-of-experts model), or use 1"))
        if args.expert_tensor_parallel_size is not None:
            found.append(Problem("expert_tensor_parallel_size", f"splits each expert; needs {name('num_experts')} (a "
                                 "mixture-of-experts model), or leave it out"))
        found += [Problem(key, f"applies to mixture-of-experts layers only; set {name('num_experts')}, or leave it "
                          "out") for key in MOE_ONLY if getattr(args, key)]
        if str(args.moe_layer_freq) != "1":
            found.append(Problem("moe_layer_freq", f"applies to mixture-of-experts layers only; set "
                                 f"{name('num_experts')}, or leave it out"))
        return found
    if experts % ep:
        found.append(Problem("expert_model_parallel_size", f"{ep} ranks cannot share {name('num_experts')} {experts} "
                             f"evenly; use a divisor of {experts}"))
    split = etp * ep * args.pipeline_model_parallel_size
    if world_size % split:
        found.append(Problem("expert_model_parallel_size", f"the expert layers split the world size {world_size} into "
                             f"{name('expert_tensor_parallel_size')} {etp} x {name('expert_model_parallel_size')} {ep} "
                             f"x {name('pipeline_model_parallel_size')} {args.pipeline_model_parallel_size} x "
                             f"expert-data; use sizes whose product divides {world_size}"))
    topk = args.moe_router_topk
    if not 1 <= topk <= experts:
        found.append(Problem("moe_router_topk", f"{topk}: each token goes to between 1 and {name('num_experts')} "
                             f"{experts} experts"))
    elif topk == 1 and not args.moe_router_pre_softmax and args.moe_router_load_balancing_type != "sinkhorn":
        found.append(Problem("moe_router_topk", f"1 needs {name('moe_router_pre_softmax')} (a softmax over one chosen "
                             "expert has zero gradient; megatron-core refuses it)"))
    if args.moe_router_load_balancing_type == "sinkhorn" and args.moe_aux_loss_coeff:
        # megatron-core's TopKRouter.sinkhorn_load_balancing asserts it ("Sinkhorn routing does not support aux loss")
        found.append(Problem("moe_aux_loss_coeff", f"{args.moe_aux_loss_coeff}: Sinkhorn routing balances the load "
                             "itself and takes no auxiliary loss; use 0, or another "
                             f"{name('moe_router_load_balancing_type')}"))
    if args.add_bias_linear and etp != 1:
        found.append(Problem("expert_tensor_parallel_size", f"{etp}: megatron-core keeps experts' biases only when each "
                             f"expert is whole; use {name('expert_tensor_parallel_size')} 1, or drop the linear layers' "
                             f"biases ({name('add_bias_linear')})"))
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        found.append(Problem("sequence_parallel", f"needed beside {name('tensor_model_parallel_size')} "
                             f"{args.tensor_model_parallel_size} in a mixture-of-experts model (megatron-core's MoE "
                             "layer refuses to train tensor-parallel without it)"))
    try:
        sizes.moe_layer_pattern(args.moe_layer_freq, args.num_layers)
    except sizes.SizeError as exc:
        found.append(Problem("moe_layer_freq", str(exc).removeprefix(f"moe_layer_freq {args.moe_layer_freq!r} ")))
    if runtime.driver and not runtime.cuda:
        for key, used, what in (("moe_grouped_gemm", args.moe_grouped_gemm, "grouped GEMM kernels"),
                                ("moe_token_dispatcher_type", args.moe_token_dispatcher_type == "flex",
                                 "the flex dispatcher's DeepEP/HybridEP kernels")):
            if used:
                found.append(Problem(key, f"needs GPUs ({what}); on CPUs use "
                                     + ("allgather or alltoall" if key == "moe_token_dispatcher_type"
                                        else "one GEMM per expert: leave it out")))
    if args.moe_token_dispatcher_type == "flex" and etp * ep == 1:
        # MoEFlexTokenDispatcher asserts "Flex token dispatcher requires TPxEP > 1", its TP the expert-tensor group
        found.append(Problem("moe_token_dispatcher_type", f"flex: {FLEX_NEEDS_RANKS}: "
                             f"{name('expert_tensor_parallel_size')} x {name('expert_model_parallel_size')} is 1; "
                             "raise either, or keep one expert rank with alltoall or allgather"))
    return found


FLEX_NEEDS_RANKS = "megatron-core's flex dispatcher exchanges tokens between two or more expert ranks"
"""The flex dispatcher's problem with a layout of one expert-tensor x expert rank: the planner, which chooses the
layout, sets it aside."""


def context_split_problems(name: Name, *, seq_length: int, context: int) -> list[Problem]:
    """megatron-core splits each sequence into 2 x context chunks, two per context rank, to balance the causal mask
    (get_batch_on_this_cp_rank)."""
    if context > 1 and seq_length % (2 * context):
        return [Problem("context_parallel_size", f"{name('seq_length')} {seq_length} must be a multiple of 2 x "
                        f"{context} (megatron-core splits each sequence into 2 x context chunks to balance the causal "
                        "mask)")]
    return []


NEEDS_TRANSFORMER_ENGINE = ("needs Transformer Engine on GPUs (megatron-core's local layers have no such kernels: "
                            "torch LayerNorm, attention without a ring, no FP8); leave it out for a run on CPUs")
"""Why sequence parallelism, FP8, context parallelism, flash or fused attention and the tensor-parallel overlap are
refused where megatron-core builds its local layers (no Transformer Engine, or no GPU)."""


def _recompute_problems(args, world_size: int, runtime: Runtime, name: Name) -> list[Problem]:
    """Recomputation, the legacy spellings (the NVIDIA workshop's) included."""
    granularity, _ = recompute_in_effect(args)
    method, layers = args.recompute_method, args.recompute_num_layers
    found = []
    if args.checkpoint_activations:
        if args.recompute_granularity not in (None, "full"):
            found.append(Problem("checkpoint_activations", f"conflicts with {name('recompute_granularity')} "
                                 f"{args.recompute_granularity}"))
        method = method or args.activations_checkpoint_method or "uniform"
        layers = layers if layers is not None else args.activations_checkpoint_num_layers
    elif args.activations_checkpoint_method:
        found.append(Problem("activations_checkpoint_method", f"needs {name('checkpoint_activations')}"))
    if args.recompute_activations and granularity == "full":
        found.append(Problem("recompute_activations", f"conflicts with {name('recompute_granularity')} full"))
        granularity = "selective"
    if granularity == "full":
        if method is None:
            found.append(Problem("recompute_method", f"needed with {name('recompute_granularity')} full (uniform or "
                                 "block)"))
        if layers is not None and layers <= 0:
            found.append(Problem("recompute_num_layers", f"must be positive, got {layers}"))
        elif method == "block" and layers is not None and layers > args.num_layers:
            found.append(Problem("recompute_num_layers", f"{layers} exceeds {name('num_layers')} {args.num_layers}"))
    elif method or layers is not None:
        found.append(Problem("recompute_method" if method else "recompute_num_layers",
                             f"only applies to {name('recompute_granularity')} full"))
    modules = args.recompute_modules or []
    if modules and granularity != "selective":
        found.append(Problem("recompute_modules", f"only applies to {name('recompute_granularity')} selective"))
    elif modules:
        # megatron-core 0.16.1's TransformerConfig.__post_init__, and what labkit builds (no multi-latent attention);
        # a module the model lacks would be recomputed nowhere, so it is refused rather than ignored
        moe, shared = args.num_experts is not None, bool(args.moe_shared_expert_intermediate_size)
        for module, ok, why in (
                ("moe", moe, f"recomputes an MoE layer; needs {name('num_experts')}"),
                ("moe_act", moe and args.moe_grouped_gemm,
                 f"recomputes the experts' activation inside grouped GEMM; needs {name('moe_grouped_gemm')}"),
                ("shared_experts", shared,
                 f"recomputes the shared experts; needs {name('moe_shared_expert_intermediate_size')}"),
                ("mla_up_proj", False, "recomputes multi-latent attention's up projection, which labkit does not "
                                       "build"),
                ("mlp", not moe or args.moe_layer_freq not in (1, "1"),
                 "recomputes dense MLPs, and every layer of this model is MoE; use moe or moe_act")):
            if module in modules and not ok:
                found.append(Problem("recompute_modules", f"{module} {why}"))
        if runtime.driver and not (runtime.cuda and runtime.transformer_engine):
            # megatron-core 0.16.1's output-discarding checkpoint (layernorm, moe_act) calls Transformer Engine's FP8
            # state even in bf16. Its plain checkpoint (mlp, moe, shared_experts) returns the local layers' output
            # bias, a parameter, as an output of the checkpoint, so the recomputed backward re-enters itself without
            # end: those run on the CPU without biases.
            needs_te = [m for m in modules if m in ("layernorm", "moe_act")]
            with_bias = [m for m in modules if m in ("mlp", "moe", "shared_experts")] if args.add_bias_linear else []
            if needs_te:
                found.append(Problem("recompute_modules", f"{', '.join(needs_te)}: labkit's driver recomputes these "
                                     "with Transformer Engine on GPUs only; leave them out here, or run on GPUs"))
            if with_bias:
                found.append(Problem("recompute_modules", f"{', '.join(with_bias)}: without Transformer Engine "
                                     "megatron-core's checkpoint of a layer with biases never finishes its backward "
                                     f"pass; drop the linear layers' biases ({name('add_bias_linear')} false), or "
                                     "recompute core_attn only"))
    return found


def virtual_stages(args) -> int | None:
    """Model chunks per pipeline stage the arguments ask for (None without interleaving), read as the driver sets
    virtual_pipeline_model_parallel_size; None where the arguments break a rule about them."""
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout:
        if pp == 1 or sizes.layout_problems(args.pipeline_model_parallel_layout, args.num_layers, pp):
            return None
        chunks = sizes.layout_virtual_stages(args.pipeline_model_parallel_layout, pp)
        return chunks if chunks > 1 else None
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is None or pp == 1 or per_chunk <= 0:
        return None
    counted = sizes.split_layers(args.num_layers, args.account_for_embedding_in_pipeline_split,
                                 args.account_for_loss_in_pipeline_split)
    if counted % pp or counted // pp % per_chunk:
        return None
    return counted // pp // per_chunk


def _pipeline_problems(args, world_size: int, runtime: Runtime, name: Name) -> list[Problem]:
    """Interleaving, uneven layouts and the account-for switches (megatron-core's TransformerConfig and
    get_num_layers_to_build, Megatron-LM's validate_args)."""
    pp, found = args.pipeline_model_parallel_size, []
    embedding, loss = args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split
    accounted = "account_for_embedding_in_pipeline_split" if embedding else \
        "account_for_loss_in_pipeline_split" if loss else None
    counted = sizes.split_layers(args.num_layers, embedding, loss)
    layout, per_chunk = args.pipeline_model_parallel_layout, args.num_layers_per_virtual_pipeline_stage
    if accounted and layout:
        found.append(Problem(accounted, f"cannot be combined with {name('pipeline_model_parallel_layout')}, which "
                             "places the embedding (E) and the loss (L) itself (megatron-core refuses both)"))
    if per_chunk is not None:
        if pp == 1:
            found.append(Problem("num_layers_per_virtual_pipeline_stage",
                                 f"the interleaved schedule needs {name('pipeline_model_parallel_size')} > 1"))
        elif layout:
            found.append(Problem("num_layers_per_virtual_pipeline_stage", "cannot be combined with "
                                 f"{name('pipeline_model_parallel_layout')} (the layout sets the virtual stages)"))
        elif per_chunk <= 0 or counted % pp or counted // pp % per_chunk:
            found.append(Problem("num_layers_per_virtual_pipeline_stage",
                                 f"{per_chunk} does not divide the {counted}/{pp} layers per pipeline stage"
                                 + (" (embedding and loss counted as asked)" if accounted else "")))
    elif accounted and not layout and pp > 1 and counted % pp:
        found.append(Problem(accounted, f"{counted} layers with the embedding and loss counted do not split evenly "
                             f"over {name('pipeline_model_parallel_size')} {pp}"))
    elif accounted and pp == 1:
        found.append(Problem(accounted, f"only moves layers between pipeline stages; needs "
                             f"{name('pipeline_model_parallel_size')} > 1"))
    elif not accounted and not layout and args.num_layers % pp:
        found.append(Problem("num_layers", f"{args.num_layers} layers do not split evenly over "
                             f"{name('pipeline_model_parallel_size')} {pp}; give a layout or a pipeline size that "
                             f"divides {args.num_layers}"))
    if layout:
        if pp == 1:
            found.append(Problem("pipeline_model_parallel_layout",
                                 f"needs {name('pipeline_model_parallel_size')} > 1"))
        else:
            found += [Problem("pipeline_model_parallel_layout", problem)
                      for problem in sizes.layout_problems(layout, args.num_layers, pp)]
    if virtual_stages(args) and not args.overlap_p2p_comm and pp == 2:
        # Batched sends and receives with two stages put both directions between the same two ranks in one batch;
        # NCCL matches them in posting order and a stage can receive a gradient as its activation (Megatron-LM's
        # arguments.py refuses this combination too).
        found.append(Problem("overlap_p2p_comm", "the interleaved schedule with "
                             f"{name('pipeline_model_parallel_size')} 2 needs overlapped sends and receives; leave the "
                             "flag out or use more than 2 pipeline stages"))
    return found


def transformer_impl(args, runtime: Runtime) -> str:
    """--transformer-impl as the driver builds it: as given, else transformer_engine where Transformer Engine runs (a
    GPU and the package), else megatron-core's local layers."""
    return args.transformer_impl or ("transformer_engine" if runtime.transformer_engine and runtime.cuda else "local")


def sdpa_attention(args, runtime: Runtime) -> bool:
    """Whether labkit's driver runs attention's core through PyTorch's scaled_dot_product_attention
    (labkit/train/attention.py): when asked (--sdpa-attention), and under --attention-backend auto on GPUs whose layers
    are megatron-core's local ones (no Transformer Engine), where megatron-core's DotProductAttention would write the
    s x s scores and PyTorch picks a flash or memory-efficient kernel. On CPUs auto keeps megatron-core's local
    attention, whose saved bytes the estimate counts exactly (the losses agree to fp32 rounding either way)."""
    return bool(args.sdpa_attention) or (runtime.driver and runtime.cuda and args.attention_backend == "auto"
                                         and transformer_impl(args, runtime) == "local")


def tokenizer_type(args) -> str:
    """--tokenizer-type as the driver reads it: as given, else GPT-2's BPE (a dataset, or mock tokens without
    --vocab-size), else NullTokenizer (mock tokens of --vocab-size ids)."""
    return args.tokenizer_type or ("GPT2BPETokenizer" if args.data_path or args.vocab_size is None
                                   else "NullTokenizer")


def _implementation_problems(args, world_size: int, runtime: Runtime, name: Name) -> list[Problem]:
    """What needs Transformer Engine, GPUs or labkit's driver's support."""
    te = runtime.transformer_engine and runtime.cuda
    impl = transformer_impl(args, runtime)
    found = []
    if args.transformer_impl == "transformer_engine" and not te:
        found.append(Problem("transformer_impl", "transformer_engine: Transformer Engine needs a GPU and the "
                             f"transformer_engine package; use {name('transformer_impl')} local"))
    if args.distributed_backend == "nccl" and not runtime.cuda:
        found.append(Problem("distributed_backend", "nccl needs GPUs; use gloo on CPU"))
    # labkit's driver: what it does not set up on any machine, refused rather than accepted and ignored
    if runtime.driver and args.tp_comm_overlap:
        found.append(Problem("tp_comm_overlap", "labkit's driver does not start Transformer Engine's userbuffers, "
                             "which it needs; leave it out, or run Megatron-LM's pretrain_gpt.py"))
    if runtime.driver and args.context_parallel_size > 1:
        found.append(Problem("context_parallel_size", "labkit's driver does not split sequences over context-parallel "
                             "ranks (the batch slicing and loss reduction are Megatron-LM's); use 1, or run "
                             "Megatron-LM's pretrain_gpt.py"))
    if args.sdpa_attention and not runtime.driver:
        found.append(Problem("sdpa_attention", "is labkit's driver's own attention (PyTorch's "
                             "scaled_dot_product_attention in megatron-core's layers), which Megatron-LM's "
                             f"{name('attention_backend')} does not have; leave it out"))
    elif args.sdpa_attention and args.attention_backend != "auto":
        found.append(Problem("sdpa_attention", f"conflicts with {name('attention_backend')} {args.attention_backend}: "
                             "each chooses attention's kernel; keep one"))
    needs_te = {"fp8_format": args.fp8_format is not None, "fp4_format": args.fp4_format is not None,
                "attention_backend": args.attention_backend in ("flash", "fused"),
                "sequence_parallel": args.sequence_parallel and args.tensor_model_parallel_size > 1,
                # on the driver these two are refused above, wherever it runs
                "tp_comm_overlap": args.tp_comm_overlap and args.sequence_parallel and not runtime.driver,
                "context_parallel_size": args.context_parallel_size > 1 and not runtime.driver}
    for argument, used in needs_te.items():
        if used and impl != "transformer_engine":
            found.append(Problem(argument, NEEDS_TRANSFORMER_ENGINE))
    # the parameter gather's pairing is the distributed optimizer's; FSDP and DeepSpeed have their own rules on it
    sharded = sharding.from_args(args).implementation != sharding.DDP
    found += pairing_problems(name, tensor=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
                              tp_comm_overlap=args.tp_comm_overlap, overlap_param_gather=args.overlap_param_gather,
                              overlap_grad_reduce=args.overlap_grad_reduce, distributed_optimizer=sharded)
    return found


def _sharding_problems(args, world_size: int, runtime: Runtime, name: Name) -> list[Problem]:
    """Who shards the model state (labkit.megatron.sharding) and what each implementation needs."""
    shard, found = sharding.from_args(args), []
    if args.use_distributed_optimizer and args.optimizer != "adam":
        # megatron-core's DistributedOptimizer asserts an Adam optimizer ("Only Adam currently supported")
        found.append(Problem("use_distributed_optimizer", "megatron-core's distributed optimizer steps Adam only; "
                             f"use {name('optimizer')} adam, or leave it out"))
    named = [key for key in ("use_distributed_optimizer", "use_torch_fsdp2", "use_megatron_fsdp", "deepspeed")
             if getattr(args, key)]
    if len(named) > 1 and not (named == ["use_distributed_optimizer", "use_megatron_fsdp"]):
        found.append(Problem(named[1], f"conflicts with {name(named[0])}: one implementation shards the model "
                             "state; keep one"))
    if args.data_parallel_sharding_strategy != "no_shard" and not args.use_megatron_fsdp:
        found.append(Problem("data_parallel_sharding_strategy", f"needs {name('use_megatron_fsdp')}"))
    if not args.torch_fsdp2_reshard_after_forward and not args.use_torch_fsdp2:
        found.append(Problem("torch_fsdp2_reshard_after_forward", f"needs {name('use_torch_fsdp2')}"))
    pp = args.pipeline_model_parallel_size
    runs = f"ZeRO stage {shard.stage} runs as {sharding.DESCRIPTIONS[shard.implementation]}"
    if shard.fsdp and pp > 1:
        # Megatron-LM's validate_args asserts pipeline size 1 for --use-torch-fsdp2; Megatron-FSDP reduce-scatters
        # every micro-batch's gradients and is documented with tensor, context and expert parallelism only
        # (docs/discussions/megatron-fsdp-user-guide)
        found.append(Problem(named[-1], f"{runs}, which does not run under megatron-core's pipeline schedules; use "
                             f"{name('pipeline_model_parallel_size')} 1, or ZeRO stage 1"))
    if shard.implementation == sharding.TORCH_FSDP2:
        # Megatron-LM's validate_args for --use-torch-fsdp2, and the driver's checkpoints
        for key, bad, why in (
                ("untie_embeddings_and_output_weights", not args.untie_embeddings_and_output_weights,
                 "which needs untied embeddings; untie them"),
                ("fp16", args.fp16, "which does not run fp16; use bf16 or fp32"),
                ("expert_model_parallel_size", args.expert_model_parallel_size > 1,
                 "which does not split experts over expert ranks; use 1, or ZeRO stage 1"),
                ("overlap_param_gather", args.overlap_param_gather, "which gathers each layer's parameters itself; "
                                                                    "leave it out"),
                ("save" if args.save else "load", runtime.driver and (args.save or args.load),
                 "whose DTensor parameters neither of labkit's driver's checkpoint formats saves; leave out "
                 f"{name('save')} and {name('load')}")):
            if bad:
                elsewhere = ("; or run Megatron-LM's pretrain_gpt.py, where the stage runs as Megatron-FSDP"
                             if runtime.driver else "")
                found.append(Problem(key, f"{runs} ({name('use_torch_fsdp2')}), {why}{elsewhere}"))
    if shard.implementation == sharding.MEGATRON_FSDP:
        if args.ckpt_format not in (None, "fsdp_dtensor"):
            found.append(Problem("ckpt_format", f"{runs}, which saves only fsdp_dtensor checkpoints (Megatron-LM's "
                                 "validate_args); leave it out"))
        if runtime.driver:
            found.append(Problem(named[-1], f"{runs}, which labkit's driver does not run: it reduce-scatters and "
                                 "all-gathers on CUDA streams (megatron_fsdp.py) the driver does not set up; use "
                                 f"{name('use_torch_fsdp2')} (PyTorch FSDP2 through megatron-core), or Megatron-LM's "
                                 "pretrain_gpt.py"))
    found += _deepspeed_problems(args, runtime, name)
    found += _precision_aware_problems(args, runtime, name)
    found += _fp8_parameter_problems(args, runtime, name)
    return found


def _fp8_parameter_problems(args, runtime: Runtime, name: Name) -> list[Problem]:
    """--fp8-param-gather, as Megatron-LM core_v0.16.1 takes it: FP8 training (TransformerConfig refuses fp8_param
    without fp8), weights sharded by the distributed optimizer or Megatron-FSDP (validate_args asserts it; under
    --use-torch-fsdp2 it turns the flag off with Transformer Engine 2, a change refused here rather than made
    silently); --reuse-grad-buf-for-mxfp8-param-ag beside it (DistributedDataParallelConfig asserts it), under MXFP8
    only (with any other recipe the distributed optimizer would copy its updated weights into a buffer the model no
    longer reads), and not under Megatron-FSDP (validate_args turns it off). labkit's driver does not run that reuse
    beside the overlapped parameter gather: Megatron-LM's training loop copies the weights into the gradient buffer
    before each forward and takes its forward pre-hooks off around evaluations and checkpoints, which the driver's
    loop does not."""
    shard, found = sharding.from_args(args), []
    if args.fp8_param_gather:
        if not args.fp8_format:
            found.append(Problem("fp8_param_gather", f"keeps the linear layers' weights in FP8 and needs FP8 training "
                                 f"({name('fp8_format')}); leave it out"))
        if shard.implementation == sharding.TORCH_FSDP2:
            found.append(Problem("fp8_param_gather", f"ZeRO stage {shard.stage} runs as PyTorch FSDP2 "
                                 f"({name('use_torch_fsdp2')}), under which Megatron-LM turns it off (Transformer "
                                 "Engine 2); leave it out, or use ZeRO stage 1"))
        elif not shard.megatron_gathers:
            found.append(Problem("fp8_param_gather", "all-gathers sharded weights; needs "
                                 f"{name('use_distributed_optimizer')} or Megatron-FSDP (Megatron-LM's validate_args); "
                                 "add one, or leave it out"))
    if args.reuse_grad_buf_for_mxfp8_param_ag:
        if not args.fp8_param_gather:
            found.append(Problem("reuse_grad_buf_for_mxfp8_param_ag", f"needs {name('fp8_param_gather')} (megatron-"
                                 "core's DistributedDataParallelConfig asserts it); add it, or leave this out"))
        elif args.fp8_recipe != "mxfp8" or not args.fp8_format:
            found.append(Problem("reuse_grad_buf_for_mxfp8_param_ag", "gathers MXFP8 weights through the gradient "
                                 f"buffer; needs {name('fp8_recipe')} mxfp8, or leave it out"))
        elif shard.implementation == sharding.MEGATRON_FSDP:
            found.append(Problem("reuse_grad_buf_for_mxfp8_param_ag", "Megatron-LM turns it off under Megatron-FSDP "
                                 f"({name('use_megatron_fsdp')}); leave it out"))
        elif runtime.driver and args.overlap_param_gather:
            found.append(Problem("reuse_grad_buf_for_mxfp8_param_ag", "labkit's driver does not gather MXFP8 weights "
                                 f"through the gradient buffer beside {name('overlap_param_gather')} (Megatron-LM's "
                                 "training loop copies them back around its evaluations and checkpoints); leave out "
                                 f"{name('overlap_param_gather')}, keep bf16 weights ({name('fp8_param_gather')} "
                                 "off), or run Megatron-LM's pretrain_gpt.py"))
    return found


def _precision_aware_problems(args, runtime: Runtime, name: Name) -> list[Problem]:
    """megatron-core 0.16.1's OptimizerConfig.__post_init__: the precision-aware optimizer steps Adam under the
    distributed optimizer with Transformer Engine's FusedAdam, and without it the main gradients and parameters stay
    fp32; Megatron-LM's validate_args: bf16 gradients with --bf16. The moments' dtypes, which megatron-core ignores
    without it, are refused rather than ignored."""
    if not args.use_precision_aware_optimizer:
        return [Problem(key, f"{getattr(args, key)} needs {name('use_precision_aware_optimizer')}; add it, or use fp32")
                for key in OPTIMIZER_DTYPES if getattr(args, key) != "fp32"]
    found = []
    if args.optimizer != "adam":
        found.append(Problem("use_precision_aware_optimizer", f"steps Adam only; use {name('optimizer')} adam"))
    if not args.use_distributed_optimizer:
        found.append(Problem("use_precision_aware_optimizer", f"needs {name('use_distributed_optimizer')}, whose "
                             "shards it keeps"))
    if args.use_megatron_fsdp:
        # Megatron-FSDP keeps fp32 main weights of its own and hands FusedAdam .grad, where megatron-core 0.16.1 builds
        # FusedAdam to read decoupled_grad (optimizer/__init__.py): nothing it could step
        found.append(Problem("use_precision_aware_optimizer", f"does not run under {name('use_megatron_fsdp')} in "
                             "megatron-core 0.16.1; use ZeRO stage 1 (the distributed optimizer), or leave it out"))
    if not (runtime.transformer_engine and runtime.cuda):
        found.append(Problem("use_precision_aware_optimizer", "needs Transformer Engine's FusedAdam, on GPUs with "
                             "the transformer_engine package; leave it out where they are not"))
    if args.main_grads_dtype == "bf16" and not args.bf16:
        found.append(Problem("main_grads_dtype", f"bf16 gradients need bf16 training ({name('bf16')}); use fp32"))
    return found


def _deepspeed_problems(args, runtime: Runtime, name: Name) -> list[Problem]:
    """--deepspeed on labkit's driver (labkit/train/deepspeed_engine.py), which hands DeepSpeed's ZeRO engine one
    whole megatron-core GPTModel per rank, as Megatron-DeepSpeed's flags spell it."""
    if not args.deepspeed:
        return [Problem(key, f"needs {name('deepspeed')}") for key in ("deepspeed_config", "zero_stage")
                if getattr(args, key) is not None]
    if not runtime.driver:
        return []  # a plan: DeepSpeed's engine is labkit's driver's alone, which the spec's job checks name
    found = []
    if not runtime.deepspeed:
        found.append(Problem("deepspeed", "needs the deepspeed package, which this environment lacks; "
                             "pip install 'labkit[deepspeed]'"))
    engine = f"DeepSpeed's ZeRO engine ({name('deepspeed')})"
    for key, bad, why in (
            ("tensor_model_parallel_size", args.tensor_model_parallel_size > 1,
             "takes one whole GPT per rank on labkit's driver (Megatron-DeepSpeed's model parallelism is its own code); "
             "use 1"),
            ("pipeline_model_parallel_size", args.pipeline_model_parallel_size > 1,
             "takes one whole GPT per rank on labkit's driver (Megatron-DeepSpeed's model parallelism is its own code); "
             "use 1"),
            ("expert_model_parallel_size", args.expert_model_parallel_size > 1,
             "takes one whole GPT per rank on labkit's driver, every expert on every rank; use 1"),
            ("overlap_param_gather", args.overlap_param_gather, "gathers its own parameters; leave it out"),
            ("optimizer", args.optimizer != "adam", "steps Adam-family optimizers; use adam"),
            ("fp16", args.fp16 and not runtime.cuda, "does not run fp16 on CPUs (\"Type fp16 is not supported on your "
                                                     "device\"); use bf16 or fp32 there"),
            ("save" if args.save else "load", args.save or args.load,
             f"saves and loads checkpoints in its own layout, which labkit's driver does not; leave out "
             f"{name('save')} and {name('load')}")):
        if bad:
            found.append(Problem(key, f"{engine} {why}"))
    if args.deepspeed_config is None or args.zero_stage is None:
        found.append(Problem("deepspeed", f"needs {name('deepspeed_config')} FILE and {name('zero_stage')} N"))
    return found


def recompute_in_effect(args) -> tuple[str | None, list[str]]:
    """The recompute granularity and modules the driver and Megatron-LM run, the legacy spellings mapped: (None, []),
    ("full", []) or ("selective", modules), megatron-core's default module core_attn when none are named."""
    if args.checkpoint_activations or args.recompute_granularity == "full":
        return "full", []
    if args.recompute_activations or args.recompute_granularity == "selective":
        return "selective", list(args.recompute_modules or ["core_attn"])
    return None, []


def _every_layer_moe(args) -> bool:
    """megatron-core's test for a model without dense layers: --moe-layer-freq 1, or a pattern without a 0 (a frequency
    N > 1 counts as having dense layers, as TransformerConfig counts it)."""
    if str(args.moe_layer_freq).strip() == "1":
        return True
    if str(args.moe_layer_freq).strip().isdigit():
        return False
    try:
        return 0 not in sizes.moe_layer_pattern(args.moe_layer_freq, args.num_layers)
    except sizes.SizeError:
        return False  # _expert_problems reports the pattern


NO_EXPERT_PARALLELISM = "has no all-to-all to hide without expert parallelism; set it above 1"
"""The overlap's problem with a layout of one expert rank: the planner, which chooses the layout, sets it aside."""


def graph_scopes(impl: str, scopes) -> list[str]:
    """The scopes a CUDA graph captures as megatron-core 0.16.1 reads them: its local graphs do not tell the router from
    the dispatch's preprocessing, and take both where either is named (TransformerConfig.__post_init__)."""
    scopes = list(scopes or [])
    if impl == "local" and ("moe_router" in scopes or "moe_preprocess" in scopes):
        scopes += [scope for scope in ("moe_router", "moe_preprocess") if scope not in scopes]
    return scopes


def graph_recompute_problems(name: Name, *, impl: str, scopes, granularity: str | None, modules: list[str],
                             attention_dropout: float, hidden_dropout: float) -> list[Problem]:
    """Recomputation inside CUDA graphs (megatron-core 0.16.1's TransformerConfig.__post_init__): full recompute only
    in a whole-iteration graph, and no dropout in a graphed module that is recomputed (its replay draws no new random
    numbers). Also what the planner asks of each recompute it would try beside the spec's graphs."""
    if impl == "none":
        return []
    scopes, found = graph_scopes(impl, scopes), []
    whole = not scopes or "full_iteration" in scopes  # the graphs hold whole layers, or the whole step
    if granularity == "full" and scopes != ["full_iteration"]:
        found.append(Problem("recompute_granularity", f"full recomputes inside a graph only when "
                             f"{name('cuda_graph_scope')} is full_iteration alone; use selective, or graph the "
                             "whole iteration"))
    if granularity == "selective":
        if impl == "transformer_engine" and "moe" in modules and "moe_router" in scopes:
            found.append(Problem("recompute_modules", f"moe recomputes the layer that {name('cuda_graph_scope')} "
                                 "moe_router graphs in part; recompute moe_act, or graph less"))
        for module, scope, dropout, rate in (("core_attn", "attn", "attention_dropout", attention_dropout),
                                             ("mlp", "mlp", "hidden_dropout", hidden_dropout),
                                             ("moe", "moe", "hidden_dropout", hidden_dropout)):
            if module in modules and (whole or scope in scopes) and rate:
                found.append(Problem(dropout, f"{rate}: the graphed {module}, recomputed, replays without new "
                                     f"random numbers; use 0, or recompute it outside the graph "
                                     f"({name('cuda_graph_scope')})"))
    return found


def _graph_and_overlap_problems(args, world_size: int, runtime: Runtime, name: Name) -> list[Problem]:
    """CUDA graphs and the MoE all-to-all's overlap, as megatron-core 0.16.1's TransformerConfig.__post_init__ checks
    them (the scopes a model can graph, recomputation inside a graph, the combined 1F1B schedule's conditions), with
    Megatron-LM's validate_args (a whole-iteration graph without the NaN check). Both run on GPUs under Megatron-LM's
    training loop, which captures the graphs and schedules the overlap; labkit's driver does neither."""
    impl, found = args.cuda_graph_impl, []
    scopes = graph_scopes(impl, args.cuda_graph_scope)
    overlap = args.overlap_moe_expert_parallel_comm
    granularity, modules = recompute_in_effect(args)
    if runtime.driver:
        for key, used, what in (("cuda_graph_impl", impl != "none", "captures no CUDA graph"),
                                ("moe_pad_experts_for_cuda_graph_inference",
                                 args.moe_pad_experts_for_cuda_graph_inference, "runs no inference"),
                                ("overlap_moe_expert_parallel_comm", overlap,
                                 "runs the plain 1F1B schedule, not megatron-core's combined one")):
            if used:
                found.append(Problem(key, f"labkit's driver {what}; leave it out, or run Megatron-LM's "
                                     "pretrain_gpt.py"))
    elif not runtime.cuda:
        found += [Problem(key, "needs GPUs (CUDA streams and graphs); leave it out for a run on CPUs")
                  for key, used in (("cuda_graph_impl", impl != "none"), ("overlap_moe_expert_parallel_comm", overlap))
                  if used]
    if scopes and impl == "none":
        found.append(Problem("cuda_graph_scope", f"chooses what a CUDA graph captures; needs "
                             f"{name('cuda_graph_impl')} transformer_engine or local"))
    if impl != "none":
        moe = args.num_experts is not None
        if impl == "transformer_engine" and "full_iteration" in scopes:
            found.append(Problem("cuda_graph_scope", f"full_iteration is captured by {name('cuda_graph_impl')} "
                                 "local only; use local, or graph parts of each layer"))
        if impl == "transformer_engine" and not runtime.transformer_engine:
            found.append(Problem("cuda_graph_impl", NEEDS_TRANSFORMER_ENGINE))
        if "moe" in scopes and "moe_router" in scopes:
            found.append(Problem("cuda_graph_scope", "moe and moe_router overlap; keep one"))
        if "moe_preprocess" in scopes and "moe_router" not in scopes:
            found.append(Problem("cuda_graph_scope", "moe_preprocess is graphed together with moe_router; add it"))
        if not moe:
            found += [Problem("cuda_graph_scope", f"{scope} graphs a mixture-of-experts layer, and this model is dense")
                      for scope in ("moe", "moe_router", "moe_preprocess") if scope in scopes]
        else:
            if "mlp" in scopes and _every_layer_moe(args):
                found.append(Problem("cuda_graph_scope", f"mlp graphs a dense layer's MLP, and every layer of this "
                                     f"model is MoE ({name('moe_layer_freq')} {args.moe_layer_freq}); use moe_router"))
            if "moe" in scopes:
                found.append(Problem("cuda_graph_scope", "moe graphs an MoE layer whose experts take a fixed number "
                                     "of tokens (dropping and padding to a capacity), which labkit's dropless MoE "
                                     "layers do not; use moe_router with moe_preprocess"))
        found += graph_recompute_problems(name, impl=impl, scopes=scopes, granularity=granularity, modules=modules,
                                          attention_dropout=args.attention_dropout,
                                          hidden_dropout=args.hidden_dropout)
        # Megatron-LM turns the check off itself for fp16 with a dynamic loss scale (validate_args)
        checks_nan = args.check_for_nan_in_loss_and_grad and not (args.fp16 and args.loss_scale is None)
        if "full_iteration" in scopes and checks_nan:
            found.append(Problem("check_for_nan_in_loss_and_grad", "a whole-iteration CUDA graph cannot stop on a "
                                 f"NaN; add {name('check_for_nan_in_loss_and_grad')}"))
        if impl == "local" and args.expert_model_parallel_size > 1 and \
                not args.moe_pad_experts_for_cuda_graph_inference:
            found.append(Problem("moe_pad_experts_for_cuda_graph_inference", "Megatron-LM asks for it beside "
                                 f"{name('cuda_graph_impl')} local with expert parallelism; add it"))
    if overlap:
        for argument, broken, why in (
                ("num_experts", args.num_experts is None,
                 "missing: the overlap hides a mixture-of-experts model's all-to-all, and this model is dense"),
                ("moe_token_dispatcher_type", args.moe_token_dispatcher_type not in ("alltoall", "flex"),
                 f"{args.moe_token_dispatcher_type}: the overlap hides the alltoall and flex dispatchers' exchange; "
                 "use one of them"),
                ("bf16", not (args.bf16 or args.fp16),
                 "the overlap runs in a bf16 or fp16 model only; train in one of them"),
                ("cuda_graph_impl" if impl == "local" else "cuda_graph_scope",
                 impl == "local" or any(s in scopes for s in ("moe", "mlp")),
                 f"megatron-core runs the overlap beside Transformer Engine's graphs of attn, moe_router and "
                 f"moe_preprocess only; use {name('cuda_graph_impl')} transformer_engine without moe or mlp scopes")):
            if broken:
                found.append(Problem(argument, f"{why} ({name('overlap_moe_expert_parallel_comm')})"))
        if args.num_experts is not None:
            found += overlap_layout_problems(name, expert=args.expert_model_parallel_size,
                                             pipeline=args.pipeline_model_parallel_size,
                                             virtual_stages=virtual_stages(args) or 1, granularity=granularity)
    return found


def overlap_layout_problems(name: Name, *, expert: int, pipeline: int, virtual_stages: int,
                            granularity: str | None) -> list[Problem]:
    """What the MoE all-to-all's overlap asks of a layout (megatron-core 0.16.1's TransformerConfig.__post_init__):
    expert ranks to exchange tokens between, the interleaved schedule when pipelined, no full recompute. Also how the
    planner tells the layouts that keep a written overlap."""
    found = []
    for argument, broken, why in (
            ("expert_model_parallel_size", expert == 1, NO_EXPERT_PARALLELISM),
            ("num_layers_per_virtual_pipeline_stage", pipeline > 1 and virtual_stages <= 1,
             f"the overlap pairs micro-batches inside the interleaved schedule, which "
             f"{name('pipeline_model_parallel_size')} {pipeline} runs with two or more model chunks a stage; set it"),
            ("recompute_granularity", granularity == "full",
             "full: the combined schedule cannot re-run whole layers; use selective, or drop the overlap")):
        if broken:
            found.append(Problem(argument, f"{why} ({name('overlap_moe_expert_parallel_comm')})"))
    return found


def _schedule_problems(args, world_size: int, runtime: Runtime, name: Name) -> list[Problem]:
    """Checkpoints, data and logging."""
    found = []
    if args.ckpt_format is not None and runtime.driver and args.ckpt_format not in ("torch", "torch_dist") \
            and not args.use_megatron_fsdp:
        found.append(Problem("ckpt_format", f"labkit's driver writes Megatron-LM's torch and torch_dist formats, "
                             f"not {args.ckpt_format}; use one of them"))
    if runtime.driver and args.ckpt_format == "torch_dist" and args.use_distributed_optimizer \
            and not runtime.fused_adam:
        # megatron-core 0.16.1 reloads the distributed optimizer's reshardable state in FusedAdam's layout only: with
        # torch's Adam (its fallback without Transformer Engine or Apex) the per-parameter "step" it keeps stops
        # load_parameter_state_from_fully_reshardable (distrib_optimizer.py) with a KeyError
        found.append(Problem("ckpt_format", "torch_dist with the distributed optimizer needs Transformer Engine's or "
                             "Apex's FusedAdam, absent where this run goes (CPU nodes, or GPUs without either): "
                             "megatron-core cannot reload torch Adam's state from it; use torch, or leave out "
                             f"{name('use_distributed_optimizer')}"))
    if args.save_interval is not None and not args.save:
        found.append(Problem("save_interval", f"needs {name('save')} DIR"))
    if args.save_interval is not None and args.save_interval <= 0:
        found.append(Problem("save_interval", f"must be positive, got {args.save_interval}"))
    if args.mock_data and args.data_path:
        found.append(Problem("mock_data", f"conflicts with {name('data_path')}; give one of them"))
    if not args.mock_data and not args.data_path:
        found.append(Problem("data_path", "missing; give a prefix from `labkit data prepare`, or "
                             f"{name('mock_data')}"))
    tokenizer = tokenizer_type(args)
    if tokenizer in ("HuggingFaceTokenizer", "SentencePieceTokenizer"):
        if args.tokenizer_model is None:
            found.append(Problem("tokenizer_model", f"needed with {name('tokenizer_type')} {tokenizer}"))
    elif tokenizer == "NullTokenizer" and args.vocab_size is None:
        found.append(Problem("vocab_size", f"needed with {name('tokenizer_type')} NullTokenizer"))
    if args.tokenizer_model is not None and tokenizer not in ("HuggingFaceTokenizer", "SentencePieceTokenizer"):
        found.append(Problem("tokenizer_model", f"{name('tokenizer_type')} {tokenizer} does not read one; use "
                             "HuggingFaceTokenizer or SentencePieceTokenizer"))
    split = args.split.replace("/", ",").split(",")
    try:
        if len(split) > 3 or sum(float(s) for s in split) <= 0 or any(float(s) < 0 for s in split):
            raise ValueError
    except ValueError:
        found.append(Problem("split", f"{args.split!r} is not like 969,30,1 (train, validation, test weights)"))
    if args.profile:
        if not 0 <= args.profile_step_start < args.profile_step_end:
            found.append(Problem("profile_step_start", f"needs 0 <= {name('profile_step_start')} < "
                                 f"{name('profile_step_end')}"))
        bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
        if bad:
            found.append(Problem("profile_ranks", f"{bad} outside the world of {world_size} processes"))
    for key in ("log_timers_to_tensorboard", "log_memory_to_tensorboard", "log_validation_ppl_to_tensorboard"):
        if getattr(args, key) and not args.tensorboard_dir:
            found.append(Problem(key, f"needs {name('tensorboard_dir')} DIR"))
    if args.wandb_project:
        if args.wandb_exp_name == "":
            found.append(Problem("wandb_exp_name", "an empty name; name the W&B run"))
        if not args.wandb_save_dir and not args.save:
            found.append(Problem("wandb_project", f"W&B keeps its files under {name('save')}'s wandb/; add "
                                 f"{name('wandb_save_dir')} DIR or {name('save')} DIR"))
    return found

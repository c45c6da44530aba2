"""The driver's command line: the flags are labkit.megatron.flags' table (Megatron-LM's names, nothing else); this
module checks their combinations and derives what Megatron derives (data-parallel size, padded sizes, warm-up steps)
so the arguments block prints like theirs.

An unknown flag is an error naming it (exit 2). A flag that exists but cannot work in this environment (for example
--sequence-parallel without Transformer Engine) is an error naming the flag and the reason. This module imports nothing
heavier than the standard library and labkit.megatron until `parse_args` runs.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
from pathlib import Path

from labkit.megatron import rules, sizes
from labkit.megatron.flags import (DEFAULT_MERGES, DEFAULT_VOCAB, SHARDING_STRATEGIES, ArgumentError, FLAG, FLAGS,
                                   build_parser)


def _te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _fused_adam_importable() -> bool:
    """Whether megatron-core's optimizers run Transformer Engine's or Apex's FusedAdam (else torch's Adam)."""
    for module in ("transformer_engine.pytorch.optimizers", "apex.optimizers"):
        try:
            importlib.import_module(module)
        except Exception:
            continue
        return True
    return False


def _data_blend(paths: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's --data-path: `P` or `P1 P2` (equal weights) or `W1 P1 W2 P2`."""
    def is_number(s):
        try:
            float(s)
            return True
        except ValueError:
            return False
    if len(paths) % 2 == 0 and all(is_number(w) for w in paths[0::2]):
        return list(paths[1::2]), [float(w) for w in paths[0::2]]
    return list(paths), None


def _flag_name(argument: str) -> str:
    """The flag that sets a Megatron argument, for labkit.megatron.rules' messages."""
    return next(flag.name for flag in FLAGS if (flag.dest or flag.key) == argument)


def _raise_first(problems: list[rules.Problem]) -> None:
    if problems:
        raise ArgumentError(f"{_flag_name(problems[0].argument)}: {problems[0].message}")


def finish(args: argparse.Namespace, world_size: int, rank: int, cuda: bool) -> argparse.Namespace:
    """Check flag combinations and derive Megatron's derived arguments. Raises ArgumentError naming the flag."""
    args.world_size, args.rank = world_size, rank
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "log_interval"):
        if getattr(args, flag) <= 0:
            raise ArgumentError(f"--{flag.replace('_', '-')}: must be positive, got {getattr(args, flag)}")
    cp = args.context_parallel_size
    if cp <= 0:
        raise ArgumentError(f"--context-parallel-size: must be positive, got {cp}")
    _raise_first(rules.split_problems(_flag_name, world=world_size, tensor=tp, context=cp, pipeline=pp))
    args.data_parallel_size = sizes.data_parallel_size(world_size, tp, cp, pp)
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    _raise_first(rules.batch_problems(_flag_name, global_batch=args.global_batch_size, micro=args.micro_batch_size,
                                      data=dp, pipeline=pp, interleaved=False))
    if not args.group_query_attention:
        if args.num_query_groups not in (None, args.num_attention_heads):
            raise ArgumentError("--num-query-groups: needs --group-query-attention")
        args.num_query_groups = None
    elif args.num_query_groups is None:
        raise ArgumentError("--num-query-groups: needed with --group-query-attention")
    _raise_first(rules.shape_problems(_flag_name, heads=args.num_attention_heads, hidden=args.hidden_size,
                                      groups=args.num_query_groups, tensor=tp))
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ArgumentError(f"--seq-length: {args.seq_length} exceeds --max-position-embeddings "
                            f"{args.max_position_embeddings}")

    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16/--bf16: choose one precision")
    args.params_dtype = "torch.float16" if args.fp16 else "torch.bfloat16" if args.bf16 else "torch.float32"

    # Recomputation: the legacy spellings map onto today's flags.
    if args.checkpoint_activations:
        if args.recompute_granularity not in (None, "full"):
            raise ArgumentError("--checkpoint-activations: conflicts with --recompute-granularity selective")
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or args.activations_checkpoint_method or "uniform"
        if args.recompute_num_layers is None:
            args.recompute_num_layers = args.activations_checkpoint_num_layers
    elif args.activations_checkpoint_method:
        raise ArgumentError("--activations-checkpoint-method: needs --checkpoint-activations")
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise ArgumentError("--recompute-activations: conflicts with --recompute-granularity full")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            raise ArgumentError("--recompute-method: needed with --recompute-granularity full (uniform or block)")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
    elif args.recompute_method or args.recompute_num_layers is not None:
        raise ArgumentError("--recompute-method/--recompute-num-layers: only apply to --recompute-granularity full")

    # Pipeline: interleaving and uneven layouts.
    args.virtual_pipeline_model_parallel_size = None
    accounted = args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split
    # the layers split over the chunks: the embedding and the loss count as one each where asked (validate_args)
    counted = sizes.split_layers(args.num_layers, args.account_for_embedding_in_pipeline_split,
                                 args.account_for_loss_in_pipeline_split)
    if accounted and args.pipeline_model_parallel_layout:
        raise ArgumentError("--account-for-embedding/loss-in-pipeline-split: cannot be combined with "
                            "--pipeline-model-parallel-layout (the layout places the embedding and loss itself)")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if pp == 1:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage: needs --pipeline-model-parallel-size > 1")
        if args.pipeline_model_parallel_layout:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage: cannot be combined with "
                                "--pipeline-model-parallel-layout (the layout sets the virtual stages)")
        per_stage = counted // pp
        if counted % pp or per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise ArgumentError(f"--num-layers-per-virtual-pipeline-stage: {args.num_layers_per_virtual_pipeline_stage}"
                                f" does not divide the {counted}/{pp} layers per pipeline stage"
                                + (" (embedding and loss counted as asked)" if accounted else ""))
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    elif accounted and counted % pp:
        raise ArgumentError(f"--account-for-embedding/loss-in-pipeline-split: {counted} layers with the embedding and "
                            f"loss counted do not split evenly over --pipeline-model-parallel-size {pp}")
    if args.pipeline_model_parallel_layout:
        if pp == 1:
            raise ArgumentError("--pipeline-model-parallel-layout: needs --pipeline-model-parallel-size > 1")
        problems = sizes.layout_problems(args.pipeline_model_parallel_layout, args.num_layers, pp)
        if problems:
            raise ArgumentError("--pipeline-model-parallel-layout: " + "; ".join(problems))
        chunks = sizes.layout_virtual_stages(args.pipeline_model_parallel_layout, pp)
        if chunks > 1:
            args.virtual_pipeline_model_parallel_size = chunks
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False  # only the interleaved schedule overlaps its sends and receives
    elif not args.overlap_p2p_comm and pp == 2:
        # Batched sends and receives with two stages put both directions between the same two ranks in one batch;
        # NCCL matches them in posting order and a stage can receive a gradient as its activation (Megatron-LM's
        # arguments.py refuses this combination too).
        raise ArgumentError("--no-overlap-p2p-communication: the interleaved schedule with "
                            "--pipeline-model-parallel-size 2 needs overlapped sends and receives; leave the flag out "
                            "or use more than 2 pipeline stages")
    _raise_first(rules.batch_problems(_flag_name, global_batch=args.global_batch_size, micro=args.micro_batch_size,
                                      data=dp, pipeline=pp,
                                      interleaved=bool(args.virtual_pipeline_model_parallel_size)))

    # Implementation and backend.
    te = _te_importable()
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if te and cuda else "local"
    elif args.transformer_impl == "transformer_engine" and not (te and cuda):
        raise ArgumentError("--transformer-impl transformer_engine: Transformer Engine needs a GPU and the "
                            "transformer_engine package; use --transformer-impl local")
    # What labkit's driver does not set up on any machine: refused, never accepted and ignored.
    if args.use_megatron_fsdp or args.data_parallel_sharding_strategy != "no_shard":
        stage = SHARDING_STRATEGIES.index(args.data_parallel_sharding_strategy)
        raise ArgumentError(f"--use-megatron-fsdp/--data-parallel-sharding-strategy: ZeRO stage {stage} through "
                            "Megatron-FSDP (optimizer.zero_backend megatron) is not run by labkit's driver: "
                            "Megatron-FSDP reduce-scatters and all-gathers on CUDA streams (megatron_fsdp.py), which "
                            "this driver does not set up; use --use-torch-fsdp2 (PyTorch FSDP2 through "
                            "megatron-core), or Megatron-LM's pretrain_gpt.py (job.entrypoint megatron-lm)")
    # The driver's default stays the legacy format; torch_dist (Megatron-LM's default) goes through megatron-core's
    # dist_checkpointing and can resume under another tensor/pipeline layout (checkpoint.py).
    args.ckpt_format = args.ckpt_format or "torch"
    if args.ckpt_format not in ("torch", "torch_dist"):
        raise ArgumentError(f"--ckpt-format {args.ckpt_format}: labkit's driver writes Megatron-LM's torch and "
                            "torch_dist formats; use one of them")
    if args.ckpt_format == "torch_dist" and args.use_distributed_optimizer and not _fused_adam_importable():
        # megatron-core 0.16.1 reloads the distributed optimizer's reshardable state in FusedAdam's layout only: with
        # torch's Adam (its fallback without Transformer Engine or Apex) the per-parameter "step" it keeps stops
        # load_parameter_state_from_fully_reshardable (distrib_optimizer.py) with a KeyError
        raise ArgumentError("--ckpt-format torch_dist: with --use-distributed-optimizer it needs Transformer Engine's "
                            "or Apex's FusedAdam, which this environment lacks (megatron-core cannot reload torch "
                            "Adam's state from it); use --ckpt-format torch, or leave out --use-distributed-optimizer")
    if args.tp_comm_overlap:
        raise ArgumentError("--tp-comm-overlap: labkit's driver does not start Transformer Engine's userbuffers, "
                            "which it needs; leave it out, or run Megatron-LM's pretrain_gpt.py (job.entrypoint: "
                            "megatron-lm)")
    if cp > 1:
        raise ArgumentError("--context-parallel-size: labkit's driver does not split sequences over context-parallel "
                            "ranks (the batch slicing and loss reduction are Megatron-LM's); use 1, or run "
                            "Megatron-LM's pretrain_gpt.py (job.entrypoint: megatron-lm)")
    gpu_only = {FLAG.fp8_format.name: args.fp8_format is not None,
                FLAG.attention_backend.name: args.attention_backend in ("flash", "fused")}
    for flag, given in gpu_only.items():
        if given and args.transformer_impl != "transformer_engine":
            raise ArgumentError(f"{flag}: needs Transformer Engine on a GPU, which this run does not have "
                                "(the CPU driver runs megatron-core's local layers); leave it out on CPU")
    if args.distributed_timeout_minutes <= 0:
        raise ArgumentError(f"--distributed-timeout-minutes: must be positive, got {args.distributed_timeout_minutes}")
    if args.fp8_format and not args.bf16:
        raise ArgumentError("--fp8-format: FP8 GEMMs run inside a bf16 model; add --bf16")
    _raise_first(rules.pairing_problems(_flag_name, tensor=tp, sequence_parallel=args.sequence_parallel,
                                        tp_comm_overlap=args.tp_comm_overlap,
                                        overlap_param_gather=args.overlap_param_gather,
                                        overlap_grad_reduce=args.overlap_grad_reduce,
                                        distributed_optimizer=args.use_distributed_optimizer))
    if args.sequence_parallel:
        if args.transformer_impl != "transformer_engine":
            raise ArgumentError("--sequence-parallel: megatron-core's local layers use torch LayerNorm, which sequence "
                                "parallelism does not support; it needs Transformer Engine on a GPU "
                                "(--transformer-impl transformer_engine)")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    elif args.distributed_backend == "nccl" and not cuda:
        raise ArgumentError("--distributed-backend nccl: needs GPUs; use gloo on CPU")
    if args.use_distributed_optimizer and args.optimizer != "adam":
        raise ArgumentError("--use-distributed-optimizer: megatron-core's distributed optimizer needs --optimizer adam")
    if args.use_torch_fsdp2:
        # Megatron-LM's validate_args, for --use-torch-fsdp2
        for bad, why in ((pp > 1, "is not supported with pipeline parallelism (--pipeline-model-parallel-size 1)"),
                         (args.use_distributed_optimizer, "replaces megatron-core's distributed optimizer; leave out "
                                                          "--use-distributed-optimizer"),
                         (not args.untie_embeddings_and_output_weights, "needs "
                                                                        "--untie-embeddings-and-output-weights"),
                         (args.fp16, "does not run fp16; use --bf16 or fp32"),
                         (args.save or args.load, "shards parameters as DTensors, which neither of the driver's "
                                                  "checkpoint formats saves; leave out --save and --load")):
            if bad:
                raise ArgumentError(f"--use-torch-fsdp2: {why}")
    elif not args.torch_fsdp2_reshard_after_forward:
        raise ArgumentError("--torch-fsdp2-no-reshard-after-forward: needs --use-torch-fsdp2")
    _check_deepspeed(args, tp, pp, cuda)

    # Data.
    if args.mock_data and args.data_path:
        raise ArgumentError("--mock-data: conflicts with --data-path; give one of them")
    if not args.mock_data and not args.data_path:
        raise ArgumentError("--data-path: missing; give a prefix from `labkit data prepare`, or --mock-data")
    if args.data_path:
        args.data_prefixes, args.data_weights = _data_blend(args.data_path)
        for prefix in args.data_prefixes:
            missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
            if missing:
                raise ArgumentError(f"--data-path: {prefix} has no {' or '.join(prefix + s for s in missing)}; "
                                    "create it with `labkit data prepare INPUT.jsonl --output-prefix P` and pass "
                                    "P_text_document")
        args.tokenizer_type = args.tokenizer_type or "GPT2BPETokenizer"
    else:
        args.data_prefixes, args.data_weights = [], None
        mock_tokenizer = "GPT2BPETokenizer" if args.vocab_size is None else "NullTokenizer"
        args.tokenizer_type = args.tokenizer_type or mock_tokenizer
    if args.tokenizer_type == "GPT2BPETokenizer":
        args.vocab_file = args.vocab_file or str(DEFAULT_VOCAB)
        args.merge_file = args.merge_file or str(DEFAULT_MERGES)
        for flag, path in ((FLAG.vocab_file.name, args.vocab_file), (FLAG.merge_file.name, args.merge_file)):
            if not Path(path).is_file():
                raise ArgumentError(f"{flag}: no such file {path}")
    elif args.tokenizer_type in ("HuggingFaceTokenizer", "SentencePieceTokenizer"):
        if args.tokenizer_model is None:
            raise ArgumentError(f"--tokenizer-model: needed with --tokenizer-type {args.tokenizer_type}")
        if not Path(args.tokenizer_model).is_file():
            raise ArgumentError(f"--tokenizer-model: no such file {args.tokenizer_model}")
    elif args.vocab_size is None:
        raise ArgumentError("--vocab-size: needed with --tokenizer-type NullTokenizer")
    if args.tokenizer_model is not None and args.tokenizer_type not in ("HuggingFaceTokenizer",
                                                                         "SentencePieceTokenizer"):
        raise ArgumentError(f"--tokenizer-model: --tokenizer-type {args.tokenizer_type} does not read one; "
                            "use HuggingFaceTokenizer or SentencePieceTokenizer")
    split = args.split.replace("/", ",").split(",")
    try:
        if len(split) > 3 or sum(float(s) for s in split) <= 0:
            raise ValueError
    except ValueError:
        raise ArgumentError(f"--split: {args.split!r} is not like 969,30,1 (train, validation, test weights)") from None

    # Schedule.
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.save_interval is not None and not args.save:
        raise ArgumentError("--save-interval: needs --save DIR")
    if args.profile:
        if not 0 <= args.profile_step_start < args.profile_step_end:
            raise ArgumentError("--profile-step-start/--profile-step-end: need 0 <= start < end")
        bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
        if bad:
            raise ArgumentError(f"--profile-ranks: {bad} outside the world of {world_size} processes")
    for flag in ("log_timers_to_tensorboard", "log_memory_to_tensorboard", "log_validation_ppl_to_tensorboard"):
        if getattr(args, flag) and not args.tensorboard_dir:
            raise ArgumentError(f"--{flag.replace('_', '-')}: needs --tensorboard-dir DIR")
    if args.wandb_project:
        _check_wandb(args)
    args.consumed_train_samples = 0
    args.iteration = 0
    return args


def _check_wandb(args) -> None:
    """W&B as Megatron-LM's _set_wandb_writer (megatron/training/global_vars.py) starts it: a named run, its files
    under --wandb-save-dir or else --save's wandb/."""
    import importlib.util

    from labkit.extras import install_hint

    if importlib.util.find_spec("wandb") is None:
        raise ArgumentError(install_hint(FLAG.wandb_project.name, "wandb"))
    if args.wandb_exp_name == "":
        raise ArgumentError(f"{FLAG.wandb_exp_name}: an empty name; name the W&B run")
    if not args.wandb_save_dir:
        if not args.save:
            raise ArgumentError(f"{FLAG.wandb_project}: W&B keeps its files under --save's wandb/; add "
                                f"{FLAG.wandb_save_dir} DIR or --save DIR")
        args.wandb_save_dir = os.path.join(args.save, "wandb")


def _check_deepspeed(args, tp: int, pp: int, cuda: bool) -> None:
    """--deepspeed (labkit/train/deepspeed_engine.py): what the engine needs, and a config that agrees with the
    Megatron flags (DeepSpeed would train its own batch sizes and precision otherwise)."""
    if not args.deepspeed:
        for given, flag in ((args.deepspeed_config, FLAG.deepspeed_config), (args.zero_stage, FLAG.zero_stage)):
            if given is not None:
                raise ArgumentError(f"{flag}: needs {FLAG.deepspeed}")
        return
    if importlib.util.find_spec("deepspeed") is None:
        raise ArgumentError(f"{FLAG.deepspeed}: needs the deepspeed package, which this environment lacks; "
                            "pip install deepspeed")
    for bad, why in ((tp > 1 or pp > 1, f"the driver hands DeepSpeed one whole GPT per rank: use "
                                        f"{FLAG.tensor_model_parallel_size} 1 and {FLAG.pipeline_model_parallel_size} 1"),
                     (args.use_distributed_optimizer or args.use_torch_fsdp2,
                      f"DeepSpeed's ZeRO shards instead; leave out {FLAG.use_distributed_optimizer} and "
                      f"{FLAG.use_torch_fsdp2}"),
                     (args.overlap_param_gather, f"belongs to megatron-core's distributed optimizer; leave out "
                                                 f"{FLAG.overlap_param_gather}"),
                     (args.optimizer != "adam", "DeepSpeed's ZeRO steps Adam-family optimizers; use --optimizer adam"),
                     (args.fp16 and not cuda, "DeepSpeed's CPU accelerator does not run fp16 (\"Type fp16 is not "
                                              "supported on your device\"); use --bf16 or fp32 on CPUs"),
                     (args.save or args.load, "the driver does not save or load DeepSpeed's checkpoints "
                                              "(engine.save_checkpoint's layout); leave out --save and --load")):
        if bad:
            raise ArgumentError(f"{FLAG.deepspeed}: {why}")
    if args.deepspeed_config is None or args.zero_stage is None:
        raise ArgumentError(f"{FLAG.deepspeed}: needs {FLAG.deepspeed_config} FILE and {FLAG.zero_stage} N "
                            "(`labkit run` renders both)")
    try:
        config = json.loads(Path(args.deepspeed_config).read_text())
    except (OSError, ValueError) as exc:
        raise ArgumentError(f"{FLAG.deepspeed_config}: cannot read {args.deepspeed_config} as JSON ({exc})") from None
    wanted = {"train_batch_size": (args.global_batch_size, FLAG.global_batch_size),
              "train_micro_batch_size_per_gpu": (args.micro_batch_size, FLAG.micro_batch_size),
              "zero_optimization.stage": (args.zero_stage, FLAG.zero_stage),
              "gradient_clipping": (args.clip_grad, FLAG.clip_grad),
              "fp16.enabled": (args.fp16, FLAG.fp16), "bf16.enabled": (args.bf16, FLAG.bf16)}
    for key, (value, flag) in wanted.items():
        section, _, field = key.rpartition(".")
        written = (config.get(section) or {}).get(field) if section else config.get(field)
        written = bool(written) if field == "enabled" else written
        if written != value:
            shown = "on" if value is True else "off" if value is False else value
            raise ArgumentError(f"{FLAG.deepspeed_config}: {key} is {written} in {args.deepspeed_config}, and "
                                f"{flag} says {shown}; write the same in both (`labkit run` renders them from one spec)")


def parse_args(argv: list[str] | None = None, world_size: int | None = None, rank: int | None = None,
               cuda: bool | None = None) -> argparse.Namespace:
    """Parse and check the flags; exits 2 with a message naming the flag when one cannot be honoured. A command line
    argparse refuses is refused before torch is imported (seconds)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    try:
        return finish(args, world_size, rank, cuda)
    except ArgumentError as exc:
        parser.error(str(exc))

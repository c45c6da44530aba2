"""The driver's command line: the flags are labkit.megatron.flags' table (Megatron-LM's names, nothing else), their
combinations checked by labkit.megatron.rules (the rules `labkit validate` runs over a spec's rendered flags); this
module adds the files they name and derives what Megatron derives (data-parallel size, padded sizes, warm-up steps) so
the arguments block prints like theirs.

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
from labkit.megatron.flags import DEFAULT_MERGES, DEFAULT_VOCAB, ArgumentError, FLAG, build_parser


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


def moe_layer_freq(value, num_layers: int) -> int | list[int]:
    """--moe-layer-freq as Megatron-LM's parser (moe_freq_type) turns it into what megatron-core reads: an integer N
    (one MoE layer in every N), or a pattern's list of 0 (dense) and 1 (MoE) per layer. Megatron-LM evaluates the
    pattern with eval; labkit.megatron.sizes reads the same grammar without it."""
    if isinstance(value, (int, list)):
        return value
    text = str(value).strip()
    return int(text) if text.isdigit() else sizes.moe_layer_pattern(text, num_layers)


def runtime(cuda: bool, args: argparse.Namespace) -> rules.Runtime:
    """This machine, as labkit.megatron.rules asks after it for labkit's driver. FusedAdam is looked for only where
    a rule reads it (importing Transformer Engine's optimizers takes seconds)."""
    fused_adam = _fused_adam_importable() if args.ckpt_format == "torch_dist" and args.use_distributed_optimizer \
        else False
    return rules.Runtime(driver=True, cuda=cuda, transformer_engine=_te_importable(), fused_adam=fused_adam,
                         deepspeed=not args.deepspeed or importlib.util.find_spec("deepspeed") is not None)


def finish(args: argparse.Namespace, world_size: int, rank: int, cuda: bool) -> argparse.Namespace:
    """Check the arguments against Megatron's rules (labkit.megatron.rules, the first problem raised as an
    ArgumentError naming its flag) and the files they name, then derive Megatron's derived arguments."""
    machine = runtime(cuda, args)
    problems = rules.problems(args, world_size, machine)
    if problems:
        raise ArgumentError(f"{rules.flag_name(problems[0].argument)}: {problems[0].message}")
    args.world_size, args.rank = world_size, rank
    tp, cp, pp = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    args.data_parallel_size = sizes.data_parallel_size(world_size, tp, cp, pp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if not args.group_query_attention:
        args.num_query_groups = None
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    # Megatron-LM's validate_args: the MLP's width, each head hidden / heads wide unless written, the experts' tensor
    # size the model's, each expert as wide as the MLP unless written, --moe-layer-freq as its parser reads it.
    args.ffn_hidden_size = sizes.ffn_hidden_size(args.hidden_size, args.swiglu, args.ffn_hidden_size)
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    args.expert_tensor_parallel_size = sizes.expert_tensor_size(tp, args.expert_tensor_parallel_size)
    if args.num_experts is not None:
        args.moe_ffn_hidden_size = sizes.moe_ffn_hidden_size(args.ffn_hidden_size, args.moe_ffn_hidden_size)
    args.moe_layer_freq = moe_layer_freq(args.moe_layer_freq, args.num_layers)
    args.params_dtype = "torch.float16" if args.fp16 else "torch.bfloat16" if args.bf16 else "torch.float32"

    # Recomputation: the legacy spellings map onto today's flags.
    if args.checkpoint_activations:
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or args.activations_checkpoint_method or "uniform"
        if args.recompute_num_layers is None:
            args.recompute_num_layers = args.activations_checkpoint_num_layers
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = 1

    args.virtual_pipeline_model_parallel_size = rules.virtual_stages(args)
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False  # only the interleaved schedule overlaps its sends and receives
    args.transformer_impl = rules.transformer_impl(args, machine)
    args.sdpa_attention = rules.sdpa_attention(args, machine)
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    # The driver's default stays the legacy format; torch_dist (Megatron-LM's default) goes through megatron-core's
    # dist_checkpointing and can resume under another tensor/pipeline layout (checkpoint.py).
    args.ckpt_format = args.ckpt_format or "torch"
    if args.deepspeed:
        _check_deepspeed_config(args)

    # Data and tokenizer: the files must be here.
    if args.data_path:
        args.data_prefixes, args.data_weights = _data_blend(args.data_path)
        for prefix in args.data_prefixes:
            missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
            if missing:
                raise ArgumentError(f"--data-path: {prefix} has no {' or '.join(prefix + s for s in missing)}; "
                                    "create it with `labkit data prepare INPUT.jsonl --output-prefix P` and pass "
                                    "P_text_document")
    else:
        args.data_prefixes, args.data_weights = [], None
    args.tokenizer_type = rules.tokenizer_type(args)
    if args.tokenizer_type == "GPT2BPETokenizer":
        args.vocab_file = args.vocab_file or str(DEFAULT_VOCAB)
        args.merge_file = args.merge_file or str(DEFAULT_MERGES)
        for flag, path in ((FLAG.vocab_file.name, args.vocab_file), (FLAG.merge_file.name, args.merge_file)):
            if not Path(path).is_file():
                raise ArgumentError(f"{flag}: no such file {path}")
    elif args.tokenizer_model is not None and not Path(args.tokenizer_model).is_file():
        raise ArgumentError(f"--tokenizer-model: no such file {args.tokenizer_model}")

    # Schedule.
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.wandb_project:
        _check_wandb(args)
    args.consumed_train_samples = 0
    args.iteration = 0
    return args


def _check_wandb(args) -> None:
    """W&B as Megatron-LM's _set_wandb_writer (megatron/training/global_vars.py) starts it: the package here, its files
    under --wandb-save-dir or else --save's wandb/."""
    from labkit.extras import install_hint

    if importlib.util.find_spec("wandb") is None:
        raise ArgumentError(install_hint(FLAG.wandb_project.name, "wandb"))
    if not args.wandb_save_dir:
        args.wandb_save_dir = os.path.join(args.save, "wandb")


def _check_deepspeed_config(args) -> None:
    """--deepspeed_config (labkit/train/deepspeed_engine.py): a config that agrees with the Megatron flags (DeepSpeed
    would train its own batch sizes and precision otherwise)."""
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

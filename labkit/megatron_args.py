"""Run spec -> Megatron-LM command-line flags: the one place where labkit's names meet Megatron's."""
from __future__ import annotations

import os

from labkit.megatron import sizes
from labkit.spec import RunSpec
from labkit.megatron.flags import DEFAULT_MERGES, DEFAULT_VOCAB, FLAG as F


def pipeline_layout(partition: list[int]) -> str:
    """Transformer layers per stage -> megatron-core's layout string, embedding (E) first and loss (L) last.

    [0, 11, 8, 5, 0] -> "E|t*11|t*8|t*5|L"; stages with no transformer layer are allowed, as in FASOP's
    0-11-8-8-8-8-5-0 (github.com/AvatarHwang/FASOP).
    """
    stages = []
    for i, layers in enumerate(partition):
        parts = []
        if i == 0:
            parts.append("E")
        if layers:
            parts.append(f"t*{layers}")
        if i == len(partition) - 1:
            parts.append("L")
        stages.append(",".join(parts))
    return "|".join(stages)


def tokenizer_args(spec: RunSpec) -> list:
    """--tokenizer-type and the files it reads: GPT-2 BPE's vocab/merges, or one --tokenizer-model file."""
    tokenizer, data = spec.data.tokenizer, spec.data
    kind = tokenizer.type if tokenizer else "GPT2BPETokenizer"
    args = [F.tokenizer_type, kind]
    if kind == "GPT2BPETokenizer":
        args += [F.vocab_file, _as_read_here(data.vocab_file or DEFAULT_VOCAB),
                 F.merge_file, _as_read_here(data.merge_file or DEFAULT_MERGES)]
    elif kind == "NullTokenizer":
        args += [F.vocab_size, spec.model.vocab_size]
    else:
        args += [F.tokenizer_model, _as_read_here(tokenizer.model)]
    return args


def _as_read_here(path) -> str:
    """A file the spec names, absolute as `labkit validate` read it (jobs run in their own run directory); an absolute
    path stays exactly as written."""
    path = os.path.expanduser(str(path))
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def kernel_args(spec: RunSpec) -> list:
    """The attention backend (when not auto, Megatron-LM's default) and the communication overlaps."""
    k = spec.kernels
    args: list = [] if k.attention_backend == "auto" else [F.attention_backend, k.attention_backend]
    for flag, on in ((F.overlap_grad_reduce, k.overlap_grad_reduce),
                     (F.overlap_param_gather, k.overlap_param_gather), (F.tp_comm_overlap, k.tp_comm_overlap)):
        if on:
            args.append(flag)
    return args


def megatron_args(spec: RunSpec, legacy: bool = False, save_dir: str | os.PathLike | None = None) -> list[str]:
    """The flags `python -m labkit.train` (and Megatron-LM's pretrain_gpt.py) take for this spec.

    `legacy=True` writes recomputation the way Megatron-LM before 2022 and the NVIDIA workshop notebook spell it
    (`--checkpoint-activations --activations-checkpoint-method uniform`).

    Taught in lab 08.
    """
    m, par, b, opt, tr, data = spec.model, spec.parallel, spec.batch, spec.optimizer, spec.train, spec.data
    args = [
        F.num_layers, m.num_layers,
        F.hidden_size, m.hidden_size,
        F.num_attention_heads, m.num_attention_heads,
    ]
    if m.num_query_groups and m.num_query_groups != m.num_attention_heads:
        args += [F.group_query_attention, F.num_query_groups, m.num_query_groups]
    if m.ffn_hidden_size:
        args += [F.ffn_hidden_size, m.ffn_hidden_size]
    args += [F.seq_length, m.seq_length, F.max_position_embeddings, m.seq_length]
    if m.swiglu:
        args += [F.swiglu]
    if m.untie_embeddings:
        args += [F.untie_embeddings_and_output_weights]
    # Megatron-LM's defaults (LayerNorm, learned positions, biases, padding to 128) go unwritten.
    if m.normalization != F.normalization.default:
        args += [F.normalization, m.normalization]
    if m.position_embedding_type != F.position_embedding_type.default:
        args += [F.position_embedding_type, m.position_embedding_type]
    if m.position_embedding_type == "rope":
        args += [F.rotary_base, m.rotary_base]
    if not m.add_bias_linear:
        args += [F.disable_bias_linear]
    if m.make_vocab_size_divisible_by != F.make_vocab_size_divisible_by.default:
        args += [F.make_vocab_size_divisible_by, m.make_vocab_size_divisible_by]
    for flag, value in ((F.hidden_dropout, m.hidden_dropout), (F.attention_dropout, m.attention_dropout)):
        if value != flag.default:  # Llama-style presets train without dropout
            args += [flag, value]

    args += [F.tensor_model_parallel_size, par.tensor, F.pipeline_model_parallel_size, par.pipeline]
    if par.account_for_embedding_in_pipeline_split:
        args += [F.account_for_embedding_in_pipeline_split]
    if par.account_for_loss_in_pipeline_split:
        args += [F.account_for_loss_in_pipeline_split]
    if par.pipeline_layout is not None:  # it sets the virtual stages itself: Megatron-LM refuses both flags
        args += [F.pipeline_model_parallel_layout, par.pipeline_layout]
    elif par.virtual_stages > 1:
        counted = sizes.split_layers(m.num_layers, par.account_for_embedding_in_pipeline_split,
                                     par.account_for_loss_in_pipeline_split)
        args += [F.num_layers_per_virtual_pipeline_stage,
                 sizes.layers_per_virtual_stage(counted, par.pipeline, par.virtual_stages)]
    if par.partition:
        args += [F.pipeline_model_parallel_layout, pipeline_layout(par.partition)]
    if par.context > 1:
        args += [F.context_parallel_size, par.context]
    if par.sequence_parallel:
        args += [F.sequence_parallel]
    args += kernel_args(spec)

    args += [F.micro_batch_size, b.micro, F.global_batch_size, b.global_]

    if spec.precision == "fp16":
        args += [F.fp16]
        if opt.loss_scale is not None:
            args += [F.loss_scale, opt.loss_scale]
        else:
            args += [F.initial_loss_scale, opt.initial_loss_scale]
    elif spec.precision == "bf16":
        args += [F.bf16]
    elif spec.precision == "fp8":
        args += [F.bf16, F.fp8_format, "hybrid"]  # e4m3 forward, e5m2 gradients, bf16 outside the GEMMs

    r = spec.recompute
    if r is not None and legacy and r.granularity == "full":
        args += [F.checkpoint_activations, F.activations_checkpoint_method, r.method,
                 F.activations_checkpoint_num_layers, r.num_layers]
    elif r is not None and r.granularity == "full":
        args += [F.recompute_granularity, "full", F.recompute_method, r.method, F.recompute_num_layers, r.num_layers]
    elif r is not None:
        args += [F.recompute_granularity, "selective"]

    args += [F.optimizer, opt.name, F.lr, opt.lr, F.min_lr, opt.min_lr, F.lr_decay_style, opt.lr_decay_style,
             F.lr_warmup_fraction, opt.lr_warmup_fraction, F.weight_decay, opt.weight_decay,
             F.clip_grad, opt.clip_grad]
    if opt.name == "adam":
        args += [F.adam_beta1, opt.adam_beta1, F.adam_beta2, opt.adam_beta2]
    if opt.distributed:
        args += [F.use_distributed_optimizer]
    if opt.grad_reduce_in_bf16:
        args += [F.grad_reduce_in_bf16]

    args += [F.train_iters, tr.iters, F.log_interval, tr.log_interval, F.seed, tr.seed]
    if tr.timing_log_level:
        args += [F.timing_log_level, tr.timing_log_level]
    if tr.eval_interval:
        args += [F.eval_interval, tr.eval_interval, F.eval_iters, tr.eval_iters]
    else:
        args += [F.eval_iters, 0]
    save = save_dir if save_dir is not None else tr.save
    if save:
        args += [F.save, save]
        if tr.save_interval:
            args += [F.save_interval, tr.save_interval]
    load = tr.load or (save if spec.job.requeue else None)
    if load:
        args += [F.load, load]
    if spec.job.requeue:
        # SIGTERM (Slurm's requeue or time limit) -> save a checkpoint and stop; the next attempt loads it.
        args += [F.exit_signal_handler]

    if data.path and not data.mock:
        args += [F.data_path, _as_read_here(data.path), F.split, data.split] + tokenizer_args(spec)
    else:
        args += [F.mock_data, F.vocab_size, m.vocab_size]
    args += [F.log_throughput]
    args += list(spec.job.extra_args)
    return [str(a) for a in args]

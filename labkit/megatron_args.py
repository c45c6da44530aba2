"""Run spec -> Megatron-LM command-line flags: the one place where labkit's names meet Megatron's."""
from __future__ import annotations

import os

from labkit.megatron import sizes
from labkit.spec import RunSpec
from labkit.train.arguments import DEFAULT_MERGES, DEFAULT_VOCAB


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
    args = ["--tokenizer-type", kind]
    if kind == "GPT2BPETokenizer":
        args += ["--vocab-file", _as_read_here(data.vocab_file or DEFAULT_VOCAB),
                 "--merge-file", _as_read_here(data.merge_file or DEFAULT_MERGES)]
    elif kind == "NullTokenizer":
        args += ["--vocab-size", spec.model.vocab_size]
    else:
        args += ["--tokenizer-model", _as_read_here(tokenizer.model)]
    return args


def _as_read_here(path) -> str:
    """A file the spec names, absolute as `labkit validate` read it (jobs run in their own run directory); an absolute
    path stays exactly as written."""
    path = os.path.expanduser(str(path))
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def kernel_args(spec: RunSpec) -> list:
    """The attention backend (when not auto, Megatron-LM's default) and the communication overlaps."""
    k = spec.kernels
    args: list = [] if k.attention_backend == "auto" else ["--attention-backend", k.attention_backend]
    for flag, on in (("--overlap-grad-reduce", k.overlap_grad_reduce),
                     ("--overlap-param-gather", k.overlap_param_gather), ("--tp-comm-overlap", k.tp_comm_overlap)):
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
        "--num-layers", m.num_layers,
        "--hidden-size", m.hidden_size,
        "--num-attention-heads", m.num_attention_heads,
    ]
    if m.num_query_groups and m.num_query_groups != m.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.ffn_hidden_size:
        args += ["--ffn-hidden-size", m.ffn_hidden_size]
    args += ["--seq-length", m.seq_length, "--max-position-embeddings", m.seq_length]
    if m.swiglu:
        args += ["--swiglu"]
    if m.untie_embeddings:
        args += ["--untie-embeddings-and-output-weights"]
    # Megatron-LM's defaults (LayerNorm, learned positions, biases, padding to 128) go unwritten.
    if m.normalization != "LayerNorm":
        args += ["--normalization", m.normalization]
    if m.position_embedding_type != "learned_absolute":
        args += ["--position-embedding-type", m.position_embedding_type]
    if m.position_embedding_type == "rope":
        args += ["--rotary-base", m.rotary_base]
    if not m.add_bias_linear:
        args += ["--disable-bias-linear"]
    if m.make_vocab_size_divisible_by != 128:
        args += ["--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by]
    for flag, value in (("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)):
        if value != 0.1:  # Megatron-LM's default; Llama-style presets train without dropout
            args += [flag, value]

    args += ["--tensor-model-parallel-size", par.tensor, "--pipeline-model-parallel-size", par.pipeline]
    if par.account_for_embedding_in_pipeline_split:
        args += ["--account-for-embedding-in-pipeline-split"]
    if par.account_for_loss_in_pipeline_split:
        args += ["--account-for-loss-in-pipeline-split"]
    if par.pipeline_layout is not None:  # it sets the virtual stages itself: Megatron-LM refuses both flags
        args += ["--pipeline-model-parallel-layout", par.pipeline_layout]
    elif par.virtual_stages > 1:
        counted = sizes.split_layers(m.num_layers, par.account_for_embedding_in_pipeline_split,
                                     par.account_for_loss_in_pipeline_split)
        args += ["--num-layers-per-virtual-pipeline-stage",
                 sizes.layers_per_virtual_stage(counted, par.pipeline, par.virtual_stages)]
    if par.partition:
        args += ["--pipeline-model-parallel-layout", pipeline_layout(par.partition)]
    if par.context > 1:
        args += ["--context-parallel-size", par.context]
    if par.sequence_parallel:
        args += ["--sequence-parallel"]
    args += kernel_args(spec)

    args += ["--micro-batch-size", b.micro, "--global-batch-size", b.global_]

    if spec.precision == "fp16":
        args += ["--fp16"]
        if opt.loss_scale is not None:
            args += ["--loss-scale", opt.loss_scale]
        else:
            args += ["--initial-loss-scale", opt.initial_loss_scale]
    elif spec.precision == "bf16":
        args += ["--bf16"]
    elif spec.precision == "fp8":
        args += ["--bf16", "--fp8-format", "hybrid"]  # e4m3 forward, e5m2 gradients, bf16 outside the GEMMs

    r = spec.recompute
    if r is not None and legacy and r.granularity == "full":
        args += ["--checkpoint-activations", "--activations-checkpoint-method", r.method,
                 "--activations-checkpoint-num-layers", r.num_layers]
    elif r is not None and r.granularity == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", r.method, "--recompute-num-layers", r.num_layers]
    elif r is not None:
        args += ["--recompute-granularity", "selective"]

    args += ["--optimizer", opt.name, "--lr", opt.lr, "--min-lr", opt.min_lr, "--lr-decay-style", opt.lr_decay_style,
             "--lr-warmup-fraction", opt.lr_warmup_fraction, "--weight-decay", opt.weight_decay,
             "--clip-grad", opt.clip_grad]
    if opt.name == "adam":
        args += ["--adam-beta1", opt.adam_beta1, "--adam-beta2", opt.adam_beta2]
    if opt.distributed:
        args += ["--use-distributed-optimizer"]
    if opt.grad_reduce_in_bf16:
        args += ["--grad-reduce-in-bf16"]

    args += ["--train-iters", tr.iters, "--log-interval", tr.log_interval, "--seed", tr.seed]
    if tr.timing_log_level:
        args += ["--timing-log-level", tr.timing_log_level]
    if tr.eval_interval:
        args += ["--eval-interval", tr.eval_interval, "--eval-iters", tr.eval_iters]
    else:
        args += ["--eval-iters", 0]
    save = save_dir if save_dir is not None else tr.save
    if save:
        args += ["--save", save]
        if tr.save_interval:
            args += ["--save-interval", tr.save_interval]
    load = tr.load or (save if spec.job.requeue else None)
    if load:
        args += ["--load", load]
    if spec.job.requeue:
        # SIGTERM (Slurm's requeue or time limit) -> save a checkpoint and stop; the next attempt loads it.
        args += ["--exit-signal-handler"]

    if data.path and not data.mock:
        args += ["--data-path", _as_read_here(data.path), "--split", data.split] + tokenizer_args(spec)
    else:
        args += ["--mock-data", "--vocab-size", m.vocab_size]
    args += ["--log-throughput"]
    args += list(spec.job.extra_args)
    return [str(a) for a in args]

"""Run spec -> Megatron-LM command-line flags: the one place where labkit's names meet Megatron's.

It reads the spec's values only (no spec code runs), so the spec's checks can ask which flags a spec renders.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from labkit import deepspeed_config
from labkit.megatron import sharding, sizes
from labkit.megatron.flags import (DEFAULT_MERGES, DEFAULT_VOCAB, DRIVER_ATTENTION_BACKENDS, FLAG as F,
                                   OPTIMIZER_DTYPES, SHARDING_STRATEGIES, Flag)

if TYPE_CHECKING:
    from labkit.spec import RunSpec

HF_TOKENIZER_FILE = "tokenizer.json"
"""The file a HuggingFace tokenizer directory holds: what labkit's driver reads, and what Megatron-LM's
AutoTokenizer.from_pretrained looks for in the directory it is given."""


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


ALWAYS = ""
"""The field of a flag every command line carries, whatever the spec says."""


class RenderedFlags:
    """A command line in the making: the flags in order, and the spec field each flag comes from."""

    def __init__(self):
        self.args: list = []
        self.fields: dict[str, str] = {}
        """Flag name -> the spec field that renders it (the first one, when two fields render the same flag); ALWAYS
        for a flag no field controls."""

    def add(self, field: str, flag: Flag, *values) -> None:
        self.args += [flag, *values]
        self.fields.setdefault(flag.name, field)


def huggingface_tokenizer_file(path) -> str:
    """data.tokenizer.model of a HuggingFaceTokenizer -> its tokenizer.json: the path itself when it names a .json
    file, else the file of that name in the directory. Decided by the name alone, so that a path that exists only on
    the cluster renders the same as one that exists here."""
    path = str(path)
    return path if path.endswith(".json") else os.path.join(path, HF_TOKENIZER_FILE)


def _tokenizer_flags(spec: RunSpec, out: RenderedFlags) -> None:
    """--tokenizer-type and the files it reads: GPT-2 BPE's vocab/merges, one --tokenizer-model file (a directory
    for Megatron-LM's HuggingFace tokenizer), or NullTokenizer's size."""
    tokenizer, data = spec.data.tokenizer, spec.data
    kind = tokenizer.type if tokenizer else "GPT2BPETokenizer"
    out.add("data.tokenizer.type", F.tokenizer_type, kind)
    if kind == "GPT2BPETokenizer":
        out.add("data.vocab_file", F.vocab_file, _as_read_here(data.vocab_file or DEFAULT_VOCAB))
        out.add("data.merge_file", F.merge_file, _as_read_here(data.merge_file or DEFAULT_MERGES))
    elif kind == "NullTokenizer":
        out.add("model.vocab_size", F.vocab_size, null_tokenizer_size(spec.model.vocab_size))
    elif kind == "HuggingFaceTokenizer":
        file = huggingface_tokenizer_file(_as_read_here(tokenizer.model))
        # Megatron-LM's _HuggingFaceTokenizer calls AutoTokenizer.from_pretrained, which takes the directory (and
        # refuses a file); labkit's driver reads the tokenizer.json itself.
        out.add("data.tokenizer.model", F.tokenizer_model,
                os.path.dirname(file) if spec.job.entrypoint == "megatron-lm" else file)
    else:
        out.add("data.tokenizer.model", F.tokenizer_model, _as_read_here(tokenizer.model))


def _as_read_here(path) -> str:
    """A file the spec names, absolute as `labkit validate` read it (jobs run in their own run directory); an absolute
    path stays exactly as written."""
    path = os.path.expanduser(str(path))
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def null_tokenizer_size(vocab: int) -> int:
    """--vocab-size for NullTokenizer so that the model's vocabulary is `vocab` (model.vocab_size): Megatron-LM's
    _NullTokenizer (megatron/training/tokenizer/tokenizer.py) adds its end-of-document id after the --vocab-size ids,
    so its vocabulary, padded into the embedding, is one larger than the flag."""
    return vocab - 1


def _kernel_flags(spec: RunSpec, out: RenderedFlags) -> None:
    """The attention backend (when not auto, Megatron-LM's default; sdpa is labkit's driver's own flag, which
    Megatron-LM lacks, and so renders nothing for it: the spec's checks refuse it there) and the overlaps."""
    k = spec.kernels
    if k.attention_backend in DRIVER_ATTENTION_BACKENDS:
        if spec.job.entrypoint != sharding.MEGATRON_LM:
            out.add("kernels.attention_backend", F.sdpa_attention)
    elif k.attention_backend != "auto":
        out.add("kernels.attention_backend", F.attention_backend, k.attention_backend)
    for key, flag in (("overlap_grad_reduce", F.overlap_grad_reduce), ("overlap_param_gather", F.overlap_param_gather),
                      ("tp_comm_overlap", F.tp_comm_overlap),
                      ("overlap_moe_expert_parallel_comm", F.overlap_moe_expert_parallel_comm)):
        if getattr(k, key):
            out.add(f"kernels.{key}", flag)
    if k.cuda_graph_impl != F.cuda_graph_impl.default:
        out.add("kernels.cuda_graph_impl", F.cuda_graph_impl, k.cuda_graph_impl)
    if k.cuda_graph_scope:
        out.add("kernels.cuda_graph_scope", F.cuda_graph_scope, *k.cuda_graph_scope)
        if "full_iteration" in k.cuda_graph_scope:
            # Megatron-LM's validate_args: a whole-iteration graph cannot stop on a NaN midway, and with expert
            # parallelism the local graphs ask for the router's padding (an inference setting; training is unchanged)
            out.add("kernels.cuda_graph_scope", F.no_check_for_nan_in_loss_and_grad)
    if k.cuda_graph_impl == "local" and spec.parallel.expert > 1:
        out.add("kernels.cuda_graph_impl", F.moe_pad_experts_for_cuda_graph_inference)


def profile_steps(profile) -> tuple[int, int]:
    """The capture range of a spec's profile section, as --profile-step-start and --profile-step-end: profile.nsys's
    steps, else Megatron-LM's defaults (profile.ncu alone)."""
    if profile.nsys is not None:
        return profile.nsys.start_step, profile.nsys.end_step
    return F.profile_step_start.default, F.profile_step_end.default


def profile_ranks(profile) -> list[int]:
    """Every rank the profile section captures (under nsys or ncu), in order."""
    return sorted({r for tool in (profile.nsys, profile.ncu) if tool is not None for r in tool.ranks})


def _profile_flags(spec: RunSpec, out: RenderedFlags) -> None:
    """profile.nsys / profile.ncu: the training program opens the CUDA profiler's capture range over the steps on the
    profiled ranks, as Megatron-LM's --profile does without --use-pytorch-profiler (labkit's driver alike); the job
    starts those ranks under nsys or ncu (labkit.jobs.render_profile)."""
    profile = spec.profile
    if profile is None or (profile.nsys is None and profile.ncu is None):
        return
    field = "profile.nsys" if profile.nsys is not None else "profile.ncu"
    start, end = profile_steps(profile)
    out.add(field, F.profile)
    out.add(f"{field}.start_step" if profile.nsys is not None else field, F.profile_step_start, start)
    out.add(f"{field}.end_step" if profile.nsys is not None else field, F.profile_step_end, end)
    out.add(f"{field}.ranks", F.profile_ranks, *profile_ranks(profile))


def _tracking_flags(spec: RunSpec, save, out: RenderedFlags) -> None:
    """TensorBoard and W&B. Megatron-LM's training_log sends loss, learning rate and grad norm to W&B only inside its
    TensorBoard branch (megatron/training/training.py), so W&B brings a TensorBoard directory with it; the timers
    switch adds iteration time and throughput to both."""
    tr = spec.train
    if tr.tensorboard_dir or tr.wandb:
        out.add("train.tensorboard_dir" if tr.tensorboard_dir else "train.wandb", F.tensorboard_dir,
                tr.tensorboard_dir or "tensorboard")
        out.add("train.tensorboard_dir" if tr.tensorboard_dir else "train.wandb", F.log_timers_to_tensorboard)
    if tr.wandb:
        out.add("train.wandb.project", F.wandb_project, tr.wandb.project)
        out.add("train.wandb.exp_name", F.wandb_exp_name, tr.wandb.exp_name or spec.name)
        # Megatron-LM's default, --save's wandb/, fails without --save (os.path.join(None, ...)): say where instead.
        out.add("train.wandb.save_dir", F.wandb_save_dir,
                tr.wandb.save_dir or (os.path.join(save, "wandb") if save else "wandb"))


def _expert_flags(m, out: RenderedFlags) -> None:
    """A mixture-of-experts model's flags: the experts and the router always (they are the model), the rest where the
    spec departs from Megatron-LM's defaults."""
    out.add("model.num_experts", F.num_experts, m.num_experts)
    out.add("model.moe_router_topk", F.moe_router_topk, m.moe_router_topk)
    for key, flag in (("moe_ffn_hidden_size", F.moe_ffn_hidden_size),
                      ("moe_shared_expert_intermediate_size", F.moe_shared_expert_intermediate_size)):
        if getattr(m, key) is not None:
            out.add(f"model.{key}", flag, getattr(m, key))
    if m.moe_layer_freq is not None and str(m.moe_layer_freq) != str(F.moe_layer_freq.default):
        out.add("model.moe_layer_freq", F.moe_layer_freq, m.moe_layer_freq)
    for key, flag in (("moe_router_load_balancing_type", F.moe_router_load_balancing_type),
                      ("moe_aux_loss_coeff", F.moe_aux_loss_coeff),
                      ("moe_token_dispatcher_type", F.moe_token_dispatcher_type)):
        out.add(f"model.{key}", flag, getattr(m, key))
    if m.moe_flex_dispatcher_backend is not None:
        out.add("model.moe_flex_dispatcher_backend", F.moe_flex_dispatcher_backend, m.moe_flex_dispatcher_backend)
    if m.moe_grouped_gemm:
        out.add("model.moe_grouped_gemm", F.moe_grouped_gemm)


def megatron_args(spec: RunSpec, legacy: bool = False, save_dir: str | os.PathLike | None = None,
                  ds_config: str | os.PathLike = deepspeed_config.FILE_NAME) -> list[str]:
    """The flags `python -m labkit.train` (and Megatron-LM's pretrain_gpt.py) take for this spec: the spec's own
    (`spec_flags`), then job.extra_args as written.

    `legacy=True` writes recomputation the way Megatron-LM before 2022 and the NVIDIA workshop notebook spell it
    (`--checkpoint-activations --activations-checkpoint-method uniform`).

    `ds_config`: where the job finds DeepSpeed's config (labkit.deepspeed_config), with optimizer.zero_backend deepspeed.

    Taught in lab 08.
    """
    rendered = spec_flags(spec, legacy, save_dir, ds_config)
    return [str(a) for a in rendered.args + list(spec.job.extra_args)]


def spec_flags(spec: RunSpec, legacy: bool = False, save_dir: str | os.PathLike | None = None,
               ds_config: str | os.PathLike = deepspeed_config.FILE_NAME) -> RenderedFlags:
    """The flags the spec's fields render, before job.extra_args, each with the field it comes from."""
    m, par, b, opt, tr, data = spec.model, spec.parallel, spec.batch, spec.optimizer, spec.train, spec.data
    save = save_dir if save_dir is not None else tr.save
    load = tr.load or (save if spec.job.requeue else None)
    out = RenderedFlags()
    out.add("model.num_layers", F.num_layers, m.num_layers)
    out.add("model.hidden_size", F.hidden_size, m.hidden_size)
    out.add("model.num_attention_heads", F.num_attention_heads, m.num_attention_heads)
    if m.num_query_groups and m.num_query_groups != m.num_attention_heads:
        out.add("model.num_query_groups", F.group_query_attention)
        out.add("model.num_query_groups", F.num_query_groups, m.num_query_groups)
    if m.ffn_hidden_size:
        out.add("model.ffn_hidden_size", F.ffn_hidden_size, m.ffn_hidden_size)
    out.add("model.seq_length", F.seq_length, m.seq_length)
    out.add("model.seq_length", F.max_position_embeddings, m.seq_length)
    if m.swiglu:
        out.add("model.swiglu", F.swiglu)
    if m.untie_embeddings:
        out.add("model.untie_embeddings", F.untie_embeddings_and_output_weights)
    # Megatron-LM's defaults (LayerNorm, learned positions, biases, padding to 128) go unwritten.
    if m.normalization != F.normalization.default:
        out.add("model.normalization", F.normalization, m.normalization)
    if m.position_embedding_type != F.position_embedding_type.default:
        out.add("model.position_embedding_type", F.position_embedding_type, m.position_embedding_type)
    if m.position_embedding_type == "rope":
        out.add("model.rotary_base", F.rotary_base, m.rotary_base)
    if not m.add_bias_linear:
        out.add("model.add_bias_linear", F.disable_bias_linear)
    if m.make_vocab_size_divisible_by != F.make_vocab_size_divisible_by.default:
        out.add("model.make_vocab_size_divisible_by", F.make_vocab_size_divisible_by, m.make_vocab_size_divisible_by)
    for key, flag in (("hidden_dropout", F.hidden_dropout), ("attention_dropout", F.attention_dropout)):
        if getattr(m, key) != flag.default:  # Llama-style presets train without dropout
            out.add(f"model.{key}", flag, getattr(m, key))
    if m.kv_channels is not None:
        out.add("model.kv_channels", F.kv_channels, m.kv_channels)
    if m.qk_layernorm:
        out.add("model.qk_layernorm", F.qk_layernorm)
    if m.num_experts:
        _expert_flags(m, out)

    out.add("parallel.tensor", F.tensor_model_parallel_size, par.tensor)
    out.add("parallel.pipeline", F.pipeline_model_parallel_size, par.pipeline)
    if par.account_for_embedding_in_pipeline_split:
        out.add("parallel.account_for_embedding_in_pipeline_split", F.account_for_embedding_in_pipeline_split)
    if par.account_for_loss_in_pipeline_split:
        out.add("parallel.account_for_loss_in_pipeline_split", F.account_for_loss_in_pipeline_split)
    if par.pipeline_layout is not None:  # it sets the virtual stages itself: Megatron-LM refuses both flags
        out.add("parallel.pipeline_layout", F.pipeline_model_parallel_layout, par.pipeline_layout)
    elif par.virtual_stages > 1:
        counted = sizes.split_layers(m.num_layers, par.account_for_embedding_in_pipeline_split,
                                     par.account_for_loss_in_pipeline_split)
        out.add("parallel.virtual_stages", F.num_layers_per_virtual_pipeline_stage,
                sizes.layers_per_virtual_stage(counted, par.pipeline, par.virtual_stages))
    if par.partition:
        out.add("parallel.partition", F.pipeline_model_parallel_layout, pipeline_layout(par.partition))
    if par.context > 1:
        out.add("parallel.context", F.context_parallel_size, par.context)
    if par.sequence_parallel:
        out.add("parallel.sequence_parallel", F.sequence_parallel)
    if par.expert > 1:
        out.add("parallel.expert", F.expert_model_parallel_size, par.expert)
    if par.expert_tensor is not None:
        out.add("parallel.expert_tensor", F.expert_tensor_parallel_size, par.expert_tensor)
    _kernel_flags(spec, out)

    out.add("batch.micro", F.micro_batch_size, b.micro)
    out.add("batch.global", F.global_batch_size, b.global_)

    if spec.precision == "fp16":
        out.add("precision", F.fp16)
        if opt.loss_scale is not None:
            out.add("optimizer.loss_scale", F.loss_scale, opt.loss_scale)
        else:
            out.add("optimizer.initial_loss_scale", F.initial_loss_scale, opt.initial_loss_scale)
    elif spec.precision == "bf16":
        out.add("precision", F.bf16)
    elif spec.precision == "fp8":
        out.add("precision", F.bf16)
        out.add("precision", F.fp8_format, "hybrid")  # e4m3 forward, e5m2 gradients, bf16 outside the GEMMs
    elif spec.precision == "mxfp8":  # e4m3 throughout, one scale per 32 elements (Blackwell's MX formats)
        out.add("precision", F.bf16)
        out.add("precision", F.fp8_format, "e4m3")
        out.add("precision", F.fp8_recipe, "mxfp8")
    elif spec.precision == "nvfp4":  # e2m1 with one scale per 16 elements (Blackwell)
        out.add("precision", F.bf16)
        out.add("precision", F.fp4_format, "e2m1")
        out.add("precision", F.fp4_recipe, "nvfp4")

    r = spec.recompute
    if r is not None and legacy and r.granularity == "full":
        out.add("recompute.granularity", F.checkpoint_activations)
        out.add("recompute.method", F.activations_checkpoint_method, r.method)
        out.add("recompute.num_layers", F.activations_checkpoint_num_layers, r.num_layers)
    elif r is not None and r.granularity == "full":
        out.add("recompute.granularity", F.recompute_granularity, "full")
        out.add("recompute.method", F.recompute_method, r.method)
        out.add("recompute.num_layers", F.recompute_num_layers, r.num_layers)
    elif r is not None:
        out.add("recompute.granularity", F.recompute_granularity, "selective")
        if r.modules is not None:
            out.add("recompute.modules", F.recompute_modules, *r.modules)

    for key, flag in (("name", F.optimizer), ("lr", F.lr), ("min_lr", F.min_lr), ("lr_decay_style", F.lr_decay_style),
                      ("lr_warmup_fraction", F.lr_warmup_fraction), ("weight_decay", F.weight_decay),
                      ("clip_grad", F.clip_grad)):
        out.add(f"optimizer.{key}", flag, getattr(opt, key))
    if opt.name == "adam":
        out.add("optimizer.adam_beta1", F.adam_beta1, opt.adam_beta1)
        out.add("optimizer.adam_beta2", F.adam_beta2, opt.adam_beta2)
    shard = sharding.of_spec(spec)
    if shard.megatron_gathers:
        # Megatron-FSDP runs beside the distributed optimizer, as Megatron-LM's user guide runs it
        # (docs/discussions/megatron-fsdp-user-guide)
        out.add("optimizer.distributed", F.use_distributed_optimizer)
    if deepspeed_config.uses_deepspeed(spec):
        # DeepSpeed's ZeRO engine shards instead of megatron-core, as Megatron-DeepSpeed spells it: the stage on the
        # command line and in the config the job writes beside its script (labkit.deepspeed_config)
        out.add("optimizer.zero_backend", F.deepspeed)
        out.add("optimizer.zero_backend", F.deepspeed_config, str(ds_config))
        out.add("optimizer.zero_stage", F.zero_stage, opt.zero_stage)
    elif shard.implementation == sharding.TORCH_FSDP2:
        # labkit's driver (labkit.megatron.sharding says why); stage 2 keeps each layer's gathered parameters from its
        # forward to its backward (Megatron-LM's help: "Set to enable FSDP ZeRO-2")
        out.add("optimizer.zero_stage", F.use_torch_fsdp2)
        if opt.zero_stage == 2:
            out.add("optimizer.zero_stage", F.torch_fsdp2_no_reshard_after_forward)
    elif shard.implementation == sharding.MEGATRON_FSDP:
        out.add("optimizer.zero_stage", F.use_megatron_fsdp)
        out.add("optimizer.zero_stage", F.data_parallel_sharding_strategy, SHARDING_STRATEGIES[opt.zero_stage])
        if not (tr.ckpt_format and (save or load)):  # its own format (validate_args asserts fsdp_dtensor)
            out.add("optimizer.zero_stage", F.ckpt_format, "fsdp_dtensor")
    if opt.grad_reduce_in_bf16:
        out.add("optimizer.grad_reduce_in_bf16", F.grad_reduce_in_bf16)
    if sharding.fp8_param_gather(spec):
        out.add("optimizer.fp8_param_gather", F.fp8_param_gather)
        if spec.precision == "mxfp8" and shard.implementation == sharding.DISTRIBUTED_OPTIMIZER:
            # the bf16 weights gathered in the gradient buffer, as Megatron-Bridge's bf16_with_mxfp8_mixed pairs them
            # (Megatron-LM turns it off under Megatron-FSDP)
            out.add("optimizer.fp8_param_gather", F.reuse_grad_buf_for_mxfp8_param_ag)
    if opt.precision_aware:
        out.add("optimizer.precision_aware", F.use_precision_aware_optimizer)
    for key in OPTIMIZER_DTYPES:  # each one written, so that the rules refuse one without precision_aware
        if getattr(opt, key) != "fp32":
            out.add(f"optimizer.{key}", getattr(F, key), getattr(opt, key))

    out.add("train.iters", F.train_iters, tr.iters)
    out.add("train.log_interval", F.log_interval, tr.log_interval)
    out.add("train.seed", F.seed, tr.seed)
    if tr.timing_log_level:
        out.add("train.timing_log_level", F.timing_log_level, tr.timing_log_level)
    if tr.eval_interval:
        out.add("train.eval_interval", F.eval_interval, tr.eval_interval)
        out.add("train.eval_iters", F.eval_iters, tr.eval_iters)
    else:
        out.add("train.eval_iters", F.eval_iters, 0)
    if save:
        out.add("train.save", F.save, save)
        if tr.save_interval:
            out.add("train.save_interval", F.save_interval, tr.save_interval)
    if load:
        out.add("train.load" if tr.load else "job.requeue", F.load, load)
    if tr.ckpt_format and (save or load):
        # the same flag for both entrypoints; left out, each writes its own default (the driver torch, Megatron-LM
        # torch_dist), which is what the spec's docs promise
        out.add("train.ckpt_format", F.ckpt_format, tr.ckpt_format)
    if (save and spec.job.entrypoint == sharding.MEGATRON_LM and tr.ckpt_format in (None, "torch_dist")
            and sharding.of_spec(spec).implementation == sharding.DISTRIBUTED_OPTIMIZER):
        # Megatron-LM 0.16.1 saves the distributed optimizer's state dp_reshardable unless told otherwise: reloadable
        # only under the same tensor/pipeline layout, which is not what torch_dist promises (labkit's driver always
        # saves it fully reshardable, labkit/train/checkpoint.py)
        out.add("train.ckpt_format", F.dist_ckpt_optim_fully_reshardable)
    if spec.job.requeue:
        # Slurm's warning before the time limit, passed on as USR1 by the job script (templates/node.sh.j2) -> save a
        # checkpoint at the end of the iteration and stop; the job is requeued after that and the next attempt loads it.
        out.add("job.requeue", F.exit_signal_handler)
        out.add("job.requeue", F.exit_signal, "SIGUSR1")

    _tracking_flags(spec, save, out)
    _profile_flags(spec, out)

    if data.path and not data.mock:
        out.add("data.path", F.data_path, _as_read_here(data.path))
        out.add("data.split", F.split, data.split)
        _tokenizer_flags(spec, out)
    else:
        # Random tokens need no tokenizer files, but Megatron-LM's build_tokenizer needs a type: NullTokenizer, sized
        # so that the embedding holds model.vocab_size tokens as the estimate counts them.
        out.add("data.mock", F.mock_data)
        out.add("data.mock", F.tokenizer_type, "NullTokenizer")
        out.add("model.vocab_size", F.vocab_size, null_tokenizer_size(m.vocab_size))
    out.add(ALWAYS, F.log_throughput)  # the logs' throughput per iteration
    return out

"""Every rule a run spec must satisfy, spec.job's fields included, so that `labkit validate` refuses what `labkit run`
would; what depends on the backend a job is submitted to is checked at submission (labkit.jobs.submission).

Each check returns 'field: what is wrong; how to fix it' strings (labkit.spec.errors) and collects every problem
before anything runs.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import re
from typing import TYPE_CHECKING

from labkit import catalog, deepspeed_config
from labkit.megatron import rules, sharding, sizes
from labkit.megatron.flags import (ATTENTION_BACKENDS, CUDA_GRAPH_IMPLS, CUDA_GRAPH_SCOPES, DRIVER_ATTENTION_BACKENDS,
                                   FLAG, MOE_LOAD_BALANCING_TYPES,
                                   MOE_FLEX_BACKENDS, MOE_TOKEN_DISPATCHERS, OPTIMIZER_DTYPES,
                                   NORMALIZATIONS, POSITION_EMBEDDING_TYPES, RECOMPUTE_MODULES, TOKENIZER_TYPES,
                                   ArgumentError,
                                   build_parser, flag_errors)
from labkit.megatron_args import ALWAYS, profile_steps, spec_flags
from labkit.spec import files
from labkit.spec.containers import container_errors
from labkit.spec.k8s_checks import k8s_spec_errors
from labkit.spec.errors import CONTROL_CHARS, SpecError, quote

if TYPE_CHECKING:
    from labkit.spec.schema import RunSpec

PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "mxfp8", "nvfp4")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
MOE_KEYS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
            "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type",
            "moe_flex_dispatcher_backend", "moe_grouped_gemm")
"""model keys that shape or route experts."""
MAX_WORLD = 2 ** 20
"""Most processes a spec may lay out (a million GPUs), and the bound of parallel.data and of a node group's figures:
sizes far beyond any cluster are typing errors, and checking them must not build one entry per rank."""
MAX_SPLIT = 1024
"""Most tensor ranks, pipeline stages or virtual stages: far beyond any model's layers or any GPU domain, and small
enough that what is listed per stage (the partition, each stage's GPU) stays short."""
MAX_LR = 1.0
"""Highest peak learning rate accepted: GPT pretraining peaks far below it (Megatron-LM's examples/pretrain_gpt.sh
at 1.5e-4, labkit's default); a rate above 1 is a typing error (65, 1e300)."""
_SPLIT = re.compile(r"^\s*\d+(?:\.\d*)?(?:\s*,\s*\d+(?:\.\d*)?){0,2}\s*$")
"""data.split as Megatron-LM reads it (megatron/core/datasets/utils.py, parse_and_normalize_split): up to three
non-negative shares, separated by commas."""
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME_LIMIT = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                         r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$")



SPEC_FIELDS = {"num_attention_heads": "model.num_attention_heads", "hidden_size": "model.hidden_size",
               "num_query_groups": "model.num_query_groups", "group_query_attention": "model.num_query_groups",
               "num_layers": "model.num_layers", "seq_length": "model.seq_length",
               "untie_embeddings_and_output_weights": "model.untie_embeddings",
               "tensor_model_parallel_size": "parallel.tensor", "context_parallel_size": "parallel.context",
               "pipeline_model_parallel_size": "parallel.pipeline",
               "pipeline_model_parallel_layout": "parallel.pipeline_layout",
               "global_batch_size": "batch.global", "micro_batch_size": "batch.micro",
               "sequence_parallel": "parallel.sequence_parallel", "tp_comm_overlap": "kernels.tp_comm_overlap",
               "overlap_param_gather": "kernels.overlap_param_gather",
               "overlap_grad_reduce": "kernels.overlap_grad_reduce", "use_distributed_optimizer": "optimizer.distributed",
               "use_torch_fsdp2": "optimizer.zero_stage", "use_megatron_fsdp": "optimizer.zero_stage",
               "deepspeed": "optimizer.zero_backend", "optimizer": "optimizer.name", "fp16": "precision",
               "bf16": "precision", "save": "train.save", "load": "train.load", "ckpt_format": "train.ckpt_format",
               "tensorboard_dir": "train.tensorboard_dir", "num_experts": "model.num_experts",
               "expert_model_parallel_size": "parallel.expert", "expert_tensor_parallel_size": "parallel.expert_tensor",
               "add_bias_linear": "model.add_bias_linear", "moe_router_topk": "model.moe_router_topk",
               "moe_layer_freq": "model.moe_layer_freq", "kv_channels": "model.kv_channels",
               "moe_grouped_gemm": "model.moe_grouped_gemm", "moe_ffn_hidden_size": "model.moe_ffn_hidden_size",
               "moe_shared_expert_intermediate_size": "model.moe_shared_expert_intermediate_size",
               "moe_token_dispatcher_type": "model.moe_token_dispatcher_type",
               "moe_flex_dispatcher_backend": "model.moe_flex_dispatcher_backend",
               "recompute_granularity": "recompute.granularity", "recompute_modules": "recompute.modules",
               "use_precision_aware_optimizer": "optimizer.precision_aware", "fp8_format": "precision",
               "fp8_recipe": "precision", "fp8_param_gather": "optimizer.fp8_param_gather",
               "overlap_moe_expert_parallel_comm": "kernels.overlap_moe_expert_parallel_comm",
               "cuda_graph_impl": "kernels.cuda_graph_impl", "cuda_graph_scope": "kernels.cuda_graph_scope",
               "recompute_method": "recompute.method", "attention_dropout": "model.attention_dropout",
               "hidden_dropout": "model.hidden_dropout",
               "num_layers_per_virtual_pipeline_stage": "parallel.virtual_stages"}
"""The spec field that sets each Megatron argument (argparse dest) labkit.megatron.rules speaks of, where the spec
renders no flag for it: a rule may name an argument the command line lacks ("needs --use-distributed-optimizer")."""


def _field(argument: str) -> str:
    return SPEC_FIELDS.get(argument, rules.FLAG_OF.get(argument, argument))


def _worded(problems: list[rules.Problem]) -> list[str]:
    """Megatron's rules broken by a spec, each as an error naming its field."""
    return [f"{_field(problem.argument)}: {problem.message}" for problem in problems]


def runtime(spec: RunSpec, layout: str | None = None) -> rules.Runtime:
    """Where the spec's command line runs, as labkit.megatron.rules asks after it. A plan (no `layout`) on GPUs is
    judged as Megatron-LM would run it, since labkit estimates runs either program makes; a plan on CPUs, and every
    job submitted with job.entrypoint labkit, as labkit's driver runs it. GPU nodes are taken to carry Transformer
    Engine and FusedAdam (NVIDIA's containers do); DeepSpeed is looked for here only for a job that runs here."""
    cpu = any(catalog.resolve_gpu_name(g.gpu) and catalog.gpu(g.gpu).is_cpu for g in spec.cluster_or_default().nodes)
    driver = spec.job.entrypoint != "megatron-lm" and (layout is not None or cpu)
    here = layout == "local" and sharding.of_spec(spec).implementation == sharding.DEEPSPEED
    return rules.Runtime(driver=driver, cuda=not cpu, transformer_engine=not cpu, fused_adam=not cpu,
                         deepspeed=not here or importlib.util.find_spec("deepspeed") is not None)


def rule_errors(spec: RunSpec, layout: str | None = None) -> list[str]:
    """labkit.megatron.rules over the flags the spec renders (and job.extra_args, which the driver's parser took), each
    problem under the spec field that rendered its flag: the driver's own check of its command line, before anything
    is submitted. Needs a spec whose sizes were checked (the flags are rendered)."""
    where = runtime(spec, layout)
    if not where.driver and spec.job.entrypoint != sharding.MEGATRON_LM:  # a plan, rendered as Megatron-LM runs it
        spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, entrypoint=sharding.MEGATRON_LM))
    rendered = spec_flags(spec)
    extra = list(spec.job.extra_args) if spec.job.entrypoint != sharding.MEGATRON_LM else []
    parser = build_parser()
    parser.exit_on_error = False
    try:
        args = parser.parse_args([str(a) for a in rendered.args] + extra)
    except (ArgumentError, argparse.ArgumentError):
        return []  # job.extra_args the parser refuses: check_job names them
    written = {arg.split("=", 1)[0]: i for i, arg in enumerate(extra)}

    def field(argument: str) -> str:
        flag = rules.FLAG_OF.get(argument, argument)
        if flag in written:  # the later value wins, and it is the user's
            return f"job.extra_args[{written[flag]}]"
        return rendered.fields.get(flag) or _field(argument)

    return [f"{field(problem.argument)}: {problem.message}"
            for problem in rules.problems(args, spec.world_size, where, name=field)]


SIZE_BOUNDS = {"num_layers": 4096, "hidden_size": 1 << 20, "num_attention_heads": 1 << 16, "seq_length": 1 << 24,
               "vocab_size": 1 << 24, "global_batch": 1 << 31}
"""The largest sizes a spec may give: a few hundred times today's largest runs (Llama 3.1 405B: 126 layers, hidden
16384, 128 heads; million-token contexts; 256K vocabularies; global batches of a few thousand sequences), so that
every size a real run uses passes and a typo such as 4294967296 layers is refused before the estimate sizes lists by
it."""
SIZE_BOUNDS_WHY = "labkit.spec.checks.SIZE_BOUNDS: far beyond today's largest runs"


def validate(spec: RunSpec, raise_errors: bool = True) -> list[str]:
    """Every problem with the spec, each 'field: what is wrong; how to fix it'; raises SpecError when `raise_errors`."""
    errors: list[str] = check_job(spec)
    m, par, b = spec.model, spec.parallel, spec.batch

    unknown_preset = m.preset is not None and m.preset not in catalog.models()  # reported where it is read
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
        value = getattr(m, name)
        if value is None and unknown_preset:
            continue  # the one fix is the preset's name, not five fields
        if value is None:
            errors.append(f"model.{name}: missing; set it or pick a model.preset ({', '.join(catalog.models())})")
        elif value <= 0:
            errors.append(f"model.{name}: must be a positive number, got {value}")
        elif value > SIZE_BOUNDS[name]:
            errors.append(f"model.{name}: {value:,} is beyond any model a cluster trains; at most "
                          f"{SIZE_BOUNDS[name]:,} ({SIZE_BOUNDS_WHY})")
    for name in ("num_query_groups", "ffn_hidden_size", "kv_channels", "num_experts", "moe_router_topk",
                 "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(m, name)
        if value is not None and value <= 0:
            errors.append(f"model.{name}: must be a positive number, got {value}; or leave it out for the default")
    for where, value in (("parallel.tensor", par.tensor), ("parallel.pipeline", par.pipeline),
                         ("parallel.context", par.context),
                         ("parallel.data", par.data), ("parallel.virtual_stages", par.virtual_stages),
                         ("parallel.expert", par.expert), ("parallel.expert_tensor", par.expert_tensor),
                         ("batch.micro", b.micro), ("batch.global", b.global_), ("train.iters", spec.train.iters),
                         ("train.log_interval", spec.train.log_interval)):
        if value is not None and value <= 0:
            errors.append(f"{where}: must be a positive number, got {value}")
    if b.global_ is not None and b.global_ > SIZE_BOUNDS["global_batch"]:
        errors.append(f"batch.global: {b.global_:,} sequences per step is beyond any run; at most "
                      f"{SIZE_BOUNDS['global_batch']:,} ({SIZE_BOUNDS_WHY})")
    errors += _check_sizes(spec)
    if spec.precision not in PRECISIONS:
        errors.append(f"precision: {quote(spec.precision)} is not one of {', '.join(PRECISIONS)}")
    if spec.optimizer.name not in OPTIMIZERS:
        errors.append(f"optimizer.name: {quote(spec.optimizer.name)} is not one of {', '.join(OPTIMIZERS)}")
    if spec.optimizer.lr_decay_style not in LR_DECAY_STYLES:
        errors.append(f"optimizer.lr_decay_style: {quote(spec.optimizer.lr_decay_style)} is not one of "
                      f"{', '.join(LR_DECAY_STYLES)}")
    errors += _check_optimizer(spec)
    errors += _check_zero(spec)
    stacks = catalog.calibration()["stacks"]
    if spec.kernels.stack is not None and spec.kernels.stack not in stacks:
        errors.append(f"kernels.stack: {quote(spec.kernels.stack)} is not one of {', '.join(stacks)} (the software "
                      "stacks of labkit/data/calibration.yaml); leave it out for "
                      f"{catalog.calibration()['default_stack']}")
    errors += _check_train(spec)
    errors += _check_architecture(spec)
    errors += files.file_errors(spec)
    errors += _check_recompute(spec)
    errors += _check_cluster(spec)
    if unknown_preset or any(e.startswith(("model.", "parallel.", "batch.", "cluster.")) for e in errors):
        return _finish(errors, raise_errors)  # the layout checks below need sane sizes

    t, p = par.tensor, par.pipeline
    errors += _worded(rules.shape_problems(_field, heads=m.num_attention_heads, hidden=m.hidden_size,
                                           groups=m.num_query_groups, tensor=t, kv_channels=m.kv_channels))

    world, c = spec.world_size, par.context
    split = t * c * p
    split_sizes = f"tensor {t} x context {c} x pipeline {p}" if c > 1 else f"tensor {t} x pipeline {p}"
    if spec.cluster is not None and spec.cluster.nodes and par.data is not None and world != split * par.data:
        fix = (f"set parallel.data to {sizes.data_parallel_size(world, t, c, p)} or change cluster.nodes"
               if world % split == 0 else f"give cluster.nodes {split * par.data} GPUs in all, or change "
               f"parallel.tensor/context/pipeline so that their product divides {world}")
        errors.append(f"parallel.data: world size {world} (cluster.nodes) != {split_sizes} x data {par.data} "
                      f"= {split * par.data}; {fix}")
    else:
        errors += _worded(rules.split_problems(_field, world=world, tensor=t, context=c, pipeline=p))
    errors += _check_kernels(spec)
    errors += _check_profile(spec)
    d = spec.data_parallel

    errors += _check_partition(spec)
    errors += _worded(rules.batch_problems(_field, global_batch=b.global_, micro=b.micro, data=d, pipeline=p,
                                           interleaved=par.virtual_stages > 1))
    if b.global_ % (b.micro * d) == 0 and par.virtual_stages > 1:
        if p == 1:
            errors.append("parallel.virtual_stages: the interleaved schedule needs parallel.pipeline > 1")
        per_stage = m.num_layers // p if m.num_layers % p == 0 else None
        if par.partition:
            errors.append("parallel.virtual_stages: an explicit parallel.partition cannot be interleaved; drop one of "
                          "them, or write each model chunk's layers as parallel.pipeline_layout")
        elif par.pipeline_layout is not None or _accounted(par):
            pass  # _check_partition checked the split into chunks
        elif per_stage is None or per_stage % par.virtual_stages:
            errors.append(f"parallel.virtual_stages: {par.virtual_stages} does not divide the layers per stage "
                          f"({m.num_layers}/{p}); choose a divisor of {per_stage or 'the even split'}")
    if not errors:  # the flags render only from sane sizes
        errors += repeated_flag_errors(spec) or rule_errors(spec)
    return _finish(errors, raise_errors)


def _finish(errors: list[str], raise_errors: bool) -> list[str]:
    if errors and raise_errors:
        raise SpecError(errors)
    return errors


def _check_architecture(spec: RunSpec) -> list[str]:
    """Megatron-LM's choices of normalization, positions and vocabulary padding, and the tokenizer type."""
    m, errors = spec.model, []
    if m.normalization not in NORMALIZATIONS:
        errors.append(f"model.normalization: {quote(m.normalization)} is not one of {', '.join(NORMALIZATIONS)}")
    if m.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        errors.append(f"model.position_embedding_type: {quote(m.position_embedding_type)} is not one of "
                      f"{', '.join(POSITION_EMBEDDING_TYPES)}")
    elif m.rotary_base is not None and m.position_embedding_type != "rope":
        errors.append(f"model.rotary_base: set to {m.rotary_base} but model.position_embedding_type is "
                      f"{quote(m.position_embedding_type)}; rotary_base applies only with position_embedding_type rope")
    if m.rotary_base is not None and m.rotary_base <= 0:
        errors.append(f"model.rotary_base: must be a positive number, got {m.rotary_base}")
    if m.make_vocab_size_divisible_by is not None and m.make_vocab_size_divisible_by <= 0:
        errors.append(f"model.make_vocab_size_divisible_by: must be a positive number, got "
                      f"{m.make_vocab_size_divisible_by}; Megatron's default is 128")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, name)
        if value is not None and not 0 <= value < 1:
            errors.append(f"model.{name}: a dropout probability is at least 0 and below 1, got {value}")
    for key, choices in (("moe_token_dispatcher_type", MOE_TOKEN_DISPATCHERS),
                         ("moe_flex_dispatcher_backend", MOE_FLEX_BACKENDS),
                         ("moe_router_load_balancing_type", MOE_LOAD_BALANCING_TYPES)):
        value = getattr(m, key)
        if value is not None and value not in choices:
            errors.append(f"model.{key}: {quote(value)} is not one of {', '.join(choices)}")
    if not m.num_experts:  # a dense model renders none of them: text the user wrote would be dropped unseen
        errors += [f"model.{key}: applies to mixture-of-experts models only; set model.num_experts, or leave it out"
                   for key in MOE_KEYS if getattr(m, key) not in (None, False)]
    elif m.moe_flex_dispatcher_backend is not None and m.moe_token_dispatcher_type != "flex":
        errors.append("model.moe_flex_dispatcher_backend: chooses the flex dispatcher's kernels; set "
                      "model.moe_token_dispatcher_type: flex, or leave it out")
    if m.moe_aux_loss_coeff is not None and m.moe_aux_loss_coeff < 0:
        errors.append(f"model.moe_aux_loss_coeff: must be zero or more, got {m.moe_aux_loss_coeff}")
    tokenizer = spec.data.tokenizer
    if tokenizer is not None and tokenizer.type not in TOKENIZER_TYPES:
        errors.append(f"data.tokenizer.type: {quote(tokenizer.type)} is not one of {', '.join(TOKENIZER_TYPES)}")
    return errors


def _check_sizes(spec: RunSpec) -> list[str]:
    """Layout sizes within MAX_SPLIT and MAX_WORLD, checked on the figures alone before anything is laid out."""
    par, errors = spec.parallel, []
    for key, bound in (("tensor", MAX_SPLIT), ("pipeline", MAX_SPLIT), ("context", MAX_SPLIT),
                       ("virtual_stages", MAX_SPLIT),
                       ("data", MAX_WORLD)):
        value = getattr(par, key)
        if value is not None and value > bound:
            errors.append(f"parallel.{key}: {value} is beyond any cluster; use at most {bound}")
    nodes = spec.cluster.nodes if spec.cluster is not None else []
    for i, group in enumerate(nodes):
        for key in ("count", "gpus_per_node"):
            if getattr(group, key) > MAX_WORLD:
                errors.append(f"cluster.nodes[{i}].{key}: {getattr(group, key)} is beyond any cluster; "
                              f"use at most {MAX_WORLD}")
    if errors:
        return errors
    world = sum(g.count * g.gpus_per_node for g in nodes) if nodes else \
        par.tensor * par.context * par.pipeline * (par.data or 1)
    if world > MAX_WORLD:
        errors.append(f"{'cluster.nodes' if nodes else 'parallel.data'}: {world} processes in all is beyond any "
                      f"cluster; use at most {MAX_WORLD}")
    return errors


def _check_optimizer(spec: RunSpec) -> list[str]:
    """Rates, betas and scales Megatron would take but no training wants (NaN and infinity are refused on loading)."""
    opt, errors = spec.optimizer, []
    if opt.lr is not None and opt.lr <= 0:
        errors.append(f"optimizer.lr: must be positive, got {opt.lr}")
    elif opt.lr is not None and opt.lr > MAX_LR:
        errors.append(f"optimizer.lr: {opt.lr:g} is above {MAX_LR:g}, a rate at which any GPT diverges; write the "
                      "peak rate, e.g. 1.5e-4 (Megatron-LM's examples/pretrain_gpt.sh)")
    for key in ("min_lr", "weight_decay", "clip_grad"):
        if getattr(opt, key) is not None and getattr(opt, key) < 0:
            errors.append(f"optimizer.{key}: must be zero or more, got {getattr(opt, key)}")
    if opt.lr is not None and opt.min_lr is not None and opt.min_lr > opt.lr > 0:
        errors.append(f"optimizer.min_lr: {opt.min_lr} exceeds the peak optimizer.lr {opt.lr}; the decay ends at "
                      "min_lr, so keep it at or below lr")
    for key in ("adam_beta1", "adam_beta2"):
        if getattr(opt, key) is not None and not 0 <= getattr(opt, key) < 1:
            errors.append(f"optimizer.{key}: must be at least 0 and below 1, got {getattr(opt, key)} "
                          "(e.g. 0.9 and 0.95)")
    for key in ("initial_loss_scale", "loss_scale"):
        if getattr(opt, key) is not None and getattr(opt, key) <= 0:
            errors.append(f"optimizer.{key}: must be a positive scale, got {getattr(opt, key)}")
    if opt.lr_warmup_fraction is not None and not 0 <= opt.lr_warmup_fraction <= 1:
        errors.append(f"optimizer.lr_warmup_fraction: must be between 0 and 1, got {opt.lr_warmup_fraction}")
    # every precision but fp16 and fp32 trains under Megatron-LM's --bf16, which the flag reduces in bf16
    if opt.grad_reduce_in_bf16 and spec.precision in ("fp16", "fp32"):
        errors.append(f"optimizer.grad_reduce_in_bf16: reduces bf16 gradients, and precision is {spec.precision}; "
                      "set precision: bf16 (or fp8, mxfp8, nvfp4), or leave it out")
    if opt.fp8_param_gather and opt.precision_aware:
        # megatron-core 0.16.1 hands Transformer Engine's FusedAdam the model's weights, whose master it keeps as the
        # 16 bits bf16 lacks (store_param_remainders): with FP8 weights there are no bf16 bits to complete
        errors.append("optimizer.fp8_param_gather: conflicts with optimizer.precision_aware, whose FusedAdam keeps the "
                      "master weights as the low bits of bf16 weights that FP8 parameters do not have; leave one out")
    for key, choices in OPTIMIZER_DTYPES.items():
        if getattr(opt, key) not in choices:
            errors.append(f"optimizer.{key}: {quote(getattr(opt, key))} is not one of {', '.join(choices)}")
    return errors


ZERO_BACKENDS = sharding.BACKENDS
"""optimizer.zero_backend values (labkit.megatron.sharding)."""


def _check_zero(spec: RunSpec) -> list[str]:
    """ZeRO stage and backend: a known stage, and gradients and parameters sharded only where the backend can."""
    opt, errors = spec.optimizer, []
    if opt.zero_stage not in (0, 1, 2, 3):
        errors.append(f"optimizer.zero_stage: {opt.zero_stage} is not 0 (nothing sharded), 1 (optimizer states), "
                      "2 (and gradients) or 3 (and parameters)")
    if opt.zero_backend not in ZERO_BACKENDS:
        errors.append(f"optimizer.zero_backend: {quote(opt.zero_backend)} is not one of {', '.join(ZERO_BACKENDS)}")
    elif sharding.of_spec(spec).implementation == sharding.DEEPSPEED and spec.precision == "fp16" and \
            opt.loss_scale is None and \
            deepspeed_config.initial_scale_power(opt.initial_loss_scale) is None:
        errors.append(f"optimizer.initial_loss_scale: {opt.initial_loss_scale:g} is no power of 2, and DeepSpeed "
                      "starts its dynamic fp16 loss scale at 2**initial_scale_power (optimizer.zero_backend "
                      "deepspeed); use e.g. 4294967296 (2**32)")
    if sharding.of_spec(spec).implementation == sharding.DEEPSPEED and opt.zero_stage in (2, 3) \
            and spec.parallel.pipeline > 1:
        # DeepSpeed's PipelineEngine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" (a rule of
        # DeepSpeed's, not of Megatron's flags: labkit.megatron.rules has megatron-core's FSDP counterpart)
        errors.append(f"optimizer.zero_stage: {opt.zero_stage} with parallel.pipeline {spec.parallel.pipeline}: "
                      "DeepSpeed's pipeline engine refuses ZeRO stages 2 and 3 (optimizer.zero_backend deepspeed); "
                      "use zero_stage 1, or parallel.pipeline 1")
    return errors


SEED_LIMIT = 2**31
"""Megatron seeds NumPy (32-bit seeds) with train.seed + 100 x the pipeline stage: this leaves room for every stage."""


def _check_kernels(spec: RunSpec) -> list[str]:
    """Kernels, FP8 and context parallelism: what megatron-core accepts, and what the GPUs can run."""
    k, errors = spec.kernels, []
    if k.attention_backend not in ATTENTION_BACKENDS + DRIVER_ATTENTION_BACKENDS:
        errors.append(f"kernels.attention_backend: {quote(k.attention_backend)} is not one of "
                      f"{', '.join(ATTENTION_BACKENDS + DRIVER_ATTENTION_BACKENDS)}")
    elif k.attention_backend in DRIVER_ATTENTION_BACKENDS and spec.job.entrypoint == sharding.MEGATRON_LM:
        errors.append(f"kernels.attention_backend: {k.attention_backend} is labkit's driver's (PyTorch's "
                      "scaled_dot_product_attention in megatron-core's layers), and Megatron-LM's "
                      f"{FLAG.attention_backend} has no such choice (job.entrypoint megatron-lm); use flash or fused "
                      "(Transformer Engine), unfused or local, or job.entrypoint labkit")
    if k.cuda_graph_impl not in CUDA_GRAPH_IMPLS:
        errors.append(f"kernels.cuda_graph_impl: {quote(k.cuda_graph_impl)} is not one of "
                      f"{', '.join(CUDA_GRAPH_IMPLS)}")
    if k.cuda_graph_scope is not None:
        if k.cuda_graph_impl == "none":
            errors.append("kernels.cuda_graph_scope: chooses what a CUDA graph captures; set kernels.cuda_graph_impl "
                          "(transformer_engine or local), or leave the scope out")
        errors += [f"kernels.cuda_graph_scope[{i}]: {quote(scope)} is not one of {', '.join(CUDA_GRAPH_SCOPES)}"
                   for i, scope in enumerate(k.cuda_graph_scope) if scope not in CUDA_GRAPH_SCOPES]
    gpus = {g.gpu for g in spec.cluster_or_default().nodes}
    known = {name: catalog.gpu(name) for name in gpus if catalog.resolve_gpu_name(name)}
    if spec.precision == "fp8":
        for name, gpu in sorted(known.items()):
            if not gpu.fp8:
                errors.append(f"precision: fp8 needs FP8 tensor cores (Ada, Hopper or later), and cluster GPU "
                              f"{name} has none; use bf16")
    if spec.precision in ("mxfp8", "nvfp4"):
        for name, gpu in sorted(known.items()):
            if not gpu.fp4:
                fallback = "fp8" if gpu.fp8 else "bf16"
                errors.append(f"precision: {spec.precision} scales blocks of values in the tensor cores of Blackwell "
                              f"(B200, GB200, GB300) and later, and cluster GPU {name} has none; use {fallback}")
    return errors


NSYS_SET_BY_LABKIT = ("--capture-range", "--capture-range-end", "--trace", "-t", "--output", "-o", "--export",
                     "--force-overwrite", "-f")
"""`nsys profile` options the job writes itself (labkit.jobs.render_profile), which profile.nsys.extra_args may not
repeat."""
_WORD = re.compile(r"[A-Za-z0-9_.-]+")


def _check_profile(spec: RunSpec) -> list[str]:
    """profile.nsys and profile.ncu: GPUs, ranks of this world, a capture range inside the run, options the job can
    write."""
    profile, errors = spec.profile, []
    if profile is None:
        return errors
    tools = [(f"profile.{name}", tool) for name, tool in (("nsys", profile.nsys), ("ncu", profile.ncu)) if tool]
    if not tools:
        errors.append("profile: names neither nsys nor ncu; add profile.nsys or profile.ncu, or remove profile")
    nodes = spec.cluster_or_default().nodes
    cpu = [i for i, g in enumerate(nodes) if catalog.resolve_gpu_name(g.gpu) and catalog.gpu(g.gpu).is_cpu]
    world = spec.world_size
    for key, tool in tools:
        if cpu:
            errors.append(f"{key}: Nsight records CUDA GPUs, and cluster.nodes[{cpu[0]}].gpu is cpu; on CPUs take a "
                          "torch.profiler trace (labkit.jobs.sweep.profiled), or remove " + key)
        if not tool.ranks:
            errors.append(f"{key}.ranks: empty; list the global ranks to profile, e.g. [0]")
        bad = [r for r in tool.ranks if not 0 <= r < world]
        if bad:
            errors.append(f"{key}.ranks: {bad} outside the world of {world} processes; use ranks 0 to {world - 1}")
        if len(set(tool.ranks)) < len(tool.ranks):
            errors.append(f"{key}.ranks: {tool.ranks} names a rank twice; name each once")
    if profile.nsys and profile.ncu and set(profile.nsys.ranks) & set(profile.ncu.ranks):
        errors.append(f"profile.ncu.ranks: {sorted(set(profile.nsys.ranks) & set(profile.ncu.ranks))} also in "
                      "profile.nsys.ranks; a process runs under one tool, so give each rank to nsys or to ncu")
    if tools:
        start, end = profile_steps(profile)
        key = "profile.nsys" if profile.nsys else "profile.ncu"
        if profile.nsys and not 0 <= start < end:
            errors.append(f"profile.nsys.start_step: {start} with end_step {end}; needs 0 <= start_step < end_step")
        elif end > spec.train.iters:
            where = "profile.nsys.end_step" if profile.nsys else "profile.ncu"
            why = "" if profile.nsys else (f" (with no profile.nsys, ncu measures inside Megatron-LM's default steps "
                                           f"{start} to {end})")
            errors.append(f"{where}: the capture range closes after iteration {end}{why}, past train.iters "
                          f"{spec.train.iters}, so it would never close; "
                          + ("lower end_step or raise train.iters" if profile.nsys else
                             "add profile.nsys with steps inside the run, or raise train.iters"))
        if FLAG.use_pytorch_profiler.name in spec.job.extra_args:
            errors.append(f"job.extra_args: {FLAG.use_pytorch_profiler} turns the capture range {key} needs into a "
                          "torch.profiler trace; remove it, or remove " + key)
    if profile.nsys:
        for i, api in enumerate(profile.nsys.trace):
            if not _WORD.fullmatch(str(api)):
                errors.append(f"profile.nsys.trace[{i}]: {quote(api)} is not an nsys --trace value (cuda, nvtx, "
                              "cublas, cudnn, osrt, ...)")
        for i, arg in enumerate(profile.nsys.extra_args):
            option = str(arg).split("=", 1)[0]
            if CONTROL_CHARS.search(str(arg)) or not str(arg).strip():
                errors.append(f"profile.nsys.extra_args[{i}]: {quote(arg)} is not one command-line word on one line")
            elif option in NSYS_SET_BY_LABKIT:
                errors.append(f"profile.nsys.extra_args[{i}]: {quote(arg)} repeats {option}, which the job sets "
                              "(capture range, trace from profile.nsys.trace, output into the run's logs); remove it")
    if profile.ncu:
        ncu = profile.ncu
        if ncu.kernel_regex is not None and (not ncu.kernel_regex.strip() or CONTROL_CHARS.search(ncu.kernel_regex)):
            errors.append(f"profile.ncu.kernel_regex: {quote(ncu.kernel_regex)} is not a regular expression on one "
                          "line; e.g. gemm|flash, or leave it out for every kernel")
        if ncu.launch_count < 1:
            errors.append(f"profile.ncu.launch_count: must be at least 1, got {ncu.launch_count}")
        errors += [f"profile.ncu.sections[{i}]: {quote(name)} is not an ncu section identifier (e.g. SpeedOfLight)"
                   for i, name in enumerate(ncu.sections) if not _WORD.fullmatch(str(name))]
    if profile.output_dir is not None and (not str(profile.output_dir).startswith("/")
                                           or CONTROL_CHARS.search(str(profile.output_dir))):
        errors.append(f"profile.output_dir: {quote(profile.output_dir)} is not an absolute path on one line; write "
                      "where the nodes keep the reports, or leave it out for the run's logs/")
    return errors


def _check_train(spec: RunSpec) -> list[str]:
    train, errors = spec.train, []
    if train.iters is not None and train.log_interval is not None and train.log_interval > train.iters > 0:
        # Megatron-LM logs an interval line when iteration % log_interval == 0 (training.py, training_log): none here.
        errors.append(f"train.log_interval: {train.log_interval} is more than train.iters {train.iters}, so no "
                      f"iteration would be logged (no loss, no time); set train.log_interval to at most {train.iters}")
    shares = spec.data.split
    if shares is not None and not (_SPLIT.match(shares) and sum(float(x) for x in re.findall(r"[.0-9]+", shares))):
        errors.append(f"data.split: {quote(spec.data.split)} is not the train, validation and test shares; write up "
                      "to three numbers separated by commas with a positive sum, e.g. 90,5,5 or 100,0,0")
    for key in ("eval_interval", "save_interval"):
        if getattr(train, key) is not None and getattr(train, key) <= 0:
            errors.append(f"train.{key}: must be a positive number of steps, got {getattr(train, key)}; "
                          "or leave it out")
    if train.eval_iters is not None and train.eval_iters < 0:
        errors.append(f"train.eval_iters: must be zero or more, got {train.eval_iters}")
    if train.seed is not None and not 0 <= train.seed < SEED_LIMIT:
        errors.append(f"train.seed: must be from 0 to {SEED_LIMIT - 1:,}, got {train.seed}; Megatron seeds NumPy with "
                      "it plus 100 per pipeline stage, and NumPy takes 32-bit seeds")
    if train.ckpt_format not in (None, "torch", "torch_dist"):
        errors.append(f"train.ckpt_format: {quote(train.ckpt_format)} is not torch or torch_dist (torch_dist resumes "
                      "under another tensor/pipeline layout); or leave it out for the entrypoint's default")
    if train.timing_log_level not in (0, 1, 2):
        errors.append(f"train.timing_log_level: {quote(train.timing_log_level)} is not 0, 1 or 2 (Megatron's timer "
                      "levels; 0 logs the iteration time only)")
    if train.wandb is not None and not str(train.wandb.project or "").strip():
        errors.append("train.wandb.project: the W&B project is needed with train.wandb, e.g. train: {wandb: {project: "
                      "labkit}}; or leave train.wandb out")
    return errors


def _check_recompute(spec: RunSpec) -> list[str]:
    r = spec.recompute
    if r is None:
        return []
    errors = []
    if r.granularity not in RECOMPUTE_GRANULARITIES:
        errors.append(f"recompute.granularity: {quote(r.granularity)} is not one of "
                      f"{', '.join(RECOMPUTE_GRANULARITIES)} (or write `recompute: none`)")
    if r.granularity == "full":
        if r.method not in RECOMPUTE_METHODS:
            errors.append(f"recompute.method: {quote(r.method)} is not one of {', '.join(RECOMPUTE_METHODS)} "
                          "(needed with granularity full)")
        if r.num_layers is None or r.num_layers <= 0:
            errors.append(f"recompute.num_layers: must be a positive number, got {r.num_layers}")
        elif spec.model.num_layers and r.method == "block" and r.num_layers > spec.model.num_layers:
            errors.append(f"recompute.num_layers: {r.num_layers} exceeds model.num_layers {spec.model.num_layers}")
    if r.modules is not None:
        if r.granularity != "selective":
            errors.append("recompute.modules: chooses what granularity selective recomputes; set granularity "
                          "selective, or leave modules out")
        if not r.modules:
            errors.append(f"recompute.modules: empty; name one or more of {', '.join(RECOMPUTE_MODULES)}, or leave "
                          "it out for core_attn")
        errors += [f"recompute.modules[{i}]: {quote(module)} is not one of {', '.join(RECOMPUTE_MODULES)}"
                   for i, module in enumerate(r.modules) if module not in RECOMPUTE_MODULES]
    return errors


def _check_cluster(spec: RunSpec) -> list[str]:
    if spec.cluster is None:
        return []
    errors = []
    if not spec.cluster.nodes:
        errors.append("cluster.nodes: empty; list at least one node group like {gpu: A100-80GB, count: 1, gpus_per_node: 8}")
    for i, group in enumerate(spec.cluster.nodes):
        where = f"cluster.nodes[{i}]"
        name = catalog.resolve_gpu_name(group.gpu)
        if name is None:
            hint = catalog.closest(group.gpu, [n for g in catalog.gpus().values() for n in (g.name, *g.aliases)])
            errors.append(f"{where}.gpu: unknown GPU {quote(group.gpu)}; "
                          + (f"closest: {', '.join(hint)}; " if hint else "") + f"known: {', '.join(catalog.gpus())}")
        else:
            gpu = catalog.gpus()[name]
            if spec.precision == "bf16" and not gpu.bf16:
                errors.append(f"precision: bf16 is not supported by {name} ({where}.gpu); use fp16 on this GPU")
            if spec.precision == "fp16" and not gpu.fp16:
                errors.append(f"precision: fp16 is not supported by {name} ({where}.gpu); use bf16 or fp32")
        for key in ("count", "gpus_per_node"):
            if getattr(group, key) <= 0:
                errors.append(f"{where}.{key}: must be a positive number, got {getattr(group, key)}")
        for key in ("inter_node_gbps", "intra_node_gbps"):
            if getattr(group, key) is not None and getattr(group, key) <= 0:
                errors.append(f"{where}.{key}: must be a positive link speed in Gbit/s, got {getattr(group, key)}")
        if group.cpus_per_node is not None and group.cpus_per_node <= 0:
            errors.append(f"{where}.cpus_per_node: must be a positive number of CPUs, got {group.cpus_per_node}")
    for key in ("inter_node_gbps", "intra_node_gbps"):
        if getattr(spec.cluster, key) is not None and getattr(spec.cluster, key) <= 0:
            errors.append(f"cluster.{key}: must be a positive link speed in Gbit/s, got {getattr(spec.cluster, key)}")
    return errors + login_errors(spec.cluster.login, spec.cluster.remote_dir)


LOGIN = re.compile(r"(?:[A-Za-z0-9._][A-Za-z0-9._-]*@)?[A-Za-z0-9_][A-Za-z0-9._-]*")
"""cluster.login: user@host or a Host of the ssh config; nothing ssh would read as an option or a second word."""

REMOTE_PATH = re.compile(r"[A-Za-z0-9_./+-]+")
"""cluster.remote_dir: a path the remote shell, rsync and scp all read as the same one path."""


def login_errors(login, remote_dir) -> list[str]:
    """Problems with cluster.login and cluster.remote_dir (labkit.jobs.remote), each naming its field and the fix."""
    errors = []
    if login is not None and (not isinstance(login, str) or not LOGIN.fullmatch(login)):
        errors.append(f"cluster.login: {quote(login)} is not user@host; write the login node as user@host (e.g. "
                      "alice@login.cluster.org) or a Host of your ~/.ssh/config")
    if remote_dir is not None:
        if login is None:
            errors.append("cluster.remote_dir: only used with cluster.login; set cluster.login or leave it out")
        if not isinstance(remote_dir, str) or not REMOTE_PATH.fullmatch(remote_dir) or ".." in remote_dir.split("/"):
            errors.append(f"cluster.remote_dir: {quote(remote_dir)} is not a plain path; use letters, digits and "
                          "_ . / + - (absolute, or under your home on the login node, e.g. labkit-runs), without '..'")
        elif remote_dir.startswith("-"):
            errors.append(remote_option_error("cluster.remote_dir", remote_dir))
    return errors


def remote_option_error(field: str, path: str) -> str:
    """A path that starts with '-', which mkdir, cd and the other commands of the login node's shell would read as an
    option: the error naming its field and the fix."""
    return (f"{field}: {quote(path)} starts with '-', which mkdir and cd on the login node would read as an option; "
            f"write ./{path} for a directory of that name under your home, or an absolute path")


_ACCOUNT_FOR = {"account_for_embedding_in_pipeline_split": "the embedding",
                "account_for_loss_in_pipeline_split": "the loss"}


def _accounted(par) -> list[str]:
    """The account-for keys a ParallelSpec sets."""
    return [key for key in _ACCOUNT_FOR if getattr(par, key)]


def _check_partition(spec: RunSpec) -> list[str]:
    """How the layers split over the pipeline: parallel.partition, parallel.pipeline_layout, the account-for keys or
    the even split, each as Megatron-LM and megatron-core accept it (labkit.megatron.sizes)."""
    par = spec.parallel
    part, p, layers = par.partition, par.pipeline, spec.model.num_layers
    if par.pipeline_layout is not None:
        return _check_pipeline_layout(spec)
    if _accounted(par):
        return _check_account_for(spec)
    if part is None:
        if layers % p == 0:
            return []
        # Megatron-LM splits layers evenly over pipeline stages unless given a layout, and refuses an uneven split.
        counted = ""
        if (layers + 2) % p == 0:
            counted = ("set parallel.account_for_embedding_in_pipeline_split and parallel.account_for_loss_in_"
                       f"pipeline_split (then {layers} + 2 split evenly), ")
        elif (layers + 1) % p == 0:
            counted = f"set parallel.account_for_loss_in_pipeline_split (then {layers} + 1 split evenly), "
        return [f"parallel.pipeline: {layers} layers (model.num_layers) do not split evenly over {p} pipeline stages; "
                f"set parallel.partition (layers per stage, e.g. {_uneven_example(layers, p)}), {counted}or use a "
                f"pipeline size that divides {layers}"]
    errors = []
    if len(part) != p:
        errors.append(f"parallel.partition: has {len(part)} stages but parallel.pipeline is {p}; "
                      f"give one layer count per pipeline stage")
    if any(n is None or n < 0 for n in part):
        errors.append(f"parallel.partition: layer counts must be zero or more, got {part}")
    elif sum(part) != layers:
        errors.append(f"parallel.partition: sums to {sum(part)} but model.num_layers is {layers}; "
                      f"adjust the counts so they add up to {layers}")
    return errors


def _check_pipeline_layout(spec: RunSpec) -> list[str]:
    """parallel.pipeline_layout as megatron-core's PipelineParallelLayerLayout accepts it and matching
    parallel.virtual_stages (the rule book refuses it beside the account-for keys)."""
    par, errors = spec.parallel, []
    if par.partition:
        errors.append("parallel.pipeline_layout: cannot be combined with parallel.partition (both place the layers); "
                      "keep one of them")
    if par.pipeline == 1:
        errors.append("parallel.pipeline_layout: needs parallel.pipeline > 1; drop it or raise parallel.pipeline")
    problems = sizes.layout_problems(par.pipeline_layout, spec.model.num_layers, par.pipeline)
    errors += [f"parallel.pipeline_layout: {quote(par.pipeline_layout)} {problem}" for problem in problems]
    if not problems:
        chunks = sizes.layout_virtual_stages(par.pipeline_layout, par.pipeline)
        if chunks != par.virtual_stages:
            errors.append(f"parallel.virtual_stages: is {par.virtual_stages} but parallel.pipeline_layout has "
                          f"{chunks * par.pipeline} stages = pipeline {par.pipeline} x {chunks} model chunks; "
                          f"set parallel.virtual_stages to {chunks}")
    return errors


def _check_account_for(spec: RunSpec) -> list[str]:
    """The account-for keys: the layers with the embedding and/or the loss counted as one more split evenly over
    pipeline x virtual_stages chunks (megatron-core's TransformerConfig.__post_init__ and get_num_layers_to_build)."""
    par, errors = spec.parallel, []
    keys = _accounted(par)
    first = f"parallel.{keys[0]}"
    if par.partition:
        errors.append(f"{first}: cannot be combined with parallel.partition, which labkit writes as a "
                      f"--pipeline-model-parallel-layout (megatron-core refuses the two together); drop one of them")
        return errors
    layers, p, v = spec.model.num_layers, par.pipeline, par.virtual_stages
    counted = layers + len(keys)
    what = " and ".join(_ACCOUNT_FOR[key] for key in keys)
    if counted % p:
        divisors = [n for n in range(2, min(counted, MAX_SPLIT) + 1) if counted % n == 0]
        errors.append(f"parallel.pipeline: {layers} layers + {len(keys)} for {what} = {counted} do not split evenly "
                      f"over {p} pipeline stages ({first}); use a pipeline size that divides {counted} "
                      f"({', '.join(map(str, divisors[:8])) or 'none'}), or drop {first}")
    elif counted // p % v:
        per_stage = counted // p
        errors.append(f"parallel.virtual_stages: {v} does not divide the {per_stage} layers per stage ({layers} + "
                      f"{len(keys)} for {what}, over {p} stages; {first}); choose a divisor of {per_stage}")
    return errors


def _uneven_example(layers: int, p: int) -> str:
    """A split with earlier stages taking one layer more, shortened when long."""
    counts = [layers // p + (1 if i < layers % p else 0) for i in range(min(p, 8))]
    return "[" + ", ".join(map(str, counts)) + (", ...]" if p > 8 else "]")


def time_limit_seconds(limit: str | None) -> int | None:
    """Slurm's time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds; None when unlimited or unset."""
    if limit is None or str(limit).upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = _TIME_LIMIT.match(str(limit).strip())
    if not match:
        raise ValueError(limit)
    g = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    if "d" in g:
        return ((g["d"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
    if "c" in g:
        return (g["a"] * 60 + g["b"]) * 60 + g["c"]
    return g["a"] * 60 + g.get("b", 0)


_MEM = re.compile(r"\d+[KMGT]?")
GPU_FLAGS = ("gres", "gpus-per-node")
RENDEZVOUS = ("static", "c10d")
ENTRYPOINTS = ("labkit", "megatron-lm")


def _check_scheduler_options(spec: RunSpec) -> list[str]:
    """The production options: memory, GPU request, extra #SBATCH lines, rendezvous, presets, entrypoint, and each
    node group's constraint and gres."""
    job, errors = spec.job, []
    if job.mem is not None and not _MEM.fullmatch(job.mem):
        errors.append(f"job.mem: {quote(job.mem)} is not a Slurm memory size; write 0 (all of the node), 64G or "
                      "512000M")
    for key, value, choices in (("gpus_per_node_flag", job.gpus_per_node_flag, GPU_FLAGS),
                                ("rendezvous", job.rendezvous, RENDEZVOUS),
                                ("entrypoint", job.entrypoint, ENTRYPOINTS)):
        if value not in choices:
            errors.append(f"job.{key}: {quote(value)} is not one of {', '.join(choices)}")
    for i, line in enumerate(job.sbatch):
        if not line.startswith("--") or CONTROL_CHARS.search(line) or len(line) < 3:
            errors.append(f"job.sbatch[{i}]: {quote(line)} is not one #SBATCH option; write it as --option=value on "
                          "one line, e.g. --qos=high")
    if job.env_preset is not None and job.env_preset not in catalog.env_presets():
        errors.append(f"job.env_preset: unknown preset {quote(job.env_preset)}; known: "
                      f"{', '.join(catalog.env_presets())}")
    if job.entrypoint == "megatron-lm" and (not job.megatron_lm or CONTROL_CHARS.search(job.megatron_lm)):
        errors.append("job.megatron_lm: give the Megatron-LM checkout whose pretrain_gpt.py runs (on the nodes or in "
                      "the container, e.g. /workspace/megatron-lm), on one line")
    nodes = spec.cluster.nodes if spec.cluster is not None else []
    for i, group in enumerate(nodes):
        if group.price_per_gpu_hour is not None and group.price_per_gpu_hour < 0:
            errors.append(f"cluster.nodes[{i}].price_per_gpu_hour: must be zero or more USD, got "
                          f"{group.price_per_gpu_hour}")
        for key in ("constraint", "gres"):
            value = getattr(group, key)
            if value is not None and (not value.strip() or re.search(r"[\s\x00-\x1f\x7f\"'\\#]", value)):
                errors.append(f"cluster.nodes[{i}].{key}: {quote(value)} is not a Slurm {key}; write it as Slurm "
                              "does, e.g. " + ("a100-80gb or 'a100&ib'" if key == "constraint" else "gpu:a100_80g:8"))
    return errors


def _check_requeue(spec: RunSpec) -> list[str]:
    """job.requeue: true needs a checkpoint directory to resume from, and one Slurm job to requeue."""
    job, train, errors = spec.job, spec.train, []
    if not job.requeue:
        return errors
    if not train.save:
        errors.append("job.requeue: a requeued job resumes from its checkpoints; set train.save to a directory every "
                      "node can write (train.save_interval sets how often it saves besides the warning signal)")
    elif train.load is not None and train.load != train.save:
        errors.append(f"train.load: {quote(train.load)} differs from train.save; with job.requeue every attempt "
                      "resumes from train.save, so leave train.load out or set it to the same directory")
    if job.requeue_signal_s <= 0:
        errors.append(f"job.requeue_signal_s: must be a positive number of seconds, got {job.requeue_signal_s}")
    else:
        with contextlib.suppress(ValueError):
            limit = time_limit_seconds(job.time_limit)
            if limit is not None and job.requeue_signal_s >= limit:
                errors.append(f"job.requeue_signal_s: {job.requeue_signal_s} s is not before job.time_limit "
                              f"{quote(job.time_limit)}; lower it or raise the limit")
    return errors


def repeated_flag_errors(spec: RunSpec) -> list[str]:
    """job.extra_args must not repeat a flag the spec renders: argparse would keep the later value, and the spec
    would say one thing while the run did another. Needs a spec whose sizes were checked (the flags are rendered)."""
    fields = spec_flags(spec).fields
    errors = []
    for i, arg in enumerate(spec.job.extra_args):
        name = arg.split("=", 1)[0]
        if name not in fields:
            continue
        field = fields[name]
        if field == ALWAYS:
            errors.append(f"job.extra_args[{i}]: {quote(arg)} is on every command line labkit renders; remove it from "
                          "job.extra_args")
        else:
            errors.append(f"job.extra_args[{i}]: {quote(arg)} repeats the {name} that {field} renders (the later one "
                          f"would win); set {field} instead and remove job.extra_args[{i}]")
    return errors


def check_job(spec: RunSpec) -> list[str]:
    """Problems with spec.job (and values that cannot be written into a script), each naming its field and the fix;
    what depends on where the job is submitted is checked there (labkit.jobs.submission)."""
    job, errors = spec.job, []
    for field in ("partition", "account"):
        value = getattr(job, field)
        if value is not None and (not value.strip() or re.search(r"[\s\x00-\x1f\x7f\"'\\#,]", value)):
            errors.append(f"job.{field}: {quote(value)} is not a Slurm {field} name; use letters, digits, '-', '_' "
                          "or '.'")
    if job.time_limit is not None:
        try:
            time_limit_seconds(job.time_limit)
        except ValueError:
            errors.append(f"job.time_limit: {quote(job.time_limit)} is not a Slurm time limit; write minutes (30), "
                          "H:MM:SS (1:30:00), D-HH (2-00) or UNLIMITED")
    if job.cpus_per_task is not None and job.cpus_per_task <= 0:
        errors.append(f"job.cpus_per_task: must be a positive number, got {job.cpus_per_task}")
    errors += _check_requeue(spec)
    if job.master_port is not None and not 0 < job.master_port < 65536:
        errors.append(f"job.master_port: {job.master_port} is not a TCP port; use 1024-65535")
    if job.gpu_monitor_interval_s <= 0:
        errors.append(f"job.gpu_monitor_interval_s: must be a positive number of seconds, got {job.gpu_monitor_interval_s}")
    for key, value in job.env.items():
        if not _ENV_NAME.match(key):
            errors.append(f"job.env.{key}: not a valid environment variable name; use letters, digits and '_', "
                          "not starting with a digit")
        if "\x00" in str(value):
            errors.append(f"job.env.{key}: contains a NUL byte, which no environment value can hold")
    for i, arg in enumerate(job.extra_args):
        if "\x00" in arg:
            errors.append(f"job.extra_args[{i}]: contains a NUL byte, which no command-line argument can hold")
    errors += _check_scheduler_options(spec)
    errors += k8s_spec_errors(spec)
    for i, prefix in enumerate(job.cluster_paths):
        if not str(prefix).startswith("/") or CONTROL_CHARS.search(str(prefix)):
            errors.append(f"job.cluster_paths[{i}]: {quote(prefix)} is not an absolute path on one line; write the "
                          "directory the cluster's paths start with, e.g. /fsx")
    if job.entrypoint == "megatron-lm":
        errors += files.megatron_lm_tokenizer_errors(spec)
        known = catalog.megatron_lm_flags()
        errors += [f"job.extra_args[{i}]: {quote(arg)} is not a flag of Megatron-LM (core_v0.16.1)"
                   for i, arg in enumerate(job.extra_args) if arg.startswith("--") and arg.split("=")[0] not in known]
    else:
        errors += [f"job.extra_args: {e}; labkit's driver (python -m labkit.train) would refuse it"
                   for e in flag_errors(list(job.extra_args))]
    for where, value in (("name", spec.name), ("data.path", spec.data.path)):
        if value and "\x00" in value:
            errors.append(f"{where}: contains a NUL byte; remove it")
    errors += one_line_errors(spec)
    container = job.container
    if container is not None:
        if not container.image or CONTROL_CHARS.search(container.image):
            errors.append("job.container.image: give an image (e.g. nvcr.io#nvidia/pytorch:24.01-py3 or a .sqsh path) "
                          "on one line")
            container = dataclasses.replace(container, image=None)
        errors += [f"job.container.mounts[{i}]: {problem}" for i, mount in enumerate(container.mounts)
                   for problem in mount_problems(mount)]
        errors += container_errors(container)
    return errors


def one_line_fields(spec: RunSpec) -> list[tuple[str, str | None]]:
    """(field, value) of every path and name a spec writes that lands on one line of a job script or command (those
    with checks of their own, such as job.container.image, job.megatron_lm or job.partition, are not listed)."""
    data, train, tokenizer, wandb = spec.data, spec.train, spec.data.tokenizer, spec.train.wandb
    return [("name", spec.name), ("data.path", data.path), ("data.vocab_file", data.vocab_file),
            ("data.merge_file", data.merge_file), ("data.tokenizer.model", tokenizer.model if tokenizer else None),
            ("train.save", train.save), ("train.load", train.load), ("train.tensorboard_dir", train.tensorboard_dir),
            *((f"train.wandb.{key}", getattr(wandb, key)) for key in ("project", "exp_name", "save_dir")
              if wandb is not None)]


def one_line_errors(spec: RunSpec) -> list[str]:
    """A line break (or another control character) in a path or name: no file, flag or job name holds one; refused
    naming the field, never cut or replaced. (A NUL byte is refused as the spec is read.)"""
    errors = []
    for field, value in one_line_fields(spec):
        if isinstance(value, str) and "\x00" not in value and CONTROL_CHARS.search(value):
            what = "a line break" if re.search(r"[\n\r]", value) else "a control character"
            errors.append(f"{field}: {quote(value)} holds {what}, which no path or name on a job's command line may "
                          f"hold; write {field} on one line, without it")
    return errors


MOUNT_FLAG = re.compile(r"[A-Za-z0-9_=.-]+")
"""One of a mount's flags (ro, rbind, x-create=file): pyxis joins them with '+'."""


def mount_problems(mount) -> list[str]:
    """What keeps a job.container.mounts entry from being pyxis's SRC:DST[:FLAGS] (--container-mounts): the host path
    and the container path, each absolute or relative (starting with '/' or '.'; the source may also be tmpfs or
    umount), then optional flags joined with '+'; no comma (it separates mounts) and no line break."""
    text = str(mount)
    if "," in text or CONTROL_CHARS.search(text) or not text.strip():
        return [f"{quote(mount)} must be SRC:DST[:FLAGS] on one line without commas (pyxis separates mounts with "
                "commas), e.g. /fsx:/fsx"]
    parts = text.split(":")
    source, target, flags = (parts + [""] * 3)[:3]
    fix = ("write the host path and the container path, each starting with / (or .), and any flags joined with +, "
           "e.g. /fsx:/fsx or /data:/data:ro")
    if len(parts) < 2:
        return [f"{quote(mount)} is not SRC:DST[:FLAGS]: it gives no container path; {fix}"]
    if len(parts) > 3:
        return [f"{quote(mount)} is not SRC:DST[:FLAGS]: it has {len(parts) - 1} colons; {fix}"]
    problems = []
    if not (source[:1] in ("/", ".") or source in ("tmpfs", "umount")):
        problems.append(f"{quote(mount)}: the source {quote(source)} is not a path (pyxis takes one starting with / or "
                        f"., or tmpfs); {fix}")
    if target[:1] not in ("/", "."):
        problems.append(f"{quote(mount)}: the container path {quote(target)} does not start with / (or .); {fix}")
    if flags and not all(MOUNT_FLAG.fullmatch(flag) for flag in flags.split("+")):
        problems.append(f"{quote(mount)}: the flags {quote(flags)} are not mount flags joined with + (e.g. ro or "
                        "ro+rprivate)")
    return problems



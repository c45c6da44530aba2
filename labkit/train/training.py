"""The driver: initialise (torch.distributed, model-parallel groups, seeds), build model/optimizer/data, train, log.

Read top to bottom: `run(args)` is pretrain() of Megatron-LM, `train_step` one iteration, `training_log` one interval.
"""
from __future__ import annotations

import datetime
import math
import os
import random
import time
from functools import partial

import numpy
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.timers import Timers
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, track_moe_metrics

from labkit.megatron.flops import megatron_logged_flops
from labkit.megatron.shape import Shape
from labkit.megatron.sizes import padded_vocab_size
from labkit.train import checkpoint, data, megatron_log
from labkit.train.exit_signal import ExitSignal
from labkit.train.megatron_log import print_logging_rank, print_rank_0
from labkit.train.model import attention_line, build_model, fusions_line, gather_zero2_weights, transformer_config
from labkit.train.profiling import StepProfiler, nvtx_timers
from labkit.train.tracking import Tracking

TIMERS_TO_LOG = [
    "forward-backward", "forward-compute", "backward-compute", "batch-generator",
    "forward-recv", "forward-send", "backward-recv", "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
    "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather",
    "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
    "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
]


class TrainingError(Exception):
    """A run that must stop: the message is printed as an ERROR line and the process exits non-zero."""


# ---------------------------------------------------------------------------------------------------------------------
# Set-up

def initialize(args) -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        print_rank_0("> initializing torch distributed ...")
        rendezvous = {}
        if args.world_size == 1 and "MASTER_ADDR" not in os.environ:
            # One process started without torchrun: an in-process store, so runs started side by side never race
            # for a TCP port.
            rendezvous["store"] = dist.HashStore()
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend=args.distributed_backend, world_size=args.world_size, rank=args.rank,
                                timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
                                device_id=device if device.type == "cuda" else None, **rendezvous)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # the expert layers' own grid over the same ranks: expert-tensor x expert x expert-data x pipeline
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        # megatron-core keeps gloo copies of the data-parallel groups for checkpoint formats this driver does not
        # write (see checkpoint.py); creating them costs a rendezvous per group and sockets per rank.
        create_gloo_process_groups=False,
    )
    print_rank_0(f"> initialized tensor model parallel with size {args.tensor_model_parallel_size}")
    print_rank_0(f"> initialized pipeline model parallel with size {args.pipeline_model_parallel_size}")
    if args.num_experts:
        print_rank_0(f"> initialized expert model parallel with size {args.expert_model_parallel_size} (expert tensor "
                     f"parallel size {args.expert_tensor_parallel_size})")
    print_rank_0(f"> setting random seeds to {args.seed} ...")
    # Megatron-LM's seeding: each pipeline stage its own stream; tensor-parallel ranks fork a tracked stream.
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return device


def build_optimizer(args, model, config):
    opt_config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        fp16=args.fp16, bf16=args.bf16, params_dtype=config.params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, use_distributed_optimizer=args.use_distributed_optimizer,
        clip_grad=args.clip_grad, timers=config.timers,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        fp8_recipe=args.fp8_recipe,  # as Megatron-LM's config: it decides who keeps the main parameters under MXFP8
        # the step writes the updated MXFP8 weights' bf16 values into the gradient buffer and gathers them from there
        # (without the overlapped gather, which the rules refuse beside it on the driver)
        reuse_grad_buf_for_mxfp8_param_ag=args.reuse_grad_buf_for_mxfp8_param_ag,
        # Megatron-LM's validate_args maps the names so, fp8 to the uint8 Transformer Engine's FusedAdam stores; each
        # argument read by name, as the driver's flag audit (tests/test_train_gpu_path.py) looks for it
        **{key: {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}[value]
           for key, value in (("main_grads_dtype", args.main_grads_dtype),
                              ("main_params_dtype", args.main_params_dtype),
                              ("exp_avg_dtype", args.exp_avg_dtype), ("exp_avg_sq_dtype", args.exp_avg_sq_dtype))},
    )
    optimizer = get_megatron_optimizer(opt_config, model, use_gloo_process_groups=False)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant")
    return optimizer, scheduler


def _set_up_grad_sync(args, model, config, optimizer) -> None:
    """megatron-core's gradient reduction and loss scaling, as Megatron-LM's training loop hooks them into the
    schedules."""
    config.finalize_model_grads_func = finalize_model_grads
    if args.fp16:
        config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    if args.overlap_grad_reduce:
        # The pipeline schedules start each chunk's bucketed reduce once its last micro-batch is through (as
        # Megatron-LM's training loop sets them up).
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model] if len(model) > 1 \
            else model[0].start_grad_sync
    if args.overlap_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in model] if len(model) > 1 \
            else model[0].start_param_sync


# ---------------------------------------------------------------------------------------------------------------------
# One iteration

def forward_step(timers, data_iterator, model):
    timers("batch-generator", log_level=2).start()
    batch = next(data_iterator)
    timers("batch-generator").stop()
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # The schedule scales `loss` in place; report an untouched copy.
    return loss, {"lm loss": loss.detach().clone()}


def _average_losses(losses_reduced: list[dict]) -> dict[str, float]:
    """Mean over micro-batches on this rank, then over data-parallel ranks (last pipeline stage only)."""
    if not losses_reduced:
        return {}
    keys = list(losses_reduced[0])
    local = torch.stack([torch.stack([x[k].float() for x in losses_reduced]).mean() for k in keys])
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
    local /= parallel_state.get_data_parallel_world_size()
    return {k: float(v) for k, v in zip(keys, local.tolist())}


def train_step(args, timers, forward_backward_func, data_iterator, model, optimizer, scheduler):
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = forward_backward_func(
        forward_step_func=partial(forward_step, timers), data_iterator=data_iterator, model=model,
        num_microbatches=args.num_micro_batches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)  # times itself as "forward-backward"
    timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    update_successful, grad_norm, _ = optimizer.step()
    gather_zero2_weights(args, model)
    timers("optimizer").stop()
    if update_successful:
        scheduler.step(increment=1)
    losses = _average_losses(losses_reduced) if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else {}
    return losses, not update_successful, grad_norm


def _loss_is_nan_anywhere(losses: dict[str, float], device) -> bool:
    bad = torch.tensor([float(any(not math.isfinite(v) for v in losses.values()))], device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item())


def evaluate(args, forward_backward_func, data_iterator, model, timers) -> dict[str, float]:
    for chunk in model:
        chunk.eval()
    totals: dict[str, float] = {}
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses_reduced = forward_backward_func(
                forward_step_func=partial(forward_step, timers), data_iterator=data_iterator, model=model,
                num_microbatches=args.num_micro_batches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True)
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                for key, value in _average_losses(losses_reduced).items():
                    totals[key] = totals.get(key, 0.0) + value / args.eval_iters
    for chunk in model:
        chunk.train()
    return totals


# ---------------------------------------------------------------------------------------------------------------------
# Logging

def num_floating_point_operations(args, batch_size: int) -> float:
    """The FLOPs Megatron-LM's `throughput per GPU` divides by (its 2025 form: padded vocabulary, causal attention; an
    MoE layer's router, top-k experts and shared experts)."""
    shape = Shape(num_layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                  seq_length=args.seq_length, vocab=args.padded_vocab_size, query_groups=args.num_query_groups,
                  ffn=args.ffn_hidden_size, swiglu=args.swiglu, tied=not args.untie_embeddings_and_output_weights,
                  **_attention_and_experts(args))
    return megatron_logged_flops(shape, batch_size, version="2025")


def moe_track_names(load_balancing_type: str) -> list[str]:
    """The auxiliary losses Megatron-LM's training_log tracks for --moe-router-load-balancing-type, named as it names
    them. Its test is a substring test, so seq_aux_loss and global_aux_loss also track load_balancing_loss, which
    their routers never add to: it stays 0 and, as every 0 loss, is not printed."""
    names = []
    for kind, name in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
                       ("global_aux_loss", "global_load_balancing_loss")):
        if kind in load_balancing_type:
            names.append(name)
    return names


def track_moe(args, iteration: int, tracking, stats: "IntervalStats") -> None:
    """After every step, as Megatron-LM's training_log: megatron-core's track_moe_metrics sums each auxiliary loss the
    MoE routers saved over this step's micro-batches (scaled by 1 / micro-batches, so their mean), over pipeline
    stages and the ranks its reduce group names, averages it over the MoE layers, writes it to TensorBoard and W&B on
    the rank that writes them, and clears the tracker. Every rank calls it: the sums are collectives."""
    if not args.num_experts:
        return
    totals: dict = {}
    track_moe_metrics(loss_scale=1.0 / args.num_micro_batches, iteration=iteration, writer=tracking.writer,
                      wandb_writer=tracking.wandb, total_loss_dict=totals, per_layer_logging=False,
                      force_initialize=True, track_names=moe_track_names(args.moe_router_load_balancing_type),
                      num_layers=args.num_layers, moe_layer_freq=args.moe_layer_freq)
    stats.add_aux({key: float(value) for key, value in totals.items()})


def _attention_and_experts(args) -> dict:
    """The Shape fields of the head width and the experts, from arguments that name them (a dense model's arguments
    may leave them out)."""
    experts = getattr(args, "num_experts", None)
    fields = {"kv_channels": getattr(args, "kv_channels", None)}
    if experts:
        fields.update(experts=experts, topk=args.moe_router_topk, expert_ffn=args.moe_ffn_hidden_size,
                      shared_ffn=args.moe_shared_expert_intermediate_size, moe_layer_freq=str(args.moe_layer_freq))
    return fields


class IntervalStats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.losses: dict[str, float] = {}
        self.aux: dict[str, float] = {}
        self.advanced = self.skipped = self.nan = 0

    def add_aux(self, losses: dict[str, float]):
        """Auxiliary losses (MoE load balancing): added every iteration, skipped or not, and averaged over the
        advanced ones with the others, as Megatron-LM's total_loss_dict does; they print after the model's losses."""
        for key, value in losses.items():
            self.aux[key] = self.aux.get(key, 0.0) + value

    def add(self, losses: dict[str, float], skipped: bool):
        self.skipped += int(skipped)
        if skipped:
            self.nan += int(any(not math.isfinite(v) for v in losses.values()))
            return
        self.advanced += 1
        for key, value in losses.items():
            self.losses[key] = self.losses.get(key, 0.0) + value

    def mean_losses(self) -> dict[str, float]:
        """Megatron-LM's averages over the interval's advanced iterations; a loss whose average is not above 0 is not
        printed."""
        totals = {**self.losses, **{k: v for k, v in self.aux.items() if k not in self.losses}}
        return {k: v / max(1, self.advanced) for k, v in totals.items() if v / max(1, self.advanced) > 0.0}


def training_log(args, timers, iteration, stats, optimizer, grad_norm, tracking, report_memory) -> None:
    lr = optimizer.param_groups[0]["lr"]
    elapsed = timers("interval-time").elapsed(barrier=True)
    per_iteration = elapsed / args.log_interval
    throughput = None
    if args.log_throughput:
        throughput = num_floating_point_operations(args, args.global_batch_size) / (
            per_iteration * 1e12 * args.world_size)
    tracking.interval(iteration, per_iteration, throughput)
    tracking.timers(timers, TIMERS_TO_LOG, iteration, normalizer=args.log_interval)
    print_logging_rank(megatron_log.iteration_line(
        iteration=iteration, train_iters=args.train_iters, consumed_samples=args.consumed_train_samples,
        elapsed_ms=per_iteration * 1000.0, throughput=throughput, learning_rate=lr,
        global_batch_size=args.global_batch_size, losses=stats.mean_losses(),
        loss_scale=optimizer.get_loss_scale().item(),
        grad_norm=grad_norm, skipped=stats.skipped, nan=stats.nan))
    stats.reset()
    if report_memory and parallel_state.get_data_parallel_rank() == 0:
        print(megatron_log.memory_line(f"(after {iteration} iterations)"), flush=True)
    log_timers(timers, TIMERS_TO_LOG, normalizer=args.log_interval)


def log_timers(timers, names, normalizer=1.0) -> None:
    """megatron.core's Timers.log sends the block to a logger; Megatron-LM prints it, on the last rank."""
    text = timers.get_all_timers_string(names, normalizer=normalizer, reset=True, barrier=False)
    if text is not None and dist.get_rank() == dist.get_world_size() - 1:
        print(text, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# The run

def run(args) -> int:
    # Installed first, as Megatron-LM's set_global_variables does: a signal that comes while the model is built or a
    # checkpoint loads (minutes for a large model) stops the run after its first iteration instead of being lost.
    exit_signal = ExitSignal(args.exit_signal) if args.exit_signal_handler else None
    try:
        return _run(args, exit_signal)
    finally:
        if exit_signal is not None:
            exit_signal.restore()


def _run(args, exit_signal: ExitSignal | None) -> int:
    start = time.time()
    args.barrier_with_L1_time = True
    args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    print_rank_0(megatron_log.world_line(args))
    tokenizer = data.build_tokenizer(args)
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    timers = nvtx_timers(Timers)(args.timing_log_level, args.timing_log_option)
    config = transformer_config(args, timers)
    print_rank_0(megatron_log.arguments_block(args))
    print_rank_0(f"setting number of micro-batches to constant {args.num_micro_batches}")
    print_rank_0(f"> building {args.tokenizer_type} tokenizer ...")
    print_rank_0(" > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(
        tokenizer.vocab_size, args.padded_vocab_size - tokenizer.vocab_size, args.padded_vocab_size))
    device = initialize(args)
    print_rank_0(f"time to initialize megatron (seconds): {time.time() - start:.3f}")
    print_rank_0(megatron_log.datetime_line("after megatron is initialized"))

    print_rank_0(fusions_line(args, torch.cuda.is_available()))
    print_rank_0(attention_line(args))
    print_rank_0("building GPT model ...")
    model = build_model(args, config)
    if parallel_state.get_data_parallel_rank() == 0:
        print(" > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}".format(
            parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            args.num_parameters), flush=True)
    step, forward_backward_func = train_step, get_forward_backward_func()
    if args.deepspeed:
        from labkit.train import deepspeed_engine  # only here: the driver runs without deepspeed installed

        engine, optimizer, scheduler = deepspeed_engine.initialize(args, model[0])
        model = [engine]
        step = partial(deepspeed_engine.train_step, forward_step, _average_losses)
        forward_backward_func = deepspeed_engine.forward_backward_func(engine)
    else:
        optimizer, scheduler = build_optimizer(args, model, config)
        _set_up_grad_sync(args, model, config, optimizer)
    print_rank_0(f"> learning rate decay style: {args.lr_decay_style}")

    iteration = 0
    if args.load:
        timers("load-checkpoint", log_level=0).start(barrier=True)
        iteration = checkpoint.load(args, model, optimizer, scheduler)
        timers("load-checkpoint").stop(barrier=True)
        log_timers(timers, ["load-checkpoint"])
    args.iteration = iteration
    print_rank_0(megatron_log.datetime_line("after model, optimizer, and learning rate scheduler are built"))

    print_rank_0("> building train, validation, and test datasets ...")
    sizes = data.target_sizes(args)
    print_rank_0(" > datasets target sizes (minimum size):\n    train:      {}\n    validation: {}\n    test:       {}"
                 .format(*sizes))
    train_ds, valid_ds, test_ds = data.build_datasets(args, tokenizer)
    print_rank_0("> finished creating GPT datasets ...")
    train_iter = data.data_iterators(args, train_ds, args.consumed_train_samples, device)
    valid_consumed = (iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
    valid_iter = data.data_iterators(args, valid_ds, valid_consumed, device) if args.eval_iters else None
    test_iter = data.data_iterators(args, test_ds, 0, device) if args.eval_iters else None
    print_rank_0(megatron_log.datetime_line("after dataloaders are built"))
    print_rank_0("done with setup ...")
    print_rank_0("training ...")

    tracking = Tracking(args, megatron_log.is_logging_rank())
    profiler = StepProfiler(args)
    stats = IntervalStats()
    report_memory = True
    for chunk in model:
        chunk.train()
    print_rank_0(megatron_log.datetime_line("before the start of training step"))
    timers("interval-time", log_level=0).start(barrier=True)
    stopped_by_signal = False
    try:
        while iteration < args.train_iters:
            profiler.before_step(iteration)
            losses, skipped, grad_norm = _guarded(step, args, timers, forward_backward_func, train_iter,
                                                  model, optimizer, scheduler, iteration=iteration + 1)
            iteration += 1
            args.iteration = iteration
            args.consumed_train_samples += args.global_batch_size
            if args.check_for_nan_in_loss_and_grad and _loss_is_nan_anywhere(losses, device) and not skipped:
                raise TrainingError(f"NaN loss at iteration {iteration} (lm loss {losses.get('lm loss', 'nan')}); "
                                    "lower --lr or --init-method-std, keep --clip-grad on, "
                                    "or use --bf16 instead of --fp16")
            stats.add(losses, skipped)
            track_moe(args, iteration, tracking, stats)
            profiler.after_step(iteration)
            if losses:
                tracking.iteration(iteration, args.consumed_train_samples, optimizer.param_groups[0]["lr"],
                                      losses, optimizer.get_loss_scale().item(), grad_norm)
            if iteration % args.log_interval == 0:
                training_log(args, timers, iteration, stats, optimizer, grad_norm, tracking, report_memory)
                report_memory = False
            # As in Megatron-LM, evaluation and checkpointing do not count towards the iteration time.
            if args.eval_iters and valid_iter is not None and iteration % args.eval_interval == 0:
                timers("interval-time").stop()
                _validate(args, forward_backward_func, valid_iter, model, timers, tracking, f"iteration {iteration}")
                timers("interval-time", log_level=0).start(barrier=True)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                timers("interval-time").stop()
                _save(args, timers, iteration, model, optimizer, scheduler)
                timers("interval-time", log_level=0).start(barrier=True)
            if exit_signal is not None and exit_signal.anywhere(device):
                stopped_by_signal = True
                break
        if args.save and (not args.save_interval or iteration % args.save_interval):
            _save(args, timers, iteration, model, optimizer, scheduler)
    finally:
        profiler.finish()
        tracking.close()
    if stopped_by_signal:
        print_rank_0(megatron_log.datetime_line(f"exiting program after receiving {args.exit_signal}."))
        dist.barrier()
        return 0
    print_rank_0(megatron_log.datetime_line("after training is done"))
    # As Megatron-LM ends a run: one more pass over the validation set, then the test set.
    for split, split_iter in (("validation", valid_iter), ("test", test_iter)):
        if split_iter is not None:
            _validate(args, forward_backward_func, split_iter, model, timers, None,
                      f"iteration {iteration} on {split} set")
    dist.barrier()
    return 0


def out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


OOM_HINT = "lower --micro-batch-size, add --recompute-granularity, or raise --tensor/--pipeline-model-parallel-size"


def _guarded(step, *args, iteration: int, **kwargs):
    """Run a training step, turning out-of-memory into a TrainingError that names the iteration and rank."""
    try:
        return step(*args, **kwargs)
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        where = "GPU" if torch.cuda.is_available() else "host"
        raise TrainingError(f"out of {where} memory at iteration {iteration} on rank {dist.get_rank()}: "
                            f"{str(exc).strip().splitlines()[0]}; {OOM_HINT}") from exc


def _validate(args, forward_backward_func, data_iterator, model, timers, tracking, prefix: str) -> None:
    timers("evaluate", log_level=0).start(barrier=True)
    losses = evaluate(args, forward_backward_func, data_iterator, model, timers)
    if args.num_experts:
        clear_aux_losses_tracker()  # as Megatron-LM after evaluating: what evaluation's forwards saved is not logged
    timers("evaluate").stop()
    log_timers(timers, ["evaluate"])
    if losses:
        print_logging_rank(megatron_log.validation_lines(prefix, losses))
        if tracking is not None:
            tracking.validation(args.iteration, args.consumed_train_samples, losses)
            tracking.flush()


def _save(args, timers, iteration, model, optimizer, scheduler):
    timers("save-checkpoint", log_level=0).start(barrier=True)
    if args.overlap_param_gather:
        # The step updated only this rank's shard; the gather waits for the next forward. Gather now, or the
        # checkpoint holds the other shards' stale weights (Megatron-LM's force_param_sync before every save).
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    checkpoint.save(args, iteration, model, optimizer, scheduler)
    timers("save-checkpoint").stop(barrier=True)
    log_timers(timers, ["save-checkpoint"])

"""DeepSpeed's ZeRO engine in labkit's driver (--deepspeed --deepspeed_config F --zero-stage N), as Megatron-DeepSpeed
trains a GPT: the rank's megatron-core GPTModel wrapped by deepspeed.initialize, which shards optimizer states (stage
1), gradients (2) and parameters (3) over the data-parallel ranks.

Imported only when --deepspeed is given, so the driver runs without the deepspeed package. On a CPU DeepSpeed's
accelerator is "cpu", and its communication runs over the gloo process group the driver has already started
(deepspeed.init_distributed adopts it instead of asking for oneCCL).

The optimizer is the one the driver builds for megatron-core (torch's AdamW with megatron-core's parameter groups: no
weight decay on biases and norms), handed to deepspeed.initialize rather than DeepSpeed's own built from an
"optimizer" block: Megatron-DeepSpeed does the same (its get_megatron_optimizer returns the bare optimizer under
--deepspeed), so the Megatron flags (--lr, --weight-decay, --adam-beta1, ...) and megatron-core's learning-rate
schedule mean what they mean on the other paths, and the losses can be compared with them step for step.
"""
from __future__ import annotations

import json

import deepspeed
import torch
from megatron.core.optimizer import OptimizerConfig, _get_param_groups, get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from labkit.train.megatron_log import print_rank_0


def initialize_distributed(args) -> None:
    """DeepSpeed's communication over the process group the driver started (gloo on CPUs, NCCL on GPUs)."""
    if args.distributed_backend == "gloo":
        # DeepSpeed's CPU backend would compile a shared-memory all-reduce (a C++ extension, over a minute on first
        # use) for ranks on one host; gloo reduces here, as on the driver's other paths, so the losses compare
        import deepspeed.comm.torch as ds_torch

        ds_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=args.distributed_backend, dist_init_required=False)


def _torch_optimizer(args, model):
    """The optimizer megatron-core would build inside its wrapper, bare: torch's AdamW over megatron-core's parameter
    groups (DeepSpeed's ZeRO takes torch's Adam family as tested optimizers)."""
    config = OptimizerConfig(optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                             adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps)
    groups = _get_param_groups([model], config, get_standard_config_overrides(config))
    return torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)


def initialize(args, model: torch.nn.Module):
    """deepspeed.initialize over the rank's GPTModel -> (engine, optimizer view for the logs, scheduler)."""
    initialize_distributed(args)
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    optimizer = _torch_optimizer(args, model)
    # megatron-core's schedule, stepped by the driver after each applied step (as Megatron-DeepSpeed passes its own
    # scheduler to deepspeed.initialize): it sets each parameter group's rate, which the ZeRO optimizer reads
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant")
    # mpu=None: with tensor and pipeline size 1 (the driver's check) the data-parallel group is the whole world
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    print_rank_0(f"> DeepSpeed ZeRO stage {engine.zero_optimization_stage()} engine over the GPT model "
                 f"({type(engine.optimizer).__name__})")
    return engine, EngineOptimizer(engine), scheduler


class EngineOptimizer:
    """What the driver's logs read from an optimizer (learning rate, loss scale), read from DeepSpeed's engine."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        scale = self.engine.optimizer.cur_scale if self.engine.fp16_enabled() else 1.0
        return torch.tensor(float(scale))


def forward_backward_func(engine):
    """A forward-only pass over micro-batches with the signature of megatron-core's schedules, for evaluation."""
    def forward_only(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                     forward_only):
        assert forward_only, "training steps go through train_step"
        losses = []
        for _ in range(num_microbatches):
            output, loss_func = forward_step_func(data_iterator, engine)
            losses.append(loss_func(output)[1])
        return losses
    return forward_only


def train_step(forward_step, average_losses, args, timers, forward_backward_func, data_iterator, model, optimizer,
               scheduler):
    """One iteration as DeepSpeed runs it: forward, engine.backward and engine.step on every micro-batch of this rank's
    share of the global batch; DeepSpeed accumulates the gradients (scaling each loss by 1 / accumulation steps) and
    reduces, clips and steps at the last one. -> (losses, skipped, grad norm), as the driver's train_step, whose
    forward step and loss averaging (training.py) it is given first."""
    engine = model[0]
    losses_reduced = []
    timers("forward-backward", log_level=1).start(barrier=args.barrier_with_L1_time)
    for _ in range(args.num_micro_batches):
        output, loss_func = forward_step(timers, data_iterator, engine)
        loss, reduced = loss_func(output)
        engine.backward(loss)
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # counts the micro-batch; the boundary's step is the optimizer's, timed below
        losses_reduced.append(reduced)
    timers("forward-backward").stop()
    timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    engine.step()
    timers("optimizer").stop()
    applied = engine.was_step_applied()
    if applied:
        scheduler.step(increment=1)
    grad_norm = engine.get_global_grad_norm()
    grad_norm = float(grad_norm) if grad_norm is not None else None
    return average_losses(losses_reduced), not applied, grad_norm


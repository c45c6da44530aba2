"""Experiment tracking for the driver: TensorBoard (--tensorboard-dir) and Weights & Biases (--wandb-project), fed the
same scalars at the same points.

W&B is started as Megatron-LM's _set_wandb_writer starts it (megatron/training/global_vars.py): on the last rank,
`wandb.init(dir=--wandb-save-dir, name=--wandb-exp-name, project=--wandb-project, config=<the arguments>)`, and it
receives what Megatron-LM's training_log and evaluate_and_print_results send it (megatron/training/training.py):
samples vs steps, learning-rate, batch-size, each loss, loss-scale and grad-norm per iteration; iteration-time,
throughput and the timers per log interval (with --log-timers-to-tensorboard); the validation losses. Megatron-LM
sends the per-iteration scalars only where it also has a TensorBoard writer; this driver sends them either way (the
spec renders --tensorboard-dir with train.wandb, so both agree). With WANDB_MODE=offline the run stays on disk under
--wandb-save-dir/wandb/offline-run-*, for `wandb sync` later.
"""
from __future__ import annotations

import os
from pathlib import Path

from labkit.train.profiling import TensorBoard


def wandb_config(args) -> dict:
    """The arguments as W&B's run config (Megatron-LM passes vars(args)): values W&B stores as they are, paths as
    text, anything else left out."""
    plain = (str, int, float, bool, type(None))
    config = {}
    for key, value in vars(args).items():
        if isinstance(value, Path):
            value = str(value)
        if isinstance(value, plain) or (isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value)):
            config[key] = value
    return config


class Tracking:
    """The TensorBoard writer and the W&B run of one process; both are None except on the rank that writes."""

    def __init__(self, args, is_writer_rank: bool):
        self.args = args
        self.tensorboard = TensorBoard(args, is_writer_rank)
        self.wandb = None
        if args.wandb_project and is_writer_rank:
            import wandb

            os.makedirs(args.wandb_save_dir, exist_ok=True)
            print("> setting wandb ...", flush=True)
            self.wandb = wandb.init(dir=args.wandb_save_dir, name=args.wandb_exp_name, project=args.wandb_project,
                                    config=wandb_config(args))

    @property
    def writer(self):
        """The TensorBoard SummaryWriter, or None."""
        return self.tensorboard.writer

    def iteration(self, iteration: int, samples: int, lr: float, losses: dict[str, float], loss_scale: float,
                  grad_norm: float | None) -> None:
        self.tensorboard.iteration(iteration, samples, lr, losses, loss_scale, grad_norm)
        if self.wandb is None or iteration % self.args.tensorboard_log_interval:
            return
        scalars = {"samples vs steps": samples, "learning-rate": lr, "batch-size": self.args.global_batch_size,
                   **losses, "loss-scale": loss_scale}
        if grad_norm is not None:
            scalars["grad-norm"] = grad_norm
        self.wandb.log(scalars, step=iteration)

    def interval(self, iteration: int, elapsed_s: float, throughput: float | None) -> None:
        self.tensorboard.interval(iteration, elapsed_s, throughput)
        if self.wandb is None or not self.args.log_timers_to_tensorboard:
            return
        scalars = {"iteration-time": elapsed_s}
        if throughput is not None:
            scalars["throughput"] = throughput
        self.wandb.log(scalars, step=iteration)

    def timers(self, timers, names: list[str], iteration: int, normalizer: float) -> None:
        """The interval's timers (their maximum over ranks) as `<name>-time`. Every rank calls it: gathering the
        times is a collective."""
        if not self.args.log_timers_to_tensorboard:
            return
        timers.write(names, self.writer, iteration, normalizer=normalizer, reset=False)
        if self.args.wandb_project:
            import wandb

            # megatron-core's Timers.write logs to W&B when given the wandb module itself, as Megatron-LM passes it.
            timers.write(names, wandb if self.wandb is not None else None, iteration, normalizer=normalizer,
                         reset=False)

    def validation(self, iteration: int, samples: int, losses: dict[str, float]) -> None:
        self.tensorboard.validation(iteration, samples, losses)
        if self.wandb is not None:
            self.wandb.log({f"{key} validation": value for key, value in losses.items()}, step=iteration)

    def flush(self) -> None:
        self.tensorboard.flush()

    def close(self) -> None:
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()

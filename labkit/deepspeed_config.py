"""Run spec -> DeepSpeed's JSON config (ds_config.json), as a Megatron-DeepSpeed launch passes it with
`--deepspeed --deepspeed_config ds_config.json --zero-stage N` (github microsoft/Megatron-DeepSpeed,
examples_deepspeed/): batch sizes, the ZeRO stage, precision and gradient clipping.

The optimizer and its learning-rate schedule stay on the Megatron command line (--optimizer, --lr, ...): like
Megatron-DeepSpeed, labkit's driver builds the optimizer itself and hands it to deepspeed.initialize, so the config
has no "optimizer" or "scheduler" block. It reads the spec's values only, like labkit.megatron_args.
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from labkit.megatron import sharding

if TYPE_CHECKING:
    from labkit.spec import RunSpec

FILE_NAME = "ds_config.json"
"""The config's file name, in the run's directory beside the job script."""

LOSS_SCALE_WINDOW, HYSTERESIS, MIN_LOSS_SCALE = 1000, 2, 1.0
"""Dynamic fp16 loss scaling as Megatron-LM does it by default (--loss-scale-window, --hysteresis, --min-loss-scale),
which DeepSpeed's defaults also are."""


def uses_deepspeed(spec: RunSpec) -> bool:
    """Whether the run trains with DeepSpeed's engine (labkit.megatron.sharding): optimizer.zero_backend deepspeed on
    labkit's driver (Megatron-LM's pretrain_gpt.py does not start it)."""
    return sharding.of_spec(spec).implementation == sharding.DEEPSPEED and spec.job.entrypoint != sharding.MEGATRON_LM


def initial_scale_power(initial_loss_scale: float) -> int | None:
    """DeepSpeed's initial_scale_power for a dynamic fp16 loss scale of 2**power; None when the scale is no power of 2
    (DeepSpeed cannot start there: the spec's check says so)."""
    power = math.log2(initial_loss_scale) if initial_loss_scale > 0 else 0.5
    return int(power) if power.is_integer() else None


def ds_config(spec: RunSpec) -> dict:
    """DeepSpeed's config for this spec. DeepSpeed checks train_batch_size = micro x accumulation x data-parallel
    size (deepspeed.runtime.config, _batch_assertion); the stage's communication settings are DeepSpeed's defaults
    (reduce-scatter and contiguous gradients on), with overlap_comm following kernels.overlap_grad_reduce."""
    b, opt = spec.batch, spec.optimizer
    dp = spec.data_parallel
    config: dict = {
        "train_batch_size": b.global_,
        "train_micro_batch_size_per_gpu": b.micro,
        "gradient_accumulation_steps": b.global_ // (b.micro * dp),
        "zero_optimization": {
            "stage": opt.zero_stage,
            "reduce_scatter": True,
            "overlap_comm": spec.kernels.overlap_grad_reduce,
            "contiguous_gradients": True,
        },
        "gradient_clipping": opt.clip_grad,
    }
    if spec.precision == "fp16":
        fixed = opt.loss_scale is not None
        config["fp16"] = {
            "enabled": True,
            "loss_scale": opt.loss_scale if fixed else 0,  # 0: dynamic
            "initial_scale_power": initial_scale_power(opt.initial_loss_scale) if not fixed else 16,
            "loss_scale_window": LOSS_SCALE_WINDOW,
            "hysteresis": HYSTERESIS,
            "min_loss_scale": MIN_LOSS_SCALE,
        }
    else:
        config["fp16"] = {"enabled": False}
    # fp8 GEMMs are Transformer Engine's, inside a bf16 model: DeepSpeed sees bf16
    config["bf16"] = {"enabled": spec.precision in ("bf16", "fp8")}
    # Megatron's iteration lines are the run's log: DeepSpeed's own step prints (null: never, its default) and timers
    # stay quiet
    config["steps_per_print"] = None
    config["wall_clock_breakdown"] = False
    return config


def ds_config_text(spec: RunSpec) -> str:
    """The config as the file holds it: JSON, two-space indented, ending in a newline."""
    return json.dumps(ds_config(spec), indent=2) + "\n"

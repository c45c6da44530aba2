"""Megatron-LM's log lines, character for character, so one parser reads labkit's runs and Megatron-LM's.

Who prints what follows Megatron-LM: set-up lines on global rank 0, the iteration and validation lines once (by the
first tensor/data-parallel rank of the last pipeline stage), memory lines by every data-parallel rank 0, timer blocks
by the last rank (megatron.core.timers).
"""
from __future__ import annotations

import math
import os
import resource
import sys
from datetime import datetime

import torch
import torch.distributed as dist

MB = 1024.0 * 1024.0


def _print(message: str) -> None:
    print(message, flush=True)


def print_rank_0(message: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        _print(message)


def is_logging_rank() -> bool:
    """The one rank that prints iteration and validation lines: the last rank, as Megatron-LM's `print_rank_last`
    (it holds the loss: the last rank is on the last pipeline stage). The timers print there too, so a log's timer
    block follows the iteration line it belongs to in the same rank's stream."""
    return dist.get_rank() == dist.get_world_size() - 1


def print_logging_rank(message: str) -> None:
    if is_logging_rank():
        _print(message)


def world_line(args) -> str:
    return ("using world size: {}, data-parallel size: {}, context-parallel size: {}, tensor-model-parallel size: {}, "
            "pipeline-model-parallel size: {} ").format(args.world_size, args.data_parallel_size,
                                                         args.context_parallel_size, args.tensor_model_parallel_size,
                                                         args.pipeline_model_parallel_size)


def arguments_block(args, title: str = "arguments") -> str:
    lines = [f"------------------------ {title} ------------------------"]
    entries = ["  {} {} {}".format(name, "." * (48 - len(name)), value) for name, value in vars(args).items()]
    lines += sorted(entries, key=lambda x: x.lower())
    lines.append(f"-------------------- end of {title} ---------------------")
    return "\n".join(lines)


def datetime_line(label: str) -> str:
    return "[{}] datetime: {} ".format(label, datetime.now().strftime("%Y-%m-%d %H:%M:%S"))


def iteration_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                   throughput: float | None, learning_rate: float, global_batch_size: int,
                   losses: dict[str, float], loss_scale: float, grad_norm: float | None, skipped: int,
                   nan: int) -> str:
    s = " [{}]".format(datetime.now().strftime("%Y-%m-%d %H:%M:%S"))
    s += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    s += " consumed samples: {:12d} |".format(consumed_samples)
    s += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms)
    if throughput is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    s += f" learning rate: {learning_rate:.6E} |"
    s += " global batch size: {:5d} |".format(global_batch_size)
    for key, value in losses.items():
        s += " {}: {:.6E} |".format(key, value)
    s += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        s += " grad norm: {:.3f} |".format(grad_norm)
    s += " number of skipped iterations: {:3d} |".format(skipped)
    s += " number of nan iterations: {:3d} |".format(nan)
    return s


def validation_lines(prefix: str, losses: dict[str, float]) -> str:
    s = f" validation loss at {prefix} | "
    for key, value in losses.items():
        s += "{} value: {:.6E} | ".format(key, value)
        s += "{} PPL: {:.6E} | ".format(key, math.exp(min(20, value)))
    rule = "-" * (len(s) + 1)
    return "\n".join([rule, s, rule])


def memory_figures() -> tuple[dict[str, float], str | None]:
    """Megatron's four memory figures in MB, and the label for where they come from off a GPU."""
    if torch.cuda.is_available():
        return {"allocated": torch.cuda.memory_allocated() / MB,
                "max allocated": torch.cuda.max_memory_allocated() / MB,
                "reserved": torch.cuda.memory_reserved() / MB,
                "max reserved": torch.cuda.max_memory_reserved() / MB}, None
    import psutil

    rss = psutil.Process().memory_info().rss / MB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    if sys.platform == "darwin":
        peak /= 1024.0  # bytes on macOS
    peak = max(peak, rss)
    return {"allocated": rss, "max allocated": peak, "reserved": rss, "max reserved": peak}, \
        "cpu process resident memory"


def memory_line(name: str) -> str:
    figures, label = memory_figures()
    s = "[Rank {}] {} memory (MB)".format(dist.get_rank(), name)
    for key, value in figures.items():
        s += " | {}: {}".format(key, value)
    if label:
        s += f" | measured as: {label}"
    return s

"""Checkpoints in Megatron-LM's legacy `torch` format (torch.save per model-parallel rank), which works on gloo/CPU.

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000020/mp_rank_TT[_PPP]/model_optim_rng.pt   model, optimizer, scheduler, RNG states, counters
    SAVE/iter_0000020/mp_rank_TT[_PPP]/distrib_optim_dp_DDD.pt   with --use-distributed-optimizer: each data-parallel
                                                                 rank's shard of the Adam state and fp32 master weights

Resuming restores the weights, the optimizer (fp32 master weights and moments), the learning-rate schedule, every RNG
(Python, NumPy, torch, CUDA and the tensor-parallel tracker, per data-parallel rank) and the consumed-sample count,
so the next iteration's loss is the one the uninterrupted run would have printed. A distributed-optimizer checkpoint
is read back with the same data-parallel size (each rank reloads its own shard); megatron-core 0.16.1's gather-to-rank-0
path (`save_parameter_state`) drops Adam's step counters and cannot be read back.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from labkit.train.megatron_log import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"


def _rank_dir(root: str, iteration: int) -> Path:
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}" if parallel_state.get_pipeline_model_parallel_world_size() == 1 \
        else f"mp_rank_{tp:02d}_{pp:03d}"
    return Path(root) / f"iter_{iteration:07d}" / name


def _where() -> str:
    return "[ t {}/{}, p {}/{} ]".format(
        parallel_state.get_tensor_model_parallel_rank() + 1, parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank() + 1, parallel_state.get_pipeline_model_parallel_world_size())


def _rng_state() -> dict:
    state = {"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    numpy.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _shard_state(optimizer) -> list[dict]:
    """This data-parallel rank's part of a distributed optimizer: Adam moments and fp32 master weights."""
    return [{"inner": opt.optimizer.state_dict(),
             "main_params": [[p.detach().clone() for p in group] for group in opt.shard_fp32_from_float16_groups],
             "grad_scaler": opt.grad_scaler.state_dict() if opt.grad_scaler else None}
            for opt in _sub_optimizers(optimizer)]


def _load_shard_state(optimizer, states: list[dict]) -> None:
    for opt, state in zip(_sub_optimizers(optimizer), states, strict=True):
        opt.optimizer.load_state_dict(state["inner"])
        for group, saved in zip(opt.shard_fp32_from_float16_groups, state["main_params"], strict=True):
            for param, value in zip(group, saved, strict=True):
                param.data.copy_(value)
        if opt.grad_scaler and state["grad_scaler"]:
            opt.grad_scaler.load_state_dict(state["grad_scaler"])


def save(args, iteration: int, model, optimizer, scheduler) -> None:
    print_rank_0("saving checkpoint at iteration {:7d} to {} in torch format".format(iteration, args.save))
    folder = _rank_dir(args.save, iteration)
    dp_group = parallel_state.get_data_parallel_group()
    rng_states = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(rng_states, _rng_state(), group=dp_group)
    if args.use_distributed_optimizer:
        folder.mkdir(parents=True, exist_ok=True)
        shard = folder / f"distrib_optim_dp_{parallel_state.get_data_parallel_rank():03d}.pt"
        torch.save(_shard_state(optimizer), shard)
    if parallel_state.get_data_parallel_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "optimizer": None if args.use_distributed_optimizer else optimizer.state_dict(),
            "opt_param_scheduler": scheduler.state_dict(),
            "rng_state": rng_states,
        }
        for i, chunk in enumerate(model):
            state["model" if len(model) == 1 else f"model{i}"] = chunk.state_dict()
        tmp = folder / "model_optim_rng.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, folder / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(args.save) / TRACKER).write_text(str(iteration))
    print_rank_0("  successfully saved checkpoint from iteration {:7d} to {} {}".format(iteration, args.save,
                                                                                         _where()))
    dist.barrier()


def load(args, model, optimizer, scheduler) -> int:
    """Load the latest checkpoint under --load; returns its iteration (0 when there is none)."""
    tracker = Path(args.load) / TRACKER
    if args.ckpt_step is not None:
        iteration = args.ckpt_step
    elif tracker.is_file():
        iteration = int(tracker.read_text().strip())
    else:
        print_rank_0(f"WARNING: could not find the metadata file {tracker} ")
        print_rank_0("    will not load any checkpoints and will start from random")
        return 0
    folder = _rank_dir(args.load, iteration)
    print_rank_0(f" loading checkpoint from {args.load} at iteration {iteration}")
    path = folder / "model_optim_rng.pt"
    if not path.is_file():
        raise FileNotFoundError(f"--load: {path} is missing; check --ckpt-step, and that the checkpoint was written "
                                "with the same --tensor-model-parallel-size and --pipeline-model-parallel-size")
    state = torch.load(path, map_location="cpu", weights_only=False)
    for i, chunk in enumerate(model):
        chunk.load_state_dict(state["model" if len(model) == 1 else f"model{i}"], strict=True)
    if args.use_distributed_optimizer:
        shard = folder / f"distrib_optim_dp_{parallel_state.get_data_parallel_rank():03d}.pt"
        if not shard.is_file():
            raise FileNotFoundError(f"--load: {shard} is missing; a distributed-optimizer checkpoint is read back with "
                                    "the data-parallel size it was written with, and with --use-distributed-optimizer")
        _load_shard_state(optimizer, torch.load(shard, map_location="cpu", weights_only=False))
    elif state["optimizer"] is None:
        raise ValueError("--use-distributed-optimizer: the checkpoint was written with it; pass it again to resume")
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    rng_states = state["rng_state"]
    dp_rank = parallel_state.get_data_parallel_rank()
    _set_rng_state(rng_states[dp_rank] if dp_rank < len(rng_states) else rng_states[0])
    saved_args = state["args"]
    args.consumed_train_samples = saved_args.consumed_train_samples
    dist.barrier()
    print_rank_0(f"  successfully loaded checkpoint from {args.load} {_where()} at iteration {iteration}")
    return iteration

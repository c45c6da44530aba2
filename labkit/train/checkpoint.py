"""Checkpoints in Megatron-LM's two formats: the legacy `torch` (torch.save per model-parallel rank, the driver's
default) and `torch_dist` (megatron-core's distributed checkpointing, Megatron-LM's default), which a run can resume
under another tensor/pipeline layout.

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000020/mp_rank_TT[_PPP]/model_optim_rng.pt   model, optimizer, scheduler, RNG states, counters
    SAVE/iter_0000020/mp_rank_TT[_PPP]/distrib_optim_dp_DDD.pt   with --use-distributed-optimizer: each data-parallel
                                                                 rank's shard of the Adam state and fp32 master weights

With expert parallelism each folder name ends in the expert rank, mp_rank_TT[_PPP]_EEE, as Megatron-LM names them.

Resuming restores the weights, the optimizer (fp32 master weights and moments), the learning-rate schedule, every RNG
(Python, NumPy, torch, CUDA and the tensor-parallel tracker, per data-parallel rank) and the consumed-sample count,
so the next iteration's loss is the one the uninterrupted run would have printed. A distributed-optimizer checkpoint
is read back with the same data-parallel size (each rank reloads its own shard); megatron-core 0.16.1's gather-to-rank-0
path (`save_parameter_state`) drops Adam's step counters and cannot be read back.

    SAVE/iter_0000020/common.pt, metadata.json, __0_0.distcp ...   --ckpt-format torch_dist: every tensor saved once
                                                                  as a slice of the global tensor it belongs to

A torch_dist checkpoint stores each weight and Adam moment by its place in the whole model (megatron-core's
`sharded_state_dict`), so loading asks for the slices the new layout needs: tensor 2 / pipeline 1 resumes at tensor 1 /
pipeline 2, and expert parallel 1 at 2 (the experts' Adam state moves between megatron-core's one optimizer and its
two). The distributed optimizer saves its state `fully_reshardable` (Megatron-LM's
--dist-ckpt-optim-fully-reshardable) for the same reason; megatron-core reloads that state only from Transformer
Engine's or Apex's FusedAdam, so without them (on CPU) the driver refuses torch_dist with the distributed optimizer.
The RNG states are kept per (pipeline, tensor) rank and restored only under the layout that wrote them, as Megatron-LM's
load_checkpoint does: under another layout the run keeps the streams it seeded, so dropout masks differ from the
uninterrupted run's.
"""
from __future__ import annotations

import os
import random
import warnings
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (get_default_load_sharded_strategy,
                                                            get_default_save_sharded_strategy)
from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
from megatron.core.utils import unwrap_model

from labkit.train.megatron_log import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
"""What the tracker says of a checkpoint that holds weights alone, in LOAD/release (Megatron-LM's name)."""


def _rank_dir(root: str, iteration: int) -> Path:
    """Megatron-LM's get_checkpoint_name: mp_rank_TT, then _PPP with pipeline stages, then _EEE with expert ranks."""
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}" if parallel_state.get_pipeline_model_parallel_world_size() == 1 \
        else f"mp_rank_{tp:02d}_{pp:03d}"
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
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


def _main_params(opt) -> list[list]:
    """A distributed optimizer's fp32 master weights by group: none where the precision-aware optimizer leaves them
    to Transformer Engine's FusedAdam (None entries, distrib_optimizer.py), whose own state dict carries them."""
    return [[p for p in group if p is not None] for group in opt.shard_fp32_from_float16_groups]


def _shard_state(optimizer) -> list[dict]:
    """This data-parallel rank's part of a distributed optimizer: Adam moments and fp32 master weights."""
    return [{"inner": opt.optimizer.state_dict(),
             "main_params": [[p.detach().clone() for p in group] for group in _main_params(opt)],
             "grad_scaler": opt.grad_scaler.state_dict() if opt.grad_scaler else None}
            for opt in _sub_optimizers(optimizer)]


def _load_shard_state(optimizer, states: list[dict]) -> None:
    for opt, state in zip(_sub_optimizers(optimizer), states, strict=True):
        opt.optimizer.load_state_dict(state["inner"])
        for group, saved in zip(_main_params(opt), state["main_params"], strict=True):
            for param, value in zip(group, saved, strict=True):
                param.data.copy_(value)
        if opt.grad_scaler and state["grad_scaler"]:
            opt.grad_scaler.load_state_dict(state["grad_scaler"])


def save(args, iteration: int, model, optimizer, scheduler) -> None:
    print_rank_0("saving checkpoint at iteration {:7d} to {} in {} format".format(iteration, args.save,
                                                                                 args.ckpt_format))
    if args.ckpt_format == "torch_dist":
        _save_dist(args, iteration, model, optimizer, scheduler)
    else:
        _save_torch(args, iteration, model, optimizer, scheduler)
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(args.save) / TRACKER).write_text(str(iteration))
    print_rank_0("  successfully saved checkpoint from iteration {:7d} to {} {}".format(iteration, args.save,
                                                                                         _where()))
    dist.barrier()


def _save_torch(args, iteration: int, model, optimizer, scheduler) -> None:
    folder = _rank_dir(args.save, iteration)
    dp_group = parallel_state.get_data_parallel_group()
    rng_states = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(rng_states, _rng_state(), group=dp_group)
    if args.use_distributed_optimizer:
        folder.mkdir(parents=True, exist_ok=True)
        shard = folder / f"distrib_optim_dp_{parallel_state.get_data_parallel_rank():03d}.pt"
        torch.save(_shard_state(optimizer), shard)
    # As Megatron-LM: one rank of each expert-data-parallel group writes, so that each expert rank's experts are saved
    # (without experts the group is the data-parallel one).
    if parallel_state.get_expert_data_parallel_rank() == 0:
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


def load(args, model, optimizer, scheduler) -> int:
    """Load the latest checkpoint under --load; returns its iteration (0 when there is none)."""
    tracker = Path(args.load) / TRACKER
    if args.ckpt_step is None and tracker.is_file() and tracker.read_text().strip() == RELEASE:
        return _load_release(args, model, optimizer)
    if args.ckpt_step is not None:
        iteration = args.ckpt_step
    elif tracker.is_file():
        iteration = int(tracker.read_text().strip())
    else:
        print_rank_0(f"WARNING: could not find the metadata file {tracker} ")
        print_rank_0("    will not load any checkpoints and will start from random")
        return 0
    print_rank_0(f" loading checkpoint from {args.load} at iteration {iteration}")
    if args.ckpt_format == "torch_dist":
        _load_dist(args, iteration, model, optimizer, scheduler)
    else:
        _load_torch(args, iteration, model, optimizer, scheduler)
    dist.barrier()
    print_rank_0(f"  successfully loaded checkpoint from {args.load} {_where()} at iteration {iteration}")
    return iteration


def read_sharded(sharded: dict, folder) -> dict:
    """A torch_dist checkpoint's tensors for a sharded state dict, read with megatron-core's default strategy.
    megatron-core 0.16.1 reads through torch's deprecated ShardedTensor and load_state_dict, and torch says so on every
    rank: nothing a user of the driver can change, so those notices are kept out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint|megatron")
        return dist_checkpointing.load(sharded, str(folder), get_default_load_sharded_strategy(str(folder)))


def _load_release(args, model, optimizer) -> int:
    """A release checkpoint (`labkit checkpoint import-hf` writes one): torch_dist model weights alone under
    LOAD/release. As Megatron-LM's load_checkpoint reads one, the run starts at iteration 0 with its own optimizer,
    schedule and RNG states; mixed precision copies the loaded weights into the optimizer's fp32 main weights."""
    folder = Path(args.load) / RELEASE
    if not dist_checkpointing.check_is_distributed_checkpoint(str(folder)):
        raise FileNotFoundError(f"--load: {folder} is not a torch_dist checkpoint; write it with labkit checkpoint "
                                "import-hf")
    print_rank_0(f" loading release checkpoint (weights only) from {args.load}")
    rows = dist_checkpointing.load_tensors_metadata(str(folder)).get("embedding.word_embeddings.weight")
    if rows is not None and rows.global_shape[0] != args.padded_vocab_size:
        raise ValueError(f"--load: {folder} holds a vocabulary padded to {rows.global_shape[0]} rows where this run "
                         f"pads it to {args.padded_vocab_size} (its tensor-parallel size); import it again with this "
                         "spec's parallel.tensor")
    common = dist_checkpointing.load_common_state_dict(str(folder))
    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {},
                    dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    sharded = {f"model{i}": chunk.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(unwrap_model(model))}
    state = read_sharded(sharded, folder)
    for i, chunk in enumerate(unwrap_model(model)):
        chunk.load_state_dict(state[f"model{i}"], strict=True)
    if args.fp16 or args.bf16:
        optimizer.reload_model_params()
    dist.barrier()
    print_rank_0(f"  successfully loaded release checkpoint from {args.load} {_where()}")
    return 0


def _load_torch(args, iteration: int, model, optimizer, scheduler) -> None:
    folder = _rank_dir(args.load, iteration)
    path = folder / "model_optim_rng.pt"
    if not path.is_file() and dist_checkpointing.check_is_distributed_checkpoint(str(folder.parent)):
        raise FileNotFoundError(f"--load: {folder.parent} is a torch_dist checkpoint; pass --ckpt-format torch_dist")
    if not path.is_file():
        raise FileNotFoundError(f"--load: {path} is missing; check --ckpt-step, and that the checkpoint was written "
                                "with the same --tensor-model-parallel-size, --pipeline-model-parallel-size and "
                                "--expert-model-parallel-size (--ckpt-format torch_dist resumes under another)")
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
    args.consumed_train_samples = state["args"].consumed_train_samples


# ---------------------------------------------------------------------------------------------------------------------
# torch_dist: megatron-core's distributed checkpointing (Megatron-LM's checkpointing.py, generate_state_dict)

def _layout() -> tuple[int, int]:
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())


def _expert_layout() -> tuple[int, int]:
    return (parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size())


_GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")
"""How megatron-core tells an optimizer's parameter groups apart (_filter_and_reorder_param_groups), less
is_expert_parallel, which is what changes between the two layouts."""


def _regrouped_optimizer_state(optimizer, loaded: dict) -> dict:
    """A torch_dist checkpoint written under another expert-parallel size, in the shape this optimizer loads.

    megatron-core builds one optimizer for every parameter at expert-parallel size 1 and two (chained: the dense
    parameters, and the experts, which reduce over their own data-parallel group) above it. The Adam moments are saved
    by parameter name and load into either shape; the parameter groups' settings and Adam's step counter are saved as
    they were shaped, and come back beside the ones the new shape asks for. Each parameter group of this optimizer
    takes the settings of the saved group of the same kind (weight decay, learning-rate multiplier) and the saved
    step. The same shape, or one this does not recognise, is returned as loaded."""
    current = _sub_optimizers(optimizer)
    numbered = sorted(k for k in loaded if isinstance(k, int))
    if len(current) > 1 and not numbered:
        return loaded
    if len(current) > 1:
        saved, entries = [_inner(loaded)], [loaded[k] for k in numbered]
        if saved[0] is None or "param_groups" not in saved[0] or len(entries) != len(current):
            return loaded
        extra = {k: v for k, v in loaded.items() if not isinstance(k, int) and k not in ("state", "param_groups",
                                                                                            "optimizer")}
    else:
        if not numbered:
            return loaded
        saved, entries, extra = [_inner(loaded[k]) for k in numbered], [loaded], {}
        if any(s is None or "param_groups" not in s for s in saved):
            return loaded
    groups = [group for s in saved for group in s["param_groups"]]
    step = next((s["state"]["common_step"] for s in saved if "common_step" in s.get("state", {})), None)
    for opt, entry in zip(current, entries):
        inner = _inner(entry)
        if inner is None:
            return loaded
        for i, (asked, group) in enumerate(zip(inner["param_groups"], opt.optimizer.param_groups)):
            kind = tuple(group[k] for k in _GROUP_KEYS)
            match = next((g for g in groups if tuple(g.get(k) for k in _GROUP_KEYS) == kind), None)
            if match is None:
                return loaded
            inner["param_groups"][i] = {**match, "is_expert_parallel": group["is_expert_parallel"],
                                        "params": asked["params"]}
        if step is not None:
            inner["state"]["common_step"] = step
        for key, value in extra.items():
            entry.setdefault(key, value)
    if len(current) > 1:
        return {k: loaded[k] for k in numbered}
    for k in numbered:
        del loaded[k]
    return loaded


def _inner(entry) -> dict | None:
    """The torch optimizer's state dict inside one megatron-core optimizer's: the entry itself (fp32), or under
    'optimizer' (mixed precision)."""
    if not isinstance(entry, dict):
        return None
    return entry["optimizer"] if isinstance(entry.get("optimizer"), dict) else entry


def _content_metadata(args) -> dict:
    """What shapes the sharded state dicts (Megatron-LM's _build_sharded_state_dict_metadata): saved with the
    checkpoint so that loading builds the same structure."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        # dp_reshardable, Megatron-LM's default, ties the optimizer state to the tensor/pipeline layout
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def _sharded_rng_state() -> ShardedObject:
    """Every data-parallel rank's RNG states, stored once per (pipeline, tensor) rank."""
    states = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(states, _rng_state(), group=parallel_state.get_data_parallel_group())
    return ShardedObject("rng_state", states,
                         (parallel_state.get_pipeline_model_parallel_world_size(), _layout()[0]),
                         (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank())


def _sharded_state(args, model, optimizer, scheduler, metadata: dict, rng: bool, is_loading: bool) -> dict:
    metadata = dict(metadata, dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    state = {"args": args, "checkpoint_version": 3.0, "opt_param_scheduler": scheduler.state_dict()}
    for i, chunk in enumerate(unwrap_model(model)):
        state["model" if len(model) == 1 else f"model{i}"] = chunk.sharded_state_dict(metadata=metadata)
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    if rng:
        state["rng_state"] = _sharded_rng_state()
    return state


def _save_dist(args, iteration: int, model, optimizer, scheduler) -> None:
    folder = Path(args.save) / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    metadata = _content_metadata(args)
    state = _sharded_state(args, model, optimizer, scheduler, metadata, rng=True, is_loading=False)
    state["iteration"] = iteration
    dist_checkpointing.save(state, str(folder), get_default_save_sharded_strategy("torch_dist"),
                            content_metadata=_clean_metadata_for_serialization(metadata))


def _load_dist(args, iteration: int, model, optimizer, scheduler) -> None:
    folder = Path(args.load) / f"iter_{iteration:07d}"
    if not dist_checkpointing.check_is_distributed_checkpoint(str(folder)):
        raise FileNotFoundError(f"--load: {folder} is not a torch_dist checkpoint; check --ckpt-step, and pass the "
                                "--ckpt-format it was written with")
    common = dist_checkpointing.load_common_state_dict(str(folder))
    saved_args = common["args"]
    saved_layout = (saved_args.tensor_model_parallel_size, saved_args.pipeline_model_parallel_size)
    saved_experts = (getattr(saved_args, "expert_model_parallel_size", 1),
                     getattr(saved_args, "expert_tensor_parallel_size", None) or saved_args.tensor_model_parallel_size)
    same_layout = saved_layout == _layout() and (saved_experts == _expert_layout() or not args.num_experts)
    if saved_layout != _layout():
        print_rank_0(f" (tensor, pipeline) = {_layout()} resumes a checkpoint written at {saved_layout}: weights and "
                     "optimizer state are resharded; the RNG states are not restored")
    elif not same_layout:
        print_rank_0(f" (expert, expert tensor) = {_expert_layout()} resumes a checkpoint written at {saved_experts}: "
                     "the experts and their optimizer state are resharded; the RNG states are not restored")
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or _content_metadata(args)
    if args.use_distributed_optimizer != ("distrib_optim_sharding_type" in metadata):
        raise ValueError("--use-distributed-optimizer: pass it when, and only when, the checkpoint was written with it")
    sharded = _sharded_state(args, model, optimizer, scheduler, metadata, rng=same_layout, is_loading=True)
    state = read_sharded(sharded, folder)
    for i, chunk in enumerate(unwrap_model(model)):
        chunk.load_state_dict(state["model" if len(model) == 1 else f"model{i}"], strict=True)
    optimizer.load_state_dict(_regrouped_optimizer_state(optimizer, state["optimizer"]))
    scheduler.load_state_dict(common["opt_param_scheduler"])
    if same_layout:
        rng_states = state["rng_state"]
        dp_rank = parallel_state.get_data_parallel_rank()
        _set_rng_state(rng_states[dp_rank] if dp_rank < len(rng_states) else rng_states[0])
    args.consumed_train_samples = saved_args.consumed_train_samples

"""The model state each rank of labkit's driver really holds: weights, gradients and optimizer state, in bytes, counted
on the megatron-core objects the driver trains (benchmarks/bench_zero_memory.py prints the same beside the estimate).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path


def held_bytes(model, optimizer) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) in bytes that these megatron-core objects hold, each storage once.

    Weights: the parameters' storage (DDP's parameter buffer under the distributed optimizer, FSDP2's local shards
    and, at stage 2, the whole parameters it keeps gathered).
    Gradients: DDP's `grad_data` buffers, or the parameters' own gradients under FSDP2. Optimizer: the inner
    optimizer's parameters (fp32 main copies, or the model's own fp32 parameters, then already counted), their
    gradients where they are not views of DDP's buffer, and their state tensors (exp_avg, exp_avg_sq; SGD's
    momentum_buffer). Adam's scalar `step` counters are left out.
    """
    import torch
    from megatron.core.distributed import DistributedDataParallel

    seen: set[int] = set()

    def new(tensors) -> int:
        total = 0
        for x in tensors:
            if x is None:
                continue
            storage = (x.to_local() if hasattr(x, "to_local") else x).untyped_storage()  # a DTensor by its shard
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    # FSDP2 at stage 2 registers the gathered whole parameters; its shards, which the optimizer steps, are weights too
    params = [p for chunk in model for p in chunk.parameters()] + [
        fsdp_param.sharded_param for chunk in model for m in chunk.modules() if hasattr(m, "_get_fsdp_state")
        for group in [m._get_fsdp_state()._fsdp_param_group] if group is not None for fsdp_param in group.fsdp_params]
    weights = new(params)
    buffers = [b.grad_data for chunk in model if isinstance(chunk, DistributedDataParallel)
               for b in [*chunk.buffers, *chunk.expert_parallel_buffers]]
    gradients = new(buffers) if buffers else new(p.grad for p in params)
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    main = [p for o in inner for group in o.param_groups for p in group["params"]]
    state = [v for o in inner for st in o.state.values() for k, v in st.items() if k != "step" and torch.is_tensor(v)]
    return weights, gradients, new(main) + new(p.grad for p in main) + new(state)


def built_after_one_step(args):
    """labkit's driver model and optimizer for these arguments, after one optimizer step on zero gradients (which
    makes Adam's moments): the state a rank holds between steps."""
    import torch

    from labkit.train.model import build_model, gather_zero2_weights, transformer_config
    from labkit.train.training import build_optimizer

    config = transformer_config(args)
    model = build_model(args, config)
    optimizer, _ = build_optimizer(args, model, config)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if args.use_torch_fsdp2:  # FSDP2 keeps sharded .grad tensors where DDP has its buffers
        for p in (p for chunk in model for p in chunk.parameters()):
            p.grad = torch.zeros_like(p)
    optimizer.step()
    gather_zero2_weights(args, model)
    return model, optimizer


def _rank(rank: int, world: int, address: str, commands: list[list[str]], measure, out: str) -> None:
    import contextlib
    import io
    import warnings

    import torch
    import torch.distributed as dist

    from labkit.train import cpu_compat

    # megatron-core's notices that Transformer Engine and Apex are absent, which its modules give as they load and as
    # the model is built, once per rank, would bury the caller's own output (a notebook's): on a CPU they say nothing
    for pattern in cpu_compat.EXPECTED_ON_CPU:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    # and two more that megatron-core's code gives, not the caller's: its distributed optimizer zeroes the gradients of
    # its fp32 shards, views of the parameters (non-leaf tensors), and it and FSDP2 call collectives torch 2.13 renames
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    from labkit.train import data
    from labkit.train.arguments import parse_args
    from labkit.train.training import initialize, padded_vocab_size

    torch.set_num_threads(1)
    cpu_compat.apply()
    dist.init_process_group("gloo", init_method=address, world_size=world, rank=rank)
    rows = []
    for i, command in enumerate(commands):
        args = parse_args(command, world_size=world, rank=rank, cuda=False)
        args.padded_vocab_size = padded_vocab_size(data.build_tokenizer(args).vocab_size,
                                                   args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
        if i == 0:  # the specs share one layout: one set of parallel groups
            with contextlib.redirect_stdout(io.StringIO()):
                initialize(args)
        rows.append(measure(args))
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def on_driver_ranks(specs, measure) -> list[list]:
    """`measure(args)` on every rank of labkit's driver, for each spec (all of one layout and world size): the
    driver's parsed arguments for the spec's command line in gloo processes on this machine, its parallel groups set
    up once, nothing trained. `measure` returns what JSON can carry. Returns [spec][rank]."""
    import torch.multiprocessing as mp

    from labkit.megatron_args import megatron_args
    from labkit.net import free_port

    specs = list(specs)
    worlds = {spec.world_size for spec in specs}
    if len(worlds) != 1:
        raise ValueError(f"specs: one world size for all, not {sorted(worlds)}")
    world = worlds.pop()
    with tempfile.TemporaryDirectory() as out:
        # forked: the ranks start with this process's imports (a notebook's megatron-core) instead of their own, and
        # take `measure` as it is, unpickled
        mp.start_processes(_rank, args=(world, f"tcp://127.0.0.1:{free_port()}", [megatron_args(s) for s in specs],
                                        measure, out), nprocs=world, join=True, start_method="fork")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return [[ranks[r][i] for r in range(world)] for i in range(len(specs))]


def measure_model_state(specs) -> list[list[tuple[int, int, int]]]:
    """For each spec (all of one layout and world size), each rank's (weights, gradients, optimizer state) bytes as
    labkit's driver holds them after one optimizer step: its model and optimizer built from the spec's command line
    in gloo processes on this machine, nothing trained. Returns [spec][rank].

    Taught in lab 09.
    """
    return [[tuple(row) for row in ranks]
            for ranks in on_driver_ranks(specs, lambda args: held_bytes(*built_after_one_step(args)))]

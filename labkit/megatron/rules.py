"""Megatron's rules for how a run's sizes fit together, written once: `labkit validate` (labkit.spec.checks) and the
training driver's argument checks (labkit.train.arguments) both call them, and each words a problem with its own
names, a spec field (`parallel.tensor`) or a Megatron-LM flag (`--tensor-model-parallel-size`), through the `name`
function it passes.

The rules are megatron-core 0.16.1's (TransformerConfig.__post_init__: heads and query groups split over the tensor
ranks; parallel_state.initialize_model_parallel: the world splits into tensor x context x pipeline x data) and
Megatron-LM's validate_args in megatron/training/arguments.py (the global batch splits into micro-batches over the
data-parallel ranks; the interleaved schedule needs a multiple of the pipeline size of them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

Name = Callable[[str], str]
"""Megatron argument (its argparse dest, e.g. "tensor_model_parallel_size") -> how the caller names it."""


@dataclass(frozen=True)
class Problem:
    """One broken rule."""
    argument: str
    """The Megatron argument at fault (argparse dest); the caller names it at the start of its message."""
    message: str
    """What is wrong and how to mend it, other arguments named through the caller's `name`."""


def shape_problems(name: Name, *, heads: int, hidden: int, groups: int | None, tensor: int) -> list[Problem]:
    """Attention's heads and query groups split evenly over the tensor ranks, and the hidden size over the heads.
    `groups`: the query groups when written (grouped-query attention), else None."""
    problems = []
    if heads % tensor:
        problems.append(Problem("num_attention_heads", f"{heads} heads do not split over "
                                f"{name('tensor_model_parallel_size')} {tensor}; use a tensor size that divides "
                                f"{heads}"))
    if hidden % heads:
        problems.append(Problem("hidden_size", f"{hidden} is not divisible by {name('num_attention_heads')} {heads}; "
                                "each head needs an equal share"))
    if groups is not None:
        if heads % groups:
            problems.append(Problem("num_query_groups", f"{groups} does not divide {name('num_attention_heads')} "
                                    f"{heads}"))
        elif groups % tensor:
            problems.append(Problem("num_query_groups", f"{groups} query groups do not split over "
                                    f"{name('tensor_model_parallel_size')} {tensor}; use a tensor size that divides "
                                    f"{groups}"))
    return problems


def split_problems(name: Name, *, world: int, tensor: int, context: int, pipeline: int) -> list[Problem]:
    """The world's ranks split into tensor x context x pipeline x data (the data size is what is left)."""
    split = tensor * context * pipeline
    if world % split == 0:
        return []
    sizes = (f"{name('tensor_model_parallel_size')} {tensor} x {name('context_parallel_size')} {context} x "
             if context > 1 else f"{name('tensor_model_parallel_size')} {tensor} x ")
    return [Problem("pipeline_model_parallel_size", f"world size {world} is not divisible by {sizes}"
                    f"{name('pipeline_model_parallel_size')} {pipeline}; use sizes whose product divides {world}")]


def batch_problems(name: Name, *, global_batch: int, micro: int, data: int, pipeline: int,
                   interleaved: bool) -> list[Problem]:
    """The global batch splits into micro-batches over the data-parallel ranks; the interleaved schedule runs them in
    groups of the pipeline size (megatron-core's forward_backward_pipelining_with_interleaving)."""
    if global_batch % (micro * data):
        step = micro * data
        return [Problem("global_batch_size", f"{global_batch} is not divisible by {name('micro_batch_size')} {micro} "
                        f"x data-parallel {data} = {step}; use a multiple of {step}, e.g. "
                        f"{max(1, global_batch // step) * step}")]
    num_micro = global_batch // (micro * data)
    if interleaved and num_micro % pipeline:
        return [Problem("global_batch_size", f"the interleaved schedule needs the {num_micro} micro-batches to be a "
                        f"multiple of {name('pipeline_model_parallel_size')} {pipeline}; raise it to a multiple of "
                        f"{pipeline * micro * data}")]
    return []


def pairing_problems(name: Name, *, tensor: int, sequence_parallel: bool, tp_comm_overlap: bool,
                     overlap_param_gather: bool, overlap_grad_reduce: bool,
                     distributed_optimizer: bool) -> list[Problem]:
    """Settings that only work beside another (Megatron-LM's validate_args): sequence parallelism splits activations
    over the tensor ranks; Transformer Engine's tensor-parallel overlap pipelines sequence parallelism's all-gathers
    and reduce-scatters; the overlapped parameter gather gathers the distributed optimizer's shards, bucket by
    bucket as the overlapped gradient reduce-scatter made them."""
    problems = []
    if sequence_parallel and tensor == 1:
        problems.append(Problem("sequence_parallel", f"needs {name('tensor_model_parallel_size')} > 1 (it splits "
                                "activations across the tensor ranks); leave it out or raise the tensor size"))
    if tp_comm_overlap and not sequence_parallel:
        problems.append(Problem("tp_comm_overlap", "overlaps sequence parallelism's all-gathers and reduce-scatters; "
                                f"needs {name('sequence_parallel')} (with {name('tensor_model_parallel_size')} > 1), "
                                "or leave it out"))
    if overlap_param_gather and not distributed_optimizer:
        problems.append(Problem("overlap_param_gather", "gathers the distributed optimizer's parameter shards; needs "
                                f"{name('use_distributed_optimizer')}, or leave it out"))
    elif overlap_param_gather and not overlap_grad_reduce:
        problems.append(Problem("overlap_param_gather", f"needs {name('overlap_grad_reduce')} beside it (megatron-core "
                                "gathers the parameters bucket by bucket in the overlapped reduce's buckets), or "
                                "leave it out"))
    return problems

"""Per-rank model state at ZeRO stages 0-3: the bytes labkit's driver really holds, beside the estimate.

    .venv/bin/python benchmarks/bench_zero_memory.py [--data 2 4] [--precision fp32|bf16] [--layers 2 --hidden 72
                                                      --heads 4 --seq-length 32]

For each data-parallel size (gloo processes on the CPU) and each stage, labkit.train.model_state.measure_model_state
builds the driver's model and optimizer from the command line the spec renders for labkit's driver: stage 0
megatron-core's DDP, stage 1 its distributed optimizer, stages 2 and 3 PyTorch FSDP2 through megatron-core
(--use-torch-fsdp2, without and with resharding after forward; Megatron-FSDP, which the spec renders for
Megatron-LM, runs its reduce-scatters and all-gathers on CUDA streams). One optimizer step makes Adam's moments;
then each rank sums the storage it holds: parameters (FSDP2: the local shards), gradients (DDP's buffers, or FSDP2's
sharded gradients) and the optimizer's main parameters, their gradients and Adam's moments, each storage once.

The estimate is labkit.estimate.memory.model_state_bytes for the same model on labkit's driver (what the spec's
entrypoint runs: FSDP2 at stages 2 and 3, `torch_fsdp2_model_state_bytes`) on the data-parallel rank that holds the
most, without the working buffers it adds for the layers being computed, which are not held between steps: exact for
stages 0 and 1 (megatron-core's padded buffers) and for FSDP2's shards (each parameter's rows split over the ranks,
padded to ceil(rows / ranks)). At stage 2 the driver keeps FSDP2's units gathered and gathers the updated shards after
each step, so each rank holds the whole parameters beside its shards, as ZeRO-2 does.
`--precision bf16` runs the 16-bit model with Megatron's fp32 main copies instead of fp32; there FSDP2's 16-bit
gradient shards live from the backward to the step only (the estimate counts them, as they are part of the peak).

Those working buffers are measured too, at stages 2 and 3: one micro-batch's forward and backward on the driver's
FSDP2 model, with every operator followed by a count of what FSDP2 holds unsharded (`fsdp2_unsharded_bytes`); the
largest count beside the estimate's gathered parameters (stage 2: all of them) and unsharded gradients.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.estimate.memory import model_state_bytes  # noqa: E402
from labkit.estimate.params import Shape  # noqa: E402
from labkit.spec import load_spec  # noqa: E402
from labkit.train.model_state import measure_model_state, on_driver_ranks  # noqa: E402

# A GPT with odd widths (hidden 72: gaps before 64-element-aligned parameters; vocabulary 1000, padded to 1024) and
# untied embeddings, which FSDP2 needs.
MODEL = {"num_layers": 2, "hidden_size": 72, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 1000,
         "untie_embeddings": True}
STAGES = (0, 1, 2, 3)


PRECISION = "fp32"


def spec(stage: int, data: int):
    return load_spec({"model": MODEL, "precision": PRECISION, "parallel": {"data": data},
                      "batch": {"micro": 1, "global": data}, "optimizer": {"zero_stage": stage}})


def estimate(stage: int, data: int) -> tuple[tuple[int, int, int], int]:
    """The estimate's bytes held between steps (weights, gradients and optimizer state, working buffers left out),
    and its working buffers."""
    s = spec(stage, data)
    state = model_state_bytes(Shape.of(s.model), [s.model.num_layers], data_parallel=data, precision=PRECISION,
                              distributed_optimizer=s.optimizer.distributed, zero_stage=stage)
    gradients = state.gradients - state.gradients_working
    if stage >= 2 and PRECISION != "fp32":
        # Megatron's 16-bit optimizer frees FSDP2's 16-bit gradient shards once it has copied them to fp32
        # (Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads): held from the backward to the step only
        gradients = 0
    held = (state.weights - state.weights_working, gradients, state.optimizer)
    # what FSDP2 holds unsharded: at stage 2 the whole parameters it keeps gathered, held between steps too (its
    # gradient shards have the weights' dtype and size, so weights less held gradients is what it gathered)
    gathered = state.weights - state.gradients + state.gradients_working if stage == 2 else state.weights_working
    return held, gathered + state.gradients_working


def fsdp2_unsharded_bytes(model) -> Callable[[], int]:
    """A function that counts the bytes FSDP2 (torch 2.13's fully_shard, whose private names it reads) holds
    unsharded in `model` now: gathered parameters, all-gather buffers (a prefetched unit, or the last one kept in the
    forward), unsharded gradients and reduce-scatter inputs awaiting their collective, each storage once."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    params = [p for g in groups for p in g.fsdp_params]

    def count() -> int:
        context = groups[0].comm_ctx  # shared by every unit from the first forward on
        tensors = [t for p in params for t in p.all_gather_outputs]
        tensors += [g._all_gather_result.all_gather_output for g in groups if g._all_gather_result]
        if getattr(context, "all_gather_state", None):
            tensors.append(context.all_gather_state.all_gather_result.all_gather_output)
        for p in params:
            tensors += [getattr(getattr(p, "_unsharded_param", None), "grad", None), p.unsharded_accumulated_grad]
        tensors += [state.reduce_scatter_input for state in getattr(context, "reduce_scatter_states", [])]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        return sum(storages.values())

    return count


def working_peak(args) -> int:
    """The most bytes FSDP2 holds unsharded on this rank at any operator of one forward and backward of the driver's
    model for these arguments."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from labkit.train.model import build_model, transformer_config

    model = build_model(args, transformer_config(args))[0]
    count, peak = fsdp2_unsharded_bytes(model), [0]

    class EveryOperator(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            peak[0] = max(peak[0], count())
            return result

    tokens = torch.randint(0, MODEL["vocab_size"], (1, MODEL["seq_length"]))
    positions = torch.arange(MODEL["seq_length"]).unsqueeze(0)
    with EveryOperator():
        model(tokens, positions, None, labels=tokens).float().sum().backward()
    return peak[0]


def measure_working_peak(specs) -> list[int]:
    """For each FSDP2 spec (one world size), the most bytes any rank held unsharded in one forward and backward."""
    return [max(ranks) for ranks in on_driver_ranks(specs, working_peak)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=int, nargs="+", default=[2, 4], help="data-parallel sizes (gloo processes)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--layers", type=int, default=MODEL["num_layers"])
    parser.add_argument("--hidden", type=int, default=MODEL["hidden_size"])
    parser.add_argument("--heads", type=int, default=MODEL["num_attention_heads"])
    parser.add_argument("--seq-length", type=int, default=MODEL["seq_length"])
    options = parser.parse_args()
    global PRECISION
    sizes, PRECISION = options.data, options.precision
    MODEL.update(num_layers=options.layers, hidden_size=options.hidden, num_attention_heads=options.heads,
                 seq_length=options.seq_length)
    print(f"{'dp':>2} {'stage':>5} {'runs as':<24} {'measured weights/grads/optimizer (bytes, fullest rank)':>56} "
          f"{'estimate':>30} {'diff':>6} {'working peak measured':>22} {'estimate':>10} {'diff':>6}")
    for world in sizes:
        held = measure_model_state(spec(stage, world) for stage in STAGES)
        working = dict(zip((2, 3), measure_working_peak(spec(stage, world) for stage in (2, 3))))
        for stage, ranks in zip(STAGES, held):
            fullest = max(ranks, key=sum)
            est, est_working = estimate(stage, world)
            runs = ("megatron-core DDP", "distributed optimizer", "torch FSDP2, no reshard", "torch FSDP2")[stage]
            line = (f"{world:>2} {stage:>5} {runs:<24} {'/'.join(f'{x:,}' for x in fullest):>56} "
                    f"{'/'.join(f'{x:,}' for x in est):>30} {sum(est) / sum(fullest) - 1:>+6.1%}")
            if stage in working:
                line += f" {working[stage]:>22,} {est_working:>10,} {est_working / working[stage] - 1:>+6.1%}"
            print(line)


if __name__ == "__main__":
    main()

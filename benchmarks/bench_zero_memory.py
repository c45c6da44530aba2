"""Per-rank model state at ZeRO stages 0-3: the bytes labkit's driver really holds, beside the estimate.

    .venv/bin/python benchmarks/bench_zero_memory.py [--data 2 4]

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
padded to ceil(rows / ranks)). FSDP2 keeps stage 2's parameters sharded between steps too, gathering them for the
forward and keeping them to the backward: ZeRO-2's unsharded parameters exist only at the peak.
`--precision bf16` runs the 16-bit model with Megatron's fp32 main copies instead of fp32; there FSDP2's 16-bit
gradient shards live from the backward to the step only (the estimate counts them, as they are part of the peak).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.estimate.memory import model_state_bytes  # noqa: E402
from labkit.estimate.params import Shape  # noqa: E402
from labkit.spec import load_spec  # noqa: E402
from labkit.train.model_state import measure_model_state  # noqa: E402

# A GPT with odd widths (hidden 72: gaps before 64-element-aligned parameters; vocabulary 1000, padded to 1024) and
# untied embeddings, which FSDP2 needs.
MODEL = {"num_layers": 2, "hidden_size": 72, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 1000,
         "untie_embeddings": True}
STAGES = (0, 1, 2, 3)


PRECISION = "fp32"


def spec(stage: int, data: int):
    return load_spec({"model": MODEL, "precision": PRECISION, "parallel": {"data": data},
                      "batch": {"micro": 1, "global": data}, "optimizer": {"zero_stage": stage}})


def estimate(stage: int, data: int) -> tuple[int, int, int]:
    """The estimate's bytes held between steps: weights, gradients and optimizer state, working buffers left out."""
    s = spec(stage, data)
    state = model_state_bytes(Shape.of(s.model), [s.model.num_layers], data_parallel=data, precision=PRECISION,
                              distributed_optimizer=s.optimizer.distributed, zero_stage=stage)
    gradients = state.gradients - state.gradients_working
    if stage >= 2 and PRECISION != "fp32":
        # Megatron's 16-bit optimizer frees FSDP2's 16-bit gradient shards once it has copied them to fp32
        # (Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads): held from the backward to the step only
        gradients = 0
    return (state.weights - state.weights_working, gradients, state.optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=int, nargs="+", default=[2, 4], help="data-parallel sizes (gloo processes)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    options = parser.parse_args()
    global PRECISION
    sizes, PRECISION = options.data, options.precision
    print(f"{'dp':>2} {'stage':>5} {'runs as':<28} {'measured weights/grads/optimizer (bytes, fullest rank)':>56} "
          f"{'estimate':>30} {'total diff':>10}")
    for world in sizes:
        for stage, ranks in zip(STAGES, measure_model_state(spec(stage, world) for stage in STAGES)):
            fullest = max(ranks, key=sum)
            est = estimate(stage, world)
            runs = ("megatron-core DDP", "distributed optimizer", "torch FSDP2, no reshard", "torch FSDP2")[stage]
            print(f"{world:>2} {stage:>5} {runs:<28} {'/'.join(f'{x:,}' for x in fullest):>56} "
                  f"{'/'.join(f'{x:,}' for x in est):>30} {sum(fullest) - sum(est):>+10,}")


if __name__ == "__main__":
    main()

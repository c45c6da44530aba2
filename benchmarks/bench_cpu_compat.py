"""Overhead of labkit's CPU compatibility layer per micro-batch (goal: <= 10%).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_cpu_compat.py

One process builds the driver's GPT (same flags, same megatron-core config) and times one micro-batch, forward + loss
+ backward, three ways, interleaved round by round so machine noise hits all of them alike:

  layer     labkit.train.cpu_compat as the driver applies it (megatron modules see a `torch` stand-in, Tensor.type and
            Tensor.cuda patched)
  bare      the same model with the stand-in and the Tensor patches taken out again: megatron as if it had been
            ported to the CPU by hand. The CPU versions of the RNG get/set functions stay (the tensor-parallel RNG fork
            is work a GPU run does too), the causal mask megatron builds with device="cuda" on every forward is built
            by a plain CPU copy of that function, and the attention scratch buffer was allocated during warm-up.
  op-mode   bare plus a torch.overrides.TorchFunctionMode that sees every torch call (the other way to build such a
            layer), for comparison

and prints, for a tiny and a small model, the median milliseconds per micro-batch and the ratios layer/bare and
op-mode/bare of the medians and of the fastest rounds (the latter less disturbed by other work on the machine).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from labkit.net import free_port
from labkit.train import cpu_compat

CONFIGS = {
    "tiny (2 layers, hidden 64, seq 64, micro 2)":
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2",
    "small (4 layers, hidden 256, seq 128, micro 4)":
        "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --micro-batch-size 4",
}
ROUNDS, PER_ROUND, WARMUP = 25, 5, 5


class _SeeEveryOp(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = cpu_compat._on_cpu(kwargs["device"])
        return func(*args, **kwargs)


def _causal_mask_on_cpu(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _set_layer(active: bool) -> None:
    """Put the stand-in and Tensor patches in (layer) or take them out (bare); RNG functions stay either way."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    for module in cpu_compat._state["modules"].values():
        module.torch = cpu_compat._state["proxy"] if active else torch
    fused_softmax.get_default_causal_mask = utils.get_default_causal_mask if active else _causal_mask_on_cpu
    torch.Tensor.cuda = cpu_compat._tensor_cuda if active else cpu_compat._state["cuda"]
    torch.Tensor.type = cpu_compat._tensor_type if active else cpu_compat._state["type"]


def main() -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from labkit.train.arguments import parse_args
    from labkit.train.model import build_model, transformer_config
    from labkit.train.training import initialize

    assert cpu_compat.apply(), "this benchmark is for machines without CUDA"
    cpu_compat._state["proxy"] = next(iter(cpu_compat._state["modules"].values())).torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); median of {ROUNDS} rounds x {PER_ROUND} "
          "micro-batches (forward + loss + backward), modes interleaved")
    print(f"{'model':48s} {'layer ms':>9s} {'bare ms':>8s} {'op-mode ms':>11s} {'layer/bare':>11s} "
          f"{'op-mode/bare':>13s} {'fastest: layer/bare':>20s} {'op-mode/bare':>13s}")
    for name, flags in CONFIGS.items():
        args = parse_args([*flags.split(), "--lr", "1e-4", "--train-iters", "1", "--mock-data", "--vocab-size", "1024"],
                          world_size=1, rank=0, cuda=False)
        initialize(args)
        args.padded_vocab_size = 1024
        model = build_model(args, transformer_config(args))[0]
        tokens = torch.randint(0, 1024, (args.micro_batch_size, args.seq_length))
        positions = torch.arange(args.seq_length).expand_as(tokens)

        def micro_batch():
            loss = model(tokens, positions, None, labels=tokens).float().mean()
            loss.backward()

        for _ in range(WARMUP):
            micro_batch()
        times = {"layer": [], "bare": [], "op-mode": []}
        for _ in range(ROUNDS):
            for mode in times:
                _set_layer(mode == "layer")
                start = time.perf_counter()
                if mode == "op-mode":
                    with _SeeEveryOp():
                        for _ in range(PER_ROUND):
                            micro_batch()
                else:
                    for _ in range(PER_ROUND):
                        micro_batch()
                times[mode].append((time.perf_counter() - start) / PER_ROUND * 1000)
        _set_layer(True)
        med = {mode: statistics.median(values) for mode, values in times.items()}
        best = {mode: min(values) for mode, values in times.items()}
        print(f"{name:48s} {med['layer']:9.2f} {med['bare']:8.2f} {med['op-mode']:11.2f} "
              f"{med['layer'] / med['bare']:11.3f} {med['op-mode'] / med['bare']:13.3f} "
              f"{best['layer'] / best['bare']:20.3f} {best['op-mode'] / best['bare']:13.3f}")
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

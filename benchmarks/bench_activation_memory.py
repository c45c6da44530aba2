"""Activation bytes per transformer layer and micro-batch: what megatron-core 0.16.1's layers save for backward on the
CPU (counted with saved_tensors_hooks, tests/test_activation_memory.py) against labkit's formula
(labkit.estimate.memory.activation_bytes_per_layer, on_cpu=True), over GPT and Llama layers, tensor 1/2, sequence
parallelism, recompute none/selective/full, bf16 and fp32. Then the terms a GPU changes, for NVIDIA's Llama-3-70B FP8
layer (tensor 4, sequence parallel, seq 8192).

    .venv/bin/python benchmarks/bench_activation_memory.py     # 3 to 8 minutes on 2 cores

`rows()` returns the measured table for other benchmarks to print beside theirs.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_activation_memory import grid, measure  # noqa: E402

from labkit.estimate.memory import activation_bytes_per_layer  # noqa: E402
from labkit.estimate.params import Shape  # noqa: E402
from labkit.spec import load_spec  # noqa: E402


def rows() -> list[dict]:
    """One row per measured case: case, measured bytes, estimated bytes, error in percent."""
    cases = grid()
    measured = measure(cases)
    return [{"case": c.name, "measured": measured[c.name], "estimated": c.estimate(),
             "error_pct": 100 * (c.estimate() / measured[c.name] - 1)} for c in cases]


def gpu_terms() -> list[tuple[str, float]]:
    """GiB per layer and micro-batch of Llama-3-70B at tensor 4 with sequence parallelism, seq 8192, as each GPU rule
    applies in turn."""
    shape = Shape.of(load_spec({"model": {"preset": "llama3-70b", "seq_length": 8192}}).model)
    kw = dict(tensor=4, sequence_parallel=True)
    steps = [("CPU kernels (measured rules)", dict(on_cpu=True, precision="bf16")),
             ("GPU, unfused attention (fused softmax, bool masks)", dict(precision="bf16")),
             ("GPU, flash/fused attention", dict(precision="bf16", flash_attention=True)),
             ("GPU, flash/fused attention, FP8", dict(precision="fp8", flash_attention=True))]
    return [(name, activation_bytes_per_layer(shape, 1, **kw, **extra) / 2 ** 30) for name, extra in steps]


def main() -> None:
    start = time.time()
    table = rows()
    print(f"{'case':<28}{'measured B':>14}{'estimated B':>14}{'error %':>10}")
    for r in table:
        print(f"{r['case']:<28}{r['measured']:>14,}{r['estimated']:>14,.0f}{r['error_pct']:>10.3f}")
    worst = max(abs(r["error_pct"]) for r in table)
    print(f"{len(table)} cases, largest error {worst:.3f}% (limit 2%), {time.time() - start:.0f} s")
    print("\nLlama-3-70B layer, tensor 4, sequence parallel, seq 8192, micro-batch 1 (GiB per layer):")
    for name, gib in gpu_terms():
        print(f"  {name:<52}{gib:8.4f}")


if __name__ == "__main__":
    main()

"""Activation bytes one transformer layer keeps for its backward pass, per micro-batch, with megatron-core's local
attention (DotProductAttention) and with labkit's sdpa attention (torch.nn.functional.scaled_dot_product_attention),
counted on this CPU with saved_tensors_hooks as tests/test_activation_memory.py counts them: GPT (4 heads of 8, MHA,
dropout 0.1) and Llama (GQA 8 heads in 4 groups, no dropout) layers at sequence 128, micro-batch 2, bf16 and fp32.

    .venv/bin/python benchmarks/bench_sdpa_memory.py     # about a minute on 2 cores
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_activation_memory import measure  # noqa: E402
from test_sdpa_attention import attention_cases  # noqa: E402


def main() -> int:
    cases = attention_cases()
    measured = {}
    for backend in ("local", "sdpa"):  # megatron-core sets the backend's NVTE_* variables once per process
        measured.update(measure([c for c in cases if c.backend == backend]))
    print(f"{'layer':<24} {'local':>12} {'sdpa':>12} {'saved by sdpa':>14}")
    for c in cases:
        if c.backend != "local":
            continue
        local, sdpa = measured[c.name], measured[c.name.replace(" local", " sdpa")]
        print(f"{c.base.name:<24} {local:>12,} {sdpa:>12,} {local - sdpa:>+14,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

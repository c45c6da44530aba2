"""Recompute by module on labkit's CPU driver: what each setting of `recompute` saves and costs, measured beside the
estimate.

    .venv/bin/python benchmarks/bench_recompute_modules.py [--iters 12]

A Llama-shaped layer stack without biases (which megatron-core's local layers need to recompute an MLP, see
labkit.megatron.rules) is trained by `python -m labkit.train` in one process, one thread, fp32, for each of: no
recompute, selective with core_attn (megatron-core's default), mlp, core_attn + mlp, and full recompute. Two
figures per setting:
- activations saved: the bytes one layer keeps for its backward pass, counted on megatron-core's own layers with
  saved_tensors_hooks (tests/test_activation_memory.py), against labkit.estimate.memory.activation_bytes_per_layer;
- time paid: the driver's mean `elapsed time per iteration` after the first interval, as a share of the run without
  recompute, against the estimate's (estimate().iteration_time_s on the spec; on a CPU its analytic constants are
  placeholders, so the share, a ratio of FLOPs at one rate, is what it predicts).
The runs go one after another on a shared machine: compare the shares, and rerun when they disagree by more than the
noise the repeated `none` row shows.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_activation_memory import MODELS, Case, measure  # noqa: E402

from labkit.estimate import estimate  # noqa: E402
from labkit.megatron_args import megatron_args  # noqa: E402

SETTINGS = {"none": (None, ()), "core_attn": ("selective", ("core_attn",)), "mlp": ("selective", ("mlp",)),
            "core_attn+mlp": ("selective", ("core_attn", "mlp")), "full": ("full", ())}
MODEL = {**MODELS["llama"], "seq_length": 256, "ffn_hidden_size": 1024}


def spec_of(setting: str, iters: int):
    recompute, modules = SETTINGS[setting]
    c = Case(f"llama {setting}", MODEL, recompute=recompute, precision="fp32", modules=modules)
    spec = c.spec(layers=4).replace(**{"batch.global": 8, "train.iters": iters, "train.log_interval": 2})
    if recompute == "full":
        spec = spec.replace(**{"recompute.num_layers": 1})
    return c, spec


def train(spec) -> float:
    """Mean driver milliseconds per iteration after the first logged interval."""
    cmd = [sys.executable, "-m", "labkit.train", *map(str, megatron_args(spec))]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", out.stdout)]
    return sum(times[1:]) / len(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12)
    iters = parser.parse_args().iters
    start = time.time()
    cases = {name: spec_of(name, iters) for name in SETTINGS}
    saved = measure([c for c, _ in cases.values()])
    ms = {name: train(spec) for name, (_, spec) in cases.items()}
    ms["none (again)"] = train(cases["none"][1])
    predicted = {name: estimate(spec).iteration_time_s for name, (_, spec) in cases.items()}
    none_bytes = saved[cases["none"][0].name]
    print(f"Llama-shaped layers (hidden 256, SwiGLU 1024, seq 256, micro-batch 2, fp32, no biases), {iters} iterations "
          f"of 4 micro-batches on one CPU thread; os.cpu_count()={os.cpu_count()}")
    print(f"{'recompute':14s} {'layer KiB meas.':>15s} {'est.':>9s} {'saved meas.':>12s} {'saved est.':>11s} "
          f"{'ms/iter':>9s} {'time paid meas.':>16s} {'est.':>7s}")
    for name, (c, _) in cases.items():
        kib, est_kib = saved[c.name] / 1024, c.estimate() / 1024
        paid = ms[name] / ms["none"] - 1
        paid_est = predicted[name] / predicted["none"] - 1
        print(f"{name:14s} {kib:15.1f} {est_kib:9.1f} {1 - saved[c.name] / none_bytes:12.1%} "
              f"{1 - c.estimate() / none_bytes:11.1%} {ms[name]:9.1f} {paid:16.1%} {paid_est:7.1%}")
    print(f"{'none (again)':14s} {'':15s} {'':9s} {'':12s} {'':11s} {ms['none (again)']:9.1f} "
          f"{ms['none (again)'] / ms['none'] - 1:16.1%}")
    print(f"wall {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

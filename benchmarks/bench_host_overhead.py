"""The training loop's host time on this CPU, which a profile of the layers does not time: measured, and fitted.

    .venv/bin/python benchmarks/bench_host_overhead.py [--rounds 2]

A GPT too small to compute anything much (4 layers of hidden 16, 16 tokens) on two training processes, so that a
step is almost all host time: data parallel 2 and pipeline 2 (1F1B, and interleaved with 2 and 3 model chunks per
stage, the 3 counting the embedding and the loss as chunks), 1 to 8 micro-batches. `labkit profile` times its layers
first; each layout runs `--rounds` times in turn with the local backend (its steady-state step time,
labkit.logs.derive.steady_state, the least over the rounds). Then labkit.estimate's two CPU host constants (calibration.yaml: cpu_host_s_per_pass, charged per
model chunk's forward and backward pass of a micro-batch, and cpu_host_s_per_step) are fitted together on a grid: the
pair with the least mean |log error| over the layouts; the estimate without them is printed beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.estimate import default_calibration, estimate  # noqa: E402
from labkit.jobs import LocalBackend  # noqa: E402
from labkit.logs.derive import steady_state  # noqa: E402
from labkit.plan.profiler import profile_model  # noqa: E402
from labkit.spec import load_spec  # noqa: E402

TINY = {"num_layers": 4, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16, "vocab_size": 1024}
# (pipeline, data, micro-batch, model chunks per stage) with a global batch of 8
LAYOUTS = [(1, 2, 1, 1), (1, 2, 2, 1), (1, 2, 4, 1), (2, 1, 1, 1), (2, 1, 2, 1), (2, 1, 4, 1), (2, 1, 1, 2),
           (2, 1, 2, 2), (2, 1, 1, 3), (2, 1, 2, 3)]


def spec(pipeline: int, data: int, micro: int, chunks: int):
    parallel = {"tensor": 1, "pipeline": pipeline, "data": data}
    if chunks > 1:
        parallel["virtual_stages"] = chunks
    if chunks == 3:  # 4 layers, the embedding and the loss: 6 chunks of one
        parallel.update(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    return load_spec({"name": "host-overhead", "model": TINY, "batch": {"micro": micro, "global": 8},
                      "precision": "fp32", "data": {"mock": True}, "train": {"iters": 20, "log_interval": 1},
                      "parallel": parallel, "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    specs = [spec(*layout) for layout in LAYOUTS]
    with tempfile.TemporaryDirectory() as scratch:
        _, profile = profile_model(specs[0], tensor=1, micro_batch=[1, 2, 4], repeats=20,
                                   path=Path(scratch) / "tp1.json")
        backend = LocalBackend(runs_dir=str(Path(scratch) / "runs"))
        steps: list[list[float]] = [[] for _ in specs]
        for _ in range(args.rounds):
            for s, times in zip(specs, steps):
                job = backend.submit(s)
                if str(job.wait(progress=False)) != "COMPLETED":
                    print(f"{s.name}: {job.cause()}")
                    return 1
                times.append(steady_state(job.result().iterations).iteration_ms / 1000)
    measured = [min(times) for times in steps]
    base = default_calibration()

    def estimates(per_pass: float, per_step: float) -> list[float]:
        cal = dataclasses.replace(base, cpu_host_s_per_pass=per_pass, cpu_host_s_per_step=per_step)
        return [estimate(s, profiles={("cpu", 1): profile}, calibration=cal).iteration_time_s for s in specs]

    def mean_log_error(values: list[float]) -> float:
        return sum(abs(math.log(e / m)) for e, m in zip(values, measured)) / len(measured)

    grid = [(p * 1e-4, q * 5e-4) for p in range(0, 41) for q in range(0, 41)]
    per_pass, per_step = min(grid, key=lambda pair: mean_log_error(estimates(*pair)))
    without, fitted = estimates(0.0, 0.0), estimates(per_pass, per_step)
    for layout, m, w, f in zip(LAYOUTS, measured, without, fitted):
        pipeline, data, micro, chunks = layout
        print(f"pp{pipeline} dp{data} micro {micro} chunks {chunks}: measured {1e3 * m:5.1f} ms   estimated "
              f"{1e3 * w:5.1f} ms without host time ({100 * (w / m - 1):+5.1f}%), {1e3 * f:5.1f} ms with it "
              f"({100 * (f / m - 1):+5.1f}%)")
    print(f"\nfitted: cpu_host_s_per_pass {per_pass * 1e3:.2f} ms, cpu_host_s_per_step {per_step * 1e3:.2f} ms; "
          f"mean |log error| {mean_log_error(fitted):.3f} (without: {mean_log_error(without):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How right `labkit estimate` is: its predictions against measured iteration times.

    .venv/bin/python benchmarks/bench_estimate_accuracy.py [--skip-cpu]

1. AMP's 90 real trials (../shared/reference/amp/measured.csv): GPT-2 345M-like on 16 T4 and on 12 V100 + 4 T4,
   DeepSpeed 3D parallelism; AMP's own predictions printed beside ours.
2. Seed 000: GPT-2 XL on 8 nodes x 4 A10, PP 8, DP 4, partition 0-11-8-8-8-8-5-0, 1.4 s/iteration.
3. The CPU closed loop: profile this machine, predict, then run `python -m labkit.train` in several layouts.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.estimate import Profile, estimate, load_profile, save_profile  # noqa: E402
from labkit.megatron_args import megatron_args  # noqa: E402
from labkit.spec import load_spec  # noqa: E402

REFERENCE = ROOT.parent / "shared" / "reference"
AMP_MODEL = {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024, "vocab_size": 52256}
# AMP's cluster_info (homogeneous.py, het_cluster.py): link speeds in Gbit/s, node groups in rank order.
AMP_CLUSTERS = {
    "16x T4-16GB": [{"gpu": "T4", "count": 4, "gpus_per_node": 4, "intra_node_gbps": 50, "inter_node_gbps": 50}],
    "12x V100-16GB + 4x T4-16GB": [
        {"gpu": "V100-16GB", "count": 3, "gpus_per_node": 4, "intra_node_gbps": 170, "inter_node_gbps": 10},
        {"gpu": "T4", "count": 1, "gpus_per_node": 4, "intra_node_gbps": 50, "inter_node_gbps": 50},
    ],
}
# DeepSpeed's GPT-2 pipeline module: [embed, noop, 24 x transformer, noop, noop, embed2v, noop] (AMP cost_het_cluster.py)
DS_FIRST_LAYER, DS_LAYERS = 2, 24


def layers_per_stage(ds_partition: list[int]) -> list[int]:
    """DeepSpeed partition boundaries over the 30 pipeline modules -> transformer layers per stage."""
    lo, hi = DS_FIRST_LAYER, DS_FIRST_LAYER + DS_LAYERS
    return [max(0, min(b, hi) - max(a, lo)) for a, b in zip(ds_partition, ds_partition[1:])]


def amp_rows() -> list[dict]:
    rows = []
    with open(REFERENCE / "amp" / "measured.csv") as fh:
        for row in csv.DictReader(fh):
            partition = [int(x) for x in re.search(r"DS partition \[([^\]]*)\]", row["notes"])[1].split(",")]
            amp_pred = float(re.search(r"AMP predicted ([0-9.]+)", row["notes"])[1])
            tp, pp, dp = int(row["tp"]), int(row["pp"]), int(row["dp"])
            spec = load_spec({
                "name": f"amp-{row['row_id']}", "model": dict(AMP_MODEL),
                "parallel": {"tensor": tp, "pipeline": pp, "data": dp, "partition": layers_per_stage(partition)},
                "batch": {"micro": int(row["micro_batch"]), "global": int(row["global_batch"])},
                "precision": "fp16", "recompute": "none", "cluster": {"nodes": AMP_CLUSTERS[row["gpu"]]},
            })
            rows.append({"spec": spec, "measured": float(row["measured_iter_time_s"]), "amp": amp_pred,
                         "cluster": row["gpu"], "layout": f"t{tp} p{pp} d{dp} b{row['micro_batch']}"})
    return rows


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        r = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def errors(pred: list[float], meas: list[float]) -> list[float]:
    return [abs(p - m) / m for p, m in zip(pred, meas)]


def report_amp(verbose: bool) -> dict:
    rows = amp_rows()
    ours = [estimate(r["spec"]).iteration_time_s for r in rows]
    meas = [r["measured"] for r in rows]
    amp = [r["amp"] for r in rows]
    print(f"AMP real trials ({len(rows)}): GPT-2 L24 h1024 s1024, DeepSpeed 3D, fp16")
    if verbose:
        print(f"  {'cluster':<28}{'layout':<18}{'measured':>9}{'labkit':>9}{'AMP':>9}")
        for r, o in zip(rows, ours):
            print(f"  {r['cluster']:<28}{r['layout']:<18}{r['measured']:>9.3f}{o:>9.3f}{r['amp']:>9.3f}")
    result = {}
    for name, keep in (("all", lambda r: True), ("16x T4", lambda r: r["cluster"].startswith("16x")),
                       ("12x V100 + 4x T4", lambda r: r["cluster"].startswith("12x"))):
        idx = [i for i, r in enumerate(rows) if keep(r)]
        o, m, a = [ours[i] for i in idx], [meas[i] for i in idx], [amp[i] for i in idx]
        eo, ea = errors(o, m), errors(a, m)
        print(f"  {name:<18} n={len(idx):>2}  labkit: mean |err| {100 * statistics.fmean(eo):5.1f}%  "
              f"median {100 * statistics.median(eo):5.1f}%  Spearman {spearman(o, m):.3f}   |   "
              f"AMP: mean {100 * statistics.fmean(ea):5.1f}%  Spearman {spearman(a, m):.3f}")
        result[name] = (statistics.fmean(eo), spearman(o, m))
    return result


def report_seed000() -> float:
    spec = load_spec({"name": "seed000", "model": {"preset": "gpt2-xl"},
                      "parallel": {"tensor": 1, "pipeline": 8, "data": 4, "partition": [0, 11, 8, 8, 8, 8, 5, 0]},
                      "batch": {"micro": 1, "global": 64}, "precision": "fp16", "recompute": "none",
                      "cluster": "a10x8"})
    est = estimate(spec)
    measured = 1.4  # mean of iterations 20..50: 1.4015, 1.4238, 1.3739, 1.4098
    err = abs(est.iteration_time_s - measured) / measured
    parts = ", ".join(f"{k} {v:.3f}" for k, v in est.breakdown.items())
    print(f"Seed 000 GPT-2 XL, 32 x A10, PP 8 DP 4: measured {measured:.3f} s, labkit {est.iteration_time_s:.3f} s "
          f"({100 * err:+.1f}% abs)  [{parts}]")
    return err


# ---------------------------------------------------------------------------------------------------------------------
# CPU closed loop. Every process runs one thread (torchrun's default for several processes; this host has 2 cores), so
# layouts of 1 and 2 processes compute at the same per-process speed.
LOOP_MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 256, "vocab_size": 1024}
LOOP_ITERS, LOOP_LOG = 12, 4
LOOP_LAYOUTS = [  # (label, tensor, pipeline, data, recompute)
    ("world 1, recompute", 1, 1, 1, "full"),
    ("dp2", 1, 1, 2, None),
    ("dp2, recompute", 1, 1, 2, "full"),
    ("tp2", 2, 1, 1, None),
    ("pp2", 1, 2, 1, None),
    ("pp2, recompute", 1, 2, 1, "full"),
]


def loop_spec(tensor=1, pipeline=1, data=1, recompute=None, num_layers=None):
    model = dict(LOOP_MODEL, num_layers=num_layers or LOOP_MODEL["num_layers"])
    return load_spec({
        "name": "cpu-loop", "model": model,
        "parallel": {"tensor": tensor, "pipeline": pipeline, "data": data},
        "batch": {"micro": 2, "global": 8}, "precision": "fp32",
        "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1} if recompute else "none",
        "train": {"iters": LOOP_ITERS, "log_interval": LOOP_LOG},
        "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": tensor * pipeline * data}]},
    })


def run_driver(spec) -> float:
    """Seconds per iteration the driver logs, averaged over the logging intervals after the first (warm-up)."""
    cmd = [str(ROOT / ".venv" / "bin" / "torchrun"), "--nproc-per-node", str(spec.world_size), "-m", "labkit.train",
           *megatron_args(spec)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    times = [float(x) / 1000 for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out.stdout)]
    if out.returncode != 0 or len(times) < 2:
        raise RuntimeError(f"training driver failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return statistics.fmean(times[1:])


def measure_cpu_profile() -> Profile:
    """Per-layer forward seconds on this CPU from two single-process runs of the driver, at L and 2L layers: the
    difference is L layers' forward + backward (= 3 x forward, as profiles assume), the rest is embedding, output and
    the optimizer (whose predicted time is taken off)."""
    layers = LOOP_MODEL["num_layers"]
    short, long_ = loop_spec(num_layers=layers), loop_spec(num_layers=2 * layers)
    t_short, t_long = run_driver(short), run_driver(long_)
    m = short.num_micro_batches
    per_layer = (t_long - t_short) / (3 * m * layers)
    empty = Profile(model="cpu-loop", gpu="cpu", tensor=1, embedding_s=0.0, layers_s=[0.0] * layers, output_s=0.0,
                    micro_batch=2, seq_length=LOOP_MODEL["seq_length"], precision="fp32")
    fixed = estimate(short, profiles={("cpu", 1): empty}).iteration_time_s
    ends = max(0.0, (t_short - fixed) / (3 * m) - layers * per_layer)
    profile = Profile(model="cpu-loop", gpu="cpu", tensor=1, embedding_s=0.0, layers_s=[per_layer] * (2 * layers),
                      output_s=ends, micro_batch=2, seq_length=LOOP_MODEL["seq_length"], precision="fp32",
                      source=f"driver runs at {layers} and {2 * layers} layers: {t_short:.3f} s and {t_long:.3f} s",
                      measured_on="this host, 1 thread per process")
    with tempfile.TemporaryDirectory() as tmp:  # through the file format, as `labkit profile` output would come
        return load_profile(save_profile(profile, Path(tmp) / "cpu-loop_cpu_tp1.json"))


def report_cpu_loop() -> list[float]:
    profile = measure_cpu_profile()
    print(f"CPU closed loop: GPT L{LOOP_MODEL['num_layers']} h{LOOP_MODEL['hidden_size']} s{LOOP_MODEL['seq_length']},"
          f" micro 2, global 8, fp32; profile {1000 * profile.layers_s[0]:.1f} ms/layer forward, "
          f"{1000 * profile.output_s:.1f} ms output ({profile.source})")
    errs = []
    for label, t, p, d, recompute in LOOP_LAYOUTS:
        spec = loop_spec(t, p, d, recompute)
        predicted = estimate(spec, profiles={("cpu", 1): profile}).iteration_time_s
        measured = run_driver(spec)
        err = (predicted - measured) / measured
        errs.append(abs(err))
        print(f"  {label:<20} predicted {predicted:6.3f} s  measured {measured:6.3f} s  error {100 * err:+6.1f}%")
    print(f"  mean |error| {100 * statistics.fmean(errs):.1f}%, max {100 * max(errs):.1f}% over {len(errs)} layouts")
    return errs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cpu", action="store_true", help="skip the CPU closed loop (it trains for minutes)")
    parser.add_argument("--verbose", action="store_true", help="print every AMP trial")
    args = parser.parse_args(argv)
    report_amp(args.verbose)
    report_seed000()
    if not args.skip_cpu:
        report_cpu_loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

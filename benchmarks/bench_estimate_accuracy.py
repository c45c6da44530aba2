"""How right `labkit estimate` is: its predictions against measured iteration times.

    .venv/bin/python benchmarks/bench_estimate_accuracy.py [--verbose] [--validate] [--skip-cpu | --save-loop F |
                                                           --replay-loop F]

1. AMP's 90 real trials (benchmarks/data/amp/measured.csv): GPT-2 345M-like on 16 T4 and on 12 V100 + 4 T4,
   DeepSpeed 3D parallelism; AMP's own predictions printed beside ours.
2. FASOP's Megatron-LM scripts (github.com/AvatarHwang/FASOP): GPT-2 XL on 8 nodes x 4 A10, PP 8, DP 4,
   partition 0-11-8-8-8-8-5-0, 1.4 s/iteration.
3. Published runs (labkit/data/published_runs.yaml): Megatron-LM on A100 (SC21 Table 1, Korthikanti et al. Table 5)
   and megatron-core on H100 (NVIDIA's NeMo and Megatron-Bridge performance summaries).
4. The CPU closed loop: profile this machine, predict, then run `python -m labkit.train` in several layouts.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.estimate import Calibration, Profile, default_calibration, estimate, load_profile  # noqa: E402
from labkit.estimate.published import published_runs, published_table  # noqa: E402
from labkit.logs.parse import parse_text  # noqa: E402
from labkit.megatron_args import megatron_args  # noqa: E402
from labkit.spec import load_spec  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
AMP_MODEL = {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024, "vocab_size": 52256}
# AMP's clusters (paper §5; node order of het_cluster.py's cluster_info) with their physical links: g4dn.12xlarge is
# 4 T4 on PCIe Gen3 (catalog) with 50 Gbit/s Ethernet, p3.8xlarge 4 V100 on NVLink (catalog) with 10 Gbit/s.
AMP_CLUSTERS = {
    "16x T4-16GB": [{"gpu": "T4", "count": 4, "gpus_per_node": 4, "inter_node_gbps": 50}],
    "12x V100-16GB + 4x T4-16GB": [
        {"gpu": "V100-16GB", "count": 3, "gpus_per_node": 4, "inter_node_gbps": 10},
        {"gpu": "T4", "count": 1, "gpus_per_node": 4, "inter_node_gbps": 50},
    ],
}
# DeepSpeed's pipeline engine on Megatron-LM v1.1.5, with ds_config "fp32_allreduce": gradients reduced as fp32.
AMP_STACK, AMP_GRAD_BYTES = "deepspeed-megatron-2020", 4
# DeepSpeed's GPT-2 pipeline module: [embed, noop, 24 x transformer, noop, noop, embed2v, noop] (AMP cost_het_cluster.py)
DS_FIRST_LAYER, DS_LAYERS = 2, 24


def layers_per_stage(ds_partition: list[int]) -> list[int]:
    """DeepSpeed partition boundaries over the 30 pipeline modules -> transformer layers per stage."""
    lo, hi = DS_FIRST_LAYER, DS_FIRST_LAYER + DS_LAYERS
    return [max(0, min(b, hi) - max(a, lo)) for a, b in zip(ds_partition, ds_partition[1:])]


def amp_rows() -> list[dict]:
    rows = []
    with open(DATA / "amp" / "measured.csv") as fh:
        for row in csv.DictReader(fh):
            partition = [int(x) for x in re.search(r"DS partition \[([^\]]*)\]", row["notes"])[1].split(",")]
            amp_pred = float(re.search(r"AMP predicted ([0-9.]+)", row["notes"])[1])
            tp, pp, dp = int(row["tp"]), int(row["pp"]), int(row["dp"])
            spec = load_spec({
                "name": f"amp-{row['row_id']}", "model": dict(AMP_MODEL),
                "parallel": {"tensor": tp, "pipeline": pp, "data": dp,
                             **({"partition": layers_per_stage(partition)} if pp > 1 else {})},
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


def amp_estimate(spec, calibration: Calibration | None = None) -> float:
    return estimate(spec, stack=AMP_STACK, grad_reduce_bytes=AMP_GRAD_BYTES, calibration=calibration).iteration_time_s


def report_amp(verbose: bool) -> dict:
    rows = amp_rows()
    ours = [amp_estimate(r["spec"]) for r in rows]
    meas = [r["measured"] for r in rows]
    amp = [r["amp"] for r in rows]
    print(f"AMP real trials ({len(rows)}): GPT-2 L24 h1024 s1024, DeepSpeed 3D, fp16; stack {AMP_STACK}")
    fitted = ", ".join(f"{k} {v:.3g}" for k, v in constants_of(default_calibration()).items())
    print(f"  fitted to these trials: {fitted}; V100 efficiency "
          f"{default_calibration().gpu_efficiency('V100-16GB'):.3g} (weakly)")
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


def report_amp_by_dimension() -> None:
    """Signed mean error per value of each layout dimension: where the remaining error sits."""
    rows = amp_rows()
    ours = [amp_estimate(r["spec"]) for r in rows]
    signed = [(o - r["measured"]) / r["measured"] for o, r in zip(ours, rows)]
    for dim in ("t", "p", "d", "b"):
        groups: dict[int, list[float]] = {}
        for r, e in zip(rows, signed):
            value = int(re.search(rf"\b{dim}(\d+)", r["layout"])[1])
            groups.setdefault(value, []).append(e)
        cells = "  ".join(f"{dim}{v}: {100 * statistics.fmean(es):+5.1f}% (n={len(es)})" for v, es in sorted(groups.items()))
        print(f"  by {dim}: {cells}")


def report_amp_step_times() -> None:
    """Where a measurement falls outside what any 1F1B cost can give: for one layout and partition, doubling the
    micro-batch halves the micro-batches m and doubles each one's work, so the time per pipeline step,
    T / (m + p - 1), cannot fall. Lists each such pair, per cluster."""
    families: dict[tuple, list[tuple[int, float]]] = {}
    for r in amp_rows():
        t, p, d, b = (int(x) for x in re.findall(r"\d+", r["layout"]))
        m = r["spec"].num_micro_batches
        key = (r["cluster"], t, p, d, tuple(r["spec"].layer_partition))
        families.setdefault(key, []).append((b, r["measured"] / (m + p - 1)))
    print("  time per pipeline step falling as the micro-batch doubles (same layout and partition):")
    for cluster in sorted({key[0] for key in families}):
        falls = []
        for (name, t, p, d, _), steps in sorted(families.items()):
            steps.sort()
            falls += [f"t{t} p{p} d{d} b{b1}->b{b2}: {1000 * s1:.0f} -> {1000 * s2:.0f} ms"
                      for (b1, s1), (b2, s2) in zip(steps, steps[1:]) if name == cluster and s2 < s1]
        print(f"    {cluster:<28}{'; '.join(falls) or 'none'}")


# The constants fitted to AMP's trials (in labkit/data/calibration.yaml); `--validate` refits them on part of the trials.
FITTED = ("T4 efficiency", "memory passes", "TP all-reduce s", "p2p message s", "T4 in-node Gbit/s",
          "network bus fraction")


def constants_of(cal: Calibration) -> dict:
    stack = cal.stack(AMP_STACK)
    return {"T4 efficiency": cal.gpu_efficiency("T4"), "memory passes": stack.memory_passes,
            "TP all-reduce s": stack.tp_allreduce_s, "p2p message s": stack.p2p_message_s,
            "T4 in-node Gbit/s": cal.intra_node_gbps["T4"], "network bus fraction": cal.network_bus_fraction}


def calibrated(values: dict, base: Calibration | None = None) -> Calibration:
    """`base` (the shipped calibration by default) with the fitted constants set to `values`."""
    cal = base or default_calibration()
    stack = dataclasses.replace(cal.stack(AMP_STACK), memory_passes=values["memory passes"],
                                tp_allreduce_s=values["TP all-reduce s"], p2p_message_s=values["p2p message s"])
    return dataclasses.replace(cal.with_efficiency("T4", values["T4 efficiency"])
                               .with_intra_node_gbps("T4", values["T4 in-node Gbit/s"]).with_stack(stack),
                               network_bus_fraction=values["network bus fraction"])


def log_error(values: dict, rows: list[dict]) -> float:
    cal = calibrated(values)
    return statistics.fmean(abs(math.log(amp_estimate(r["spec"], cal) / r["measured"])) for r in rows)


def fit_constants(rows: list[dict], iterations: int = 300) -> dict:
    """Nelder-Mead on log-constants, minimising the mean |log(predicted / measured)| over `rows`."""
    start = constants_of(default_calibration())
    x0 = np.log([start[k] for k in FITTED])

    def objective(x):
        return log_error(dict(zip(FITTED, np.exp(x))), rows)

    simplex = [x0] + [x0 + 0.2 * np.eye(len(x0))[i] for i in range(len(x0))]
    values = [objective(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centre = np.mean(simplex[:-1], axis=0)
        reflected = centre + (centre - simplex[-1])
        f_reflected = objective(reflected)
        if f_reflected < values[0]:
            expanded = centre + 2 * (centre - simplex[-1])
            f_expanded = objective(expanded)
            simplex[-1], values[-1] = (expanded, f_expanded) if f_expanded < f_reflected else (reflected, f_reflected)
        elif f_reflected < values[-2]:
            simplex[-1], values[-1] = reflected, f_reflected
        else:
            contracted = centre + 0.5 * (simplex[-1] - centre)
            f_contracted = objective(contracted)
            if f_contracted < values[-1]:
                simplex[-1], values[-1] = contracted, f_contracted
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [objective(x) for x in simplex]
    return dict(zip(FITTED, np.exp(simplex[int(np.argmin(values))])))


def report_validation() -> None:
    """Refit the constants on part of AMP's trials and score the rest: two random halves, then each cluster alone."""
    rows = amp_rows()
    t4 = [r for r in rows if r["cluster"].startswith("16x")]
    het = [r for r in rows if r["cluster"].startswith("12x")]
    order = random.Random(0).sample(range(len(rows)), len(rows))
    halves = [[rows[i] for i in order[0::2]], [rows[i] for i in order[1::2]]]
    splits = [("half A -> half B", halves[0], halves[1]), ("half B -> half A", halves[1], halves[0]),
              ("16x T4 -> 12x V100 + 4x T4", t4, het), ("12x V100 + 4x T4 -> 16x T4", het, t4)]
    print("Validation: constants refitted on the left, scored on the right (V100 efficiency held at the calibration's)")
    for name, train, test in splits:
        fitted = fit_constants(train)
        cal = calibrated(fitted)
        pred = [amp_estimate(r["spec"], cal) for r in test]
        meas = [r["measured"] for r in test]
        errs = errors(pred, meas)
        shown = ", ".join(f"{k} {v:.3g}" for k, v in fitted.items())
        print(f"  {name:<28} held-out n={len(test)}: mean |err| {100 * statistics.fmean(errs):5.1f}%  "
              f"median {100 * statistics.median(errs):5.1f}%  Spearman {spearman(pred, meas):.3f}   [{shown}]")


def report_fasop_gpt2_xl() -> float:
    spec = load_spec({"name": "fasop-gpt2-xl", "model": {"preset": "gpt2-xl"},
                      "parallel": {"tensor": 1, "pipeline": 8, "data": 4, "partition": [0, 11, 8, 8, 8, 8, 5, 0]},
                      "batch": {"micro": 1, "global": 64}, "precision": "fp16", "recompute": "none",
                      "kernels": {"attention_backend": "unfused"}, "cluster": "a10x8"})  # Megatron-LM of 2022
    est = estimate(spec)
    measured = 1.4  # mean of iterations 20..50: 1.4015, 1.4238, 1.3739, 1.4098
    err = abs(est.iteration_time_s - measured) / measured
    parts = ", ".join(f"{k} {v:.3f}" for k, v in est.breakdown.items())
    print(f"FASOP's GPT-2 XL, 32 x A10, PP 8 DP 4: measured {measured:.3f} s, labkit {est.iteration_time_s:.3f} s "
          f"({100 * err:+.1f}% abs)  [{parts}]")
    return err


def report_published() -> None:
    """Predicted against published measured runs (per set: the figure its source prints), with each source's median
    and largest error, and whether a constant was fitted to it."""
    print("Published runs (labkit/data/published_runs.yaml): Megatron-LM on DGX A100, megatron-core on DGX H100 and "
          "Blackwell, PyTorch's FSDP2 on H200 and H100")
    table = published_table()
    for row in table.itertuples():
        unit = "TFLOP/s/GPU" if row.figure == "tflops_per_gpu" else "s/iteration"
        print(f"  {row.set:<18} {row.run:<30} measured {row.measured:7.2f}  labkit {row.predicted:7.2f} {unit}  "
              f"({100 * row.error:+5.1f}%)")
    for name, group in table.groupby("set", sort=False):
        e = group["error"].abs()
        role = ("held out" if group["held_out"].all() else
                "development data" if group["dev"].all() else "constants fitted to it")
        misfits = ", ".join(f"{r.run} {r.peak_gib:.1f} GiB" for r in group.itertuples() if not r.fits)
        print(f"  {name:<18} n={len(e):>2}  median |err| {100 * e.median():4.1f}%  max {100 * e.max():4.1f}%  "
              f"mean {100 * e.mean():4.1f}%   fit in memory {group['fits'].sum()}/{len(group)}"
              f"{' (not: ' + misfits + ')' if misfits else ''}   ({role})")
    report_tp_overlap(table)


def report_tp_overlap(table) -> None:
    """The rows that overlap tensor-parallel transfers (tp_comm_overlap), at the fitted exposed fraction and at its two
    ends: calibration.yaml's tp_overlap_exposed is the fraction that leaves their mean signed error at zero."""
    runs = {(r.set, r.label): r for r in published_runs()}
    rows = [i for i, row in enumerate(table.itertuples()) if runs[(row.set, row.run)].spec.kernels.tp_comm_overlap]
    fitted = default_calibration().tp_overlap_exposed
    cells = []
    for exposed in (0.0, fitted, 1.0):
        errors = published_table(calibration=dataclasses.replace(default_calibration(), tp_overlap_exposed=exposed))
        cells.append(f"{exposed:g}{' (fitted)' if exposed == fitted else ''}: "
                      f"{100 * errors['error'].iloc[rows].mean():+.1f}%")
    print(f"  tp_comm_overlap rows (n={len(rows)}), mean signed error by exposed fraction: {', '.join(cells)}")


# ---------------------------------------------------------------------------------------------------------------------
# CPU closed loop. This host has 2 cores; every training process runs one thread (OMP_NUM_THREADS=1), so the profile is
# taken with one thread per process too, and with as many processes running at once as the layout has. Other
# jobs on the host slow every measurement down: the load average is printed beside each one, each layout's profile is
# measured right before and right after its driver runs (the prediction is the geometric mean of the two), and each
# layout runs LOOP_REPEATS times (the median ratio is kept).
LOOP_MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 256, "vocab_size": 1024}
LOOP_MICRO, LOOP_GLOBAL = 2, 8
LOOP_ITERS, LOOP_WARMUP = 7, 2  # iterations run, and leading ones left out of the steady state
LOOP_REPEATS = 2
QUIET_LOAD, QUIET_WAIT_S = 3.0, 30  # wait up to this long for the 1-minute load average to drop below this
LOOP_LAYOUTS = [  # (label, tensor, pipeline, data, recompute)
    ("world 1", 1, 1, 1, None),
    ("world 1, recompute", 1, 1, 1, "full"),
    ("dp2", 1, 1, 2, None),
    ("dp2, recompute", 1, 1, 2, "full"),
    ("tp2", 2, 1, 1, None),
    ("pp2", 1, 2, 1, None),
    ("pp2, recompute", 1, 2, 1, "full"),
]


def loop_spec(tensor=1, pipeline=1, data=1, recompute=None):
    return load_spec({
        "name": "cpu-loop", "model": dict(LOOP_MODEL),
        "parallel": {"tensor": tensor, "pipeline": pipeline, "data": data},
        "batch": {"micro": LOOP_MICRO, "global": LOOP_GLOBAL}, "precision": "fp32",
        "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1} if recompute else "none",
        "train": {"iters": LOOP_ITERS, "log_interval": 1},
        "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": tensor * pipeline * data}]},
    })


def _one_thread_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def wait_for_quiet() -> float:
    """The 1-minute load average once it drops below QUIET_LOAD, or after QUIET_WAIT_S, whichever comes first."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while os.getloadavg()[0] > QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


class RunQueueWait:
    """Time the processes under `root` (their main threads) spent runnable but waiting for a CPU, from
    /proc/PID/task/PID/schedstat, sampled every `period` s so that processes which exit are still counted: the time
    other jobs on the host took from them. `cpu_share()` is the fraction of their runnable time they had a CPU."""

    def __init__(self, root: int, period: float = 0.2):
        self.root, self.period, self.latest, self._stop = root, period, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _tree(pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            for children in Path(f"/proc/{p}/task").glob("*/children"):
                with contextlib.suppress(OSError, ValueError):
                    todo += [int(c) for c in children.read_text().split()]
        return out

    def sample(self) -> dict[int, tuple[int, int, str]]:
        """{pid: (ns on a CPU, ns waiting for one, command line)} for every process seen so far."""
        for pid in self._tree(self.root):
            with contextlib.suppress(OSError, ValueError, IndexError):
                # the main thread, which runs the model (one thread per process); helper threads' waits overlap it
                run, wait = (int(x) for x in Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:2])
                cmd = self.latest[pid][2] if pid in self.latest else \
                    Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
                self.latest[pid] = (run, wait, cmd)
        return dict(self.latest)

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def stop(self):
        self._stop.set()
        self._thread.join()

    def cpu_share(self) -> float:
        run = sum(r for r, _, _ in self.latest.values())
        wait = sum(w for _, w, _ in self.latest.values())
        return run / (run + wait) if run + wait else 1.0


def measure_profile(tensor: int, processes: int, workdir: Path) -> tuple[Profile, float]:
    """`labkit profile` of the loop model at this tensor size, one thread per process, with as many processes busy as
    the layout runs (`--host-processes`: the profiler runs `processes` groups of `tensor` workers at once): the cores,
    caches and memory bandwidth are shared as in training. Also returns the share of their runnable time the
    profilers had a CPU (RunQueueWait)."""
    spec_path = workdir / "cpu-loop.yaml"
    spec_path.write_text(yaml.safe_dump(loop_spec(tensor).to_dict()))
    out = workdir / f"cpu-loop_cpu_tp{tensor}.json"
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "profile", "--model", str(spec_path), "--tensor",
                             str(tensor), "--micro-batch", str(LOOP_MICRO), "--precision", "fp32", "--repeats", "12",
                             "--host-processes", str(tensor * processes), "--output", str(out)],
                            cwd=ROOT, env=_one_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    sampler = RunQueueWait(proc.pid)
    output, _ = proc.communicate(timeout=900)
    sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"labkit profile failed ({proc.returncode}):\n{output[-3000:]}")
    return load_profile(out), sampler.cpu_share()


# A profiler process for `measure_cpu_time_profile`: labkit.plan.profiler's own worker, with its clock swapped for the
# process's CPU time. argv: rank world port out.json megatron-args-json micro-batch
_CPU_TIME_WORKER = """
import json, sys, time, types
import labkit.plan.profiler as profiler
profiler.time = types.SimpleNamespace(perf_counter=time.process_time)
rank, world, port, out, argv = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
LOOP_MICRO = int(sys.argv[6])
class Results:
    def put(self, value):
        open(out, "w").write(json.dumps(value[0]))
profiler._worker(rank, world, argv, [LOOP_MICRO], 12, 2, port, None, Results())
"""


def measure_cpu_time_profile(tensor: int, processes: int, workdir: Path) -> Profile:
    """The profile `labkit profile` measures, with each span timed in the process's own CPU time instead of wall time
    (labkit.plan.profiler's worker with its clock swapped): what the layers cost with the CPUs to themselves, however
    busy the host is. `processes` groups of `tensor` workers run at once, as in the layout; their profiles are
    averaged layer by layer."""
    from labkit.net import free_port
    from labkit.plan.profiler import profiling_spec

    (workdir / "cpu-loop.yaml").write_text(yaml.safe_dump(loop_spec(tensor).to_dict()))
    argv = megatron_args(profiling_spec(str(workdir / "cpu-loop.yaml"), tensor, LOOP_MICRO, "fp32")) + [
        "--distributed-backend", "gloo"]
    groups = []
    for g in range(processes):
        port, out = free_port(), workdir / f"cpu-time-profile-{g}.json"
        groups.append((out, [subprocess.Popen([sys.executable, "-c", _CPU_TIME_WORKER, str(rank), str(tensor), str(port),
                                               str(out), json.dumps(argv), str(LOOP_MICRO)], cwd=ROOT, env=_one_thread_env(),
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                             for rank in range(tensor)]))
    measured = []
    for out, procs in groups:
        for proc in procs:
            output, _ = proc.communicate(timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"CPU-time profile failed ({proc.returncode}):\n{output[-3000:]}")
        measured.append(json.loads(out.read_text()))
    return Profile(model="cpu-loop", gpu="cpu", tensor=tensor,
                   embedding_s=statistics.fmean(m["embedding"] for m in measured),
                   layers_s=[statistics.fmean(x) for x in zip(*(m["layers"] for m in measured))],
                   output_s=statistics.fmean(m["output"] for m in measured), micro_batch=LOOP_MICRO,
                   seq_length=LOOP_MODEL["seq_length"], precision="fp32",
                   backward_factor=statistics.fmean(m["backward_factor"] for m in measured),
                   source="labkit.plan.profiler worker timed in process CPU time")


def run_driver(spec, workdir: Path) -> tuple[float, float]:
    """Steady-state seconds per iteration from the driver's Megatron-format log (warm-up iterations left out): the
    median as logged, and the mean less the time its training processes waited for a CPU over those iterations (the
    mean over processes of their run-queue wait between the log lines that bound the steady iterations)."""
    cmd = [str(ROOT / ".venv" / "bin" / "torchrun"), "--nproc-per-node", str(spec.world_size), "-m", "labkit.train",
           *megatron_args(spec)]
    proc = subprocess.Popen(cmd, cwd=workdir, env=_one_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    sampler = RunQueueWait(proc.pid)
    lines, waits = [], []  # waits: {training process: its run-queue wait so far} as each iteration's line appears
    for line in proc.stdout:
        lines.append(line)
        if "elapsed time per iteration" in line:
            waits.append({pid: w / 1e9 for pid, (_, w, cmd) in sampler.sample().items()
                          if "labkit.train" in cmd and "torchrun" not in cmd and "distributed.run" not in cmd})
    stderr = proc.stderr.read()
    proc.wait(timeout=900)
    sampler.stop()
    stdout = "".join(lines)
    iterations = parse_text(stdout).iterations
    if proc.returncode != 0 or len(iterations) <= LOOP_WARMUP or len(waits) != len(iterations):
        raise RuntimeError(f"training driver failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-2000:]}")
    elapsed = iterations.sort_values("iteration")["elapsed_ms"].to_numpy(dtype=float) / 1000
    first, last = waits[LOOP_WARMUP - 1], waits[-1]  # the steady iterations lie between these two lines
    waited = statistics.fmean(last[pid] - first[pid] for pid in last if pid in first) if first else 0.0
    steady = elapsed[LOOP_WARMUP:]
    return float(np.median(steady)), float((steady.sum() - waited) / len(steady))


def measure_cpu_loop(save: Path | None = None) -> list[dict]:
    """Profile, then run the driver, for every layout LOOP_REPEATS times; each record keeps what prediction needs."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for repeat in range(LOOP_REPEATS):
            for label, t, p, d, recompute in LOOP_LAYOUTS:
                load = wait_for_quiet()
                cpu_time_profile = measure_cpu_time_profile(t, p * d, workdir)
                measured, measured_own = run_driver(loop_spec(t, p, d, recompute), workdir)
                wall_profile, _ = measure_profile(t, p * d, workdir)
                records.append({"label": label, "layout": [t, p, d, recompute], "repeat": repeat + 1, "load": load,
                                "load_after": os.getloadavg()[0], "measured_s": measured,
                                "measured_own_cpu_s": measured_own, "wall_profile": wall_profile.to_dict(),
                                "cpu_time_profile": cpu_time_profile.to_dict()})
                if save:
                    save.write_text(json.dumps(records, indent=1))
    return records


def _loop_prediction(rec: dict, key: str) -> tuple[float, float]:
    """Predicted seconds per iteration from a saved profile, and that profile's mean forward ms per layer."""
    t, p, d, recompute = rec["layout"]
    saved = rec[key]
    fields = {k: v for k, v in saved.items() if k in Profile.__dataclass_fields__}
    fwd = saved["forward_s"]
    profile = Profile(**fields, embedding_s=fwd["embedding"], layers_s=fwd["layers"], output_s=fwd["output"])
    return (estimate(loop_spec(t, p, d, recompute), profiles={("cpu", t): profile}).iteration_time_s,
            1000 * statistics.fmean(profile.layers_s))


def report_cpu_loop(records: list[dict]) -> list[float]:
    """Predicted / measured per layout: in wall time (`labkit profile` after the run, the driver's logged times), and
    with other jobs' share of the CPUs taken out of both (the profiler's worker timed in CPU time before the run; the
    logged times less the run-queue wait of the training processes). The median over repeats of the latter scores."""
    print(f"CPU closed loop: GPT L{LOOP_MODEL['num_layers']} h{LOOP_MODEL['hidden_size']} s{LOOP_MODEL['seq_length']} "
          f"V{LOOP_MODEL['vocab_size']}, micro {LOOP_MICRO}, global {LOOP_GLOBAL}, fp32, 1 thread per process; "
          f"load = 1-minute load average before/after")
    raw: dict[str, list[float]] = {}
    own: dict[str, list[float]] = {}
    for rec in records:
        predicted, wall_ms = _loop_prediction(rec, "wall_profile")
        predicted_own, cpu_ms = _loop_prediction(rec, "cpu_time_profile")
        measured_own = rec["measured_own_cpu_s"]
        raw.setdefault(rec["label"], []).append(predicted / rec["measured_s"])
        own.setdefault(rec["label"], []).append(predicted_own / measured_own)
        print(f"  run {rec['repeat']} {rec['label']:<19} load {rec['load']:4.1f}/{rec['load_after']:4.1f}  wall: profile "
              f"{wall_ms:3.0f} ms/layer, {predicted:6.3f} vs {rec['measured_s']:6.3f} s ({predicted / rec['measured_s']:4.2f})"
              f"  own CPU time: profile {cpu_ms:3.0f} ms/layer, {predicted_own:6.3f} vs {measured_own:6.3f} s "
              f"({predicted_own / measured_own:4.2f})")
    errs = []
    for label in own:
        ratio, ratio_raw = statistics.median(own[label]), statistics.median(raw[label])
        errs.append(abs(ratio - 1))
        print(f"  {label:<20} predicted/measured, median of {len(own[label])}: {ratio:5.2f} ({100 * (ratio - 1):+6.1f}%)"
              f"   as measured, with other jobs' CPU time in: {ratio_raw:5.2f}")
    print(f"  mean |error| {100 * statistics.fmean(errs):.1f}%, max {100 * max(errs):.1f}% over {len(errs)} layouts")
    return errs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cpu", action="store_true", help="skip the CPU closed loop (it trains for minutes)")
    parser.add_argument("--verbose", action="store_true", help="print every AMP trial")
    parser.add_argument("--validate", action="store_true",
                        help="refit the AMP constants on half the trials / one cluster and score the rest (minutes)")
    parser.add_argument("--save-loop", type=Path, help="write the CPU loop's measurements (and profiles) to this JSON")
    parser.add_argument("--replay-loop", type=Path,
                        help="predict against measurements saved by --save-loop instead of measuring again")
    args = parser.parse_args(argv)
    report_amp(args.verbose)
    report_amp_by_dimension()
    report_amp_step_times()
    if args.validate:
        report_validation()
    report_fasop_gpt2_xl()
    report_published()
    if args.replay_loop:
        report_cpu_loop(json.loads(args.replay_loop.read_text()))
    elif not args.skip_cpu:
        report_cpu_loop(measure_cpu_loop(args.save_loop))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check: labkit's training driver on one GPU, each step measured beside labkit's estimate.

Run through `bash benchmarks/gpu_check.sh` (it sets up megatron-core from a wheelhouse where the machine has none).
Every run goes the way a user's does: a RunSpec -> labkit.megatron_args -> `torchrun -m labkit.train`, and its log is
read back with labkit.logs.parse. The steps:

  smoke+save     bf16, 20 iterations, a checkpoint at 10 and 20
  resume         loads the checkpoint of iteration 10; iterations 11-20 must print the same loss and grad norm
  fp16+full      fp16 (dynamic loss scale) with full recompute; the loss must fall
  selective+dist bf16, selective recompute, distributed optimizer; the loss must fall
  gpt2-large     a 774M GPT at sequence 2048 at the default timing level: ms per iteration, TFLOP/s, MFU, peak memory
  gpt2-xl        GPT-2 XL (1.56B) at sequence 1024
  llama-8l       Llama 3 8B's layer shape (GQA, SwiGLU, RMSNorm, rope, 128K vocabulary) with 8 layers, sequence 2048
  *-sdpa         gpt2-large and llama-8l again with kernels.attention_backend sdpa (PyTorch's
                 scaled_dot_product_attention: flash kernels instead of megatron-core's s x s scores); the estimate
                 beside them still charges the local attention's memory (it does not know sdpa)
  nsys           where `nsys` is on the PATH: gpt2-small with profile.nsys on rank 0 over iterations 4-5, started as a
                 job starts a profiled rank (labkit.jobs.render_profile), its rank0.sqlite read back with
                 labkit.profiling.nsys (time per kernel class, the two captured iterations)

Without a GPU (`--cpu`, or no CUDA) every step runs the tiny model on gloo (sdpa as tiny-sdpa, no nsys step): a dry run
of the check itself.
Prints one table and exits 1 if any step failed.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from labkit import catalog
from labkit.estimate import estimate
from labkit.jobs.render_profile import profiled_entrypoint
from labkit.logs.parse import parse_text
from labkit.megatron_args import megatron_args
from labkit.spec import load_spec

GIB = 2 ** 30


@dataclass
class Step:
    name: str
    spec: dict
    extra_args: list[str] = field(default_factory=list)
    timeout_s: int = 150
    needs_loss_to_fall: bool = False
    measured: bool = False
    """A speed step: its figures are compared with the estimate."""
    nsys: bool = False
    """Started under nsys as the spec's profile.nsys says; its report is read back."""


@dataclass
class Result:
    step: Step
    ok: bool
    why: str = ""
    wall_s: float = 0.0
    log: str = ""
    ms: float | None = None
    tflops: float | None = None
    peak_gib: float | None = None
    losses: dict = field(default_factory=dict)
    estimate: object = None


def spec_dict(name, gpu, model, seq, micro, global_, iters, log_interval, precision="bf16", recompute="none",
              distributed=False, attention="local", profile=None, **train):
    return {"name": name, "model": {**model, "seq_length": seq}, "precision": precision,
            "parallel": {"tensor": 1, "pipeline": 1}, "batch": {"micro": micro, "global": global_},
            "recompute": recompute, "optimizer": {"distributed": distributed, "initial_loss_scale": 65536.0},
            "train": {"iters": iters, "log_interval": log_interval, "seed": 1234, **train},
            "data": {"mock": True}, "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 1}]},
            # megatron-core's local attention, which keeps the s x s scores (the estimate's default on these GPUs,
            # auto, is Transformer Engine's flash attention), or PyTorch's scaled_dot_product_attention (sdpa, what
            # the driver's auto runs without Transformer Engine)
            "kernels": {"attention_backend": attention}, **({"profile": profile} if profile else {})}


def steps(gpu: str, on_gpu: bool, work: Path) -> list[Step]:
    tiny = {"preset": "tiny"}
    small = {"preset": "gpt2-small"} if on_gpu else tiny
    seq_small = 1024 if on_gpu else 64
    save = str(work / "ckpt")
    out = [
        Step("smoke+save", spec_dict("smoke", gpu, small, seq_small, 4, 16, 20, 1, save=save, save_interval=10)),
        Step("resume", spec_dict("resume", gpu, small, seq_small, 4, 16, 20, 1, load=save), ["--ckpt-step", "10"]),
        Step("fp16+full", spec_dict("fp16", gpu, small, seq_small, 4, 16, 20, 1, precision="fp16",
                                    recompute={"granularity": "full", "method": "uniform", "num_layers": 1}),
             needs_loss_to_fall=True),
        Step("selective+dist", spec_dict("selective", gpu, small, seq_small, 4, 16, 20, 1, recompute={"granularity": "selective"},
                                         distributed=True), needs_loss_to_fall=True),
    ]
    if on_gpu:
        llama = {"preset": "llama3-8b", "num_layers": 8}
        out += [
            Step("gpt2-large", spec_dict("gpt2-large", gpu, {"preset": "gpt2-large"}, 2048, 2, 16, 15, 5),
                 measured=True),
            Step("gpt2-large-sdpa", spec_dict("gpt2-large-sdpa", gpu, {"preset": "gpt2-large"}, 2048, 2, 16, 15, 5,
                                              attention="sdpa"), measured=True),
            Step("gpt2-xl", spec_dict("gpt2-xl", gpu, {"preset": "gpt2-xl"}, 1024, 4, 16, 15, 5), measured=True),
            Step("llama-8l", spec_dict("llama-8l", gpu, llama, 2048, 1, 8, 15, 5), measured=True),
            Step("llama-8l-sdpa", spec_dict("llama-8l-sdpa", gpu, llama, 2048, 1, 8, 15, 5, attention="sdpa"),
                 measured=True),
        ]
        if shutil.which("nsys"):
            profile = {"nsys": {"ranks": [0], "start_step": 3, "end_step": 5}}
            out.append(Step("nsys", spec_dict("nsys", gpu, small, seq_small, 4, 16, 6, 1, attention="sdpa",
                                              profile=profile), timeout_s=300, nsys=True))
    else:
        out += [Step("tiny-speed", spec_dict("tiny-speed", gpu, tiny, 64, 2, 8, 6, 3), measured=True),
                Step("tiny-sdpa", spec_dict("tiny-sdpa", gpu, tiny, 64, 2, 8, 6, 3, attention="sdpa"), measured=True)]
    return out


def run_step(step: Step, work: Path) -> Result:
    spec = load_spec(step.spec)
    flags = megatron_args(spec) + step.extra_args
    # a profiled rank starts as a job starts it: torchrun --no-python, the per-rank shell, nsys, then Python
    program = shlex.split(profiled_entrypoint(spec, "-m labkit.train", sys.executable, shlex.quote(str(work))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *program, *flags]
    log_file = work / f"{step.name}.log"
    start = time.monotonic()
    try:
        with open(log_file, "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=step.timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    text = log_file.read_text(errors="replace")
    result = Result(step, ok=code == 0, wall_s=time.monotonic() - start, log=text)
    if code is None:
        result.why = f"timed out after {step.timeout_s} s"
    elif code:
        errors = [line for line in text.splitlines() if "ERROR" in line or "Error" in line]
        result.why = f"exit {code}: " + (errors[-1][:160] if errors else text.strip().splitlines()[-1][:160])
    parsed = parse_text(text)
    it = parsed.iterations
    if len(it):
        last = it.iloc[-1]
        result.ms = float(last["elapsed_ms"])
        result.tflops = None if last["tflops_per_gpu"] != last["tflops_per_gpu"] else float(last["tflops_per_gpu"])
        result.losses = {int(r.iteration): (r.lm_loss, r.grad_norm) for r in it.itertuples()}
    if len(parsed.memory):
        result.peak_gib = float(parsed.memory["max_allocated_mb"].max()) * 2 ** 20 / GIB
    result.estimate = estimate(spec)
    if result.ok and step.nsys:
        check_nsys(result, work / "nsys" / "rank0.sqlite", spec)
    if result.ok and step.needs_loss_to_fall:
        losses = [loss for loss, _ in result.losses.values() if loss == loss]
        if len(losses) < 2 or not losses[-1] < losses[0]:
            result.ok, result.why = False, f"the loss did not fall: {losses[:1]} -> {losses[-1:]}"
    return result


def check_nsys(result: Result, report: Path, spec) -> None:
    """The capture holds the two iterations of profile.nsys's range, and kernels of each class it ran."""
    from labkit.profiling import nsys

    try:
        loaded = nsys.load(report)
    except (FileNotFoundError, ValueError) as exc:
        result.ok, result.why = False, str(exc)
        return
    steps = nsys.steps(loaded)
    first, last = spec.profile.nsys.start_step + 1, spec.profile.nsys.end_step
    if steps["iteration"].tolist() != list(range(first, last + 1)):
        result.ok, result.why = False, f"captured iterations {steps['iteration'].tolist()}, not {first}-{last}"
        return
    classes = nsys.kernel_time(loaded)
    print(classes[classes["time_ms"] > 0].to_string(index=False), flush=True)
    print(steps.to_string(index=False), flush=True)
    shares = ", ".join(f"{c} {s:.0%}" for c, s in zip(classes["class"], classes["share"]) if s >= 0.01)
    result.why = f"iterations {first}-{last} captured in {report.name}: {shares}"


def check_resume(full: Result, resumed: Result) -> None:
    """Iterations 11-20 of the resumed run print what the uninterrupted run printed, bit for bit."""
    if not (full.ok and resumed.ok):
        return
    expected = {i: v for i, v in full.losses.items() if i > 10}
    got = {i: v for i, v in resumed.losses.items() if i > 10}
    if sorted(got) != list(range(11, 21)) or got != expected:
        differ = [i for i in expected if got.get(i) != expected[i]]
        resumed.ok = False
        resumed.why = (f"iterations {differ[:5]} differ from the uninterrupted run: "
                       f"{[got.get(i) for i in differ[:2]]} vs {[expected[i] for i in differ[:2]]}")
    else:
        resumed.why = "iterations 11-20 equal the uninterrupted run's (loss and grad norm)"


def table(results: list[Result], peak_tflops: float) -> str:
    header = ("step", "status", "wall s", "ms/iter", "est ms", "TFLOP/s", "est TFLOP/s", "MFU", "est MFU",
              "peak GiB", "est GiB", "note")
    rows = [header]
    for r in results:
        e = r.estimate
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        mfu = None if r.tflops is None or not peak_tflops else r.tflops / peak_tflops
        est_mfu = None if e is None or not peak_tflops else e.megatron_logged_tflops_per_gpu / peak_tflops
        rows.append((r.step.name, "ok" if r.ok else "FAILED", f"{r.wall_s:.0f}", fmt(r.ms, ".1f"),
                     fmt(e and e.iteration_time_s * 1000, ".1f"), fmt(r.tflops, ".1f"),
                     fmt(e and e.megatron_logged_tflops_per_gpu, ".1f"), fmt(mfu, ".1%"), fmt(est_mfu, ".1%"),
                     fmt(r.peak_gib, ".1f"), fmt(e and e.memory_gb_per_stage[0], ".1f"), r.why[:90]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    return "\n".join("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run: the tiny model on gloo, even with a GPU")
    parser.add_argument("--keep", default=None, help="keep the logs and checkpoints in this directory")
    parser.add_argument("--only", nargs="*", default=None, help="run only these steps")
    opts = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not opts.cpu
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    gpu = (catalog.resolve_gpu_name(device) or "H100-SXM") if on_gpu else "cpu"
    peak = catalog.gpu(gpu).peak("bf16") if on_gpu else 0.0
    print(f"device: {device} (catalog: {gpu}, bf16 peak {peak} TFLOP/s); torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; Python {sys.version.split()[0]}", flush=True)
    if not on_gpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(opts.keep or tempfile.mkdtemp(prefix="labkit-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Result] = {}
    started = time.monotonic()
    for step in steps(gpu, on_gpu, work):
        if opts.only and step.name not in opts.only:
            continue
        result = run_step(step, work)
        results[step.name] = result
        fused = re.search(r"^> fused kernels: (.*)$", result.log, re.M)
        print(f"{step.name}: {'ok' if result.ok else 'FAILED'} in {result.wall_s:.0f} s"
              f"{'' if result.ok else ' - ' + result.why}", flush=True)
        if fused and step.name == "smoke+save":
            print(f"  fused kernels: {fused.group(1)}", flush=True)
        if not result.ok:
            print("  last lines of its log:\n    " + "\n    ".join(result.log.strip().splitlines()[-8:]), flush=True)
    if "smoke+save" in results and "resume" in results:
        check_resume(results["smoke+save"], results["resume"])
    print(f"\nGPU check on {device}, {time.monotonic() - started:.0f} s in all (logs in {work}):")
    print(table(list(results.values()), peak))
    failed = [name for name, r in results.items() if not r.ok]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print("all steps passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

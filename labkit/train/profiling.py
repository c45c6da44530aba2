"""TensorBoard scalars (Megatron-LM's tag names) and torch.profiler traces for chosen steps and ranks."""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.train.megatron_log import MB, memory_figures


class TensorBoard:
    """Writes on the rank that prints the iteration lines; every other rank holds no writer."""

    def __init__(self, args, is_writer_rank: bool):
        self.args = args
        self.writer = None
        if args.tensorboard_dir and is_writer_rank:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)

    def iteration(self, iteration: int, samples: int, lr: float, losses: dict[str, float], loss_scale: float,
                  grad_norm: float | None) -> None:
        w = self.writer
        if w is None or iteration % self.args.tensorboard_log_interval:
            return
        w.add_scalar("learning-rate", lr, iteration)
        w.add_scalar("learning-rate vs samples", lr, samples)
        w.add_scalar("batch-size", self.args.global_batch_size, iteration)
        for key, value in losses.items():
            w.add_scalar(key, value, iteration)
            w.add_scalar(key + " vs samples", value, samples)
        w.add_scalar("loss-scale", loss_scale, iteration)
        if grad_norm is not None:
            w.add_scalar("grad-norm", grad_norm, iteration)
        if self.args.log_memory_to_tensorboard:
            figures, _ = memory_figures()
            w.add_scalar("mem-reserved-bytes", figures["reserved"] * MB, iteration)
            w.add_scalar("mem-allocated-bytes", figures["allocated"] * MB, iteration)
            w.add_scalar("mem-max-allocated-bytes", figures["max allocated"] * MB, iteration)

    def interval(self, iteration: int, elapsed_s: float, throughput: float | None) -> None:
        w = self.writer
        if w is None or not self.args.log_timers_to_tensorboard:
            return
        w.add_scalar("iteration-time", elapsed_s, iteration)
        if throughput is not None:
            w.add_scalar("throughput", throughput, iteration)

    def validation(self, iteration: int, samples: int, losses: dict[str, float]) -> None:
        w = self.writer
        if w is None:
            return
        for key, value in losses.items():
            w.add_scalar(f"{key} validation", value, iteration)
            w.add_scalar(f"{key} validation vs samples", value, samples)
            if self.args.log_validation_ppl_to_tensorboard:
                ppl = math.exp(min(20, value))
                w.add_scalar(f"{key} validation ppl", ppl, iteration)
                w.add_scalar(f"{key} validation ppl vs samples", ppl, samples)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def profile_dir(args) -> Path:
    return Path(args.tensorboard_dir or args.save or "profile")


class StepProfiler:
    """--profile over the steps whose 0-based index is in [--profile-step-start, --profile-step-end), i.e. the
    iterations numbered start+1 .. end in the log, on --profile-ranks, as Megatron-LM's training loop runs it
    (megatron/training/training.py, train): on GPUs the CUDA profiler's capture range, opened before the first step
    and closed after the last (torch.cuda.profiler.start/stop, cudaProfilerStart/Stop), which `nsys profile
    --capture-range=cudaProfilerApi` and `ncu --profile-from-start off` record (NVIDIA's Nsight Systems and Nsight
    Compute user guides); with --use-pytorch-profiler, or on CPUs, which have no CUDA profiler, torch.profiler, whose
    Chrome trace (and, where torch can build one, memory timeline) per rank goes into the tensorboard directory
    (else --save, else ./profile). Each profiled step is an NVTX range named `iteration N` on GPUs, which
    `labkit profile nsys` reads the steps from."""

    def __init__(self, args):
        self.args = args
        self.enabled = args.profile and dist.get_rank() in args.profile_ranks
        self.cuda_range = self.enabled and torch.cuda.is_available() and not args.use_pytorch_profiler
        self.capturing = False
        self.profiler = None

    def before_step(self, step_index: int) -> None:
        if self.cuda_range and step_index == self.args.profile_step_start:
            torch.cuda.synchronize()  # the range holds whole steps: nothing launched before it runs inside it
            torch.cuda.profiler.start()
            self.capturing = True
            print(f"> CUDA profiler range opened before iteration {step_index + 1} on rank {dist.get_rank()}",
                  flush=True)
        elif self.enabled and not self.cuda_range and step_index == self.args.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            steps = self.args.profile_step_end - self.args.profile_step_start
            # The schedule marks each step (ProfilerStep#N spans, which TensorBoard's profiler view reads) and hands
            # the finished profile to `_export` after the last one.
            self.profiler = torch.profiler.profile(
                activities=activities, record_shapes=True, profile_memory=True, with_stack=True,
                schedule=torch.profiler.schedule(wait=0, warmup=0, active=steps, repeat=1),
                on_trace_ready=self._export)
            self.profiler.start()
        if self.capturing:
            torch.cuda.nvtx.range_push(f"iteration {step_index + 1}")

    def after_step(self, steps_done: int) -> None:
        if self.capturing:
            torch.cuda.nvtx.range_pop()
            if steps_done == self.args.profile_step_end:
                self.finish()
            return
        if self.profiler is None:
            return
        self.profiler.step()
        if steps_done == self.args.profile_step_end:
            self.finish()

    def finish(self) -> None:
        if self.capturing:
            self.capturing = False
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"> CUDA profiler range closed after iteration {self.args.iteration} on rank {dist.get_rank()}",
                  flush=True)
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()

    def _export(self, profiler) -> None:
        out = profile_dir(self.args)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"rank{dist.get_rank()}_steps{self.args.profile_step_start + 1}-{self.args.profile_step_end}"
        trace = out / f"{stem}.pt.trace.json"
        profiler.export_chrome_trace(str(trace))
        written = [trace]
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        try:
            timeline = out / f"{stem}.memory_timeline.json"
            profiler.export_memory_timeline(str(timeline), device=device)
            written.append(timeline)
        except Exception as exc:  # the memory timeline is optional in torch and fails on some op mixes
            print(f"WARNING: no memory timeline from torch.profiler on rank {dist.get_rank()}: {exc}", flush=True)
        print(f"> torch.profiler trace of iterations {self.args.profile_step_start + 1}-{self.args.profile_step_end} "
              f"on rank {dist.get_rank()}: {', '.join(os.fspath(p) for p in written)}", flush=True)




NVTX_RANGES = {"forward-compute": "forward", "backward-compute": "backward", "optimizer": "optimizer"}
"""megatron-core's timers -> the NVTX range each opens on GPUs: the pipeline schedules time every micro-batch's
forward and backward step with these names (megatron/core/pipeline_parallel/schedules.py, forward_step and
backward_step) and the driver its optimizer step, whatever --timing-log-level prints."""


class _NvtxTimer:
    """One of megatron-core's timers that also opens an NVTX range while it runs."""

    def __init__(self, timer, range_name: str):
        self.timer, self.range_name = timer, range_name

    def start(self, barrier=False):
        torch.cuda.nvtx.range_push(self.range_name)
        self.timer.start(barrier=barrier)

    def stop(self, barrier=False):
        self.timer.stop(barrier=barrier)
        torch.cuda.nvtx.range_pop()

    def __getattr__(self, name):
        return getattr(self.timer, name)


def nvtx_timers(timers_class):
    """megatron-core's Timers class with NVTX ranges for the forward, backward and optimizer steps (NVTX_RANGES) on
    GPUs, which Nsight Systems shows on the timeline and `labkit profile nsys` reads; torch.cuda.nvtx needs a CUDA
    build, so on CPUs the class is returned unchanged."""
    if not torch.cuda.is_available():
        return timers_class

    class NvtxTimers(timers_class):
        def __call__(self, name, log_level=None):
            timer = super().__call__(name, log_level)
            return _NvtxTimer(timer, NVTX_RANGES[name]) if name in NVTX_RANGES else timer

    return NvtxTimers

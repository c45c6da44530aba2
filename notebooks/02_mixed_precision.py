# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 02: Mixed precision: fp16 and bf16 against the fp32 baseline
#
# **Objectives.** By the end of this lab you can
# - predict what 16-bit training changes before running it: bytes per parameter, activation memory, and speed on a
#   GPU with tensor cores;
# - train the baseline, fp16 and bf16 side by side (the same spec, only `precision` changed) and compare their
#   iteration time, memory and loss;
# - explain mixed precision's dynamic loss scale: which 16-bit format needs one, why it starts at $2^{32}$, why it
#   falls, and why iterations are skipped while it falls (and count them before reading the log);
# - read the profiler: the share of time in matrix multiplications and the memory kept for the backward pass, and
#   open the runs in TensorBoard.
#
# This is section 4.1 of the NVIDIA DLI workshop *Model Parallelism: Building and Deploying Large Neural Networks*
# (`--fp16` added to `GPT_ARGS`), with `bf16` beside it.

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
iterations = 20          # keep 20 or more: one of the runs logs no loss for its first iterations (2.4 says why)
log_interval = 1
predict_on = "A100-80GB"  # a GPU with tensor cores, for the predictions

# %%
import math
import time
from pathlib import Path

import pandas as pd
import torch

from labkit.estimate.compare import compare
from labkit.estimate.memory import bytes_per_param
from labkit.answer_key import check
from labkit.diagrams import show
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.sweep import Sweep, profiled
from labkit.messages import say
from labkit.paths import example, shipped_corpus
from labkit.logs.loss_scale import loss_scale_history, skipped_until
from labkit.logs.views import comparison_table, iteration_time_figure, loss_figure
from labkit.profiling import tensorboard
from labkit.profiling import views as profile_views
from labkit.spec import load_spec

# %% [markdown]
# ## 2.1 Predict first
#
# Mixed precision keeps a 16-bit copy of the weights for the forward and backward passes and an fp32 master copy for
# the optimizer. Per parameter, with Adam (Megatron's accounting):
#
# | precision | weights | gradients | optimizer state | total |
# |---|---|---|---|---|
# | fp32 | 4 | 4 | 8 (m, v) | 16 |
# | bf16 | 2 | 4 (fp32) | 12 (fp32 master, m, v) | 18 |
# | fp16 | 2 | 2 | 16 (fp32 master and gradient, m, v) | 20 |
#
# The fp16 row's fp32 gradient copies live only through the optimizer step: the next iteration's `zero_grad` frees
# them before its forward, so at the peak they share the memory the activations use rather than adding to it.
#
# So the *model state* grows; what shrinks is the activations, stored in 16 bits. Which wins depends on the model
# and the batch: for the workshop's GPT-2-sized model labkit's estimate says memory *falls* with fp16 (the halved
# activations outweigh the larger model state), yet the NVIDIA DLI workshop "Model Parallelism" reported its peak
# rising from about 10 GB to 12 GB. The difference is memory the estimate does not itemise (the allocator's cache, the
# loss-scaling and 16-bit copies made during the step): one reason to measure, not only to estimate.

# %% tags=["nbval-check-output"]
for precision in ("fp32", "bf16", "fp16"):
    weight, grad, optimizer = bytes_per_param(precision)
    print(f"{precision}: {weight:g} + {grad:g} + {optimizer:g} = {weight + grad + optimizer:g} bytes per parameter")

# %% [markdown]
# Before any estimate: what do you expect of the three runs this lab trains *on this machine's CPU*? Write your
# guesses in the cell below (a precision name each); 2.3 sets them beside labkit's estimate and the measurement.

# %% tags=["prediction"]
my_prediction = {
    "fastest here": ...,           # "fp32", "bf16" or "fp16"
    "logs no loss at first": ...,  # which precision skips its first iterations
}

# %%
base = load_spec(example(spec_file)).replace(
    **{"train.iters": iterations, "train.log_interval": log_interval}, data=shipped_corpus())
specs = {precision: base.replace(precision=precision) for precision in ("fp32", "fp16", "bf16")}
compare(specs)[["gpu", "precision", "bytes_per_param", "weights_mib", "gradients_mib", "optimizer_mib",
                "activations_mib", "total_mib", "iteration_ms"]].round(3)

# %% [markdown]
# labkit's catalog gives a CPU one placeholder peak for all three precisions, so on this machine the estimate's
# times differ only by the activation bytes each run moves, twice as many in fp32: it ranks the 16-bit runs first.
# That is a guess about the arithmetic, and CPUs differ. One with AVX-512 BF16 or AMX instructions (Intel Xeons
# since Cooper Lake and Sapphire Rapids, AMD since Zen 4) multiplies bf16 matrices in hardware, several times faster
# than fp32; fp16 has no such path in most CPUs and their PyTorch builds, which convert it in software, often ten
# times slower or more. What does this machine have? Its instruction flags, and a 1024 x 1024 matrix product in each
# precision:

# %%
def matmul_ms(dtype, n=1024, budget_s=0.3):
    """The fastest of a few n x n matrix products (one, when a single product already takes budget_s)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a[:64, :64] @ b[:64, :64]  # the first call picks the kernel
    times = []
    while len(times) < 5 and sum(times) < budget_s:
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


cpuinfo = Path("/proc/cpuinfo")
flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
bf16_hardware = sorted(flags & {"avx512_bf16", "amx_bf16"})
fp16_hardware = sorted(flags & {"avx512_fp16", "amx_fp16"})
print(say("lab02.cpu_flags", bf16=", ".join(bf16_hardware) or say("lab02.none"),
          fp16=", ".join(fp16_hardware) or say("lab02.none"))
      if cpuinfo.exists() else say("lab02.no_cpuinfo"))
matmul = {name: matmul_ms(getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[name]))
          for name in ("fp32", "bf16", "fp16")}
for name, ms in matmul.items():
    print(say("lab02.matmul_speed", name=name, ms=ms, speedup=matmul["fp32"] / ms))

# %% [markdown]
# Where bf16 beat fp32 above, the CPU multiplies bf16 in hardware; where both 16-bit products were slower, it
# converts them in software, and the 16-bit training runs below will be slower than fp32 whatever the estimate
# says. On a GPU with tensor cores both 16-bit formats run several times faster than fp32. The same layout on the
# GPU in `predict_on`:

# %%
compare(specs, gpu=predict_on)[["gpu", "precision", "iteration_ms", "samples_per_s", "total_mib"]].round(4)

# %% [markdown]
# ## 2.2 Train the three side by side
#
# One spec, three precisions. The runs are submitted together (on a laptop they share its cores, so compare them with
# each other, not with lab 01). Each is profiled for its last but one iteration, when fp16 is past its skipped ones.

# %%
jobs = backend_named(backend)
sweep = Sweep.submit(jobs, {name: profiled(spec, max(1, iterations - 1)) for name, spec in specs.items()},
                     prefix="lab02")
states = sweep.wait()
print({name: str(state) for name, state in states.items()})

# %% [markdown]
# ## 2.3 Iteration time, memory, loss

# %%
comparison_table(sweep.logs, baseline="fp32", specs=sweep.specs)[
    ["iteration_ms", "speedup", "samples_per_s", "max_allocated_mb", "precision", "warmup_excluded"]]

# %% [markdown]
# Your prediction, the estimate and the measurement side by side (the estimate's "fastest" is 2.1's matrix
# product, its "no loss at first" the loss scale's prediction of 2.4; ties are listed with "or"):

# %%
def fastest(times) -> str:
    times = dict(times)
    return " or ".join(sorted(name for name, t in times.items() if t <= min(times.values()) * 1.001))


measured_ms = comparison_table(sweep.logs)["iteration_ms"]
no_loss_first = [name for name, log in sweep.logs.items() if pd.isna(log.iterations["lm_loss"].iloc[0])]
# The catalog's one CPU peak cannot rank the precisions (2.1): the estimate of the fastest is the matrix products'.
prediction_table(my_prediction,
                 estimated={"fastest here": f"{fastest(matmul)} (2.1's matrix product)",
                            "logs no loss at first": "fp16"},
                 measured={"fastest here": fastest(measured_ms), "logs no loss at first": " or ".join(no_loss_first)})

# %% tags=["check-claim"]
if matmul["fp32"] * 2 < min(matmul["bf16"], matmul["fp16"]):  # 2.1: then the 16-bit runs train slower than fp32
    assert measured_ms["fp32"] < min(measured_ms["bf16"], measured_ms["fp16"]), measured_ms.to_dict()

# %%
iteration_time_figure(sweep.logs).show()

# %%
loss_figure(sweep.logs).show()

# %% [markdown]
# The runs train on the corpus labkit ships, so the loss falls, from about ln 730 = 6.6 (a uniform guess over the
# tokenizer, as in lab 01). fp32 and bf16 draw the same curve to two decimals: bf16 rounds every product to 8
# significant bits, but keeps fp32's range, and the fp32 master weights keep the small updates. fp16 logs no loss at
# first, then starts where the others started and follows the fp32 curve that many iterations late: a skipped
# iteration changes no weight. What the precisions change here is speed, memory and fp16's first iterations, not
# what the model learns.
#
# On a CPU without bf16 instructions fp16 and bf16 both train *slower* than fp32: the CPU converts them in
# software. With AVX-512 BF16 or AMX, bf16's matrix products run in hardware and its run can be the fastest of the
# three, while fp16 stays converted and slowest. 2.1 measured which kind of CPU this is. A GPU's tensor cores
# multiply both 16-bit formats several times faster than fp32. The log's memory line on a CPU is the
# process's resident memory, mostly PyTorch itself; on a GPU it is the CUDA allocator's, where the 16-bit
# activations show. The profiler (2.5) sees the allocations on both.
#
# fp16's loss curve starts late. Why?
#
# ## 2.4 The loss scale and the skipped iterations
#
# fp16 holds magnitudes only up to 65504; below about $6 \times 10^{-5}$ it keeps fewer and fewer significant bits
# (subnormal numbers), and below about $6 \times 10^{-8}$ a gradient becomes 0. Megatron
# multiplies the loss by a scale $S$ before the backward pass, so small gradients survive, and divides them by $S$
# before the optimizer step. Too large an $S$ overflows to `inf`: that step is **skipped** (weights untouched, counted
# in `number of skipped iterations`) and $S$ is halved. It starts at $2^{32}$ on purpose, as large as it can be, and
# falls until the scaled gradients fit; after 1000 clean steps it tries doubling again. With hysteresis 2, the first
# overflow only arms the halving.
#
# **Exercise 1.** Count before you read the log. The fp16 run of the NVIDIA DLI workshop "Model Parallelism" logged a
# loss scale of 131072 at iteration 20, starting from $2^{32}$ with hysteresis 2. How many iterations had it skipped
# by then?

# %%
answer_1 = ...

# %%
check("02.1", answer_1)

# %% [markdown]
# Now the log of this lab's fp16 run, which started from the same $2^{32}$:

# %%
history = loss_scale_history(sweep.logs["fp16"])
history

# %%
final_scale = history["loss_scale"].iloc[-1]
print(say("lab02.fp16_scale_fell", final=final_scale,
          predicted=skipped_until(base.optimizer.initial_loss_scale, final_scale),
          logged=history["skipped_total"].iloc[-1]))
print(say("lab02.bf16_scale", scale=loss_scale_history(sweep.logs["bf16"])["loss_scale"].iloc[-1],
          skipped=loss_scale_history(sweep.logs["bf16"])["skipped_total"].iloc[-1]))

# %% [markdown]
# **From scratch.** The whole dynamic loss scaler is a few lines: count overflows against the hysteresis, halve once
# it is used up, and double after `growth_interval` clean steps (restoring the hysteresis).

# %%
def my_loss_scales(overflows, scale=2.0 ** 32, hysteresis=2, growth_interval=1000, min_scale=1.0):
    """The scale after each step, given whether that step's gradients overflowed."""
    left, clean, scales = hysteresis, 0, []
    for overflow in overflows:
        if overflow:
            clean, left = 0, left - 1
            if left <= 0:
                scale = max(scale / 2, min_scale)
        else:
            clean += 1
            if clean == growth_interval:
                clean, left, scale = 0, hysteresis, scale * 2
        scales.append(scale)
    return scales


# %% [markdown]
# Checked against megatron-core's own `DynamicGradScaler` (the one the fp16 run used), on a sequence with overflows,
# clean steps and a regrowth (growth interval 3 here, to see one):

# %%
import torch
from labkit.train import cpu_compat

if not torch.cuda.is_available():
    cpu_compat.apply()  # megatron-core keeps its scale on the GPU; labkit's compatibility layer puts it on the CPU
from megatron.core.optimizer.grad_scaler import DynamicGradScaler

overflows = [True] * 5 + [False] * 3 + [True, False, True, True]
reference = DynamicGradScaler(initial_scale=2.0 ** 32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=3, hysteresis=2)
megatron_scales = []
for overflow in overflows:
    reference.update(torch.tensor(overflow))
    megatron_scales.append(float(reference.scale))
assert my_loss_scales(overflows, growth_interval=3) == megatron_scales
print([f"2^{math.log2(s):g}" for s in megatron_scales])

# %% [markdown]
# The same history as TensorBoard scalars, read back from the run's event files:

# %%
scalars = tensorboard.read_scalars(sweep.run_dirs["fp16"])
profile_views.scalars_figure(scalars, ["loss-scale"]).show()

# %% [markdown]
# ## 2.5 The profiler's view (optional)
#
# The workshop reads the PyTorch profiler in TensorBoard: the share of GPU time in tensor-core kernels, and a memory
# curve that jumps where fp16 copies are made. The same questions, from the traces of the profiled iterations:
# `matmul_share` is the share of time in matrix multiplications, `saved_mb` the memory the forward pass kept for the
# backward (activations, MiB), `peak_growth_mb` how far memory rose within a step.

# %%
traces = {name: sweep.traces(name)[0] for name in sweep.jobs}
profile_views.comparison_table(traces).round(3)

# %%
profile_views.breakdown_figure(traces).show()

# %%
profile_views.memory_figure(traces).show()

# %% [markdown]
# The 16-bit runs keep less for the backward pass (their activations are half the size; the logits stay in fp32).
# Communication here is mostly one rank waiting for the other at the gradient all-reduce, as both share this
# machine's cores with the other runs; the matmul share is of what is left. On a GPU, `tensor_core_share` would show how much
# kernel time ran on tensor cores; a CPU trace has no kernels.
#
# To browse the scalars interactively, open the run in TensorBoard. The workshop browsed its traces in TensorBoard's
# "PYTORCH_PROFILER" tab, which needs the `torch-tb-profiler` plugin that PyTorch has deprecated; open a trace file
# in [Perfetto](https://ui.perfetto.dev) instead (it reads the file in the browser; nothing is uploaded), or in
# Chrome's `chrome://tracing`.

# %%
from labkit.profiling import trace as traces_of

print(tensorboard.tensorboard_command(sweep.run_dirs["fp16"]))
print("\n".join(str(path) for path in traces_of.find_traces(sweep.run_dirs["fp16"])))

# %% [markdown]
# ## 2.6 Sharding the model state: ZeRO and Megatron's distributed optimizer
#
# Mixed precision makes the model state 16 to 20 bytes per parameter, and plain data parallelism keeps all of it on
# every GPU. ZeRO (Rajbhandari et al., [arXiv:1910.02054](https://arxiv.org/abs/1910.02054)) splits it over the $N$
# data-parallel GPUs in three stages: the optimizer state (stage 1), then the gradients (2), then the parameters (3).
# Megatron's distributed optimizer (`optimizer.distributed: true`, `--use-distributed-optimizer`) is stage 1: each
# rank keeps the fp32 master weights and Adam moments of its 1/N shard. Its communication is the same volume as the
# all-reduce it replaces: a reduce-scatter of the gradients before the step and an all-gather of the updated
# parameters after it. Stage 3 (PyTorch FSDP, DeepSpeed) gathers each layer's parameters again in the forward and the
# backward: about 1.5 times the traffic, for the least memory.

# %%
show("zero_stages")

# %%
gpus = 8
print(say("lab02.zero_heading", gpus=gpus))
# one GPU: nothing to shard
print(say("lab02.zero_replicated", per_param=sum(bytes_per_param("bf16", 1, zero_stage=1))))
for stage in (1, 2, 3):
    print(f"  ZeRO-{stage}:     {sum(bytes_per_param('bf16', gpus, zero_stage=stage)):5.2f}")

# %% [markdown]
# ZeRO's accounting is $2 + 2 + K$ bytes per parameter, $K = 12$ for mixed-precision Adam: 16-bit weights and
# gradients, fp32 master weights and two fp32 moments. Megatron's bf16 differs in one term: it keeps the gradients in
# fp32 (4 bytes, `--grad-reduce-in-bf16` makes them 2), so its replicated state is $2 + 4 + 12 = 18$ bytes and its
# distributed optimizer leaves $2 + 4 + 12/N$ (`bytes_per_param('bf16', gpus, distributed_optimizer=True)`, the
# bytes megatron-core allocates). Lab 09 runs the four stages and measures them.
#
# Sequence parallelism (Korthikanti et al., [arXiv:2205.05198](https://arxiv.org/abs/2205.05198)) shards the other
# large term, the activations, over the tensor-parallel GPUs: the LayerNorms and dropouts, which tensor parallelism
# leaves replicated, work on 1/t of the sequence each, and each of tensor parallelism's all-reduces becomes an
# all-gather plus a reduce-scatter of the same volume. Lab 07 splits a model over tensor-parallel ranks; the planner of
# lab 06 turns sequence parallelism on wherever tensor parallelism is, on GPUs.
#
# ## Exercises
#
# (Exercise 1 came in 2.4, before the log that answers it.)
#
# **Exercise 2.** Which 16-bit format trains without a loss scale? Answer `"fp16"` or `"bf16"`.

# %%
answer_2 = ...

# %%
check("02.2", answer_2)

# %% [markdown]
# **Exercise 3 (homework).** With fp16 and Megatron's distributed optimizer over 8 data-parallel GPUs, how many bytes of model
# state does each GPU keep per parameter? (`bytes_per_param` has the answer; try it by hand first.)

# %%
answer_3 = ...

# %%
check("02.3", answer_3)

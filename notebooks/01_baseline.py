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
# # Lab 01: The baseline run: write the job, submit it, watch it, read its log
#
# **Objectives.** By the end of this lab you can
# - describe a training run as a run spec and see the Slurm job script rendered from it (the hand-written `sbatch`
#   script of NVIDIA DLI's workshop *Model Parallelism*, now generated: `srun` one task per node, each starting
#   `torchrun` towards the first node);
# - submit it to a backend (the local one on a laptop, Slurm on a cluster: the same call) and follow it live;
# - read Megatron's log into a table: iteration time, loss, throughput, memory.
#
# On a laptop the job trains a tiny GPT with two CPU processes; on a cluster, set `backend = "slurm"` and a bigger
# `model` in the parameters cell and nothing else changes.

# %% tags=["parameters"]
backend = "local"       # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
iterations = 30
log_interval = 3

# %%
from labkit.answer_key import check
from labkit.estimate import estimate
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.report import format_report, report, widget
from labkit.jobs.render import render
from labkit.messages import say
from labkit.paths import example, runs_dir, shipped_corpus
from labkit.logs.derive import steady_state
from labkit.logs.views import comparison_table, loss_figure
from labkit.spec import load_spec

# %% [markdown]
# ## 1.1 The run spec
#
# One YAML file says what to train (model preset), how to split it (tensor, pipeline, data parallel), the batch, the
# precision and the cluster. Everything else (Megatron's flags, the job script, the estimate) is rendered from it.

# %%
spec = load_spec(example(spec_file)).replace(
    **{"train.iters": iterations, "train.log_interval": log_interval},
    data=shipped_corpus())  # the corpus labkit ships
print(spec.to_yaml())
print(say("lab01.layout", world_size=spec.world_size, data_parallel=spec.data_parallel,
          micro_batches=spec.num_micro_batches, micro=spec.batch.micro))

# %% [markdown]
# ## 1.2 The job script
#
# On Slurm this is what gets submitted: the workshop's script, with every value coming from the spec (and every
# user-given string shell-quoted). `labkit run SPEC --dry-run` prints the same.

# %%
script = render(spec, runs_dir() / "RUN_ID" / "logs", layout="multinode")
for name, text in script.scripts.items():
    print(f"# ===== {name} =====\n{text}")

# %% [markdown]
# Before it runs: how long do you expect one training iteration of this tiny GPT to take here, in milliseconds? Not a
# blind guess: below are the work one iteration does (its floating-point operations, forward and backward, counted
# as lab 05 will teach) and how fast this machine multiplies fp32 matrices. Work divided by speed is a floor: the
# operations between the matrix products, the optimizer step and the processes' communication come on top. 1.4 sets
# your guess beside labkit's estimate and the measurement.

# %%
import time

import torch

work = estimate(spec).flops_per_iteration
a = torch.randn(512, 512)
a @ a  # the first product picks the kernel
start = time.perf_counter()
for _ in range(10):
    a @ a
speed = 10 * 2 * 512 ** 3 / (time.perf_counter() - start)
print(say("lab01.work_and_speed", gflop=work / 1e9, gflops=speed / 1e9, ms=work / speed * 1e3))

# %% tags=["prediction"]
my_prediction = {"time per iteration (ms)": ...}  # a number

# %% [markdown]
# ## 1.3 Submit and watch
#
# `submit` returns a `Job` at once; the view below refreshes every two seconds while it runs (as `get_result.sh` in
# [FASOP's Megatron-LM scripts](https://github.com/AvatarHwang/FASOP) does: per-node logs, the job's own view of its
# layout compared with the spec, iterations so far).

# %%
jobs = backend_named(backend)
job = jobs.submit(spec)
job

# %% tags=["nbval-ignore-output", "widgets"]
widget(job)

# %%
state = job.wait(progress=False)
print(f"{job.job_id}: {state}")
assert str(state) == "COMPLETED", job.cause()

# %% [markdown]
# ## 1.4 Read the log
#
# The driver writes Megatron-LM's own log format, so the same parser reads this run and any Megatron run on a
# cluster. `job.result()` parses every node's log.

# %%
log = job.result()
log.iterations[["iteration", "elapsed_ms", "lm_loss", "lr", "global_batch_size", "grad_norm"]]

# %%
loss_figure({"baseline": log}).show()

# %% [markdown]
# The loss falls from about ln 730 = 6.6, a uniform guess over the corpus tokenizer's 730 tokens: the spec trains on
# the small corpus labkit ships (`labkit/data/corpus/`, tokenised; lab 08 builds it). The tiny model learns its most
# frequent tokens within these few iterations. With `data: {mock: true}` (the example spec's own setting) it would
# see random tokens, and its loss would stay at ln 1024 = 6.93 however long it trained: mock data measures speed and
# memory without a dataset, and nothing else.

# %% [markdown]
# The run in one row: steady iteration time, throughput and memory. `tflops_per_gpu` is the model's FLOPs per second
# per process (the log's own figure rounds to 0.0 for a model this small, and `tflops_source` says which was used);
# `mfu` stays empty on a CPU, which has no published peak to divide by. On a GPU both are filled in (lab 05).

# %%
comparison_table({"baseline": log}, specs={"baseline": spec})

# %%
prediction_table(my_prediction, estimated={"time per iteration (ms)": estimate(spec).iteration_time_s * 1e3},
                 measured={"time per iteration (ms)": steady_state(log.iterations).iteration_ms})

# %%
print(format_report(report(job), color=False))

# %% [markdown]
# The first iterations are slower (warm-up: memory allocation, first data reads); the steady-state time excludes
# them. labkit's estimate above prices a CPU at the catalog's placeholder peak, not at the speed 1.2 measured, so on
# a CPU it can sit far from the measurement, even below the work / speed floor; lab 06 replaces the placeholder with
# a profile measured here. Lab 02 starts from this baseline.
#
# ## Exercise
#
# **Exercise 1.** Build a spec from `spec` that keeps the micro-batch of 2 and the two processes but trains on a
# global batch of 16. How many micro-batches does each process now run per iteration? (Use `spec.replace(...)` with
# the dotted key `"batch.global"`.)

# %%
answer_1 = ...

# %%
check("01.1", answer_1)

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
# # Lab 00: Setup: what is installed, where jobs run, a first tiny job
#
# **Objectives.** By the end of this lab you can
# - check the software the labs use (PyTorch, megatron-core, labkit) and whether a GPU is visible;
# - tell which backend runs your jobs: `local` (processes on this machine), or `slurm` (labkit's local Slurm with
#   emulated nodes, or a real cluster);
# - list the cluster's nodes and GPUs with `sinfo`, as the NVIDIA DLI workshop *Model Parallelism* does;
# - submit a first tiny training job and read its last lines.

# %% tags=["parameters"]
backend = "local"
iterations = 4

# %%
import shutil
from importlib.metadata import version

import torch

from labkit.answer_key import check
from labkit.jobs import backend_named, default_backend
from labkit.paths import example
from labkit.spec import load_spec

# %% [markdown]
# ## 0.1 Software

# %%
for package in ("torch", "megatron-core", "labkit", "jupyterlab", "ipywidgets", "plotly"):
    print(f"{package:>14} {version(package)}")
print(f"{'GPU':>14} {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none: training runs on CPU'}")

# %% [markdown]
# ## 0.2 Where jobs run
#
# `default_backend()` looks only for the `sbatch` command: where it exists, the default is Slurm, whether or not a
# Slurm controller answers; elsewhere it is local, which runs the same `torchrun` command as local processes, with
# the same job API and log layout. This lab does not use the default: it uses the backend in its parameters cell.

# %%
print(f"default backend here: {default_backend().name}; this lab uses: {backend}")

# %% tags=["check-claim"]
assert default_backend().name == ("slurm" if shutil.which("sbatch") else "local"), "0.2 says the default follows sbatch"

# %% [markdown]
# ## 0.3 The cluster's nodes and GPUs
#
# `sinfo` lists Slurm's nodes with their generic resources (`gpu:TYPE:N`). labkit's local Slurm (`make slurm-up`)
# emulates one a100 node and three a10 nodes on this machine. With Slurm installed but its controller stopped, the
# default backend is still Slurm and a job submitted to it fails: choose `backend_named("local")` (or `--backend
# local`) then.

# %%
import subprocess

nodes = subprocess.run(["sinfo", "-N", "-o", "%N %P %c %G %T"], capture_output=True, text=True) \
    if shutil.which("sinfo") else None
if nodes is None:
    print("no Slurm on this machine: the default backend is local")
elif nodes.returncode != 0:
    print("Slurm is installed but its controller does not answer (start labkit's with `sudo make slurm-up`): "
          "the default backend is still slurm; run jobs with the local backend until it answers")
else:
    print(nodes.stdout)

# %% [markdown]
# ## 0.4 A first tiny job
#
# The embedded default spec trains a two-layer GPT with two processes on mock tokens.

# %%
spec = load_spec(example("tiny-cpu.yaml")).replace(
    **{"train.iters": iterations, "train.log_interval": 1})
job = backend_named(backend).submit(spec)
state = job.wait(progress=False)
print(f"{job}: {state}")
assert str(state) == "COMPLETED", job.cause()

# %%
for node, files in job.tail(lines=4).items():
    print(f"==> {node} <==")
    print("\n".join(files.get("out", [])))

# %% [markdown]
# The last lines are Megatron's: an iteration line (time, loss, learning rate) and the timers. Lab 01 reads them
# into a table.
#
# ## Exercise
#
# **Exercise 1.** Which backend would run your jobs on a machine where `sbatch` is installed, if you did not choose
# one? Answer `"local"` or `"slurm"`.

# %%
answer_1 = ...

# %%
check("00.1", answer_1)

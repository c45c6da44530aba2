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
# # Lab 09: A Slurm primer: the commands under `labkit run`
#
# **Objectives.** By the end of this lab you can
# - read a cluster's nodes, partitions and typed GPUs with `sinfo`;
# - write a batch script, submit it with `sbatch`, follow it with `squeue` and read how it ended with `sacct`;
# - start one task per node inside a job with `srun`, and ask for GPUs by type with `--gres=gpu:TYPE:N`;
# - stop a job with `scancel`, and name the job states (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT,
#   NODE_FAIL);
# - recognise each of these steps in the script `labkit run` renders.
#
# Every command runs against a real Slurm: labkit's local one (`make slurm-up`, one a100 node and three a10 nodes
# emulated on this machine) or your cluster's. Without Slurm the cells say so and the lab still runs.

# %% tags=["parameters"]
gpu_type = "a10"    # a GPU type the cluster's nodes have (sinfo's GRES column)
wait_s = 120        # the longest a cell waits for a job

# %%
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from labkit.answer_key import check
from labkit.jobs.render import render
from labkit.paths import example
from labkit.spec import load_spec

have_slurm = all(shutil.which(tool) for tool in ("sinfo", "sbatch", "squeue", "scancel"))
have_slurm = have_slurm and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
workdir = Path(tempfile.mkdtemp(prefix="slurm-primer-"))


def sh(command: str) -> str:
    """Run a shell command in the lab's directory and show what it printed."""
    done = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=workdir)
    print(f"$ {command}\n{done.stdout}{done.stderr}".rstrip())
    return done.stdout.strip()


def wait_until_gone(job_id: str) -> None:
    """Poll squeue until the controller no longer lists the job as waiting or running."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        if not state.strip() or state.strip() in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            return
        time.sleep(0.5)


print("Slurm is running here" if have_slurm else "no Slurm here: start labkit's with `sudo make slurm-up`, then "
      "run this lab again")

# %% [markdown]
# ## 9.1 The cluster: `sinfo`
#
# Slurm's controller (`slurmctld`) knows every node; a `slurmd` on each node starts the work. Nodes are grouped in
# partitions (queues). The GRES column lists generic resources, here GPUs by type: `gpu:a100:4` is four A100s.

# %%
if have_slurm:
    sh('sinfo -N -o "%N %P %c %m %G %T"')

# %% [markdown]
# ## 9.2 A batch script: `sbatch`, `squeue`, `sacct`
#
# A batch script is a shell script whose `#SBATCH` lines are options for `sbatch`: how many nodes, which GPUs, where
# the output goes. `sbatch` queues it and answers with the job's id; the job waits (PENDING) until its resources are
# free, then runs (RUNNING) on the first node it got, and ends COMPLETED (exit 0) or FAILED.

# %%
script = workdir / "hello.sbatch"
script.write_text(f"""#!/bin/bash
#SBATCH --job-name=hello
#SBATCH --nodes=1
#SBATCH --gres=gpu:{gpu_type}:1
#SBATCH --output={workdir}/hello-%j.out
echo "job $SLURM_JOB_ID on $SLURMD_NODENAME, GPUs visible: $CUDA_VISIBLE_DEVICES"
""")
print(script.read_text())
if have_slurm:
    job_id = sh(f"sbatch --parsable {script}").split(";")[0]
    sh(f'squeue -j {job_id} -o "%i %j %T %r %N"')
    wait_until_gone(job_id)
    print((workdir / f"hello-{job_id}.out").read_text())

# %% [markdown]
# `sacct` reads the accounting database (slurmdbd): how each job ended, with its exit code as `CODE:SIGNAL`. A
# cluster without accounting has `scontrol show job`, which the controller answers for a few minutes after the end.

# %%
if have_slurm:
    accounting = "accounting_storage/none" not in sh("scontrol show config | grep AccountingStorageType")
    sh(f"sacct -X -j {job_id} -o JobID,JobName,State,ExitCode,Elapsed" if accounting
       else f"scontrol show job {job_id} | grep -E 'JobState|ExitCode'")

# %% [markdown]
# ## 9.3 One task per node: `srun`
#
# Inside a job, `srun` starts tasks on the job's nodes: with `--ntasks-per-node=1`, one per node, each with its own
# `SLURM_PROCID` (0, 1, ...). labkit's scripts start torchrun this way, and torchrun starts one training process per
# GPU; the node rank torchrun gets is the task's `SLURM_PROCID`.

# %%
two_nodes = workdir / "two-nodes.sbatch"
two_nodes.write_text(f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:{gpu_type}:2
#SBATCH --output={workdir}/two-nodes-%j.out
srun bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS on $SLURMD_NODENAME sees GPUs $CUDA_VISIBLE_DEVICES"'
""")
if have_slurm:
    two_id = sh(f"sbatch --parsable {two_nodes}").split(";")[0]
    wait_until_gone(two_id)
    print((workdir / f"two-nodes-{two_id}.out").read_text())

# %% [markdown]
# ## 9.4 Waiting, cancelling, and asking for what is not there
#
# A job asks for what a node may not have: Slurm refuses it at submission when no node could ever run it (this
# cluster rejects impossible requests at once), and otherwise queues it. `squeue` shows a waiting job's reason
# (`Resources`: nodes are busy; `Priority`: others come first; `Dependency`: it waits for another job). `scancel`
# stops a job, waiting or running, and it ends CANCELLED.

# %%
if have_slurm:
    sh(f"echo '#!/bin/bash' | sbatch --parsable --nodes=1 --gres=gpu:{gpu_type}:64 --output=/dev/null")
    sleeper = sh(f"sbatch --parsable --nodes=1 --output=/dev/null --wrap 'sleep 600'").split(";")[0]
    time.sleep(1)
    sh(f'squeue -j {sleeper} -o "%i %T %r"')
    sh(f"scancel {sleeper}")
    wait_until_gone(sleeper)
    sh(f'squeue -t all -j {sleeper} -o "%i %T"')

# %% [markdown]
# A job also ends TIMEOUT (it ran past `--time`), OUT_OF_MEMORY (the kernel killed it for memory), or NODE_FAIL (a
# node went down); with `--requeue`, Slurm may put it back in the queue, and its next attempt starts over, from its
# checkpoint if it wrote one (`job.requeue` in a labkit spec).
#
# ## 9.5 What `labkit run` writes
#
# labkit renders the same commands from a run spec: the `#SBATCH` lines, one `srun` task per node running
# `torchrun`, and the training flags. `labkit run SPEC --dry-run` prints it; `backend.submit(spec)` runs `sbatch`,
# `job.status()` asks `squeue` (then `sacct`), and `job.cancel()` runs `scancel`.

# %%
spec = load_spec(example("tiny-cpu.yaml")).replace(
    cluster={"nodes": [{"gpu": "A10", "count": 2, "gpus_per_node": 1}]})
rendered = render(spec, workdir / "logs").scripts["job.sbatch"]
print("\n".join(line for line in rendered.splitlines() if line.startswith(("#SBATCH", "srun", "    bash -c"))))

# %% [markdown]
# ## Exercises
#
# **Exercise 1.** A job waits in the queue because every node with its GPUs is busy. Which state does `squeue` show
# for it? Answer with Slurm's word, in capitals.

# %%
answer_1 = ...

# %%
check("09.1", answer_1)

# %% [markdown]
# **Exercise 2.** Write the `--gres` value that asks each node for two A100 GPUs (the type as `sinfo` lists it).

# %%
answer_2 = ...

# %%
check("09.2", answer_2)

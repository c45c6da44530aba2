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
# # Lab 00: Setup and a Slurm primer: what is installed, where jobs run, the commands under `labkit run`
#
# **Objectives.** By the end of this lab you can
# - check the software the labs use (PyTorch, megatron-core, labkit) and whether a GPU is visible;
# - tell which backend runs your jobs: `local` (processes on this machine), or `slurm` (labkit's local Slurm with
#   emulated nodes, or a real cluster);
# - read a cluster's nodes, partitions and typed GPUs with `sinfo`, as the NVIDIA DLI workshop *Model Parallelism:
#   Building and Deploying Large Neural Networks* does;
# - write a batch script, submit it with `sbatch`, follow it with `squeue` and read how it ended with `sacct`;
# - start one task per node with `srun`, ask for GPUs by type with `--gres=gpu:TYPE:N`, and see a job wait (PENDING)
#   for GPUs that another job holds;
# - submit a heterogeneous job (`hetjob`): one job whose components ask for different nodes, as lab 06 does for a
#   mixed A100/A10 cluster;
# - recognise each of these steps in the script `labkit run` renders, and submit a first tiny training job.
#
# The Slurm commands run against a real Slurm: labkit's local one (`labkit slurm up`, or `make slurm-up` in a
# checkout: one a100 node and three a10 nodes emulated on this machine) or your cluster's. On your cluster, name its
# GPU types in the parameters cell as `sinfo`'s GRES column writes them (`gpu_type`, `het_gpu_types`), and a directory
# every node sees (`work_dir`); the nodes and their GPU counts come from `sinfo`. Without Slurm those cells say so and
# the lab still runs.
#
# In a workshop, a section or exercise headed *(optional)* is read if the class has time, and one headed *(homework)*
# after the session; run every cell all the same, since later cells may use what earlier ones computed.

# %% tags=["parameters"]
backend = "local"   # where the first training job runs: "local" or "slurm"
iterations = 4
gpu_type = "a10"    # the GPU type the Slurm cells ask for (sinfo's GRES column; one it lists stands in if not)
het_gpu_types = ["a100", "a10"]  # the hetjob's components (0.7): one node of the first type, two of the second
work_dir = None     # where the batch scripts and their output go: a directory every node sees (None: a new one in
                    # this machine's temporary directory, which is enough for labkit's local Slurm)
wait_s = 120        # the longest a cell waits for a job

# %%
import re
import shutil
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

from labkit.answer_key import check
from labkit.jobs import backend_named, default_backend
from labkit.jobs.render import render
from labkit.messages import say
from labkit.paths import example
from labkit.spec import load_spec

# %% [markdown]
# ## 0.1 Software

# %%
for package in ("torch", "megatron-core", "labkit", "jupyterlab", "ipywidgets", "plotly"):
    print(f"{package:>14} {version(package)}")
print(f"{'GPU':>14} {torch.cuda.get_device_name(0) if torch.cuda.is_available() else say('lab00.no_gpu')}")

# %% [markdown]
# ## 0.2 Where jobs run
#
# `default_backend()` looks only for the `sbatch` command: where it exists, the default is Slurm, whether or not a
# Slurm controller answers; elsewhere it is local, which runs the same `torchrun` command as local processes, with
# the same job API and log layout. With Slurm installed but its controller stopped, a job submitted to the default
# fails: choose `backend_named("local")` (or `--backend local`) then. This lab's training job does not use the
# default: it uses the backend in its parameters cell.

# %%
print(say("lab00.backends", default=default_backend().name, backend=backend))

# %% tags=["check-claim"]
assert default_backend().name == ("slurm" if shutil.which("sbatch") else "local"), "0.2 says the default follows sbatch"

# %%
have_slurm = all(shutil.which(tool) for tool in ("sinfo", "sbatch", "squeue", "scancel"))
have_slurm = have_slurm and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
workdir = Path(tempfile.mkdtemp(prefix="slurm-primer-", dir=work_dir))
GRES_GPUS = re.compile(r"gpu:(?:([^:,(\s]+):)?(\d+)")  # gpu:a100:4, gpu:a100:4(S:0-1), or untyped: gpu:8


def cluster_gpus() -> dict[str, dict[str, int]]:
    """The GPUs sinfo lists, by type: {type: {node: its GPUs of that type}}, idle nodes first, over the nodes of the
    default partition (of every partition when none is marked default) that can take jobs; untyped GPUs are under
    the type ""."""
    listed = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %P %G %T"], capture_output=True, text=True).stdout
    rows = [row for row in (line.split() for line in listed.splitlines()) if len(row) == 4
            and not re.match(r"(down|drain|fail|maint|inval|unk|future|reboot|power)", row[3]) and row[3][-1] != "*"]
    rows = [row for row in rows if row[1].endswith("*")] or rows
    gpus = {}
    for node, _, gres, state in sorted(rows, key=lambda row: not row[3].startswith("idle")):
        for kind, count in GRES_GPUS.findall(gres):
            gpus.setdefault(kind, {}).setdefault(node, int(count))
    return gpus


def gres(kind: str, count: int) -> str:
    """The --gres value that asks a node for `count` GPUs of a type."""
    return f"gpu:{kind}:{count}" if kind else f"gpu:{count}"


def sh(command: str) -> str:
    """Run a shell command in the lab's directory and show what it printed."""
    done = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=workdir)
    print(f"$ {command}\n{done.stdout}{done.stderr}".rstrip())
    return done.stdout.strip()


def job_state(job_id: str) -> str:
    """The job's state as squeue reports it ("" once the controller no longer lists it)."""
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def wait_until(job_id: str, states: tuple[str, ...]) -> str:
    """Poll squeue until the job is in one of `states` (or gone), for at most wait_s seconds."""
    deadline = time.monotonic() + wait_s
    while (state := job_state(job_id)) and state not in states and time.monotonic() < deadline:
        time.sleep(0.5)
    return state


def wait_until_gone(job_id: str) -> bool:
    """Wait for the job to end, for at most wait_s seconds; one still queued or running then is cancelled (False)."""
    state = wait_until(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    if state in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        return True
    print(say("lab00.job_cancelled", job_id=job_id, state=state, wait_s=wait_s))
    subprocess.run(["scancel", job_id])
    return False


def output_of(job_id: str, output: Path) -> str:
    """What a batch job wrote to its output file, once it has ended."""
    ended = wait_until_gone(job_id)
    return output.read_text() if ended and output.exists() else ""


gpus = cluster_gpus() if have_slurm else {}
if not have_slurm:
    print(say("lab00.no_slurm"))
elif not gpus:
    have_slurm = False
    print(say("lab00.no_gpus_listed"))
elif gpu_type not in gpus:
    print(say("lab00.gpu_type_missing", wanted=gpu_type, used=next(iter(gpus)), types=sorted(gpus)))
    gpu_type = next(iter(gpus))

# %% [markdown]
# ## 0.3 The cluster: `sinfo`
#
# Slurm's controller (`slurmctld`) knows every node; a `slurmd` on each node starts the work. Nodes are grouped in
# partitions (queues). The GRES column lists generic resources, here GPUs by type: `gpu:a100:4` is four A100s.

# %%
if have_slurm:
    sh('sinfo -N -o "%N %P %c %m %G %T"')
    for kind, nodes in gpus.items():
        counts = say("lab00.or").join(map(str, sorted(set(nodes.values()))))
        print(say("lab00.gpu_nodes", kind=kind or say("lab00.untyped"), nodes=len(nodes), counts=counts))

# %% [markdown]
# ## 0.4 A batch script: `sbatch`, `squeue`, `sacct`
#
# A batch script is a shell script whose `#SBATCH` lines are options for `sbatch`: how many nodes, which GPUs, where
# the output goes. `sbatch` queues it and answers with the job's id; the job waits (PENDING) until its resources are
# free, then runs (RUNNING) on the first node it got, and ends COMPLETED (exit 0) or FAILED.

# %%
script = workdir / "hello.sbatch"
script.write_text(f"""#!/bin/bash
#SBATCH --job-name=hello
#SBATCH --nodes=1
#SBATCH --gres={gres(gpu_type, 1)}
#SBATCH --output={workdir}/hello-%j.out
echo "job $SLURM_JOB_ID on $SLURMD_NODENAME, GPUs visible: $CUDA_VISIBLE_DEVICES"
""")
print(script.read_text())
if have_slurm:
    job_id = sh(f"sbatch --parsable {script}").split(";")[0]
    sh(f'squeue -j {job_id} -o "%i %j %T %r %N"')
    print(output_of(job_id, workdir / f"hello-{job_id}.out"))

# %% [markdown]
# `sacct` reads the accounting database (slurmdbd): how each job ended, with its exit code as `CODE:SIGNAL`. A
# cluster without accounting has `scontrol show job`, which the controller answers for a few minutes after the end.

# %%
if have_slurm:
    accounting = "accounting_storage/none" not in sh("scontrol show config | grep AccountingStorageType")
    sh(f"sacct -X -j {job_id} -o JobID,JobName,State,ExitCode,Elapsed" if accounting
       else f"scontrol show job {job_id} | grep -E 'JobState|ExitCode'")

# %% [markdown]
# ## 0.5 One task per node: `srun`
#
# Inside a job, `srun` starts tasks on the job's nodes: with `--ntasks-per-node=1`, one per node, each with its own
# `SLURM_PROCID` (0, 1, ...). labkit's scripts start torchrun this way, and torchrun starts one training process per
# GPU; the node rank torchrun gets is the task's `SLURM_PROCID`.

# %%
# two nodes of gpu_type and two GPUs on each, or as many as this cluster's sinfo lists
nodes, per_node = (min(2, len(gpus[gpu_type])), min(2, *gpus[gpu_type].values())) if have_slurm else (2, 2)
two_nodes = workdir / "two-nodes.sbatch"
two_nodes.write_text(f"""#!/bin/bash
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gres={gres(gpu_type, per_node)}
#SBATCH --output={workdir}/two-nodes-%j.out
srun bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS on $SLURMD_NODENAME sees GPUs $CUDA_VISIBLE_DEVICES"'
""")
if have_slurm:
    two_id = sh(f"sbatch --parsable {two_nodes}").split(";")[0]
    print(output_of(two_id, workdir / f"two-nodes-{two_id}.out"))

# %% [markdown]
# ## 0.6 Waiting for GPUs, cancelling, and asking for what is not there
#
# A job that asks for more than any node has is refused at submission when no node could ever run it (labkit's local
# Slurm rejects impossible requests at once; a cluster without `EnforcePartLimits` queues them for ever, and the cell
# below cancels such a job). A job that could run, but whose GPUs another job holds, waits: `squeue` shows
# it PENDING with its reason (`Resources`: the nodes are busy; `Priority`: others come first; `Dependency`: it waits
# for another job). Below, a first job takes every GPU of one node and sleeps; a second asks for one GPU of the same
# node (`--nodelist` names it) and pends until `scancel` stops the first. The node, its GPU type and its count come
# from `gpu_type` and `sinfo`, so this works on any cluster: without `--nodelist`, Slurm would start the second job on
# another node that has a free GPU. A cancelled job ends CANCELLED.

# %%
if have_slurm:
    most = max(gpus[gpu_type].values())  # no node has more GPUs of this type
    refused = sh(f"echo '#!/bin/bash' | sbatch --parsable --nodes=1 --gres={gres(gpu_type, most + 1)} "
                 f"--output=/dev/null")
    if refused:  # a cluster that queues what no node can run: take it back
        sh(f"scancel {refused.split(';')[0]}")
    node, count = next(iter(gpus[gpu_type].items()))  # an idle node of that type, if any is, and all its GPUs
    holder = sh(f"sbatch --parsable --nodes=1 --nodelist={node} --gres={gres(gpu_type, count)} --output=/dev/null "
                f"--wrap 'sleep 600'").split(";")[0]
    wait_until(holder, ("RUNNING",))
    waiter = sh(f"sbatch --parsable --nodes=1 --nodelist={node} --gres={gres(gpu_type, 1)} --output=/dev/null "
                f"--wrap 'hostname'").split(";")[0]
    time.sleep(2)
    sh(f'squeue -j {holder},{waiter} -o "%i %T %r %b"')
    waited = job_state(waiter)
    sh(f"scancel {holder}")
    wait_until_gone(waiter)
    sh(f'squeue -t all -j {holder},{waiter} -o "%i %T"')

# %% tags=["check-claim"]
assert not have_slurm or waited == "PENDING", f"0.6 says the second job pends while the first holds the GPUs: {waited}"

# %% [markdown]
# A job also ends TIMEOUT (it ran past `--time`), OUT_OF_MEMORY (the kernel killed it for memory), or NODE_FAIL (a
# node went down); with `--requeue`, Slurm may put it back in the queue, and its next attempt starts over, from its
# checkpoint if it wrote one (`job.requeue` in a labkit spec).
#
# ## 0.7 A heterogeneous job: `hetjob` (optional)
#
# A mixed cluster trains one model over unlike nodes: in lab 06, pipeline stages on an A100 node and on A10 nodes.
# One Slurm job asks for both with components separated by `#SBATCH hetjob`; each component has its own nodes and
# GPUs, all start together, and `srun --het-group=N` starts tasks in component N (`--het-group=0,1`: in both, one
# `SLURM_PROCID` numbering across them, which is how torchrun's node ranks span the whole job). Below, one node of
# the first type in `het_gpu_types` and two of the second, each with all the GPUs `sinfo` lists for it.

# %%
# each component's type as the parameters cell names it or, where sinfo lists no such GPUs, one it lists that the
# other component has not taken; and every GPU of its nodes
het_types = []
for kind in het_gpu_types:
    het_types.append(kind if not have_slurm or kind in gpus
                     else next((other for other in gpus if other not in het_types), gpu_type))
het_nodes = [1, min(2, len(gpus[het_types[1]]) - (het_types[0] == het_types[1]))] if have_slurm else [1, 2]
het_gpus = [min(gpus[kind].values()) if have_slurm else 4 for kind in het_types]
het_ran = have_slurm and het_nodes[1] > 0
het = workdir / "het.sbatch"
het.write_text(f"""#!/bin/bash
#SBATCH --output={workdir}/het-%j.out
#SBATCH --nodes={het_nodes[0]} --ntasks-per-node=1 --gres={gres(het_types[0], het_gpus[0])}
#SBATCH hetjob
#SBATCH --nodes={het_nodes[1]} --ntasks-per-node=1 --gres={gres(het_types[1], het_gpus[1])}
srun --het-group=0,1 bash -c 'echo "task $SLURM_PROCID on $SLURMD_NODENAME sees GPUs $CUDA_VISIBLE_DEVICES"'
""")
print(het.read_text())
if have_slurm and not het_ran:
    print(say("lab00.no_hetjob", gpu=het_types[1]))
het_output = ""
if het_ran:
    het_id = sh(f"sbatch --parsable {het}").split(";")[0]
    sh(f'squeue -j {het_id} -o "%i %T %N %b"')
    het_output = output_of(het_id, workdir / f"het-{het_id}.out")
    print(het_output)

# %% tags=["check-claim"]
het_tasks = het_output.split()
assert not het_ran or {het_tasks[i + 1] for i, word in enumerate(het_tasks) if word == "task"} == {
    str(task) for task in range(sum(het_nodes))}, "0.7 says srun numbers the tasks of both components together"

# %% [markdown]
# ## 0.8 What `labkit run` writes
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
# ## 0.9 A first tiny job
#
# The embedded default spec trains a two-layer GPT with two processes on mock tokens, with the backend of the
# parameters cell.

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
# ## Exercises
#
# **Exercise 1.** Which backend would run your jobs on a machine where `sbatch` is installed, if you did not choose
# one? Answer `"local"` or `"slurm"`.

# %%
answer_1 = ...

# %%
check("00.1", answer_1)

# %% [markdown]
# **Exercise 2 (homework).** A job waits in the queue because every node with its GPUs is busy. Which state does `squeue` show
# for it? Answer with Slurm's word, in capitals.

# %%
answer_2 = ...

# %%
check("00.2", answer_2)

# %% [markdown]
# **Exercise 3 (homework).** Write the `--gres` value that asks each node for two A100 GPUs (the type as `sinfo` lists it).

# %%
answer_3 = ...

# %%
check("00.3", answer_3)

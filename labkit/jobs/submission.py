"""What must hold before a job is submitted to a backend (`labkit run`, Job.submit), beyond what `labkit validate`
checks of the spec: what the layout needs of the node groups, the CPUs Slurm gives each node's training processes,
requeue and DeepSpeed where they can run, what this machine must have installed for a local run, and the rule book
judged as the entrypoint that will run it.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from labkit.extras import install_hint
from labkit.megatron import sharding
from labkit.spec.checks import check_job, repeated_flag_errors, rule_errors
from labkit.spec.errors import quote

if TYPE_CHECKING:
    from labkit.spec.schema import RunSpec

LAYOUTS = ("multinode", "hetjob", "pair", "local", "k8s")
"""How a job lays out on a backend: one Slurm job (multinode), a heterogeneous job (hetjob), a master/slave pair of
Slurm jobs (pair), processes on this host (local), or a Kubernetes TrainJob or PyTorchJob (k8s)."""


def submission_errors(spec: RunSpec, layout: str) -> list[str]:
    """Every problem that keeps this spec from being submitted with `layout`, each naming its field and the fix:
    spec.job's own checks, then what the layout adds. The spec itself was validated when it was loaded."""
    errors = check_job(spec)
    if spec.job.requeue and layout == "pair":
        errors.append("job.requeue: a master/slave pair is two Slurm jobs that cannot be requeued together; use the "
                      "hetjob layout")
    errors += _task_cpu_errors(spec, layout)
    if layout == "local" and spec.train.wandb is not None and importlib.util.find_spec("wandb") is None:
        errors.append(install_hint("train.wandb", "wandb"))
    if sharding.of_spec(spec).implementation == sharding.DEEPSPEED:
        errors += _deepspeed_errors(spec, layout)
    if layout in ("local", "k8s") and spec.cluster is not None and spec.cluster.login:
        where = "on this host" if layout == "local" else "in kubectl's current context"
        errors.append(f"cluster.login: the {layout} backend runs the job {where}, not on {spec.cluster.login}; "
                      "submit with the Slurm backend (--backend slurm) or leave cluster.login out")
    container = spec.job.container
    if layout == "k8s" and container is not None and container.runtime in ("apptainer", "slurm"):
        errors.append(f"job.container.runtime: {container.runtime} starts a Slurm task's container, and a pod runs a "
                      "registry image with the cluster's own runtime; leave job.container.runtime out and give a "
                      "registry image (nvcr.io#nvidia/pytorch:25.04-py3)")
    groups = spec.cluster_or_default().nodes
    if layout not in LAYOUTS:
        errors.append(f"layout: {quote(layout)} is not one of {', '.join(LAYOUTS)}")
    if layout == "multinode" and len(groups) != 1:
        errors.append(f"cluster.nodes: the multinode layout needs one node group, the spec has {len(groups)}; "
                      "use the hetjob or pair layout")
    if layout in ("hetjob", "pair") and len(groups) < 2:
        errors.append(f"cluster.nodes: the {layout} layout needs several node groups; use the multinode layout")
    if layout == "pair" and len(groups) != 2:
        errors.append(f"cluster.nodes: a master/slave pair takes exactly two node groups, the spec has {len(groups)}; "
                      "use the hetjob layout")
    errors += repeated_flag_errors(spec) or rule_errors(spec, layout)
    return errors


def _task_cpu_errors(spec: RunSpec, layout: str) -> list[str]:
    """On Slurm one task per node starts torchrun, whose training processes share that task's CPUs: what
    --cpus-per-task asks (job.cpus_per_task, else the node group's cpus_per_node), or every CPU of the node with
    job.exclusive (a step uses all of the job's CPUs on a node unless srun asks for fewer; srun(1), --exact). Asking
    for neither leaves Slurm's default of one CPU per task to all of a node's processes, so it is refused."""
    if layout in ("local", "k8s") or spec.job.cpus_per_task or spec.job.exclusive:
        return []
    return [f"cluster.nodes[{i}].cpus_per_node: not given, so Slurm would give the one task that starts this group's "
            f"{group.gpus_per_node} training processes a single CPU; set it to the node's CPUs (sinfo -N -o '%N %c'), "
            "or set job.cpus_per_task, or job.exclusive: true for whole nodes"
            for i, group in enumerate(spec.cluster_or_default().nodes)
            if group.cpus_per_node is None and group.gpus_per_node > 1]


def _deepspeed_errors(spec: RunSpec, layout: str) -> list[str]:
    """At submission, optimizer.zero_backend deepspeed: which entrypoint and backend start DeepSpeed's engine."""
    opt, errors = spec.optimizer, []
    if spec.job.entrypoint == "megatron-lm":
        errors.append(f"optimizer.zero_backend: deepspeed (zero_stage {opt.zero_stage}) needs DeepSpeed's engine, "
                      "which Megatron-LM's pretrain_gpt.py does not start (Megatron-DeepSpeed is a fork of its own); "
                      "use job.entrypoint labkit, or zero_backend megatron with job.entrypoint megatron-lm")
        return errors
    if layout == "k8s":
        errors.append("optimizer.zero_backend: deepspeed reads a ds_config.json that the job script writes, and the "
                      "k8s backend's manifest has no script; submit with the slurm or local backend")
    return errors

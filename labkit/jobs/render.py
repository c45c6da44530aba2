"""Run spec -> job scripts, from the jinja2 templates in labkit/templates/.

Layouts:
  multinode  one node group: one sbatch script, one srun task per node running torchrun (node rank = SLURM_PROCID)
  hetjob     several node groups: one Slurm heterogeneous job, one component (and one srun step) per group
  pair       two node groups on clusters without hetjob support: master.sbatch + slave.sbatch, as in FASOP's heterogeneous Megatron-LM scripts
  local      the embedded backend: a bash script that plays every node on this host

Every value that comes from the user reaches the shell single-quoted (shlex.quote) and #SBATCH lines double-quoted in
sbatch's own syntax; values that cannot be written safely (a line break in a partition name, say) are rejected with a
SpecError naming the field.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

from labkit import catalog, deepspeed_config
from labkit.jobs.render_profile import profiled_entrypoint, worker_python
from labkit.jobs.submission import submission_errors
from labkit.logs import job_info as info
from labkit.megatron import sharding
from labkit.megatron_args import megatron_args
from labkit.spec import RunSpec, SpecError
from labkit.spec.checks import time_limit_seconds
from labkit.spec.errors import CONTROL_CHARS
from labkit.spec.files import is_image_file, job_start_checks


@dataclass(frozen=True)
class NodeGroupPlan:
    """One node group as the scheduler sees it: a het component, or the whole job."""
    nodes: int
    procs_per_node: int
    gres: str | None  # e.g. gpu:a100:4 (or the group's own gres); None on CPU nodes
    first_rank: int  # node rank of its first node
    gpus: str | None = None  # TYPE:N for --gpus-per-node; None on CPU nodes
    constraint: str | None = None  # Slurm node features the group needs
    cpus_per_task: int | None = None  # job.cpus_per_task, else the node's CPUs for its one task; None: Slurm's default


@dataclass(frozen=True)
class Rendered:
    layout: str
    scripts: dict[str, str]  # file name -> script text, in submission order (then ds_config.json, no script)


TASKS_PER_NODE = 1
"""srun tasks per node: one, which starts torchrun and its processes (so a task's CPUs are the node's)."""


def gres_type(gpu: str) -> str | None:
    """Slurm's GPU type for a catalog GPU: lower-case family name (A100-40GB -> a100, A10 -> a10); None for cpu."""
    name = catalog.resolve_gpu_name(gpu) or gpu
    if name.lower() == "cpu":
        return None
    return name.lower().split("-")[0]


def node_groups(spec: RunSpec) -> list[NodeGroupPlan]:
    plans, rank = [], 0
    for group in spec.cluster_or_default().nodes:
        kind = gres_type(group.gpu)
        gres = group.gres or (f"gpu:{kind}:{group.gpus_per_node}" if kind else None)
        plans.append(NodeGroupPlan(nodes=group.count, procs_per_node=group.gpus_per_node, gres=gres, first_rank=rank,
                                   gpus=f"{kind}:{group.gpus_per_node}" if kind else None,
                                   constraint=group.constraint, cpus_per_task=_cpus_per_task(spec, group)))
        rank += group.count
    return plans


def _cpus_per_task(spec: RunSpec, group) -> int | None:
    if spec.job.cpus_per_task:
        return spec.job.cpus_per_task
    return group.cpus_per_node // TASKS_PER_NODE if group.cpus_per_node else None


def default_layout(spec: RunSpec) -> str:
    return "multinode" if len(spec.cluster_or_default().nodes) == 1 else "hetjob"


def sbatch_quote(value: str) -> str:
    """A value for an #SBATCH line, in sbatch's syntax (double quotes, backslash escapes); never shell-evaluated."""
    if re.fullmatch(r"[A-Za-z0-9_.,:/=+%@-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def one_line(text: str) -> str:
    return CONTROL_CHARS.sub(" ", text)


def _arg_lines(args: list[str]) -> list[str]:
    """Training flags grouped as `--flag value...` per line, each word shell-quoted."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([])
        lines[-1].append(shlex.quote(arg))
    return [" ".join(words) for words in lines]


def job_info(spec: RunSpec) -> dict[str, str]:
    """The job-info values the scripts print into each node's log (labkit.logs.job_info.KEYS), from the spec."""
    m = spec.model
    values = {
        "NNODES": sum(g.count for g in spec.cluster_or_default().nodes), "WORLD_SIZE": spec.world_size,
        "GLOBAL_BATCH_SIZE": spec.batch.global_, "MICRO_BATCH_SIZE": spec.batch.micro,
        "TENSOR_MP_SIZE": spec.parallel.tensor, "PIPELINE_MP_SIZE": spec.parallel.pipeline,
        "DP_SIZE": spec.data_parallel, "PARTITION": spec.partition_string, "MODEL": m.preset or "custom",
        "NUM_LAYERS": m.num_layers, "HIDDEN_SIZE": m.hidden_size, "NUM_ATTENTION_HEADS": m.num_attention_heads,
        "SEQ_LENGTH": m.seq_length, "PRECISION": spec.precision,
    }
    return {key: str(values[key]) for key in info.KEYS}


def _sbatch_component(spec: RunSpec, group: NodeGroupPlan) -> list[str]:
    job, lines = spec.job, [f"--nodes={group.nodes}", "--ntasks-per-node=1"]
    if job.gpus_per_node_flag == "gpus-per-node" and group.gpus and group.gres == f"gpu:{group.gpus}":
        lines.append(f"--gpus-per-node={group.gpus}")
    elif group.gres:
        lines.append(f"--gres={sbatch_quote(group.gres)}")
    if group.constraint:
        lines.append(f"--constraint={sbatch_quote(group.constraint)}")
    if job.mem is not None:
        lines.append(f"--mem={job.mem}")
    if group.cpus_per_task:
        lines.append(f"--cpus-per-task={group.cpus_per_task}")
    if job.partition:
        lines.append(f"--partition={sbatch_quote(job.partition)}")
    if job.exclusive:
        lines.append("--exclusive")
    return lines


def _environment():
    env = jinja2.Environment(loader=jinja2.PackageLoader("labkit", "templates"), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


RENDEZVOUS = {
    "static": '--node_rank "$node_rank" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"',
    # torchrun's c10d rendezvous assigns node ranks as nodes arrive, so a restarted node can rejoin
    "c10d": '--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$JOB_ID"',
}


def entrypoint(job) -> str:
    """What torchrun runs: labkit's driver, or Megatron-LM's pretrain_gpt.py from the given checkout (same flags)."""
    if job.entrypoint == "megatron-lm":
        return shlex.quote(str(Path(job.megatron_lm) / "pretrain_gpt.py"))
    return "-m labkit.train"


def job_env(spec: RunSpec) -> dict[str, str]:
    """The job's environment: what the layout needs, its env preset's variables, then job.env over them."""
    job = spec.job
    needed = {}
    if (spec.parallel.tensor > 1 or spec.parallel.context > 1) and not sharding.of_spec(spec).fsdp:
        # One hardware queue per GPU, so that a tensor-parallel collective is issued before the GEMM it overlaps
        # (Megatron-LM asks for it whenever tensor or context parallelism is on; with Megatron-FSDP, whose
        # validate_args refuses the setting, it is left to CUDA's default).
        needed["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    preset = catalog.env_presets()[job.env_preset]["env"] if job.env_preset else {}
    return {**needed, **{k: str(v) for k, v in preset.items()}, **job.env}


def default_torchrun(spec: RunSpec) -> str:
    """The venv's torchrun outside containers (jobs run the same Python as the submitter); `torchrun` inside one."""
    if spec.job.container is not None:
        return "torchrun"
    beside = Path(sys.executable).with_name("torchrun")
    return str(beside) if beside.exists() else "torchrun"


def ds_config_path(log_dir: Path | str) -> Path:
    """Where a DeepSpeed run's config goes: its run directory (the log directory's parent), beside the job script."""
    return Path(log_dir).parent / deepspeed_config.FILE_NAME


def _task(spec: RunSpec, log_dir: Path | str) -> dict:
    # optimizer.zero_backend deepspeed: the script writes ds_config.json itself before starting any node, so that
    # every backend (and each task of an array) runs with its own spec's config
    ds = deepspeed_config.uses_deepspeed(spec)
    ds_path = ds_config_path(log_dir)
    return {"run_name": spec.name, "log_dir": str(log_dir), "info": job_info(spec),
            "train_arg_lines": _arg_lines(megatron_args(spec, ds_config=ds_path)),
            "start_checks": job_start_checks(spec),
            "ds_config": (str(ds_path), deepspeed_config.ds_config_text(spec)) if ds else None}


def render(spec: RunSpec, log_dir: Path | str, *, layout: str | None = None, run_id: str | None = None,
           torchrun: str | None = None) -> Rendered:
    """The job script(s) for one run. `log_dir` is where LOGDIR/JOBID/NODE.* go (absolute for Slurm jobs).

    Taught in labs 00 and 01.
    """
    return render_array([spec], [log_dir], layout=layout, run_ids=[run_id] if run_id else None, torchrun=torchrun)


def render_array(specs: list[RunSpec], log_dirs: list[Path | str], *, layout: str | None = None,
                 run_ids: list[str] | None = None, torchrun: str | None = None) -> Rendered:
    """One script for several runs that share a node layout and job options: a Slurm job array, task i = run i."""
    first = specs[0]
    layout = layout or default_layout(first)
    errors = submission_errors(first, layout)
    if layout == "k8s":
        errors.append("layout: k8s is a Kubernetes manifest (labkit.jobs.k8s.manifest), not a script; choose one of "
                      "multinode, hetjob, pair or local")
    if len(specs) > 1:
        if layout != "multinode":
            errors.append(f"layout: an array of runs needs the multinode layout, not {layout}")
        for i, spec in enumerate(specs[1:], 1):
            if node_groups(spec) != node_groups(first) or spec.job != first.job or spec.profile != first.profile:
                errors.append(f"specs[{i}]: an array's runs must share cluster.nodes, job and profile settings; "
                              "submit this one on its own")
    for d in dict.fromkeys(str(d) for d in log_dirs):
        if CONTROL_CHARS.search(d):
            errors.append(f"runs dir: {d!r} contains a control character (a line break?); choose another directory")
    if errors:
        raise SpecError(errors)
    groups = node_groups(first)
    job = first.job
    ids = f" {', '.join(run_ids)}" if run_ids else ""
    title = one_line(f"labkit run{ids}: {', '.join(s.name for s in specs)}")
    log_dir = Path(log_dirs[0])
    batch_output = "slurm-%A_%a.out" if len(specs) > 1 else "slurm-%j.out"
    # The job name is shown by squeue and parsed back from scontrol lines: letters, digits and . _ + - only.
    job_name = re.sub(r"[^A-Za-z0-9._+-]", "_", first.name)[:64] or "labkit"
    whole_job = [f"--job-name={job_name}",
                 f"--output={sbatch_quote(str(log_dir / batch_output))}"]
    if len(specs) > 1:
        whole_job.append(f"--array=0-{len(specs) - 1}")
    if job.account:
        whole_job.append(f"--account={sbatch_quote(job.account)}")
    if job.time_limit:
        whole_job.append(f"--time={job.time_limit}")
    if sum(g.nodes for g in groups) > 1 and layout != "pair":
        whole_job.append("--wait-all-nodes=1")  # torchrun's rendezvous needs every node booted, not just the first
    if job.requeue:
        # Warn the batch script (B:) ahead of the limit; it requeues the job (templates/node.sh.j2).
        whole_job += ["--requeue", f"--signal=B:USR1@{job.requeue_signal_s}"]
    elif job.requeue is False:
        whole_job.append("--no-requeue")
    if job.requeue is not False:  # a requeued attempt appends to slurm-JOBID.out instead of truncating it
        whole_job.append("--open-mode=append")
    whole_job += list(job.sbatch)  # as written: each was checked to be one --option on one line
    components = [_sbatch_component(first, group) for group in groups]
    components[0] = whole_job + components[0]
    if layout == "pair":  # two separate jobs: each carries the whole-job options
        components[1] = whole_job + components[1]

    container = job.container
    if container is not None and is_image_file(container.image) and not container.image.startswith("/"):
        # An image file (by its form: a path, or a .sqsh/.sif name) goes to the runtime as the absolute path
        # `labkit validate` found it at, as data paths do (pyxis reads an image that does not start with / or . as a
        # registry name); an absolute path stays as written.
        container = dataclasses.replace(container, image=os.path.abspath(os.path.expanduser(container.image)))
    mounts = []
    srun_flags = " --kill-on-bad-exit=1"
    if container is not None:
        mounts = list(container.mounts) + [f"{d}:{d}" for d in dict.fromkeys(str(d) for d in log_dirs)]
        if container.runtime == "pyxis":
            srun_flags += (f" --container-image={shlex.quote(container.image)}"
                           f" --container-mounts={shlex.quote(','.join(mounts))}")
        elif container.runtime == "slurm":
            # Slurm's own OCI support runs the task in the bundle, with the mounts its config.json lists
            # (https://slurm.schedmd.com/containers.html); the log directory must be one of them.
            mounts = []
            srun_flags += f" --container={shlex.quote(container.image)}"
    group_srun_flags = [srun_flags + (f" --cpus-per-task={g.cpus_per_task}" if g.cpus_per_task else "")
                        for g in groups]
    context = {
        "title": title, "layout": layout, "groups": groups, "tasks": [_task(s, d) for s, d in zip(specs, log_dirs)],
        "info_keys": info.KEYS, "sbatch_lines": components[0], "component_lines": components,
        "srun_flags": group_srun_flags, "container": container, "container_mounts": mounts,
        "env": job_env(first), "master_port": job.master_port, "rendezvous": RENDEZVOUS[job.rendezvous],
        "entrypoint": profiled_entrypoint(first, entrypoint(job), worker_python(torchrun or default_torchrun(first)),
                                          reports='"$LOGDIR"'),
        "gpu_monitor_interval_s": job.gpu_monitor_interval_s,
        "torchrun": torchrun or default_torchrun(first), "time_limit_s": time_limit_seconds(job.time_limit),
        "local_node_names": [f"node{i}" for i in range(sum(g.nodes for g in groups))],
        "requeue": job.requeue, "requeue_signal_s": job.requeue_signal_s,
    }
    env = _environment()
    names = {"multinode": ["job.sbatch"], "hetjob": ["job.sbatch"], "pair": ["master.sbatch", "slave.sbatch"],
             "local": ["run.sh"]}[layout]
    templates = {"multinode": ["multinode.sbatch.j2"], "hetjob": ["hetjob.sbatch.j2"],
                 "pair": ["master.sbatch.j2", "slave.sbatch.j2"], "local": ["local-run.sh.j2"]}[layout]
    scripts = {name: env.get_template(t).render(context) for name, t in zip(names, templates)}
    if len(specs) == 1 and deepspeed_config.uses_deepspeed(first):
        # shown by --dry-run and kept in the run's record; the script writes the same text where the driver reads it
        scripts[deepspeed_config.FILE_NAME] = deepspeed_config.ds_config_text(first)
    return Rendered(layout=layout, scripts=scripts)

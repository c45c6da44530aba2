"""K8sBackend: a run as a Kubeflow PyTorchJob (kubeflow.org/v1, the training operator's), applied with kubectl to the
user's current context, followed and cancelled with kubectl.

One pod per node: a Master replica (node rank 0) and, on more nodes, Worker replicas, each asking for its node's GPUs
(nvidia.com/gpu, NVIDIA's device plugin) and running the command the Slurm script runs: torchrun, the same entrypoint
(labkit.jobs.render.entrypoint), the same Megatron flags (labkit.megatron_args) and the same environment
(labkit.jobs.render.job_env). The training operator gives each pod its node rank and the master's address and port
(PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT; training-operator v1.9 pkg/controller.v1/pytorch/envvar.go), which
Kubernetes substitutes into the command's $(NAME) references. Each job.container.mounts entry SRC:DST becomes a
hostPath volume: the data must be at SRC on every node (a shared filesystem mounted on the nodes, as FSx for Lustre on
EKS).

Built as plain dicts, not with the Kubeflow training SDK's models (pip kubeflow-training 1.9.4): that SDK installs
cleanly but brings the Kubernetes Python client and ten more packages (45 MB, 3-4 s to import its models) into the base
install, which plans and renders without them, and its models check little beyond required fields. Tests validate the
dict against the PyTorchJob CRD's schema and Kubernetes' pod schema instead, which check every field. A dict rather
than a jinja2 template: yaml.safe_dump quotes every user-given string (an env value with ': ', a flag with '#'), and
the dict the tests validate is the one written.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shlex
import subprocess
from pathlib import PurePosixPath

import yaml

from labkit.jobs.job import Job
from labkit.jobs.record import RunRecord
from labkit.jobs.render import default_torchrun, entrypoint, gres_type, job_env, node_groups
from labkit.jobs.render_profile import profiled_entrypoint, profiling, worker_python
from labkit.jobs.state import State, Status
from labkit.jobs.watcher import SCHEDULER_BACKOFF
from labkit.megatron_args import megatron_args
from labkit.paths import runs_dir
from labkit.spec import RunSpec, SpecError, load_spec
from labkit.jobs.submission import submission_errors
from labkit.spec.checks import time_limit_seconds
from labkit.spec.files import container_image_file, input_paths

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
RESOURCE = "pytorchjobs.kubeflow.org"
CONTAINER = "pytorch"
"""The operator sets the rendezvous environment and finds the port only in the container of this name
(kubeflowv1.PyTorchJobDefaultContainerName)."""
PORT_NAME = "pytorchjob-port"
"""The container port the operator reads the master's port from (kubeflowv1.PyTorchJobDefaultPortName)."""
DEFAULT_PORT = 23456
"""The operator's default master port (kubeflowv1.PyTorchJobDefaultPort), used when job.master_port is unset."""
GPU_RESOURCE = "nvidia.com/gpu"
MAX_NAME = 52
"""A job name's length limit: the operator names each pod's Service JOB-worker-N, a DNS label of at most 63."""
LAYOUT = "pytorchjob"

RENDEZVOUS = {
    "static": ["--node_rank", "$(PET_NODE_RANK)", "--master_addr", "$(PET_MASTER_ADDR)",
               "--master_port", "$(PET_MASTER_PORT)"],
    "c10d": ["--rdzv-backend", "c10d", "--rdzv-endpoint", "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"],
}


class K8sError(RuntimeError):
    """kubectl refused a command; the message is kubectl's own text."""


def k8s_name(text: str) -> str:
    """A PyTorchJob name from a spec name or run id: lower-case letters, digits and '-', starting with a letter (the
    operator's Services are DNS-1035 labels), at most MAX_NAME characters (a longer one keeps a hash of the whole)."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "run"
    if not name[0].isalpha():
        name = f"run-{name}"
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(text.encode()).hexdigest()[:8]
        name = f"{name[:MAX_NAME - 9].rstrip('-')}-{digest}"
    return name


def image_reference(image: str) -> str:
    """A registry image as Kubernetes writes it: enroot's and pyxis's REGISTRY#IMAGE (nvcr.io#nvidia/pytorch:25.04-py3)
    becomes REGISTRY/IMAGE."""
    return image.replace("#", "/", 1)


def _mounts(spec: RunSpec) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """(source, destination, read-only) of each job.container.mounts entry SRC[:DST[:FLAGS]], and the errors."""
    mounts, errors = [], []
    for i, mount in enumerate(spec.job.container.mounts if spec.job.container else []):
        source, _, rest = str(mount).partition(":")
        destination, _, flags = rest.partition(":")
        destination = destination or source
        if not (source.startswith("/") and destination.startswith("/")) or "\x00" in mount:
            errors.append(f"job.container.mounts[{i}]: {mount!r} is not SRC[:DST[:ro]] with absolute paths; a pod "
                          "mounts SRC from its node at DST")
            continue
        mounts.append((source, destination, "ro" in flags.split("+")))  # pyxis joins flags with '+'
    return mounts, errors


def k8s_errors(spec: RunSpec) -> list[str]:
    """What keeps the spec from running as a PyTorchJob, each naming its field and the fix; [] when it can."""
    # No scheduler task's CPUs are asked for (a pod may use its node's CPUs), and the container, not this machine,
    # must hold what the run imports.
    errors = submission_errors(spec, "k8s")
    groups = spec.cluster_or_default().nodes
    if len(groups) > 1:
        kinds = ", ".join(f"{g.count} x {g.gpu}" for g in groups)
        errors.append(f"cluster.nodes: a PyTorchJob runs one pod template on every node, and this spec has "
                      f"{len(groups)} node groups ({kinds}); use one group, or --backend slurm (a heterogeneous job)")
    elif gres_type(groups[0].gpu) is None:
        errors.append(f"cluster.nodes[0].gpu: {groups[0].gpu!r}: each pod asks for its node's GPUs ({GPU_RESOURCE}); "
                      "give the nodes' GPU type, or run a CPU spec with --backend local")
    container = spec.job.container
    if container is None or not container.image:
        errors.append("job.container.image: a pod runs a container image; set job.container.image to a registry "
                      "image, e.g. nvcr.io#nvidia/pytorch:25.04-py3")
    elif container_image_file(spec):
        errors.append(f"job.container.image: {container.image!r} is an image file, which a pod cannot run; push it to "
                      "a registry the cluster pulls from and give its reference")
    if spec.job.requeue:
        errors.append("job.requeue: requeueing before the time limit is Slurm's (scontrol requeue); leave it out, or "
                      "use --backend slurm")
    mounts, mount_errors = _mounts(spec)
    errors += mount_errors
    if profiling(spec) and spec.profile.output_dir is None:
        errors.append("profile.output_dir: a pod's files end with it, so the nsys/ncu reports need a directory under a "
                      "job.container.mounts destination; set profile.output_dir, e.g. /fsx/profiles/RUN")
    inputs = [(f, p) for f, p in input_paths(spec) if f != "job.container.image"]
    if profiling(spec) and spec.profile.output_dir:
        inputs.append(("profile.output_dir", spec.profile.output_dir))
    inputs += [(f"train.{key}", getattr(spec.train, key)) for key in ("save", "load") if getattr(spec.train, key)]
    for field, path in inputs:
        where = PurePosixPath(os.path.normpath(path))
        if not any(where.is_relative_to(destination) for _, destination, _ in mounts):
            errors.append(f"{field}: {path!r} is not under any job.container.mounts destination, so the pods cannot "
                          "reach it; add a mount SRC:DST whose DST holds it")
    return errors


def _escape(value: str) -> str:
    """A value Kubernetes substitutes nothing into: it replaces $(NAME) in a container's command and env with the
    variable's value, and $$ with $ (k8s.io/kubernetes third_party/forked/golang/expansion)."""
    return value.replace("$", "$$")


def pytorchjob(spec: RunSpec, name: str | None = None, labels: dict[str, str] | None = None) -> dict:
    """The PyTorchJob for a spec, as a dict: one Master pod and nodes - 1 Worker pods. `name`: the job's name
    (default: from spec.name). Raises SpecError naming the fields that keep the spec from running on Kubernetes."""
    errors = k8s_errors(spec)
    if errors:
        raise SpecError(errors)
    [group] = node_groups(spec)
    job = spec.job
    name = name or k8s_name(spec.name)
    labels = {"app.kubernetes.io/name": "labkit", "app.kubernetes.io/instance": name, **(labels or {})}
    command = [default_torchrun(spec), "--nnodes", str(group.nodes), "--nproc_per_node", str(group.procs_per_node),
               *RENDEZVOUS[job.rendezvous]]
    if job.rendezvous == "c10d":
        command += ["--rdzv-id", name]
    command += [_escape(arg) for arg in shlex.split(
        profiled_entrypoint(spec, entrypoint(job), worker_python(default_torchrun(spec))))]
    mounts, _ = _mounts(spec)
    volume_mounts = [{"name": f"mount-{i}", "mountPath": destination, **({"readOnly": True} if read_only else {})}
                     for i, (_, destination, read_only) in enumerate(mounts)]
    volumes = [{"name": f"mount-{i}", "hostPath": {"path": source}} for i, (source, _, _) in enumerate(mounts)]
    # A container runtime gives /dev/shm 64 MB; NCCL's transport between a node's GPUs and PyTorch's data loader
    # workers share memory through it.
    volume_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    container = {
        "name": CONTAINER,
        "image": image_reference(job.container.image),
        "command": command,
        "args": [_escape(arg) for arg in megatron_args(spec)],
        "env": [{"name": key, "value": _escape(value)} for key, value in job_env(spec).items()],
        "ports": [{"name": PORT_NAME, "containerPort": job.master_port or DEFAULT_PORT}],
        # An extended resource's request is its limit.
        "resources": {"limits": {GPU_RESOURCE: str(group.procs_per_node)}},
        "volumeMounts": volume_mounts,
    }
    template = {"metadata": {"labels": dict(labels)}, "spec": {"containers": [container], "volumes": volumes}}
    # Never restart one pod alone: its peers' static rendezvous has passed, so the job fails and says so.
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if group.nodes > 1:
        replicas["Worker"] = {"replicas": group.nodes - 1, "restartPolicy": "Never",
                              "template": copy.deepcopy(template)}
    # cleanPodPolicy None: ended pods stay, so that their logs can still be read.
    run_policy: dict = {"cleanPodPolicy": "None"}
    deadline = time_limit_seconds(job.time_limit)
    if deadline is not None:
        run_policy["activeDeadlineSeconds"] = deadline
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "labels": labels},
            "spec": {"nprocPerNode": str(group.procs_per_node), "runPolicy": run_policy,
                     "pytorchReplicaSpecs": replicas}}


def render_pytorchjob(spec: RunSpec, name: str | None = None, labels: dict[str, str] | None = None) -> str:
    """The PyTorchJob as YAML for kubectl apply -f, under a header saying what it runs."""
    manifest = pytorchjob(spec, name, labels)
    [group] = node_groups(spec)
    header = (f"# labkit run: {spec.name}\n"
              f"# {group.nodes} pod(s), one per node, x {group.procs_per_node} process(es): Master is node rank 0.\n"
              "# Rendered from the run spec by labkit.jobs.k8s: change the spec, not this file.\n")
    return header + yaml.safe_dump(manifest, sort_keys=False, width=120)


def pytorchjob_status(manifest: dict) -> Status:
    """A PyTorchJob's state from the operator's conditions: Failed and Succeeded end it (Failed past
    runPolicy.activeDeadlineSeconds is a TIMEOUT), Running and Restarting run it, before that it is PENDING."""
    true = {c.get("type"): c for c in manifest.get("status", {}).get("conditions", []) if c.get("status") == "True"}
    for kind, state in (("Failed", State.FAILED), ("Succeeded", State.COMPLETED), ("Running", State.RUNNING),
                        ("Restarting", State.RUNNING), ("Suspended", State.PENDING), ("Created", State.PENDING)):
        if kind in true:
            message = true[kind].get("message") or true[kind].get("reason")
            if state == State.FAILED and "deadline" in (message or ""):
                state = State.TIMEOUT  # common/job.go: "active longer than specified deadline"
            return Status(state, reason=message if state.finished or state == State.PENDING else None)
    return Status(State.PENDING, reason="waiting for the training operator")


def _kubectl(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise K8sError("kubectl not found: install it and choose the cluster with `kubectl config use-context "
                       "NAME`") from None
    if check and done.returncode != 0:
        raise K8sError(done.stderr.strip() or done.stdout.strip() or f"kubectl exited with {done.returncode}")
    return done


class K8sBackend:
    """Runs a spec as a PyTorchJob in kubectl's current context (the Kubeflow training operator must be installed
    there). The context is recorded at submission: later polls and cancels ask that cluster, whatever context is
    current then."""
    name = "k8s"
    backoff = SCHEDULER_BACKOFF  # every poll is a request to the cluster's API server

    def __init__(self, runs_dir: str | os.PathLike | None = None):
        self.runs_dir = runs_dir
        self._deleted: set[str] = set()  # jobs this backend deleted: gone from the cluster, so CANCELLED

    def submit(self, spec: RunSpec | str | os.PathLike, after: Job | list[Job] | None = None) -> Job:
        """Render, record and kubectl apply one run."""
        if after:
            raise ValueError("after: a PyTorchJob cannot wait for other jobs; submit it once they have completed")
        spec = spec if isinstance(spec, RunSpec) else load_spec(spec)
        errors = k8s_errors(spec)
        if errors:
            raise SpecError(errors)
        context = _kubectl(["config", "current-context"]).stdout.strip()
        record = RunRecord.create(spec, runs_dir(self.runs_dir))
        name = k8s_name(record.run_id)
        path = record.write_script("pytorchjob.yaml", render_pytorchjob(spec, name, {"labkit/run-id": name}))
        try:
            _kubectl(["--context", context, "apply", "-f", str(path)])
        except K8sError as exc:
            record.set_status(State.FAILED, cause=f"rejected by Kubernetes: {exc}")
            raise
        record.attach(self.name, LAYOUT, [name], context=context)
        return Job(self, [name], record)

    def poll(self, jobs: list[Job]) -> dict[Job, Status]:
        """Every job's status from one kubectl get per context; none when the API server does not answer. The logs
        of a job's pods are copied into its run record (logs/NAME/POD.out) while it runs and when it ends."""
        polled: dict[Job, Status] = {}
        by_context: dict[str, list[Job]] = {}
        for job in jobs:
            by_context.setdefault(job.record.job_info.get("context", ""), []).append(job)
        for context, group in by_context.items():
            done = _kubectl(["--context", context, "get", RESOURCE, *(j.job_id for j in group), "-o", "json",
                             "--ignore-not-found"], check=False)
            if done.returncode != 0:
                continue  # the API server did not answer: keep the states we know
            found = json.loads(done.stdout) if done.stdout.strip() else {}
            items = found.get("items", [found] if found else [])
            manifests = {item["metadata"]["name"]: item for item in items}
            for job in group:
                if job.job_id in manifests:
                    polled[job] = pytorchjob_status(manifests[job.job_id])
                    if polled[job].state != State.PENDING:
                        self._copy_logs(job, context)
                elif job.job_id in self._deleted:
                    polled[job] = Status(State.CANCELLED, reason="deleted with labkit cancel")
                else:
                    polled[job] = Status(State.UNKNOWN, reason="no such PyTorchJob: deleted outside labkit?")
        return polled

    def _copy_logs(self, job: Job, context: str) -> None:
        logs = job.record.logs / job.job_id
        logs.mkdir(parents=True, exist_ok=True)
        [group] = node_groups(job.spec)
        pods = [f"{job.job_id}-master-0"] + [f"{job.job_id}-worker-{i}" for i in range(group.nodes - 1)]
        for pod in pods:
            done = _kubectl(["--context", context, "logs", pod, "-c", CONTAINER], check=False)
            if done.returncode == 0:
                (logs / f"{pod}.out").write_text(done.stdout)

    def cancel(self, job: Job) -> bool:
        """kubectl delete the PyTorchJob (its pods go with it); False when the cluster no longer has it."""
        done = _kubectl(["--context", job.record.job_info.get("context", ""), "delete", RESOURCE, job.job_id,
                         "--ignore-not-found", "--wait=false", "-o", "name"])
        self._deleted.add(job.job_id)
        return bool(done.stdout.strip())

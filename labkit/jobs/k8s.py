"""K8sBackend: a run as a Kubeflow training job, applied with kubectl to the user's current context, followed and
cancelled with kubectl. job.k8s.kind chooses the job:

- TrainJob (the default; Kubeflow Trainer v2, trainer.kubeflow.org/v1alpha1, Trainer v2.3.0): the job refers to a
  ClusterTrainingRuntime (job.k8s.runtime, torch-distributed by default) and gives its trainer's image, command,
  arguments, environment, node count and resources per node; the runtime's JobSet runs one pod per node, whose
  container is named node. What a TrainJob's trainer cannot say (volumes, node selector, tolerations, pull secrets,
  the container's mounts and capabilities) is one runtimePatches entry for the runtime's pod template, as Kubeflow
  Trainer's Megatron guide mounts /dev/shm (github.com/kubeflow/trainer, v2.3.0 docs/user-guides/megatron.md). The
  torch plugin gives each pod PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the Job's completion index),
  PET_MASTER_ADDR (node 0's pod) and PET_MASTER_PORT 29500 (pkg/runtime/framework/plugins/torch/torch.go).
- PyTorchJob (kubeflow.org/v1, the training operator v1.9's): a Master replica (node rank 0) and, on more nodes,
  Worker replicas. The operator gives each pod PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT
  (training-operator v1.9 pkg/controller.v1/pytorch/envvar.go).

Either way each pod asks for its node's GPUs (nvidia.com/gpu, NVIDIA's device plugin) and the devices of its fabric
(job.env_preset's k8s.devices in labkit/data/clusters.yaml: EFA interfaces, RDMA HCAs; job.k8s.devices overrides a
count), and runs the command the Slurm script runs: torchrun with the node's rank and the master's address as
Kubernetes substitutes them into the command's $(NAME) references, the same entrypoint (labkit.jobs.render.entrypoint),
the same Megatron flags (labkit.megatron_args) and the same environment (labkit.jobs.render.job_env). Each
job.container.mounts entry SRC:DST becomes a hostPath volume (the data must be at SRC on every node, as a shared
filesystem mounted on the nodes, FSx for Lustre on EKS), each job.k8s.volumes entry a PersistentVolumeClaim or a
hostPath. job.k8s.queue labels the job for Kueue, which admits all of its pods at once (gang scheduling;
https://kueue.sigs.k8s.io/docs/tasks/run/trainjobs/ and https://kueue.sigs.k8s.io/docs/tasks/run/kubeflow/pytorchjobs/).
job.k8s.patch is laid over the finished manifest (merge_patch).

Built as plain dicts, not with the Kubeflow SDKs' models (pip kubeflow-training 1.9.4 for the PyTorchJob): that SDK
installs cleanly but brings the Kubernetes Python client and ten more packages (45 MB, 3-4 s to import its models) into
the base install, which plans and renders without them, and its models check little beyond required fields. Tests
validate the dicts against the TrainJob and PyTorchJob CRDs' schemas and Kubernetes' pod schema instead, which check
every field. A dict rather than a jinja2 template: yaml.safe_dump quotes every user-given string (an env value with
': ', a flag with '#'), and the dict the tests validate is the one written.
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

from labkit import catalog
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
"""A job name's length limit: the operator names each pod's Service JOB-worker-N, a DNS label of at most 63 (and a
TrainJob's JobSet names each pod's host JOB-node-0-N)."""

TRAINJOB_API_VERSION = "trainer.kubeflow.org/v1alpha1"
TRAINJOB_RESOURCE = "trainjobs.trainer.kubeflow.org"
TRAINJOB_CONTAINER = "node"
"""The trainer's replicated Job and container in Kubeflow Trainer's torch runtimes (constants.Node): the torch plugin
sets the rendezvous environment in it, and a runtime patch names it."""
TRAINJOB_PORT = 29500
"""The master port the torch plugin gives every TrainJob (constants.ContainerTrainerPort)."""
TRAINJOB_MAX_ARGS = 128
"""The most arguments a TrainJob's trainer takes (the CRD's maxItems on spec.trainer.args)."""
PATCH_MANAGER = "labkit/manager"
"""Who owns the TrainJob's runtimePatches entry: a domain-prefixed path, as Trainer's webhook requires."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The label that hands a job to a Kueue LocalQueue."""
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
"""The label JobSet gives each pod of a TrainJob's JobSet, which is named as the TrainJob."""
RESOURCES = {"TrainJob": TRAINJOB_RESOURCE, "PyTorchJob": RESOURCE}

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
    becomes REGISTRY/IMAGE, and Apptainer's docker://REGISTRY/IMAGE drops its scheme."""
    return image.removeprefix("docker://").replace("#", "/", 1)


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
    """What keeps the spec from running as job.k8s.kind, each naming its field and the fix; [] when it can."""
    # No scheduler task's CPUs are asked for (a pod may use its node's CPUs), and the container, not this machine,
    # must hold what the run imports.
    errors = submission_errors(spec, "k8s")
    kind = spec.job.k8s.kind
    groups = spec.cluster_or_default().nodes
    if len(groups) > 1:
        kinds = ", ".join(f"{g.count} x {g.gpu}" for g in groups)
        errors.append(f"cluster.nodes: a {kind} runs one pod template on every node, and this spec has "
                      f"{len(groups)} node groups ({kinds}); use one group, or --backend slurm (a heterogeneous job)")
    elif gres_type(groups[0].gpu) is None:
        errors.append(f"cluster.nodes[0].gpu: {groups[0].gpu!r}: each pod asks for its node's GPUs ({GPU_RESOURCE}); "
                      "give the nodes' GPU type, or run a CPU spec with --backend local")
    else:
        errors += fabric_devices(spec)[1]
    if kind == "TrainJob" and len(megatron_args(spec)) > TRAINJOB_MAX_ARGS:
        errors.append(f"job.k8s.kind: a TrainJob's trainer takes at most {TRAINJOB_MAX_ARGS} arguments and this run "
                      f"has {len(megatron_args(spec))} (its Megatron flags and job.extra_args); set job.k8s.kind: "
                      "PyTorchJob, whose container takes any number")
    if kind == "TrainJob" and spec.job.master_port not in (None, TRAINJOB_PORT):
        errors.append(f"job.master_port: a TrainJob's torch runtime sets the master port ({TRAINJOB_PORT}); leave "
                      "job.master_port out, or set job.k8s.kind: PyTorchJob")
    container = spec.job.container
    if container is None or not container.image:
        errors.append("job.container.image: a pod runs a container image; set job.container.image to a registry "
                      "image, e.g. nvcr.io#nvidia/pytorch:25.04-py3")
    elif container_image_file(spec):
        errors.append(f"job.container.image: {container.image!r} is an image file, which a pod cannot run; push it to "
                      "a registry the cluster pulls from and give its reference")
    elif "://" in container.image.removeprefix("docker://"):
        errors.append(f"job.container.image: {container.image!r} is not a registry image a pod pulls; give a registry "
                      "reference, e.g. nvcr.io/nvidia/pytorch:25.04-py3")
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
    destinations = [destination for _, destination, _ in mounts] + [v.mount_path for v in spec.job.k8s.volumes]
    for field, path in inputs:
        where = PurePosixPath(os.path.normpath(path))
        if not any(where.is_relative_to(destination) for destination in destinations):
            errors.append(f"{field}: {path!r} is not under any job.container.mounts destination (or job.k8s.volumes "
                          "mount_path), so the pods cannot reach it; add a mount SRC:DST whose DST holds it")
    return errors


def _escape(value: str) -> str:
    """A value Kubernetes substitutes nothing into: it replaces $(NAME) in a container's command and env with the
    variable's value, and $$ with $ (k8s.io/kubernetes third_party/forked/golang/expansion)."""
    return value.replace("$", "$$")


def fabric_devices(spec: RunSpec) -> tuple[dict[str, int], list[str]]:
    """The devices each pod asks for besides its GPUs (resource -> count) and the errors: job.env_preset's k8s.devices
    (labkit/data/clusters.yaml), a count per GPU type read for the nodes' GPU, then job.k8s.devices over them (0
    asks for none)."""
    preset = catalog.env_presets().get(spec.job.env_preset or "", {})
    gpu = spec.cluster_or_default().nodes[0].gpu
    gpu = catalog.resolve_gpu_name(gpu) or gpu
    devices, errors = {}, []
    for resource, count in preset.get("k8s", {}).get("devices", {}).items():
        if isinstance(count, dict) and resource not in spec.job.k8s.devices:
            if gpu not in count:
                errors.append(f"job.k8s.devices: job.env_preset {spec.job.env_preset} knows how many {resource} a "
                              f"node of {', '.join(count)} has, not one of {gpu}; give the count, job.k8s.devices: "
                              f"{{{resource}: N}}")
                continue
            count = count[gpu]
        devices[resource] = count
    devices.update(spec.job.k8s.devices)
    return {resource: count for resource, count in devices.items() if count}, errors


MERGE_KEYS = ("name", "manager")
"""The keys that name a list's items for job.k8s.patch: name (containers, env, volumes, volumeMounts,
replicatedJobs) and manager (a TrainJob's runtimePatches, whose list-map key it is)."""


def merge_patch(target, patch):
    """`patch` laid over `target` (job.k8s.patch over the manifest): a mapping merges key by key into the mapping it
    names, and null deletes the key; a list whose items all carry the same merge key (MERGE_KEYS) merges item by item
    with the items of the list it names that have the same value (new ones are appended), as Kubernetes' strategic
    merge patch merges containers, env and volumes by name
    (https://kubernetes.io/docs/tasks/manage-kubernetes-objects/update-api-object-kubectl-patch/); anything else
    replaces what it names, lists included (command, args, tolerations)."""
    if isinstance(target, dict) and isinstance(patch, dict):
        merged = dict(target)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = merge_patch(merged.get(key), value)
        return merged
    key = next((k for k in MERGE_KEYS if _keyed(target, k) and _keyed(patch, k)), None)
    if key is None:
        return copy.deepcopy(patch)
    merged = list(target)
    index = {item[key]: i for i, item in enumerate(merged)}
    for item in patch:
        if item[key] in index:
            merged[index[item[key]]] = merge_patch(merged[index[item[key]]], item)
        else:
            merged.append(merge_patch({}, item))  # a new item, its nulls dropped as a merged one's are
    return merged


def _keyed(items, key: str) -> bool:
    """A list merged item by item: every item a mapping with a string `key` (a name, as Kubernetes' merge keys are)."""
    return isinstance(items, list) and bool(items) and all(isinstance(i, dict) and isinstance(i.get(key), str)
                                                           for i in items)


def _command(spec: RunSpec, group, name: str) -> list[str]:
    """torchrun with the node count, the processes per node and the rendezvous, then the entrypoint."""
    command = [default_torchrun(spec), "--nnodes", str(group.nodes), "--nproc_per_node", str(group.procs_per_node),
               *RENDEZVOUS[spec.job.rendezvous]]
    if spec.job.rendezvous == "c10d":
        command += ["--rdzv-id", name]
    return command + [_escape(arg) for arg in shlex.split(
        profiled_entrypoint(spec, entrypoint(spec.job), worker_python(default_torchrun(spec))))]


def _pod_parts(spec: RunSpec, group) -> tuple[dict, dict]:
    """What the pod spec and the training container hold besides the command: volumes and their mounts, node
    selection, tolerations, pull secrets, the resources each pod asks for and the fabric's capabilities."""
    k8s = spec.job.k8s
    mounts, _ = _mounts(spec)
    volume_mounts = [{"name": f"mount-{i}", "mountPath": destination, **({"readOnly": True} if read_only else {})}
                     for i, (_, destination, read_only) in enumerate(mounts)]
    volumes = [{"name": f"mount-{i}", "hostPath": {"path": source}} for i, (source, _, _) in enumerate(mounts)]
    for volume in k8s.volumes:
        source = ({"persistentVolumeClaim": {"claimName": volume.pvc}} if volume.pvc is not None
                  else {"hostPath": {"path": volume.host_path}})
        volumes.append({"name": volume.name, **source})
        volume_mounts.append({"name": volume.name, "mountPath": volume.mount_path,
                              **({"readOnly": True} if volume.read_only else {})})
    # A container runtime gives /dev/shm 64 MB; NCCL's transport between a node's GPUs and PyTorch's data loader
    # workers share memory through it.
    volume_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    pod: dict = {"volumes": volumes}
    if k8s.node_selector:
        pod["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        pod["tolerations"] = copy.deepcopy(k8s.tolerations)
    if k8s.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret} for secret in k8s.image_pull_secrets]
    # An extended resource's request is its limit.
    limits = {GPU_RESOURCE: str(group.procs_per_node),
              **{resource: str(count) for resource, count in fabric_devices(spec)[0].items()}}
    container: dict = {"resources": {"limits": limits}, "volumeMounts": volume_mounts}
    capabilities = catalog.env_presets().get(spec.job.env_preset or "", {}).get("k8s", {}).get("capabilities")
    if capabilities:
        container["securityContext"] = {"capabilities": {"add": list(capabilities)}}
    return pod, container


def _labels(spec: RunSpec, name: str, labels: dict[str, str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """The pods' labels, and the job's: the pods' and job.k8s.queue's Kueue label."""
    pods = {"app.kubernetes.io/name": "labkit", "app.kubernetes.io/instance": name, **(labels or {})}
    queue = {QUEUE_LABEL: spec.job.k8s.queue} if spec.job.k8s.queue else {}
    return pods, {**pods, **queue}


def _checked(spec: RunSpec) -> None:
    errors = k8s_errors(spec)
    if errors:
        raise SpecError(errors)


def _patched(spec: RunSpec, manifest: dict) -> dict:
    return merge_patch(manifest, spec.job.k8s.patch) if spec.job.k8s.patch else manifest


def pytorchjob(spec: RunSpec, name: str | None = None, labels: dict[str, str] | None = None) -> dict:
    """The PyTorchJob for a spec, as a dict: one Master pod and nodes - 1 Worker pods, job.k8s.patch laid over it.
    `name`: the job's name (default: from spec.name). Raises SpecError naming the fields that keep the spec from
    running on Kubernetes."""
    _checked(spec)
    [group] = node_groups(spec)
    job = spec.job
    name = name or k8s_name(spec.name)
    pod_labels, job_labels = _labels(spec, name, labels)
    pod, extra = _pod_parts(spec, group)
    container = {
        "name": CONTAINER,
        "image": image_reference(job.container.image),
        "command": _command(spec, group, name),
        "args": [_escape(arg) for arg in megatron_args(spec)],
        "env": [{"name": key, "value": _escape(value)} for key, value in job_env(spec).items()],
        "ports": [{"name": PORT_NAME, "containerPort": job.master_port or DEFAULT_PORT}],
        **extra,
    }
    template = {"metadata": {"labels": pod_labels}, "spec": {"containers": [container], **pod}}
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
    return _patched(spec, {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "labels": job_labels},
                           "spec": {"nprocPerNode": str(group.procs_per_node), "runPolicy": run_policy,
                                    "pytorchReplicaSpecs": replicas}})


def trainjob(spec: RunSpec, name: str | None = None, labels: dict[str, str] | None = None) -> dict:
    """The TrainJob for a spec, as a dict: job.k8s.runtime's torch runtime on every node with the spec's trainer,
    the rest of the pod as one runtime patch, job.k8s.patch laid over it. Raises SpecError as pytorchjob does."""
    _checked(spec)
    [group] = node_groups(spec)
    job = spec.job
    name = name or k8s_name(spec.name)
    pod_labels, job_labels = _labels(spec, name, labels)
    pod, extra = _pod_parts(spec, group)
    trainer = {
        "image": image_reference(job.container.image),
        "command": _command(spec, group, name),
        "args": [_escape(arg) for arg in megatron_args(spec)],
        "env": [{"name": key, "value": _escape(value)} for key, value in job_env(spec).items()],
        "numNodes": group.nodes,
        "numProcPerNode": group.procs_per_node,
        "resourcesPerNode": extra.pop("resources"),
    }
    template = {"metadata": {"labels": pod_labels},
                "spec": {**pod, "containers": [{"name": TRAINJOB_CONTAINER, **extra}]}}
    node_job = {"name": TRAINJOB_CONTAINER, "template": {"spec": {"template": template}}}
    spec_: dict = {"runtimeRef": {"name": job.k8s.runtime, "apiGroup": "trainer.kubeflow.org",
                                  "kind": "ClusterTrainingRuntime"}}
    deadline = time_limit_seconds(job.time_limit)
    if deadline is not None:
        spec_["activeDeadlineSeconds"] = deadline
    spec_["trainer"] = trainer
    spec_["runtimePatches"] = [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {
        "template": {"spec": {"replicatedJobs": [node_job]}}}}]
    return _patched(spec, {"apiVersion": TRAINJOB_API_VERSION, "kind": "TrainJob",
                           "metadata": {"name": name, "labels": job_labels}, "spec": spec_})


def manifest(spec: RunSpec, name: str | None = None, labels: dict[str, str] | None = None) -> dict:
    """The job.k8s.kind manifest for a spec: trainjob or pytorchjob."""
    return (trainjob if spec.job.k8s.kind == "TrainJob" else pytorchjob)(spec, name, labels)


def manifest_file(spec: RunSpec) -> str:
    """The file the manifest is written to: trainjob.yaml or pytorchjob.yaml."""
    return f"{spec.job.k8s.kind.lower()}.yaml"


def render_manifest(spec: RunSpec, name: str | None = None, labels: dict[str, str] | None = None) -> str:
    """The manifest as YAML for kubectl apply -f, under a header saying what it runs."""
    built = manifest(spec, name, labels)
    [group] = node_groups(spec)
    first = ("Master is node rank 0" if spec.job.k8s.kind == "PyTorchJob"
             else f"node rank 0 is the pod on host {built['metadata']['name']}-node-0-0")
    header = (f"# labkit run: {spec.name}\n"
              f"# {group.nodes} pod(s), one per node, x {group.procs_per_node} process(es): {first}.\n"
              "# Rendered from the run spec by labkit.jobs.k8s: change the spec, not this file.\n")
    return header + yaml.safe_dump(built, sort_keys=False, width=120)


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


def trainjob_status(manifest: dict) -> Status:
    """A TrainJob's state (its API types, pkg/apis/trainer/v1alpha1/trainjob_types.go): the Failed and Complete
    conditions end it (Failed with reason DeadlineExceeded is a TIMEOUT), Suspended holds it (Kueue suspends a job until
    it admits it); it has no Running condition, so it runs once its child Job's pods are all ready (jobsStatus ready),
    and waits before that."""
    status = manifest.get("status", {})
    true = {c.get("type"): c for c in status.get("conditions", []) if c.get("status") == "True"}
    for kind, state in (("Failed", State.FAILED), ("Complete", State.COMPLETED), ("Suspended", State.PENDING)):
        if kind in true:
            if state == State.FAILED and true[kind].get("reason") == "DeadlineExceeded":
                state = State.TIMEOUT
            return Status(state, reason=true[kind].get("message") or true[kind].get("reason"))
    if any((child.get("ready") or 0) > 0 for child in status.get("jobsStatus", [])):
        return Status(State.RUNNING)
    return Status(State.PENDING, reason="waiting for its pods")


STATUS = {"TrainJob": trainjob_status, "PyTorchJob": pytorchjob_status}


def _kubectl(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise K8sError("kubectl not found: install it and choose the cluster with `kubectl config use-context "
                       "NAME`") from None
    if check and done.returncode != 0:
        raise K8sError(done.stderr.strip() or done.stdout.strip() or f"kubectl exited with {done.returncode}")
    return done


def _kind(job: Job) -> str:
    """The kind a job was submitted as (a record from before TrainJobs has none: a PyTorchJob)."""
    return job.record.job_info.get("kind", KIND)


class K8sBackend:
    """Runs a spec as a TrainJob or PyTorchJob (job.k8s.kind) in kubectl's current context (Kubeflow Trainer or the
    training operator must be installed there). The context is recorded at submission: later polls and cancels ask
    that cluster, whatever context is current then."""
    name = "k8s"
    backoff = SCHEDULER_BACKOFF  # every poll is a request to the cluster's API server

    def __init__(self, runs_dir: str | os.PathLike | None = None):
        self.runs_dir = runs_dir
        self._deleted: set[str] = set()  # jobs this backend deleted: gone from the cluster, so CANCELLED

    def submit(self, spec: RunSpec | str | os.PathLike, after: Job | list[Job] | None = None) -> Job:
        """Render, record and kubectl apply one run."""
        if after:
            raise ValueError("after: a Kubernetes job cannot wait for other jobs; submit it once they have completed")
        spec = spec if isinstance(spec, RunSpec) else load_spec(spec)
        _checked(spec)
        context = _kubectl(["config", "current-context"]).stdout.strip()
        record = RunRecord.create(spec, runs_dir(self.runs_dir))
        name = k8s_name(record.run_id)
        path = record.write_script(manifest_file(spec), render_manifest(spec, name, {"labkit/run-id": name}))
        try:
            _kubectl(["--context", context, "apply", "-f", str(path)])
        except K8sError as exc:
            record.set_status(State.FAILED, cause=f"rejected by Kubernetes: {exc}")
            raise
        kind = spec.job.k8s.kind
        record.attach(self.name, kind.lower(), [name], context=context, kind=kind)
        return Job(self, [name], record)

    def poll(self, jobs: list[Job]) -> dict[Job, Status]:
        """Every job's status from one kubectl get per context and kind; none when the API server does not answer.
        The logs of a job's pods are copied into its run record (logs/NAME/POD.out) while it runs and when it ends."""
        polled: dict[Job, Status] = {}
        by_context: dict[tuple[str, str], list[Job]] = {}
        for job in jobs:
            by_context.setdefault((job.record.job_info.get("context", ""), _kind(job)), []).append(job)
        for (context, kind), group in by_context.items():
            done = _kubectl(["--context", context, "get", RESOURCES[kind], *(j.job_id for j in group), "-o", "json",
                             "--ignore-not-found"], check=False)
            if done.returncode != 0:
                continue  # the API server did not answer: keep the states we know
            found = json.loads(done.stdout) if done.stdout.strip() else {}
            items = found.get("items", [found] if found else [])
            manifests = {item["metadata"]["name"]: item for item in items}
            for job in group:
                if job.job_id in manifests:
                    polled[job] = STATUS[kind](manifests[job.job_id])
                    if polled[job].state != State.PENDING:
                        self._copy_logs(job, context, kind)
                elif job.job_id in self._deleted:
                    polled[job] = Status(State.CANCELLED, reason="deleted with labkit cancel")
                else:
                    polled[job] = Status(State.UNKNOWN, reason=f"no such {kind}: deleted outside labkit?")
        return polled

    def _copy_logs(self, job: Job, context: str, kind: str) -> None:
        logs = job.record.logs / job.job_id
        logs.mkdir(parents=True, exist_ok=True)
        if kind == "TrainJob":  # the Job controller names the pods JOB-node-0-N-RANDOM
            done = _kubectl(["--context", context, "get", "pods", "-l", f"{JOBSET_LABEL}={job.job_id}", "-o", "name"],
                            check=False)
            pods = [line.removeprefix("pod/") for line in done.stdout.split()] if done.returncode == 0 else []
            container = TRAINJOB_CONTAINER
        else:
            [group] = node_groups(job.spec)
            pods = [f"{job.job_id}-master-0"] + [f"{job.job_id}-worker-{i}" for i in range(group.nodes - 1)]
            container = CONTAINER
        for pod in pods:
            done = _kubectl(["--context", context, "logs", pod, "-c", container], check=False)
            if done.returncode == 0:
                (logs / f"{pod}.out").write_text(done.stdout)

    def cancel(self, job: Job) -> bool:
        """kubectl delete the job (its pods go with it); False when the cluster no longer has it."""
        done = _kubectl(["--context", job.record.job_info.get("context", ""), "delete", RESOURCES[_kind(job)],
                         job.job_id, "--ignore-not-found", "--wait=false", "-o", "name"])
        self._deleted.add(job.job_id)
        return bool(done.stdout.strip())

"""The k8s backend's TrainJob (Kubeflow Trainer v2): golden files validated against the TrainJob CRD's schema
(Trainer v2.3.0) and, for the pod its runtime patch and trainer make, Kubernetes' pod schema; the fabric's devices;
job.k8s.patch; job.k8s's errors naming their fields; TrainJob conditions; submission, polling and cancelling through
the stand-in kubectl of test_jobs_k8s."""
from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
import yaml

from labkit.cli import main
from labkit.jobs import State, backend_named
from labkit.jobs.k8s import k8s_name, merge_patch, pytorchjob, render_manifest, trainjob, trainjob_status
from labkit.jobs.render import job_env
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError
from test_jobs_k8s import (GOLDENS, POD, SCHEMAS, UPDATE, calls, h100_spec, kubectl,  # noqa: F401 (a fixture)
                           schema_errors, strict)

TRAINJOB_CRD = jsonschema.Draft7Validator(strict(json.loads((SCHEMAS / "trainjob-crd-v2.3.0.schema.json").read_text())))
NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
"""The TrainJob CRD's own rule for metadata.name (an x-kubernetes-validations CEL rule, which jsonschema skips)."""


def trainjob_spec(**changes):
    return h100_spec(**{"job.k8s.kind": "TrainJob", **changes})


def a100_ib_spec(**changes):
    """4 nodes x 8 A100-80GB on InfiniBand, data and checkpoints on a read-only hostPath and a claim."""
    return trainjob_spec(**{"name": "gpt-a100-ib", "cluster.nodes": [{"gpu": "A100-80GB", "count": 4,
                                                                      "gpus_per_node": 8}],
                            "parallel.tensor": 8, "parallel.pipeline": 1, "batch.global": 32,
                            "job.env_preset": "infiniband", "job.rendezvous": "c10d", "job.time_limit": None,
                            "job.container.mounts": [], "data.path": "/data/fineweb_text_document",
                            "data.tokenizer.model": "/data/tokenizers/llama3", "train.save": "/ckpt/llama3-8b",
                            "job.cluster_paths": ["/data"],
                            "job.k8s": {"kind": "TrainJob",
                                        "volumes": [{"name": "data", "mount_path": "/data", "host_path": "/lustre/data",
                                                     "read_only": True},
                                                    {"name": "ckpt", "mount_path": "/ckpt", "pvc": "ckpt-claim"}],
                                        "tolerations": [{"key": "rdma", "operator": "Equal", "value": "ib",
                                                         "effect": "NoExecute", "tolerationSeconds": 300}]},
                            **changes})


GOLDEN_CASES = {"trainjob-h100-2nodes.yaml": trainjob_spec, "trainjob-a100-infiniband.yaml": a100_ib_spec}


def trainjob_pod(manifest: dict) -> dict:
    """The pod template the runtime's JobSet runs: the runtime patch's pod, its container given the trainer's image,
    command, arguments, environment and resources, as the Trainer's torch runtime builds it."""
    trainer = manifest["spec"]["trainer"]
    [patch] = manifest["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    template = copy.deepcopy(node["template"]["spec"]["template"])
    [container] = template["spec"]["containers"]
    container.update(image=trainer["image"], command=trainer["command"], args=trainer["args"], env=trainer["env"],
                     resources=trainer["resourcesPerNode"])
    return template


def trainjob_errors(manifest: dict) -> list[str]:
    """Where a TrainJob breaks its CRD's schema or its name rule, or its pod breaks Kubernetes' pod schema."""
    errors = [f"crd {list(e.absolute_path)}: {e.message}" for e in TRAINJOB_CRD.iter_errors(manifest)]
    if not NAME.match(manifest.get("metadata", {}).get("name", "")):
        errors.append("metadata.name is not an RFC 1035 label")
    try:
        pod = trainjob_pod(manifest)
    except (KeyError, ValueError, TypeError) as exc:
        return errors + [f"pod: {exc!r}"]
    return errors + [f"pod {list(e.absolute_path)}: {e.message}" for e in POD.iter_errors(pod)]


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_trainjobs_match_their_golden_files(case):
    """Regenerate with LABKIT_UPDATE_GOLDEN=1 and read the diff."""
    text, path = render_manifest(GOLDEN_CASES[case]()), GOLDENS / case
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_trainjobs_validate_against_the_crd_and_pod_schemas(case):
    manifest = yaml.safe_load((GOLDENS / case).read_text())
    assert trainjob_errors(manifest) == []
    assert manifest["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and manifest["kind"] == "TrainJob"
    assert manifest["spec"]["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                              "kind": "ClusterTrainingRuntime"}
    pod = trainjob_pod(manifest)
    [container] = pod["spec"]["containers"]
    assert container["name"] == "node" and container["image"] == "nvcr.io/nvidia/pytorch:25.04-py3"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_the_h100_trainjob_carries_the_spec_its_devices_volumes_and_placement():
    spec = trainjob_spec()
    manifest = trainjob(spec)
    trainer = manifest["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}}
    assert trainer["args"] == megatron_args(spec)
    assert {e["name"]: e["value"] for e in trainer["env"]} == job_env(spec)
    assert trainer["command"][:7] == ["torchrun", "--nnodes", "2", "--nproc_per_node", "8", "--node_rank",
                                      "$(PET_NODE_RANK)"]  # the torch plugin's PET_* variables
    assert manifest["spec"]["activeDeadlineSeconds"] == 4 * 3600
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    pod = trainjob_pod(manifest)["spec"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "llama3-ckpt"}} in pod["volumes"]
    assert {"name": "mount-0", "hostPath": {"path": "/fsx"}} in pod["volumes"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["imagePullSecrets"] == [{"name": "ngc-registry"}]
    # The same run as a PyTorchJob asks each pod for the same things.
    [container] = pytorchjob(spec)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["resources"] == trainer["resourcesPerNode"] and container["command"] == trainer["command"]


def test_infiniband_asks_for_the_rdma_device_and_ipc_lock_in_both_kinds():
    spec = a100_ib_spec()
    manifest = trainjob(spec)
    assert manifest["spec"]["trainer"]["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8",
                                                                         "rdma/rdma_shared_device_a": "1"}
    [container] = trainjob_pod(manifest)["spec"]["containers"]
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in container["volumeMounts"]
    assert "activeDeadlineSeconds" not in manifest["spec"] and "--rdzv-id" in manifest["spec"]["trainer"]["command"]
    as_pytorchjob = pytorchjob(a100_ib_spec(**{"job.k8s.kind": "PyTorchJob"}))
    assert schema_errors(as_pytorchjob) == []
    [container] = as_pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"


@pytest.mark.parametrize("changes, devices", [
    ({}, {"vpc.amazonaws.com/efa": "32"}),  # p5.48xlarge
    ({"cluster.nodes": [{"gpu": "A100-40GB", "count": 2, "gpus_per_node": 8}]}, {"vpc.amazonaws.com/efa": "4"}),
    ({"job.k8s.devices": {"vpc.amazonaws.com/efa": 16}}, {"vpc.amazonaws.com/efa": "16"}),  # p5en.48xlarge
    ({"job.k8s.devices": {"vpc.amazonaws.com/efa": 0}}, {}),
    ({"job.env_preset": None}, {}),
    ({"job.env_preset": None, "job.k8s.devices": {"example.com/nic": 2}}, {"example.com/nic": "2"}),
])
def test_the_env_presets_devices_follow_the_gpu_and_job_k8s_devices_overrides_them(changes, devices):
    manifest = trainjob(trainjob_spec(**changes))
    assert manifest["spec"]["trainer"]["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8", **devices}
    assert trainjob_errors(manifest) == []


def test_the_patch_merges_mappings_and_named_lists_and_replaces_other_lists():
    patch = {"metadata": {"annotations": {"team": "nlp"}, "labels": {"kueue.x-k8s.io/queue-name": None}},
             "spec": {"trainer": {"env": [{"name": "NCCL_DEBUG", "value": "TRACE"}, {"name": "EXTRA", "value": "1"}],
                                  "command": ["bash", "-c", "sleep 1"]},
                      "activeDeadlineSeconds": None}}
    manifest = trainjob(trainjob_spec(**{"job.k8s.patch": patch}))
    assert manifest["metadata"]["annotations"] == {"team": "nlp"}
    assert "kueue.x-k8s.io/queue-name" not in manifest["metadata"]["labels"]
    assert "activeDeadlineSeconds" not in manifest["spec"]
    env = manifest["spec"]["trainer"]["env"]
    assert {"name": "NCCL_DEBUG", "value": "TRACE"} in env and env[-1] == {"name": "EXTRA", "value": "1"}
    assert len(env) == len(trainjob(trainjob_spec())["spec"]["trainer"]["env"]) + 1
    assert manifest["spec"]["trainer"]["command"] == ["bash", "-c", "sleep 1"]
    assert trainjob_errors(manifest) == []
    assert merge_patch({"a": [1, 2], "b": {"c": 1}}, {"a": [3], "b": {"d": 2}}) == {"a": [3], "b": {"c": 1, "d": 2}}
    # A pod annotation (a Multus network) reaches the TrainJob's pods through its runtime patch, keyed by manager.
    network = {"k8s.v1.cni.cncf.io/networks": "rdma-net-ipam"}
    pod_patch = {"spec": {"runtimePatches": [{"manager": "labkit/manager", "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"metadata": {"annotations": network}}}}}]
    }}}}]}}
    annotated = trainjob(trainjob_spec(**{"job.k8s.patch": pod_patch}))
    pod = trainjob_pod(annotated)
    assert pod["metadata"]["annotations"] == network and pod["spec"] == trainjob_pod(trainjob(trainjob_spec()))["spec"]
    assert trainjob_errors(annotated) == []
    # A PyTorchJob is patched the same way, each replica by its own path.
    master = {"spec": {"pytorchReplicaSpecs": {"Master": {"template": {"spec": {"hostNetwork": True}}}}}}
    patched = pytorchjob(h100_spec(**{"job.k8s.patch": master}))["spec"]["pytorchReplicaSpecs"]
    assert patched["Master"]["template"]["spec"]["hostNetwork"] is True
    assert "hostNetwork" not in patched["Worker"]["template"]["spec"]


@pytest.mark.parametrize("changes, field", [
    ({"job.k8s.kind": "MPIJob"}, "job.k8s.kind"),
    ({"job.k8s.runtime": "Torch_Distributed"}, "job.k8s.runtime"),
    ({"job.k8s.volumes": [{"name": "data", "mount_path": "/data"}]}, "job.k8s.volumes[0]"),
    ({"job.k8s.volumes": [{"name": "data", "mount_path": "/data", "pvc": "a", "host_path": "/a"}]},
     "job.k8s.volumes[0]"),
    ({"job.k8s.volumes": [{"name": "Data_1", "mount_path": "/data", "pvc": "a"}]}, "job.k8s.volumes[0].name"),
    ({"job.k8s.volumes": [{"name": "dshm", "mount_path": "/data", "pvc": "a"}]}, "job.k8s.volumes[0].name"),
    ({"job.k8s.volumes": [{"name": "data", "mount_path": "data", "pvc": "a"}]}, "job.k8s.volumes[0].mount_path"),
    ({"job.k8s.volumes": [{"name": "data", "mount_path": "/data", "host_path": "lustre"}]},
     "job.k8s.volumes[0].host_path"),
    ({"job.k8s.volumes": [{"name": "a", "mount_path": "/a", "pvc": "x"}, {"name": "a", "mount_path": "/b", "pvc": "y"}]},
     "job.k8s.volumes[1].name"),
    ({"job.k8s.tolerations": [{"key": "gpu", "operator": "In"}]}, "job.k8s.tolerations[0].operator"),
    ({"job.k8s.tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoRun"}]},
     "job.k8s.tolerations[0].effect"),
    ({"job.k8s.tolerations": [{"key": "gpu", "operator": "Exists", "value": "x"}]}, "job.k8s.tolerations[0].value"),
    ({"job.k8s.tolerations": [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 60}]},
     "job.k8s.tolerations[0].tolerationSeconds"),
    ({"job.k8s.tolerations": [{"operator": "Equal", "value": "x"}]}, "job.k8s.tolerations[0].key"),
    ({"job.k8s.tolerations": [{"key": "gpu", "opertor": "Exists"}]}, "job.k8s.tolerations[0]"),
    ({"job.k8s.tolerations": ["nvidia.com/gpu"]}, "job.k8s.tolerations[0]"),
    ({"job.k8s.node_selector": {"bad key!": "x"}}, "job.k8s.node_selector.bad key!"),
    ({"job.k8s.image_pull_secrets": ["NGC Secret"]}, "job.k8s.image_pull_secrets[0]"),
    ({"job.k8s.queue": "team a"}, "job.k8s.queue"),
    ({"job.k8s.devices": {"efa": 4}}, "job.k8s.devices.efa"),
    ({"job.k8s.patch": ["spec"]}, "job.k8s.patch"),
])
def test_bad_k8s_keys_are_refused_naming_the_field(changes, field):
    with pytest.raises(SpecError) as info:
        trainjob_spec(**changes)
    assert any(e.startswith(field + ":") for e in info.value.errors), info.value.errors


@pytest.mark.parametrize("changes, field", [
    ({"cluster.nodes": [{"gpu": "L40S", "count": 2, "gpus_per_node": 8}]}, "job.k8s.devices"),  # no EFA count
    ({"job.master_port": 29400}, "job.master_port"),  # the torch runtime's port is 29500
    ({"job.master_port": 29400, "parallel.sequence_parallel": False,
      "cluster.nodes": [{"gpu": "cpu", "count": 2, "gpus_per_node": 8}]}, "cluster.nodes[0].gpu"),
    ({"train.load": "/scratch/ckpt"}, "train.load"),
])
def test_a_spec_that_cannot_run_as_a_trainjob_is_refused_naming_the_field(changes, field):
    with pytest.raises(SpecError) as info:
        trainjob(trainjob_spec(**changes))
    assert any(e.startswith(field + ":") for e in info.value.errors), info.value.errors
    assert trainjob(trainjob_spec(**{"train.load": "/ckpt/llama3-8b"}))  # a job.k8s.volumes mount_path holds it


def test_more_arguments_than_a_trainjob_takes_are_refused_naming_the_kind():
    from labkit import catalog

    rendered = set(megatron_args(trainjob_spec()))
    extra = sorted(flag for flag in catalog.megatron_lm_flags() if flag not in rendered)[:50]
    with pytest.raises(SpecError, match=r"job\.k8s\.kind: a TrainJob's trainer takes at most 128 arguments and this "
                                        r"run has 129"):
        trainjob(trainjob_spec(**{"job.extra_args": extra}))
    assert pytorchjob(h100_spec(**{"job.extra_args": extra}))


def test_the_schemas_refuse_a_broken_trainjob():
    good = trainjob(trainjob_spec())
    misspelt, wrong_type, long_name = copy.deepcopy(good), copy.deepcopy(good), copy.deepcopy(good)
    pod = misspelt["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod["template"]["spec"]["template"]["spec"]["tolerations"][0]["efect"] = "NoSchedule"
    wrong_type["spec"]["trainer"]["numNodes"] = "two"
    long_name["metadata"]["name"] = "2-nodes"
    for bad in (misspelt, wrong_type, long_name):
        assert trainjob_errors(bad)


@pytest.mark.parametrize("status, state", [
    ({}, State.PENDING),
    ({"conditions": [{"type": "Suspended", "status": "True", "reason": "Suspended"}]}, State.PENDING),
    ({"conditions": [{"type": "Suspended", "status": "False", "reason": "Resumed"}],
      "jobsStatus": [{"name": "node", "ready": 0, "active": 1}]}, State.PENDING),
    ({"jobsStatus": [{"name": "node", "ready": 1, "active": 1}]}, State.RUNNING),
    ({"conditions": [{"type": "Complete", "status": "True"}]}, State.COMPLETED),
    ({"conditions": [{"type": "Failed", "status": "True", "reason": "JobSetFailed"}]}, State.FAILED),
    ({"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}, State.TIMEOUT),
])
def test_a_trainjobs_conditions_and_child_jobs_give_the_state(status, state):
    assert trainjob_status({"status": status}).state == state


def test_submission_applies_the_trainjob_and_follows_and_cancels_it(kubectl, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_KUBECTL_CONDITIONS", "Complete")
    backend = backend_named("k8s", runs_dir=tmp_path / "runs")
    job = backend.submit(trainjob_spec())
    [name] = job.job_ids
    applied = job.record.path / "trainjob.yaml"
    assert calls(kubectl) == [["config", "current-context"], ["--context", "lab-cluster", "apply", "-f", str(applied)]]
    manifest = yaml.safe_load(applied.read_text())
    assert manifest["metadata"]["name"] == name == k8s_name(job.record.run_id) and trainjob_errors(manifest) == []
    assert job.record.job_info["kind"] == "TrainJob"

    job.update(backend.poll([job])[job])
    assert job.status(refresh=False).state == State.COMPLETED
    assert ["--context", "lab-cluster", "get", "trainjobs.trainer.kubeflow.org", name, "-o", "json",
            "--ignore-not-found"] in calls(kubectl)
    assert ["--context", "lab-cluster", "get", "pods", "-l", f"jobset.sigs.k8s.io/jobset-name={name}", "-o",
            "name"] in calls(kubectl)
    assert (job.log_dir / f"{name}-node-0-1-q9d4m.out").read_text() == f"log of {name}-node-0-1-q9d4m\n"
    assert backend.cancel(job)
    assert calls(kubectl)[-1] == ["--context", "lab-cluster", "delete", "trainjobs.trainer.kubeflow.org", name,
                                  "--ignore-not-found", "--wait=false", "-o", "name"]


def test_labkit_run_dry_run_prints_the_trainjob_by_default(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    data = yaml.safe_load(trainjob_spec().to_yaml())
    del data["job"]["k8s"]["kind"]  # TrainJob is the default
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["run", str(path), "--backend", "k8s", "--dry-run", "--json"]) == 0
    golden = (GOLDENS / "trainjob-h100-2nodes.yaml").read_text()
    assert json.loads(capsys.readouterr().out) == {"scripts": {"trainjob.yaml": golden}}


def test_k8s_keys_read_from_a_spec_file_render_and_round_trip(tmp_path):
    """Numbers a spec file writes in tolerations and the patch reach the manifest and the recorded spec as numbers."""
    from labkit.spec import load_spec

    path = tmp_path / "spec.yaml"
    data = yaml.safe_load(trainjob_spec().to_yaml())
    path.write_text(yaml.safe_dump(data, sort_keys=False).replace(
        "    tolerations:\n", "    tolerations:\n    - {key: spot, operator: Exists, effect: NoExecute, "
                             "tolerationSeconds: 0x12c}\n").replace(
        "    patch: null\n", "    patch: {spec: {activeDeadlineSeconds: 1e3}}\n"))
    spec = load_spec(path)
    manifest = yaml.safe_load(render_manifest(spec))
    assert manifest["spec"]["activeDeadlineSeconds"] == 1000.0
    assert trainjob_pod(manifest)["spec"]["tolerations"][0]["tolerationSeconds"] == 300
    again = tmp_path / "again.yaml"
    again.write_text(spec.to_yaml())
    assert load_spec(again).to_dict() == spec.to_dict()


def test_a_pod_pulls_apptainers_docker_reference_and_no_other_scheme():
    from labkit.jobs.k8s import image_reference, k8s_errors

    assert image_reference("docker://nvcr.io/nvidia/pytorch:25.04-py3") == "nvcr.io/nvidia/pytorch:25.04-py3"
    assert image_reference("nvcr.io#nvidia/pytorch:25.04-py3") == "nvcr.io/nvidia/pytorch:25.04-py3"
    oras = trainjob_spec(**{"job.container": {"image": "oras://ghcr.io/lab/megatron:1", "runtime": "apptainer"}})
    assert any(e.startswith("job.container.image: 'oras://ghcr.io/lab/megatron:1' is not a registry image")
               for e in k8s_errors(oras))


def test_a_volume_name_is_told_the_dns_label_rule_and_a_claim_name_the_subdomain_one():
    with pytest.raises(SpecError) as info:
        trainjob_spec(**{"job.k8s.volumes": [{"name": "my.data", "mount_path": "/data", "pvc": "Team_Claim"}]})
    (name,) = [e for e in info.value.errors if e.startswith("job.k8s.volumes[0].name:")]
    (claim,) = [e for e in info.value.errors if e.startswith("job.k8s.volumes[0].pvc:")]
    assert "'.'" not in name and "(and '.' between labels)" in claim

"""The k8s backend: the TrainJob and PyTorchJob a spec renders (golden files, validated against the TrainJob and
PyTorchJob CRDs' schemas and Kubernetes' pod schema), the same command line and environment as the Slurm script, the
fabric's devices, job.k8s's volumes, node selection, tolerations, pull secrets, queue and patch, errors naming the spec
field, and submission, polling and cancelling through a stand-in kubectl (no Kubernetes API server runs in tests)."""
from __future__ import annotations

import copy
import json
import os
import re
import shlex
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from labkit.cli import main
from labkit.jobs import State, backend_named
from labkit.jobs.k8s import (K8sError, k8s_name, merge_patch, pytorchjob, pytorchjob_status, render_manifest, trainjob,
                              trainjob_status)
from labkit.jobs.render import job_env, render
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec, with_changes

HERE = Path(__file__).resolve().parent
GOLDENS = HERE / "golden" / "k8s"
GOLDEN = GOLDENS / "pytorchjob-h100-2nodes.yaml"
SCHEMAS = HERE / "fixtures" / "k8s"  # their sources are named in each file's $comment
UPDATE = os.environ.get("LABKIT_UPDATE_GOLDEN") == "1"


K8S = {"kind": "PyTorchJob", "volumes": [{"name": "checkpoints", "mount_path": "/ckpt", "pvc": "llama3-ckpt"}],
       "node_selector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
       "image_pull_secrets": ["ngc-registry"], "queue": "team-a"}


def h100_spec(**changes):
    """Llama 3 8B on 2 nodes x 8 H100 (TP 4, PP 2, DP 2) from an NGC container, data and checkpoints on /fsx, a
    checkpoint claim at /ckpt, on p5.48xlarge nodes (aws-efa: 32 EFA interfaces each) through a Kueue queue; a
    PyTorchJob unless job.k8s.kind says otherwise."""
    spec = {"name": "llama3-8b-h100", "model": {"preset": "llama3-8b"}, "precision": "bf16",
            "parallel": {"tensor": 4, "pipeline": 2, "sequence_parallel": True}, "batch": {"micro": 1, "global": 64},
            "optimizer": {"distributed": True},
            "train": {"iters": 100, "log_interval": 10, "save": "/fsx/ckpt/llama3-8b", "save_interval": 50},
            "data": {"path": "/fsx/data/fineweb_text_document",
                     "tokenizer": {"type": "HuggingFaceTokenizer", "model": "/fsx/tokenizers/llama3"}},
            "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]},
            "job": {"time_limit": "4:00:00", "env_preset": "aws-efa", "env": {"NCCL_DEBUG": "INFO"},
                    "entrypoint": "megatron-lm", "megatron_lm": "/workspace/megatron-lm", "cluster_paths": ["/fsx"],
                    "container": {"image": "nvcr.io#nvidia/pytorch:25.04-py3", "mounts": ["/fsx:/fsx"]},
                    "k8s": copy.deepcopy(K8S)}}
    return load_spec(with_changes(spec, **changes))


def strict(schema):
    """The schema refusing fields it does not define, as kubectl's default --validate=strict has the API server do
    (an OpenAPI object schema alone allows any extra field, so a misspelt one would pass)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


CRD = jsonschema.Draft7Validator(strict(json.loads((SCHEMAS / "pytorchjob-crd-v1.9.0.schema.json").read_text())))
POD = jsonschema.Draft4Validator(strict(json.loads((SCHEMAS / "pod-template-v1.36.schema.json").read_text())))


def schema_errors(manifest: dict) -> list[str]:
    """Where the manifest breaks the PyTorchJob CRD's schema or, in each replica's pod template, Kubernetes' own."""
    errors = [f"crd {list(e.absolute_path)}: {e.message}" for e in CRD.iter_errors(manifest)]
    for kind, replica in manifest.get("spec", {}).get("pytorchReplicaSpecs", {}).items():
        errors += [f"{kind} pod {list(e.absolute_path)}: {e.message}" for e in POD.iter_errors(replica["template"])]
    return errors


def test_the_2_node_h100_pytorchjob_matches_its_golden_file():
    """Regenerate with LABKIT_UPDATE_GOLDEN=1 and read the diff."""
    text = render_manifest(h100_spec())
    if UPDATE:
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_the_golden_pytorchjob_validates_against_the_crd_and_pod_schemas():
    manifest = yaml.safe_load(GOLDEN.read_text())
    assert schema_errors(manifest) == []
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "PyTorchJob"
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert {kind: r["replicas"] for kind, r in replicas.items()} == {"Master": 1, "Worker": 1}
    for replica in replicas.values():
        [container] = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["image"] == "nvcr.io/nvidia/pytorch:25.04-py3"
        # aws-efa on p5.48xlarge: every EFA interface of the node (clusters.yaml, env_presets.aws-efa.k8s.devices)
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}
        assert {"name": "mount-0", "mountPath": "/fsx"} in container["volumeMounts"]
        assert {"name": "checkpoints", "mountPath": "/ckpt"} in container["volumeMounts"]
        pod = replica["template"]["spec"]
        assert {"name": "mount-0", "hostPath": {"path": "/fsx"}} in pod["volumes"]
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "llama3-ckpt"}} in pod["volumes"]
        assert pod["tolerations"] == K8S["tolerations"] and pod["nodeSelector"] == K8S["node_selector"]
        assert pod["imagePullSecrets"] == [{"name": "ngc-registry"}]
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert manifest["spec"]["runPolicy"]["activeDeadlineSeconds"] == 4 * 3600


def test_the_schemas_refuse_what_the_api_server_would():
    """The validation can fail: a misspelt field, a number where a string goes, a pod without its image's name."""
    good = pytorchjob(h100_spec())
    assert schema_errors(good) == []
    misspelt, wrong_type, unnamed = copy.deepcopy(good), copy.deepcopy(good), copy.deepcopy(good)
    misspelt["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["contianers"] = []
    wrong_type["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
    del unnamed["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"]
    for bad in (misspelt, wrong_type, unnamed):
        assert schema_errors(bad)


def test_pods_run_the_slurm_scripts_command_line_and_environment():
    spec = h100_spec(**{"job.exclusive": True})  # which Slurm needs for the processes' CPUs; a pod ignores it
    script = render(spec, "/runs/RUN/logs", run_id="RUN").scripts["job.sbatch"]
    train_args = shlex.split(re.search(r"\nTRAIN_ARGS=\(\n(.*?)\n\)\n", script, re.S).group(1))
    for replica in pytorchjob(spec)["spec"]["pytorchReplicaSpecs"].values():
        [container] = replica["template"]["spec"]["containers"]
        assert container["args"] == train_args == megatron_args(spec)
        assert container["command"][-1] == "/workspace/megatron-lm/pretrain_gpt.py"  # as "$TORCHRUN" ... runs it
        assert '/workspace/megatron-lm/pretrain_gpt.py "$@"' in script
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env == job_env(spec) and env["NCCL_DEBUG"] == "INFO"
        assert all(f"export {key}={shlex.quote(value)}" in script for key, value in env.items())


def test_one_master_and_a_worker_per_further_node_each_with_its_nodes_gpus():
    four = pytorchjob(h100_spec(**{"cluster.nodes": [{"gpu": "A100-80GB", "count": 4, "gpus_per_node": 4}],
                                   "job.rendezvous": "c10d", "job.master_port": 29400, "job.time_limit": None}))
    replicas = four["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    [container] = replicas["Worker"]["template"]["spec"]["containers"]
    # A100s on aws-efa: a p4d.24xlarge's 4 EFA interfaces
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4", "vpc.amazonaws.com/efa": "4"}
    assert four["spec"]["nprocPerNode"] == "4"
    assert container["command"][:5] == ["torchrun", "--nnodes", "4", "--nproc_per_node", "4"]
    assert "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)" in container["command"]
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 29400}]
    assert "activeDeadlineSeconds" not in four["spec"]["runPolicy"] and schema_errors(four) == []
    one = pytorchjob(h100_spec(**{"cluster.nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8}],
                                  "parallel.tensor": 8, "parallel.pipeline": 1}))
    assert list(one["spec"]["pytorchReplicaSpecs"]) == ["Master"] and schema_errors(one) == []


@pytest.mark.parametrize("changes, field", [
    ({"cluster.nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8},
                        {"gpu": "A100-80GB", "count": 1, "gpus_per_node": 8}]}, "cluster.nodes"),
    ({"cluster.nodes": [{"gpu": "cpu", "count": 2, "gpus_per_node": 8}], "parallel.sequence_parallel": False},
     "cluster.nodes[0].gpu"),
    ({"job.container": None}, "job.container.image"),
    ({"job.container.image": "/fsx/images/megatron.sqsh"}, "job.container.image"),
    ({"job.requeue": True}, "job.requeue"),
    ({"job.container.mounts": ["fsx"]}, "job.container.mounts[0]"),
    ({"job.container.mounts": ["/fsx/ckpt:/ckpt"]}, "data.path"),
    ({"train.load": "/scratch/ckpt"}, "train.load"),
])
def test_a_spec_that_cannot_run_as_a_pytorchjob_is_refused_naming_the_field(changes, field):
    with pytest.raises(SpecError) as info:
        pytorchjob(h100_spec(**changes))
    assert any(e.startswith(field + ":") for e in info.value.errors), info.value.errors


def test_user_strings_reach_the_pod_as_written():
    """Kubernetes substitutes $(NAME) in a container's command, args and env: a user's $ is written $$, which it
    turns back into $. YAML quotes what would otherwise change meaning."""
    spec = h100_spec(**{"job.env": {"NOTE": "a: b # c $(HOME)"},
                        "job.extra_args": ["--wandb-exp-name", "run $(date) #1"]})
    manifest = yaml.safe_load(render_manifest(spec))
    [container] = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["args"][-2:] == ["--wandb-exp-name", "run $$(date) #1"]
    assert {"name": "NOTE", "value": "a: b # c $$(HOME)"} in container["env"]
    assert manifest == pytorchjob(spec)
    assert k8s_name("20261126-090000-My Run_2") == "run-20261126-090000-my-run-2"
    long = k8s_name("x" * 80)
    assert len(long) <= 52 and long != k8s_name("x" * 81)


def test_labkit_run_dry_run_prints_the_pytorchjob(tmp_path, capsys):
    spec = h100_spec()
    path = tmp_path / "spec.yaml"
    path.write_text(spec.to_yaml())
    assert main(["run", str(path), "--backend", "k8s", "--dry-run"]) == 0
    assert capsys.readouterr().out == GOLDEN.read_text()
    assert main(["run", str(path), "--backend", "k8s", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"scripts": {"pytorchjob.yaml": GOLDEN.read_text()}}
    assert main(["run", str(HERE.parent / "examples/gpt2-xl-hetero.yaml"), "--backend", "k8s", "--dry-run"]) == 2
    assert "cluster.nodes: a TrainJob runs one pod template" in capsys.readouterr().err


FAKE_KUBECTL = """#!{python}
# kubectl as far as labkit uses it: records each call's arguments, answers from FAKE_KUBECTL_* variables.
import json, os, shutil, sys
args = sys.argv[1:]
with open(os.environ["FAKE_KUBECTL_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if args == ["config", "current-context"]:
    print("lab-cluster")
elif "apply" in args:
    if os.environ.get("FAKE_KUBECTL_REFUSE"):
        print('error: no matches for kind "PyTorchJob" in version "kubeflow.org/v1"', file=sys.stderr)
        sys.exit(1)
    shutil.copy(args[args.index("-f") + 1], os.environ["FAKE_KUBECTL_LOG"] + ".applied")
elif "get" in args and "pods" in args:
    name = args[args.index("-l") + 1].split("=")[1]
    print(f"pod/{{name}}-node-0-0-x7k2p pod/{{name}}-node-0-1-q9d4m")
elif "get" in args:
    resource = next(a for a in args if a.endswith(".kubeflow.org"))
    name = args[args.index(resource) + 1]
    conditions = [{{"type": kind, "status": "True"}} for kind in os.environ["FAKE_KUBECTL_CONDITIONS"].split()]
    if conditions:
        print(json.dumps({{"metadata": {{"name": name}}, "status": {{"conditions": conditions}}}}))
elif "logs" in args:
    print("log of " + args[args.index("logs") + 1])
elif "delete" in args:
    resource = next(a for a in args if a.endswith(".kubeflow.org"))
    print(resource + "/" + args[args.index(resource) + 1])
"""


@pytest.fixture
def kubectl(tmp_path, monkeypatch):
    """A stand-in kubectl first on PATH; returns the file its calls are logged to, one JSON list per call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL.format(python=sys.executable))
    (bin_dir / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_KUBECTL_LOG", str(tmp_path / "kubectl.log"))
    monkeypatch.setenv("FAKE_KUBECTL_CONDITIONS", "Created Running Succeeded")
    return tmp_path / "kubectl.log"


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_submission_applies_the_pytorchjob_to_the_current_context(kubectl, tmp_path):
    backend = backend_named("k8s", runs_dir=tmp_path / "runs")
    job = backend.submit(h100_spec())
    [name] = job.job_ids
    assert name == k8s_name(job.record.run_id)
    applied = job.record.path / "pytorchjob.yaml"
    assert calls(kubectl) == [["config", "current-context"], ["--context", "lab-cluster", "apply", "-f", str(applied)]]
    manifest = yaml.safe_load(Path(f"{kubectl}.applied").read_text())
    assert manifest["metadata"]["name"] == name and schema_errors(manifest) == []
    assert job.record.job_info["context"] == "lab-cluster" and job.record.job_info["backend"] == "k8s"

    job.update(backend.poll([job])[job])
    assert job.status(refresh=False).state == State.COMPLETED
    assert ["--context", "lab-cluster", "get", "pytorchjobs.kubeflow.org", name, "-o", "json",
            "--ignore-not-found"] in calls(kubectl)
    assert (job.log_dir / f"{name}-worker-0.out").read_text() == f"log of {name}-worker-0\n"
    assert backend.cancel(job)
    assert calls(kubectl)[-1] == ["--context", "lab-cluster", "delete", "pytorchjobs.kubeflow.org", name,
                                  "--ignore-not-found", "--wait=false", "-o", "name"]


def test_labkit_run_says_what_kubectl_refused_and_records_it(kubectl, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_KUBECTL_REFUSE", "1")
    path = tmp_path / "spec.yaml"
    path.write_text(h100_spec().to_yaml())
    assert main(["run", str(path), "--backend", "k8s", "--runs-dir", str(tmp_path / "runs")]) == 1
    assert 'kubectl refused the job: error: no matches for kind "PyTorchJob"' in capsys.readouterr().err
    [run] = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert "rejected by Kubernetes" in (run / "events.jsonl").read_text()
    with pytest.raises(K8sError):
        backend_named("k8s", runs_dir=tmp_path / "runs").submit(h100_spec())


@pytest.mark.parametrize("conditions, state", [
    ([], State.PENDING), (["Created"], State.PENDING), (["Created", "Running"], State.RUNNING),
    (["Created", "Succeeded"], State.COMPLETED), (["Created", "Running", "Failed"], State.FAILED),
])
def test_the_operators_conditions_give_the_state(conditions, state):
    manifest = {"status": {"conditions": [{"type": kind, "status": "True"} for kind in conditions]}}
    assert pytorchjob_status(manifest).state == state
    late = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "PyTorchJobFailed",
                                       "message": "Job x has failed because it was active longer than specified "
                                                  "deadline"}]}}
    assert pytorchjob_status(late).state == State.TIMEOUT


def test_a_login_host_is_refused_for_kubernetes_in_its_own_words():
    with pytest.raises(SpecError) as info:
        pytorchjob(h100_spec(**{"cluster.login": "me@login.example.org"}))
    login = next(e for e in info.value.errors if e.startswith("cluster.login:"))
    assert "kubectl's current context" in login and "this host" not in login


def test_a_manifest_is_not_a_slurm_script():
    with pytest.raises(SpecError, match="layout: k8s is a Kubernetes manifest"):
        render(h100_spec(), "/runs/RUN/logs", layout="k8s")

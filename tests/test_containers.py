"""job.container's runtimes (pyxis, enroot, apptainer, slurm): the image forms and mounts each takes, the job script's
check that the image is there when the job starts, and the backends that cannot run a runtime. The scripts themselves
are golden files (tests/test_jobs_render.py: apptainer.sbatch, slurm-container.sbatch)."""
from __future__ import annotations

import subprocess

import pytest

from labkit.jobs.render import render
from labkit.jobs.submission import submission_errors
from labkit.spec import SpecError, load_spec, with_changes
from labkit.spec.files import is_image_file

BASE = {"name": "tiny", "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
        "batch": {"micro": 2, "global": 8}, "train": {"iters": 10}, "data": {"mock": True},
        "cluster": {"nodes": [{"gpu": "A10", "count": 2, "gpus_per_node": 1}]}}


def spec_with(container: dict, **job):
    return load_spec(with_changes(BASE, job={"container": container, "cluster_paths": ["/images"], **job}))


def errors_of(container: dict) -> list[str]:
    with pytest.raises(SpecError) as info:
        spec_with(container)
    return info.value.errors


@pytest.mark.parametrize("container", [
    {"image": "/images/megatron.sif", "runtime": "apptainer", "mounts": ["/data:/data:ro", "/scratch:/scratch:rw"]},
    {"image": "docker://nvcr.io/nvidia/pytorch:25.04-py3", "runtime": "apptainer"},
    {"image": "oras://ghcr.io/lab/megatron.sif:1.0", "runtime": "apptainer"},
    {"image": "/images/megatron-sandbox/", "runtime": "apptainer"},  # apptainer build --sandbox
    {"image": "/images/megatron-sandbox", "runtime": "apptainer"},
    {"image": "/images/megatron-bundle", "runtime": "slurm"},
    {"image": "/images/megatron.sqsh", "runtime": "pyxis"},
    {"image": "/images/megatron.sqsh", "runtime": "enroot"},
])
def test_each_runtime_takes_its_own_image_forms(container):
    assert spec_with(container).job.container.runtime == container["runtime"]


@pytest.mark.parametrize("container, start, fix", [
    ({"image": "x", "runtime": "docker"}, "job.container.runtime: 'docker' is not one of", "apptainer, slurm"),
    ({"image": "/images/megatron.sqsh", "runtime": "apptainer"}, "job.container.image: '/images/megatron.sqsh' is "
     "not an image Apptainer runs", "apptainer build megatron.sif docker://"),
    ({"image": "/images/pytorch.tar", "runtime": "apptainer"}, "job.container.image: '/images/pytorch.tar' is "
     "not an image Apptainer runs", "a sandbox directory's path"),
    ({"image": "nvcr.io#nvidia/pytorch:25.04-py3", "runtime": "apptainer"}, "job.container.image: 'nvcr.io#nvidia/"
     "pytorch:25.04-py3' is pyxis's REGISTRY#IMAGE form", "'docker://nvcr.io/nvidia/pytorch:25.04-py3'"),
    ({"image": "nvcr.io#nvidia/pytorch:25.04-py3", "runtime": "slurm"}, "job.container.image: 'nvcr.io#nvidia/"
     "pytorch:25.04-py3' is not an OCI bundle directory", "give the bundle's path"),
    ({"image": "/images/megatron.sif", "runtime": "slurm"}, "job.container.image: '/images/megatron.sif' is not an "
     "OCI bundle directory", "give the bundle's path"),
    ({"image": "/images/megatron.sif"}, "job.container.image: '/images/megatron.sif' is an Apptainer image, which "
     "pyxis does not run", "set job.container.runtime: apptainer"),
    ({"image": "nvcr.io#nvidia/pytorch:25.04-py3", "runtime": "enroot"}, "job.container.image: 'nvcr.io#nvidia/"
     "pytorch:25.04-py3' is not a .sqsh file, the only image enroot create starts", "enroot import -o megatron.sqsh"),
    ({"image": "oras://ghcr.io/lab/megatron.sif", "runtime": "enroot"}, "job.container.image: 'oras://ghcr.io/lab/"
     "megatron.sif': enroot does not pull oras:// images", "set job.container.runtime: apptainer"),
    ({"image": "/images/bundle", "runtime": "slurm", "mounts": ["/data:/data"]}, "job.container.mounts: Slurm's srun "
     "--container mounts only what the OCI bundle's config.json lists", "add these mounts there"),
    ({"image": "/images/megatron.sif", "runtime": "apptainer", "mounts": ["/data:/data:ro+rprivate"]},
     "job.container.mounts[0]: '/data:/data:ro+rprivate': an Apptainer bind takes ro or rw", "/data:/data:ro"),
    ({"image": "/images/megatron.sif", "runtime": "apptainer", "mounts": ["tmpfs:/tmp"]},
     "job.container.mounts[0]: 'tmpfs:/tmp': Apptainer binds host paths only", "give a path for the source"),
])
def test_an_image_or_mount_its_runtime_cannot_run_is_refused_naming_the_field_and_the_fix(container, start, fix):
    [error] = errors_of(container)
    assert error.startswith(start) and fix in error


def test_uris_are_references_and_paths_are_files():
    assert not is_image_file("oras://ghcr.io/lab/megatron.sif")
    assert not is_image_file("docker://nvcr.io/nvidia/pytorch:25.04-py3")
    assert is_image_file("megatron.sif") and is_image_file("./bundle") and is_image_file("/images/megatron-bundle")


def test_a_slurm_bundle_here_must_hold_its_config_json(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with pytest.raises(SpecError) as info:
        load_spec(with_changes(BASE, job={"container": {"image": str(bundle), "runtime": "slurm"}}))
    assert info.value.errors == [f"job.container.image: '{bundle}' holds no config.json, so it is not the OCI bundle "
                                 "Slurm's srun --container runs; give the bundle's directory "
                                 "(https://slurm.schedmd.com/containers.html#bundle)"]
    (bundle / "config.json").write_text("{}")
    load_spec(with_changes(BASE, job={"container": {"image": str(bundle), "runtime": "slurm"}}))


@pytest.mark.parametrize("container", [{"image": "/images/megatron.sif", "runtime": "apptainer"},
                                       {"image": "/images/megatron-bundle", "runtime": "slurm"}])
def test_the_job_script_stops_naming_the_field_when_the_image_is_missing(container):
    script = render(spec_with(container), "/runs/RUN/logs", run_id="RUN").scripts["job.sbatch"]
    [check] = [line for line in script.splitlines() if line.startswith("[ -e ")]
    assert script.index(check) < script.index("\nsrun ")  # before any node starts
    result = subprocess.run(["bash", "-c", check], capture_output=True, text=True)  # /images does not exist here
    assert result.returncode == 1
    assert result.stderr.startswith(f"labkit: job.container.image: {container['image']} does not exist on ")
    assert "fix job.container.image in the spec" in result.stderr


@pytest.mark.parametrize("runtime", ["apptainer", "slurm"])
def test_kubernetes_refuses_a_slurm_task_runtime(runtime):
    image = {"apptainer": "docker://nvcr.io/nvidia/pytorch:25.04-py3", "slurm": "/images/megatron-bundle"}[runtime]
    errors = submission_errors(spec_with({"image": image, "runtime": runtime}), "k8s")
    assert any(e.startswith(f"job.container.runtime: {runtime} starts a Slurm task's container") for e in errors)
    assert not any(e.startswith("job.container.runtime")
                   for e in submission_errors(spec_with({"image": image, "runtime": runtime}), "multinode"))

"""What each job.container.runtime runs and the image forms and mounts it takes, each problem naming its field and
the fix:

- pyxis (srun --container-image): a registry image (nvcr.io#nvidia/pytorch:25.04-py3) or an enroot squashfs (.sqsh);
- enroot (enroot create/start, as aws-samples/awsome-distributed-training runs it): an enroot squashfs (.sqsh),
  which `enroot create` starts from (`enroot import` makes one from a registry image);
- apptainer (apptainer exec --nv): a SIF file (.sif), a sandbox directory (`apptainer build --sandbox`, given by its
  path), or an image Apptainer pulls (docker://, oras://, library://), which every task then pulls and converts into a
  SIF in its cache as the job starts: a SIF file built once on a shared filesystem starts a large job faster;
  https://apptainer.org/docs/user/main/cli/apptainer_exec.html
- slurm (srun --container, Slurm 23.02+): an OCI bundle, a directory holding the root filesystem and its config.json,
  already on every node; the bundle's config.json lists its mounts, so job.container.mounts has no place there.
  https://slurm.schedmd.com/containers.html
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.spec.errors import quote
from labkit.spec.files import is_image_file

if TYPE_CHECKING:
    from labkit.spec.schema import ContainerSpec

RUNTIMES = ("pyxis", "enroot", "apptainer", "slurm")
"""The runtimes a Slurm job's tasks can start their container with."""
APPTAINER_SCHEMES = ("docker", "oras", "library")
"""The registries Apptainer pulls an image from by itself (docker://, oras://, library://)."""
APPTAINER_BIND_FLAGS = ("ro", "rw")
"""The options of an Apptainer bind (--bind SRC:DST[:ro|rw])."""
EXAMPLE_SIF = "apptainer build megatron.sif docker://nvcr.io/nvidia/pytorch:25.04-py3"


def _scheme(image: str) -> str | None:
    """docker for docker://nvcr.io/nvidia/pytorch:25.04-py3; None for an image written without a scheme."""
    return image.split("://", 1)[0].lower() if "://" in image else None


def image_errors(container: ContainerSpec) -> list[str]:
    """What keeps job.container.image from being an image job.container.runtime runs (the image is on one line)."""
    image, runtime, field = container.image, container.runtime, "job.container.image"
    scheme, suffix = _scheme(image), image.lower().rsplit(".", 1)[-1] if "." in image else ""
    if runtime == "apptainer":
        # a SIF file, or a sandbox directory: a path ending in '/' or whose last part has no suffix (a .tar or a
        # .sqsh is neither: apptainer exec runs them only through a scheme or after apptainer build)
        last = image.rstrip("/").rsplit("/", 1)[-1]
        sandbox = is_image_file(image) and (image.endswith("/") or "." not in last)
        if scheme in APPTAINER_SCHEMES or (scheme is None and (suffix == "sif" or sandbox)):
            return []
        if "#" in image and scheme is None:
            pulled = "docker://" + image.replace("#", "/", 1)
            return [f"{field}: {quote(image)} is pyxis's REGISTRY#IMAGE form; Apptainer pulls it as {quote(pulled)}, "
                    f"or build a SIF file once ({EXAMPLE_SIF}) and give its path"]
        return [f"{field}: {quote(image)} is not an image Apptainer runs (runtime apptainer); give a .sif file "
                f"({EXAMPLE_SIF}), a sandbox directory's path (apptainer build --sandbox) or a docker://, oras:// or "
                "library:// reference"]
    if runtime == "slurm":
        if scheme is None and is_image_file(image) and suffix not in ("sif", "sqsh"):
            return []
        return [f"{field}: {quote(image)} is not an OCI bundle directory, which Slurm's srun --container runs "
                "(runtime slurm); give the bundle's path (/images/megatron-bundle, holding rootfs/ and config.json, "
                "https://slurm.schedmd.com/containers.html#bundle), or choose the runtime that runs this image"]
    if suffix == "sif" and scheme is None:
        return [f"{field}: {quote(image)} is an Apptainer image, which {runtime} does not run; set "
                "job.container.runtime: apptainer, or give a .sqsh file (enroot import) or a registry image"]
    if scheme not in (None, "docker"):
        return [f"{field}: {quote(image)}: {runtime} does not pull {scheme}:// images; give a registry image "
                "(nvcr.io#nvidia/pytorch:25.04-py3) or a .sqsh file, or set job.container.runtime: apptainer"]
    if runtime == "enroot" and not (scheme is None and suffix == "sqsh"):
        return [f"{field}: {quote(image)} is not a .sqsh file, the only image enroot create starts (runtime enroot); "
                "make one once with enroot import -o megatron.sqsh docker://nvcr.io#nvidia/pytorch:25.04-py3 and give "
                "its path, or set job.container.runtime: pyxis, which pulls registry images itself"]
    return []


def mount_errors(container: ContainerSpec) -> list[str]:
    """What the runtime adds to the checks every job.container.mounts entry gets (SRC:DST[:FLAGS])."""
    if container.runtime == "slurm" and container.mounts:
        return ["job.container.mounts: Slurm's srun --container mounts only what the OCI bundle's config.json lists "
                "(https://slurm.schedmd.com/containers.html); add these mounts there and leave job.container.mounts "
                "out"]
    if container.runtime != "apptainer":
        return []
    errors = []
    for i, mount in enumerate(container.mounts):
        source, _, rest = str(mount).partition(":")
        flags = rest.partition(":")[2]
        if source in ("tmpfs", "umount"):
            errors.append(f"job.container.mounts[{i}]: {quote(mount)}: Apptainer binds host paths only; give a path "
                          "for the source, e.g. /fsx:/fsx")
        elif flags and flags not in APPTAINER_BIND_FLAGS:
            errors.append(f"job.container.mounts[{i}]: {quote(mount)}: an Apptainer bind takes ro or rw, not "
                          f"{quote(flags)}; write e.g. /data:/data:ro")
    return errors


def container_errors(container: ContainerSpec) -> list[str]:
    """job.container's runtime, its image's form for that runtime and what the runtime allows of the mounts."""
    if container.runtime not in RUNTIMES:
        return [f"job.container.runtime: {quote(container.runtime)} is not one of {', '.join(RUNTIMES)}"]
    return (image_errors(container) if container.image else []) + mount_errors(container)

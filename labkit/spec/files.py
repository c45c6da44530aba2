"""The files a run spec names: which ones the run reads (the dataset, the tokenizer's files, a container image), which
`labkit validate` reads here, and which it leaves to the job script because they live on the cluster only
(job.cluster_paths).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from labkit.megatron_args import HF_TOKENIZER_FILE, huggingface_tokenizer_file
from labkit.spec.errors import quote

if TYPE_CHECKING:
    from labkit.spec.schema import RunSpec


def _tokenizer_file_errors(spec: RunSpec) -> list[str]:
    """The tokenizer file must be readable here, so a job is never submitted to fail on it; one under
    job.cluster_paths is left to the job script, which checks it at start."""
    tokenizer = spec.data.tokenizer
    if tokenizer is None or tokenizer.type not in ("HuggingFaceTokenizer", "SentencePieceTokenizer"):
        return []
    if not tokenizer.model:
        return [f"data.tokenizer.model: missing; {tokenizer.type} reads a file (a HuggingFace tokenizer.json or the "
                "directory holding it, or a SentencePiece .model; labkit ships labkit/data/tokenizer/llama)"]
    file = tokenizer_file(spec)
    if spec.job.on_cluster_only(file):
        return []
    try:
        with open(Path(file).expanduser(), "rb") as f:
            f.read(1)
    except OSError as exc:
        what = (f"a {HF_TOKENIZER_FILE} or the directory holding one" if tokenizer.type == "HuggingFaceTokenizer"
                else f"the {tokenizer.type} file")
        return [f"data.tokenizer.model: cannot read {quote(file)} ({exc.strerror or exc}); give {what}, or list the "
                "directory it lives in under job.cluster_paths if it exists only on the cluster"]
    return []


def _container_image_errors(spec: RunSpec) -> list[str]:
    """A container image given as a file must exist here, so that a job is never submitted to fail on it; one under
    job.cluster_paths is left to the job script, which checks it at start."""
    image = container_image_file(spec)
    if image is None or spec.job.on_cluster_only(image):
        return []
    path = Path(image).expanduser()
    if not path.exists():
        return [f"job.container.image: {quote(image)} does not exist on this machine; give the image file's path "
                "here, a registry image (nvcr.io#nvidia/pytorch:25.04-py3), or list the directory it lives in under "
                "job.cluster_paths if it exists only on the cluster"]
    if spec.job.container.runtime == "slurm" and not (path / "config.json").is_file():
        # An OCI runtime bundle is its config.json and the root filesystem it names
        # (https://github.com/opencontainers/runtime-spec/blob/main/bundle.md).
        return [f"job.container.image: {quote(image)} holds no config.json, so it is not the OCI bundle Slurm's srun "
                "--container runs; give the bundle's directory (https://slurm.schedmd.com/containers.html#bundle)"]
    return []


IMAGE_FILE_SUFFIXES = (".sqsh", ".sif")
"""How an image file is named: an enroot squashfs (what pyxis runs) or an Apptainer/Singularity image."""


def is_image_file(image: str | None) -> bool:
    """Whether a container image is given as a file, by its form: a path (/images/megatron.sqsh, ./megatron.sqsh,
    ~/megatron.sqsh, an OCI bundle's directory) or a name ending in .sqsh or .sif (megatron.sqsh, here); else a
    registry reference (nvcr.io#nvidia/pytorch:25.04-py3, whose tag never ends so, or a URI such as
    docker://nvcr.io/nvidia/pytorch:25.04-py3 or oras://ghcr.io/lab/megatron.sif)."""
    return bool(image) and "://" not in image and (image.startswith(("/", "./", "../", "~"))
                                                   or image.lower().endswith(IMAGE_FILE_SUFFIXES))


def container_image_file(spec: RunSpec) -> str | None:
    """The container image as a file (is_image_file), as written; None for a registry reference
    (nvcr.io#nvidia/pytorch:25.04-py3) or no container."""
    image = spec.job.container.image if spec.job.container else None
    return image if is_image_file(image) else None


def tokenizer_file(spec: RunSpec) -> str | None:
    """The file the spec's tokenizer reads (a HuggingFace directory's tokenizer.json), as written; None when its type
    reads none."""
    tokenizer = spec.data.tokenizer
    if tokenizer is None or not tokenizer.model:
        return None
    if tokenizer.type == "HuggingFaceTokenizer":
        return huggingface_tokenizer_file(tokenizer.model)
    return tokenizer.model if tokenizer.type == "SentencePieceTokenizer" else None


def input_paths(spec: RunSpec) -> list[tuple[str, str]]:
    """(field, path) of each file the run reads that the spec names: the dataset's .bin and .idx, the tokenizer's
    files and a container image given as a file."""
    data, paths = spec.data, []
    if data.path and not data.mock:
        paths += [("data.path", data.path + suffix) for suffix in (".bin", ".idx")]
        if data.tokenizer is None or data.tokenizer.type == "GPT2BPETokenizer":
            paths += [(f"data.{key}", getattr(data, key)) for key in ("vocab_file", "merge_file")
                      if getattr(data, key)]
    if tokenizer_file(spec) and data.path and not data.mock:
        paths.append(("data.tokenizer.model", tokenizer_file(spec)))
    if container_image_file(spec):
        paths.append(("job.container.image", container_image_file(spec)))
    return paths


def cluster_only_paths(spec: RunSpec) -> list[tuple[str, str]]:
    """input_paths under job.cluster_paths: not looked for here; the job script checks them when it starts."""
    return [(field, path) for field, path in input_paths(spec) if spec.job.on_cluster_only(path)]


def job_start_checks(spec: RunSpec) -> list[tuple[str, list[str]]]:
    """What the job script looks for before any node starts, as (field, paths of which one must exist): each
    cluster-only input path, and the file AutoTokenizer reads the class from beside a cluster-only HuggingFace
    tokenizer that Megatron-LM loads."""
    checks = [(field, [path]) for field, path in cluster_only_paths(spec)]
    file, tokenizer = tokenizer_file(spec), spec.data.tokenizer
    if (tokenizer is not None and tokenizer.type == "HuggingFaceTokenizer" and spec.job.entrypoint == "megatron-lm"
            and ("data.tokenizer.model", file) in cluster_only_paths(spec)):
        checks.append(("data.tokenizer.model", [str(Path(file).parent / name) for name in AUTOTOKENIZER_CONFIGS]))
    return checks


def checked_paths(spec: RunSpec) -> list[tuple[str, str]]:
    """(field, path) of the files `validate` read (or, for a container image, found) on this machine."""
    files = [("data.tokenizer.model", tokenizer_file(spec)), ("job.container.image", container_image_file(spec))]
    return [(field, path) for field, path in files if path and not spec.job.on_cluster_only(path)]


def path_notes(spec: RunSpec) -> list[str]:
    """What `labkit validate` says about the files the spec names: which it read here, and which it left to the job
    because they lie under job.cluster_paths. Notes, not errors."""
    notes = [f"note: checked here: {field} {path}" for field, path in checked_paths(spec)]
    notes += [f"note: not checked here (under job.cluster_paths): {field} {path}; the job script checks it when the "
              "job starts" for field, path in cluster_only_paths(spec)]
    unread = any(field == "data.tokenizer.model" for field, _ in cluster_only_paths(spec))
    if unread and "vocab_size" in spec.derived_model_keys:
        notes.append(f"note: model.vocab_size {spec.model.vocab_size} is model.preset's: the tokenizer could not be "
                     "read here to size the vocabulary; write model.vocab_size if the tokenizer's differs")
    seen = set(checked_paths(spec)) | set(cluster_only_paths(spec))
    notes += [f"note: not checked: {field} {path}; the training process opens it when it starts"
              for field, path in input_paths(spec) if (field, path) not in seen]
    return notes


AUTOTOKENIZER_CONFIGS = ("tokenizer_config.json", "config.json")
"""The files, one of which AutoTokenizer.from_pretrained(DIRECTORY) picks the tokenizer class from."""


def megatron_lm_tokenizer_errors(spec: RunSpec) -> list[str]:
    """Megatron-LM's HuggingFace tokenizer is AutoTokenizer.from_pretrained(DIRECTORY): the directory must hold a
    tokenizer.json, and the tokenizer_config.json (its tokenizer_class) or config.json that AutoTokenizer picks the
    class from (HuggingFace's save_pretrained writes them)."""
    tokenizer = spec.data.tokenizer
    if tokenizer is None or tokenizer.type != "HuggingFaceTokenizer" or not tokenizer.model:
        return []
    file = Path(huggingface_tokenizer_file(tokenizer.model))
    if file.name != HF_TOKENIZER_FILE:
        return [f"data.tokenizer.model: {quote(tokenizer.model)}: Megatron-LM (job.entrypoint: megatron-lm) is given "
                f"the directory and reads the {HF_TOKENIZER_FILE} in it; rename the file {HF_TOKENIZER_FILE} or give "
                "the directory"]
    folder = file.parent.expanduser()
    if spec.job.on_cluster_only(file) or not folder.is_dir():
        return []  # on the cluster: the job script checks it; missing here: file_errors says so
    if not any((folder / name).is_file() for name in AUTOTOKENIZER_CONFIGS):
        return [f"data.tokenizer.model: {quote(str(folder))} has no tokenizer_config.json or config.json, from which "
                "Megatron-LM's AutoTokenizer.from_pretrained picks the tokenizer class; save the tokenizer there with "
                "HuggingFace's save_pretrained (or copy the model's tokenizer_config.json beside the tokenizer.json)"]
    return []




def file_errors(spec: RunSpec) -> list[str]:
    """The files the spec names that must be readable here before anything is submitted: the tokenizer's and a
    container image given as a file (each under job.cluster_paths is left to the job script)."""
    return _tokenizer_file_errors(spec) + _container_image_errors(spec)

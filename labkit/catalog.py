"""Catalogs kept as package data in labkit/data/: GPUs, model presets, named clusters, the estimator's calibration.
(Per-layer profiles are read by labkit.estimate.profiles.)

The GPU catalog is labkit/data/gpus.yaml merged with the user's own, `gpus.yaml` in labkit's user directory
(~/.labkit/gpus.yaml, or $LABKIT_HOME/gpus.yaml when LABKIT_HOME is set): see `gpus`."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from labkit.paths import DATA_DIR, user_dir

BLOCK_SCALED = {"mxfp8": "fp8", "mxfp4": "fp4", "nvfp4": "fp4"}
"""Blackwell's block-scaled formats -> the element type whose tensor-core peak they run at."""

PEAK_PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "fp4")
"""The keys of a catalog entry's peak_tflops; fp32, fp16 and bf16 are in every entry."""

USER_EFFICIENCY = 0.5
"""Fraction of peak the estimator assumes for a GPU of the user's catalog that gives no `efficiency` (as the shipped
calibration assumes for H100-PCIe)."""


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: dict
    memory_gb: float
    memory_bw_gb_s: float
    bf16: bool
    fp16: bool
    intra_node_gbps: float
    inter_node_gbps: float
    source: str
    usable_memory_gb: float | None = None
    price_per_node_hour: float | None = None
    gpus_per_node: int | None = None
    instance: str | None = None
    aliases: tuple = field(default_factory=tuple)
    nvlink_domain_gpus: int | None = None
    """GPUs that share one NVLink domain where it spans several nodes (GB200 NVL72: 72, over 18 trays of 4 GPUs):
    ranks on different nodes of one domain talk over the NVLink rate (intra_node_gbps), not the network. None: the
    domain is the node (labkit.estimate.topology)."""
    p2p_gbps: float | None = None
    """Point-to-point rate between two ranks of one node where it differs from what the collectives reach on
    intra_node_gbps (a CPU host's gloo send/recv over loopback TCP), in Gbit/s; None: the collectives' rate."""
    message_latency_s: float | None = None
    """One small message's latency on the device's links where it exceeds the calibration's link_latency_s (gloo's
    send/recv on a CPU host), in seconds; None: the calibration's."""
    fp8_gemm_any_layout: bool = False
    """Its FP8 GEMMs take their operands in any layout (Transformer Engine's is_non_tn_fp8_gemm_supported: compute
    capability 10.x and 11.x, data-center Blackwell, and 13 on): an FP8 weight serves the backward pass as it is.
    False (Ada, Hopper): FP8 GEMMs take the TN layout only, and Transformer Engine keeps a transpose beside each FP8
    weight, twice its bytes."""

    def peak(self, precision: str) -> float:
        """Dense peak TFLOP/s for a precision; fp32 training on tensor cores is not assumed. Blackwell's block-scaled
        formats run at their element type's peak (mxfp8 at fp8's, nvfp4 at fp4's), on GPUs with FP4 tensor cores."""
        if precision in BLOCK_SCALED and not self.fp4:
            raise KeyError(f"{self.name} has no tensor cores for the block-scaled {precision} (Blackwell and later)")
        return float(self.peak_tflops[BLOCK_SCALED.get(precision, precision)])

    @property
    def fp8(self) -> bool:
        """Whether the GPU has FP8 tensor cores (Ada, Hopper and later): a catalog entry with an fp8 peak."""
        return "fp8" in self.peak_tflops

    @property
    def fp4(self) -> bool:
        """Whether the GPU has FP4 tensor cores (Blackwell and later), which also run the block-scaled formats
        (MXFP8, NVFP4): a catalog entry with an fp4 peak."""
        return "fp4" in self.peak_tflops

    @property
    def is_cpu(self) -> bool:
        """The catalog's stand-in for a CPU host: no tensor cores, a placeholder peak, megatron-core's local layers."""
        return self.name == "cpu"

    @property
    def memory_limit_gb(self) -> float:
        return self.usable_memory_gb or self.memory_gb


def _load(name: str) -> dict:
    with open(DATA_DIR / name) as fh:
        return yaml.safe_load(fh)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


class CatalogError(ValueError):
    """A GPU catalog file labkit cannot use: every problem, each naming the GPU and the field, with the fix."""

    def __init__(self, path, errors: list[str]):
        self.path, self.errors = Path(path), list(errors)
        super().__init__(f"{path}: {len(self.errors)} error(s) in this GPU catalog (the layout of "
                         f"labkit/data/gpus.yaml)\n" + "\n".join(f"  - {e}" for e in self.errors))


def user_gpus_path() -> Path:
    """The user's GPU catalog: gpus.yaml in labkit's user directory (~/.labkit, or $LABKIT_HOME)."""
    return user_dir() / "gpus.yaml"


_FIELDS = {f.name: f for f in dataclasses.fields(GPU) if f.name != "name"}
_REQUIRED = tuple(name for name, f in _FIELDS.items()
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
_POSITIVE = {  # field -> what it is, for the fix
    "memory_gb": "the GPU's memory in GB, e.g. memory_gb: 80",
    "memory_bw_gb_s": "its memory bandwidth in GB/s, e.g. memory_bw_gb_s: 3350",
    "intra_node_gbps": "the link between two GPUs of a node in Gbit/s per direction, e.g. intra_node_gbps: 3600 "
                       "(NVLink4's 450 GB/s)",
    "inter_node_gbps": "a node's network in Gbit/s, e.g. inter_node_gbps: 400",
    "usable_memory_gb": "the memory a process can allocate in GB (nvidia-smi's total), or leave it out",
    "p2p_gbps": "the point-to-point rate between two ranks of a node in Gbit/s, or leave it out",
    "message_latency_s": "one small message's latency in seconds, e.g. message_latency_s: 1.0e-4, or leave it out",
}
_WHOLE = {"gpus_per_node": "GPUs per node, e.g. gpus_per_node: 8",
          "nvlink_domain_gpus": "GPUs of one NVLink domain when it spans nodes, e.g. nvlink_domain_gpus: 72"}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _entry_errors(name: str, entry, user: bool) -> list[str]:
    """What is wrong with one catalog entry, each naming the GPU and the field, with the fix."""
    at = f"GPU {name}"
    if not isinstance(entry, dict):
        return [f"{at}: expected a mapping of its fields ({', '.join(_REQUIRED)}), got {entry!r}"]
    errors = []
    known = set(_FIELDS) | ({"efficiency"} if user else set())
    for key in entry:
        if key not in known:
            errors.append(f"{at}: {key}: unknown field; known: {', '.join(sorted(known))}")
    for key in _REQUIRED:
        if key not in entry and not (user and key == "source"):
            errors.append(f"{at}: {key}: missing; add " + (_POSITIVE.get(key) or {
                "peak_tflops": "its dense tensor-core TFLOP/s, e.g. peak_tflops: {fp32: 67, bf16: 989, fp16: 989}",
                "bf16": "bf16: true when the GPU runs bf16 (Ampere and later), else false",
                "fp16": "fp16: true when the GPU runs fp16",
                "source": "where the figures come from, e.g. source: \"vendor datasheet\""}[key]))
    peaks = entry.get("peak_tflops")
    if peaks is not None:
        if not isinstance(peaks, dict):
            errors.append(f"{at}: peak_tflops: expected a mapping like {{fp32: 67, bf16: 989, fp16: 989}}, "
                          f"got {peaks!r}")
        else:
            for key in ("fp32", "fp16", "bf16"):
                if key not in peaks:
                    errors.append(f"{at}: peak_tflops.{key}: missing; add the dense {key} TFLOP/s "
                                  f"(0 for a format the GPU lacks, with {key}: false)")
            for key, value in peaks.items():
                where = f"{at}: peak_tflops.{key}"
                if key not in PEAK_PRECISIONS:
                    hint = f"write {BLOCK_SCALED[key]} ({key} runs at its peak)" if key in BLOCK_SCALED else \
                        f"known: {', '.join(PEAK_PRECISIONS)}"
                    errors.append(f"{where}: unknown precision; {hint}")
                elif not _is_number(value) or value < 0:
                    errors.append(f"{where}: must be a number of dense TFLOP/s, 0 or more, got {value!r}")
                elif value == 0 and (key in ("fp32", "fp8", "fp4") or entry.get(key) is True):
                    fix = "leave it out on a GPU without such tensor cores" if key in ("fp8", "fp4") else \
                        f"give the dense {key} TFLOP/s" + (f", or {key}: false" if key != "fp32" else "")
                    errors.append(f"{where}: must be positive, got 0; {fix}")
    for key, what in _POSITIVE.items():
        value = entry.get(key)
        given = value is not None or (key in entry and key in _REQUIRED)  # an optional field may be null
        if given and (not _is_number(value) or value <= 0):
            errors.append(f"{at}: {key}: must be a positive number, got {value!r}; give {what}")
    for key, what in _WHOLE.items():
        value = entry.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            errors.append(f"{at}: {key}: must be a positive whole number, got {value!r}; give {what}")
    for key in ("bf16", "fp16", "fp8_gemm_any_layout"):
        if key in entry and not isinstance(entry[key], bool):
            errors.append(f"{at}: {key}: must be true or false, got {entry[key]!r}")
    price = entry.get("price_per_node_hour")
    if price is not None and (not _is_number(price) or price < 0):
        errors.append(f"{at}: price_per_node_hour: must be a number of USD, got {price!r}; or leave it out")
    aliases = entry.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        errors.append(f"{at}: aliases: expected a list of names, e.g. [\"H100\", \"H100 SXM5\"], got {aliases!r}")
    efficiency = entry.get("efficiency")
    if efficiency is not None and (not _is_number(efficiency) or not 0 < efficiency <= 1):
        errors.append(f"{at}: efficiency: must be a fraction of peak in (0, 1], got {efficiency!r}; or leave it out "
                      f"({USER_EFFICIENCY} is assumed)")
    return errors


def _checked_entries(data, path: Path, user: bool) -> dict[str, dict]:
    """The entries of a catalog file's `gpus:` mapping, each checked; a CatalogError lists every problem."""
    if data is None and user:
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        raise CatalogError(path, ["expected a mapping `gpus:` of GPU names to their fields at the top of the file, "
                                  "as in labkit/data/gpus.yaml"])
    errors = [e for name, entry in data["gpus"].items() for e in _entry_errors(str(name), entry, user)]
    if errors:
        raise CatalogError(path, errors)
    return {str(name): dict(entry) for name, entry in data["gpus"].items()}


@functools.cache
def _user_entries() -> dict[str, dict]:
    """The checked entries of the user's GPU catalog (user_gpus_path); none when there is no such file."""
    path = user_gpus_path()
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CatalogError(path, [f"cannot be read as YAML: {exc}"]) from None
    entries = _checked_entries(data, path, user=True)
    for entry in entries.values():
        entry.setdefault("source", f"the user's catalog {path}")
    return entries


@functools.cache
def gpus() -> dict[str, GPU]:
    """Every GPU of the catalog, by name: labkit/data/gpus.yaml, merged with the user's catalog.

    The user's catalog, ~/.labkit/gpus.yaml ($LABKIT_HOME/gpus.yaml when LABKIT_HOME is set), describes GPUs the
    shipped one lacks, in its layout (`gpus:` mapping names to the same fields); an entry may also give `efficiency`,
    the fraction of peak its matrix multiplies reach (the estimator's calibration; USER_EFFICIENCY when left out). A
    user entry with a shipped GPU's name replaces that entry whole, and its names and aliases win over the shipped
    aliases. Both files are checked: a missing or non-positive peak, memory or link figure raises a CatalogError
    naming the file, the GPU, the field and the fix. Read once per process; `reload` reads them again.

    Taught in lab 05.
    """
    entries = {**_checked_entries(_load("gpus.yaml"), DATA_DIR / "gpus.yaml", user=False), **_user_entries()}
    out = {}
    for name, entry in entries.items():
        entry = {k: v for k, v in entry.items() if k != "efficiency"}
        entry["aliases"] = tuple(entry.get("aliases", ()))
        out[name] = GPU(name=name, **entry)
    return out


@functools.cache
def _gpu_lookup() -> dict[str, str]:
    table = {}
    for name, gpu in gpus().items():  # the user's entries come last: their spellings win
        for spelling in (name, *gpu.aliases):
            table[_norm(spelling)] = name
    # Vendor strings often carry a prefix ("NVIDIA A100-SXM4-80GB") or a suffix ("A10-24GB"); try those shapes too.
    return table


def resolve_gpu_name(name: str) -> str | None:
    """Canonical catalog name for a GPU spelling (the user's catalog included), or None when unknown."""
    key = _norm(str(name))
    table = _gpu_lookup()
    if key in table:
        return table[key]
    if key.startswith("nvidia") and key[6:] in table:
        return table[key[6:]]
    return None


def gpu(name: str) -> GPU:
    """The catalog entry of a GPU, by name or alias (case-insensitive; vendor spellings resolve).

    Taught in lab 05.
    """
    canonical = resolve_gpu_name(name)
    if canonical is None:
        raise KeyError(f"unknown GPU {name!r}; known: {', '.join(gpus())}. A GPU the catalog lacks can be described "
                       f"in {user_gpus_path()}, in the layout of labkit/data/gpus.yaml")
    return gpus()[canonical]


def reload() -> None:
    """Forget the catalogs read so far: the next call reads the files again (after the user's gpus.yaml or
    LABKIT_HOME changed). The estimator's default calibration (labkit.estimate.calibration.default_calibration) keeps
    what it built from them until its own cache is cleared."""
    for cached in (gpus, _gpu_lookup, _user_entries, models, clusters, env_presets, megatron_lm_flags):
        cached.cache_clear()


@functools.cache
def models() -> dict[str, dict]:
    return _load("models.yaml")["models"]


@functools.cache
def clusters() -> dict[str, dict]:
    return _load("clusters.yaml")["clusters"]


@functools.cache
def env_presets() -> dict[str, dict]:
    """Named NCCL / EFA / InfiniBand settings (job.env_preset): name -> {description, source, env}."""
    return _load("clusters.yaml")["env_presets"]


@functools.cache
def megatron_lm_flags() -> frozenset[str]:
    """Every flag Megatron-LM's argument parser defines at the pinned release (labkit/data/megatron_lm_flags.txt)."""
    lines = (DATA_DIR / "megatron_lm_flags.txt").read_text().splitlines()
    return frozenset(line for line in lines if line.startswith("--"))


def calibration() -> dict:
    """The estimator's fitted constants as written in calibration.yaml (labkit.estimate.calibration builds them), with
    the efficiency of each GPU of the user's catalog: its entry's `efficiency`, else USER_EFFICIENCY where
    calibration.yaml has none for it."""
    data = _load("calibration.yaml")
    path = user_gpus_path()
    for name, entry in _user_entries().items():
        if "efficiency" in entry:
            data["efficiency"][name] = {"value": entry["efficiency"], "source": f"assumed: the user's catalog {path}"}
        elif name not in data["efficiency"]:
            data["efficiency"][name] = {"value": USER_EFFICIENCY,
                                        "source": f"assumed: no efficiency in the user's catalog {path}"}
    return data


def closest(name: str, choices) -> list[str]:
    """Up to three known names that look like `name`, for 'did you mean' hints."""
    choices = list(choices)
    by_norm = {_norm(c): c for c in choices}
    hits = difflib.get_close_matches(_norm(str(name)), list(by_norm), n=3, cutoff=0.5)
    return [by_norm[h] for h in hits]

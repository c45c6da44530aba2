"""Catalogs kept as package data in labkit/data/: GPUs, model presets, named clusters, the estimator's calibration.
(Per-layer profiles are read by labkit.estimate.profiles.)"""
from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass, field

import yaml

from labkit.paths import DATA_DIR


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

    def peak(self, precision: str) -> float:
        """Dense peak TFLOP/s for a precision; fp32 training on tensor cores is not assumed."""
        return float(self.peak_tflops[precision])

    @property
    def fp8(self) -> bool:
        """Whether the GPU has FP8 tensor cores (Ada, Hopper and later): a catalog entry with an fp8 peak."""
        return "fp8" in self.peak_tflops

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


@functools.cache
def gpus() -> dict[str, GPU]:
    """Every GPU of the catalog (gpus.yaml), by name.

    Taught in lab 05.
    """
    out = {}
    for name, entry in _load("gpus.yaml")["gpus"].items():
        entry = dict(entry)
        entry["aliases"] = tuple(entry.get("aliases", ()))
        out[name] = GPU(name=name, **entry)
    return out


@functools.cache
def _gpu_lookup() -> dict[str, str]:
    table = {}
    for name, gpu in gpus().items():
        for spelling in (name, *gpu.aliases):
            table[_norm(spelling)] = name
    # Vendor strings often carry a prefix ("NVIDIA A100-SXM4-80GB") or a suffix ("A10-24GB"); try those shapes too.
    return table


def resolve_gpu_name(name: str) -> str | None:
    """Canonical catalog name for a GPU spelling, or None when unknown."""
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
        raise KeyError(f"unknown GPU {name!r}; known: {', '.join(gpus())}")
    return gpus()[canonical]


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
    """The estimator's fitted constants as written in calibration.yaml (labkit.estimate.calibration builds them)."""
    return _load("calibration.yaml")


def closest(name: str, choices) -> list[str]:
    """Up to three known names that look like `name`, for 'did you mean' hints."""
    choices = list(choices)
    by_norm = {_norm(c): c for c in choices}
    hits = difflib.get_close_matches(_norm(str(name)), list(by_norm), n=3, cutoff=0.5)
    return [by_norm[h] for h in hits]

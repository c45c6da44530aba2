"""Per-layer profiles: measured forward seconds of each layer at one or more micro-batch sizes, per GPU type and tensor
size.

Two formats load through `load_profile` (labkit/data/profiles/README.md documents both):
- labkit's JSON: {"model", "gpu", "tensor", "micro_batch", "seq_length", "precision", "unit": "s",
  "forward_s": {"embedding", "layers": [...], "output"}, "backward_factor", "source", "measured_on"}, and optionally
  "other_micro_batches": [{"micro_batch", "forward_s", "backward_factor"}, ...] for more sizes;
- FASOP's known_cost .npy, named <model>_<gpu>_<tensor>.npy, holding [embedding, layer..., output] forward seconds at
  micro-batch 1 (FASOP takes forward + backward as 3 x forward and scales linearly with the micro-batch).
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from labkit import catalog
from labkit.paths import data_file, user_dir

SHIPPED_PROFILE_DIR = data_file("profiles")


def user_profile_dir() -> Path:
    """Where `labkit profile` writes what it measured on the user's machines; searched before the shipped profiles."""
    return user_dir() / "profiles"


# FASOP's file-name models -> labkit model presets (bert and T5 have no preset; they keep their own names).
_FASOP_MODELS = {"gpt2XL": "gpt2-xl", "gpt2": "gpt2-small", "bert": "bert-large", "T5": "t5"}
_FASOP_NAME = re.compile(r"^(?P<model>.+)_(?P<gpu>[^_]+)_(?P<tensor>\d+)$")


@dataclass
class MicroBatchTimes:
    """What was measured at one further micro-batch size: forward seconds of the ends and each layer, and the
    backward's factor."""
    embedding_s: float
    layers_s: list[float]
    output_s: float
    backward_factor: float


@dataclass
class Profile:
    """Forward seconds at `micro_batch` (the fields below) and, in `other_micro_batches`, at more sizes.

    A layer's time is not linear in the micro-batch where small ones leave the hardware idle or pay a fixed cost per
    call (a CPU's gloo all-reduces inside a tensor-parallel profile, kernel launches on a GPU), so a size between two
    measured ones is interpolated between them; outside the measured range the nearest size is scaled linearly.
    """
    model: str
    gpu: str
    tensor: int
    embedding_s: float
    layers_s: list[float]
    output_s: float
    micro_batch: int = 1
    seq_length: int | None = None
    precision: str | None = None
    backward_factor: float = 2.0
    source: str = ""
    measured_on: str = ""
    extra: dict = field(default_factory=dict)
    other_micro_batches: dict[int, MicroBatchTimes] = field(default_factory=dict)

    def _sizes(self) -> dict[int, MicroBatchTimes]:
        own = MicroBatchTimes(self.embedding_s, self.layers_s, self.output_s, self.backward_factor)
        return dict(sorted({**self.other_micro_batches, self.micro_batch: own}.items()))

    def _weights(self, micro_batch: int) -> list[tuple[MicroBatchTimes, float]]:
        """(measured size, weight) pairs whose weighted forward times give `micro_batch`'s."""
        sizes = self._sizes()
        below = [m for m in sizes if m <= micro_batch]
        above = [m for m in sizes if m >= micro_batch]
        if not below or not above:  # outside the measured range: scale the nearest size
            nearest = above[0] if not below else below[-1]
            return [(sizes[nearest], micro_batch / nearest)]
        low, high = below[-1], above[0]
        if low == high:
            return [(sizes[low], 1.0)]
        share = (micro_batch - low) / (high - low)
        return [(sizes[low], 1 - share), (sizes[high], share)]

    def backward_factor_at(self, micro_batch: int) -> float:
        """backward = factor x forward at this micro-batch size (weighted as the forward times are)."""
        pairs = self._weights(micro_batch)
        forward = sum(w * (sum(t.layers_s) + t.embedding_s + t.output_s) for t, w in pairs)
        backward = sum(w * t.backward_factor * (sum(t.layers_s) + t.embedding_s + t.output_s) for t, w in pairs)
        return backward / forward if forward > 0 else self.backward_factor

    def forward_s(self, first_layer: int, num_layers: int, micro_batch: int, embedding: bool = False,
                  output: bool = False) -> tuple[float, float]:
        """(transformer layers, embedding + output) forward seconds of one micro-batch of `micro_batch` sequences.

        Layers past the end of the measured list (a deeper model than the profiled one) take the measured mean.
        """
        layers_total = ends_total = 0.0
        for times, weight in self._weights(micro_batch):
            measured = times.layers_s[first_layer:first_layer + num_layers]
            mean = sum(times.layers_s) / len(times.layers_s) if times.layers_s else 0.0
            layers_total += weight * (sum(measured) + (num_layers - len(measured)) * mean)
            ends_total += weight * ((times.embedding_s if embedding else 0.0) + (times.output_s if output else 0.0))
        return layers_total, ends_total

    def to_dict(self) -> dict:
        out = {"model": self.model, "gpu": self.gpu, "tensor": self.tensor, "micro_batch": self.micro_batch,
               "seq_length": self.seq_length, "precision": self.precision, "unit": "s",
               "forward_s": {"embedding": self.embedding_s, "layers": list(self.layers_s), "output": self.output_s},
               "backward_factor": self.backward_factor, "source": self.source, "measured_on": self.measured_on}
        if self.other_micro_batches:
            out["other_micro_batches"] = [
                {"micro_batch": m, "forward_s": {"embedding": t.embedding_s, "layers": list(t.layers_s),
                                                 "output": t.output_s}, "backward_factor": t.backward_factor}
                for m, t in sorted(self.other_micro_batches.items())]
        out.update(self.extra)
        return out


class ProfileError(ValueError):
    pass


_KNOWN_KEYS = {"model", "gpu", "tensor", "micro_batch", "seq_length", "precision", "unit", "forward_s",
               "backward_factor", "source", "measured_on", "other_micro_batches"}


def _from_json(path: Path) -> Profile:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON: {exc}") from None
    missing = [k for k in ("model", "gpu", "tensor", "forward_s") if k not in data]
    if missing:
        raise ProfileError(f"{path}: missing {', '.join(missing)}; see labkit/data/profiles/README.md for the format")
    if data.get("unit", "s") != "s":
        raise ProfileError(f"{path}: unit {data['unit']!r} is not supported; write seconds (\"unit\": \"s\")")
    fwd = data["forward_s"]
    if not isinstance(fwd, dict) or not isinstance(fwd.get("layers"), list):
        raise ProfileError(f"{path}: forward_s must be {{\"embedding\": s, \"layers\": [s, ...], \"output\": s}}")
    others = {}
    for entry in data.get("other_micro_batches", []):
        times = entry.get("forward_s") if isinstance(entry, dict) else None
        size = entry.get("micro_batch") if isinstance(entry, dict) else None
        if (not isinstance(times, dict) or not isinstance(times.get("layers"), list) or not isinstance(size, int)
                or size < 1):
            raise ProfileError(f"{path}: each other_micro_batches entry is {{\"micro_batch\": n, \"forward_s\": "
                               f"{{\"embedding\": s, \"layers\": [s, ...], \"output\": s}}, \"backward_factor\": f}}")
        others[size] = MicroBatchTimes(
            float(times.get("embedding", 0.0)), [float(x) for x in times["layers"]], float(times.get("output", 0.0)),
            float(entry.get("backward_factor", data.get("backward_factor", 2.0))))
    return Profile(model=str(data["model"]), gpu=catalog.resolve_gpu_name(data["gpu"]) or str(data["gpu"]),
                   tensor=int(data["tensor"]), embedding_s=float(fwd.get("embedding", 0.0)),
                   layers_s=[float(x) for x in fwd["layers"]], output_s=float(fwd.get("output", 0.0)),
                   micro_batch=int(data.get("micro_batch", 1)), seq_length=data.get("seq_length"),
                   precision=data.get("precision"), backward_factor=float(data.get("backward_factor", 2.0)),
                   source=str(data.get("source", "")), measured_on=str(data.get("measured_on", "")),
                   extra={k: v for k, v in data.items() if k not in _KNOWN_KEYS}, other_micro_batches=others)


def _from_npy(path: Path) -> Profile:
    import numpy as np

    match = _FASOP_NAME.match(path.stem)
    if not match:
        raise ProfileError(f"{path}: a FASOP profile is named <model>_<gpu>_<tensor>.npy, e.g. gpt2XL_A100_1.npy")
    values = [float(x) for x in np.load(path).reshape(-1)]
    if len(values) < 3:
        raise ProfileError(f"{path}: expected [embedding, layers..., output], got {len(values)} entries")
    gpu = match["gpu"]
    return Profile(model=_FASOP_MODELS.get(match["model"], match["model"]), gpu=catalog.resolve_gpu_name(gpu) or gpu,
                   tensor=int(match["tensor"]), embedding_s=values[0], layers_s=values[1:-1], output_s=values[-1],
                   micro_batch=1, seq_length=1024, precision="fp16", backward_factor=2.0,
                   source=f"FASOP known_cost/{path.name} (forward seconds at micro-batch 1; fwd+bwd = 3 x fwd)",
                   measured_on=f"{gpu}, Megatron-LM, FASOP authors")


def load_profile(path) -> Profile:
    """Read a profile from labkit JSON or a FASOP .npy file."""
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"{path}: no such profile file")
    if path.suffix == ".npy":
        return _from_npy(path)
    return _from_json(path)


def profile_filename(model: str, gpu: str, tensor: int) -> str:
    return f"{model}_{catalog.resolve_gpu_name(gpu) or gpu}_tp{tensor}.json"


def save_profile(profile: Profile, path=None) -> Path:
    """Write a profile as labkit JSON (to <user_profile_dir()>/<model>_<gpu>_tp<t>.json when no path is given)."""
    path = Path(path) if path is not None else user_profile_dir() / profile_filename(profile.model, profile.gpu, profile.tensor)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    _index.cache_clear()
    return path


@functools.cache
def _index(directory: str) -> dict:
    table = {}
    root = Path(directory)
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".json", ".npy"):
            continue
        try:
            prof = load_profile(path)
        except ProfileError:
            continue
        # labkit JSON wins over a FASOP file for the same key: it comes from this project's own profiler
        key = (prof.model, prof.gpu, prof.tensor)
        if key not in table or path.suffix == ".json":
            table[key] = path
    return table


def _search_path(directory) -> list[str]:
    """The given directory, or the user's profiles followed by the shipped ones (the user's measurement wins)."""
    return [str(directory)] if directory else [str(user_profile_dir()), str(SHIPPED_PROFILE_DIR)]


def find_profile(model: str, gpu: str, tensor: int, directory=None) -> Profile | None:
    """The profile for a model preset on a GPU type at a tensor size, or None when none was measured.

    Taught in lab 06.
    """
    key = (model, catalog.resolve_gpu_name(gpu) or gpu, int(tensor))
    for root in _search_path(directory):
        if key in _index(root):
            return load_profile(_index(root)[key])
    return None


def available_profiles(directory=None) -> list[tuple[str, str, int]]:
    """(model, gpu, tensor) of every profile found."""
    return sorted({key for root in _search_path(directory) for key in _index(root)})

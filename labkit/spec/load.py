"""Reading a run spec: a YAML/JSON file, a mapping or a RunSpec -> plain data -> the dataclasses.

The model preset is merged under the model mapping as plain data, before any dataclass is built: every key the spec
writes wins, whatever its value (0, false and null included), and a value that is not valid is then an error naming
its field, not replaced by the preset's. Building names every unknown key and every value of the wrong type.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from labkit import catalog
from labkit.spec.checks import SpecError

DEFAULT_PRESET = "tiny"
"""The model of a spec that names none."""
_YAML_KEYS = {"global_": "global"}
# What neither the spec nor its preset sets takes Megatron-LM's default: a GPT-2-style model.
_MODEL_DEFAULTS = {"swiglu": False, "untie_embeddings": False, "normalization": "LayerNorm",
                   "position_embedding_type": "learned_absolute", "add_bias_linear": True,
                   "make_vocab_size_divisible_by": 128}
_ROTARY_BASE = 10000
"""Megatron-LM's --rotary-base default, in effect under position_embedding_type rope."""


def with_changes(data: dict, /, **changes) -> dict:
    """Plain spec data with dotted-path changes applied in place ("batch.micro" or batch__micro), not yet checked."""
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.replace("__", ".").split(".")
        for key in parents:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        node[leaf] = value
    return data


def _field_key(f: dataclasses.Field) -> str:
    return _YAML_KEYS.get(f.name, f.name)


def to_plain(obj: Any) -> Any:
    """Dataclasses -> plain mappings and lists under their YAML keys."""
    if dataclasses.is_dataclass(obj):
        return {_field_key(f): to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def read_source(source) -> tuple[dict, list[str]]:
    """Plain spec data from a path, mapping or RunSpec, with named clusters and the model preset filled in, and the
    problems found on the way."""
    data, errors = _read(source), []
    if isinstance(data.get("recompute"), str) or data.get("recompute") is False:
        if str(data["recompute"]).lower() in ("none", "false", "off"):
            data["recompute"] = None
        else:
            errors.append(f"recompute: {data['recompute']!r} is not a setting; write `recompute: none` or a mapping "
                          "like {granularity: full, method: uniform, num_layers: 1}")
            data["recompute"] = None
    cluster = data.get("cluster")
    if isinstance(cluster, str):
        if cluster in catalog.clusters():
            data["cluster"] = {"nodes": catalog.clusters()[cluster]["nodes"]}
        else:
            hint = catalog.closest(cluster, catalog.clusters())
            errors.append(f"cluster: unknown cluster {cluster!r}; known: {', '.join(catalog.clusters())}"
                          + (f" (closest: {', '.join(hint)})" if hint else ""))
            data["cluster"] = None
    model = data.get("model", {"preset": DEFAULT_PRESET})
    if dataclasses.is_dataclass(model):
        # A dataclass cannot tell a field set to None from one left out: None is "not set", so the preset fills it.
        model = {k: v for k, v in to_plain(model).items() if v is not None}
    if isinstance(model, dict):
        data["model"] = _with_preset(model, errors)
    return data, errors


def _read(source) -> dict:
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        return {_field_key(f): getattr(source, f.name) for f in dataclasses.fields(source)}  # built anew below
    if isinstance(source, dict):
        return copy.deepcopy(source)
    path = Path(source)
    if not path.exists():
        raise SpecError([f"spec: file {str(path)!r} does not exist; pass a YAML or JSON run spec"])
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise SpecError([f"spec: {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}"]) from None
    return data or {}


def _with_preset(model: dict, errors: list[str]) -> dict:
    """The model mapping over its preset's values: every key the spec wrote wins, whatever its value."""
    name = model.get("preset")
    merged = {}
    if name is not None:
        presets = catalog.models()
        if name in presets:
            merged = {k: v for k, v in presets[name].items() if k != "source"}
        else:
            hint = catalog.closest(str(name), presets)
            errors.append(f"model.preset: unknown preset {name!r}; "
                          + (f"closest: {', '.join(hint)}; " if hint else "") + f"known: {', '.join(presets)}")
    merged.update(model)
    if merged.get("position_embedding_type") != "rope" and "rotary_base" not in model:
        merged.pop("rotary_base", None)  # the preset's base belongs to the rotary positions the spec turned off
    for key, default in _MODEL_DEFAULTS.items():
        if merged.get(key) is None:
            merged[key] = default
    if merged["position_embedding_type"] == "rope" and merged.get("rotary_base") is None:
        merged["rotary_base"] = _ROTARY_BASE
    return merged


def _coerce(value: Any, tp, path: str, errors: list[str]) -> Any:
    origin = get_origin(tp)
    args = get_args(tp)
    if origin is not None and type(None) in args:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path, errors)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, errors)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path}: expected a list, got {value!r}")
            return None
        return [_coerce(v, args[0], f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping of names to values, got {value!r}")
            return None
        return {str(k): _coerce(v, args[1], f"{path}.{k}", errors) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(f"{path}: expected true or false, got {value!r}")
        return None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        errors.append(f"{path}: expected a whole number, got {value!r}")
        return None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads 1.5e-4 as a string
            except ValueError:
                pass
        errors.append(f"{path}: expected a number, got {value!r}")
        return None
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        errors.append(f"{path}: expected text, got {value!r}")
        return None
    return value


def build(cls, data: Any, path: str, errors: list[str]):
    """A `cls` dataclass from plain data, each unknown key and each value of the wrong type added to `errors`."""
    if isinstance(data, cls):
        data = to_plain(data)
    if not isinstance(data, dict):
        errors.append(f"{path or 'spec'}: expected a mapping with keys "
                      f"{', '.join(_field_key(f) for f in dataclasses.fields(cls))}, got {data!r}")
        return cls()
    hints = get_type_hints(cls)
    fields = {_field_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            hint = catalog.closest(str(key), fields)
            fix = f"did you mean {' or '.join(repr(h) for h in hint)}?" if hint else f"known keys: {', '.join(fields)}"
            errors.append(f"{where}: unknown key; {fix}")
            continue
        f = fields[key]
        coerced = _coerce(value, hints[f.name], where, errors)
        if coerced is not None or value is None:
            kwargs[f.name] = coerced
    return cls(**kwargs)

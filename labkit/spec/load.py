"""Reading a run spec: a YAML/JSON file, a mapping or a RunSpec -> plain data -> the dataclasses.

The model preset is merged under the model mapping as plain data, before any dataclass is built: every key the spec
writes a value for wins, whatever its value (0 and false included), and a value that is not valid is then an error
naming its field, not replaced by the preset's. A key written null is not set: the preset's value stands, as each
model field's doc says. Building names every unknown key and every value of the wrong type.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from labkit import catalog
from labkit.spec import yaml12
from labkit.spec.errors import SpecError, quote
from labkit.megatron.flags import DEFAULT_MERGES, DEFAULT_VOCAB, FLAG
from labkit.megatron_args import huggingface_tokenizer_file
from labkit.megatron.tokenizer import tokenizer_vocab_size

DEFAULT_PRESET = "tiny"
"""The model of a spec that names none."""
_YAML_KEYS = {"global_": "global"}
# What neither the spec nor its preset sets takes Megatron-LM's default, read from the flag that renders it: a
# GPT-2-style model.
_MODEL_DEFAULTS = {key: flag.value_when_absent for key, flag in (
    ("swiglu", FLAG.swiglu), ("untie_embeddings", FLAG.untie_embeddings_and_output_weights),
    ("normalization", FLAG.normalization), ("position_embedding_type", FLAG.position_embedding_type),
    ("add_bias_linear", FLAG.disable_bias_linear), ("make_vocab_size_divisible_by", FLAG.make_vocab_size_divisible_by),
    ("hidden_dropout", FLAG.hidden_dropout), ("attention_dropout", FLAG.attention_dropout),
    ("qk_layernorm", FLAG.qk_layernorm))}
# ... and a mixture-of-experts model's routing the same way (a dense model leaves them unset).
_MOE_DEFAULTS = {key: flag.value_when_absent for key, flag in (
    ("moe_router_topk", FLAG.moe_router_topk), ("moe_router_load_balancing_type", FLAG.moe_router_load_balancing_type),
    ("moe_aux_loss_coeff", FLAG.moe_aux_loss_coeff), ("moe_token_dispatcher_type", FLAG.moe_token_dispatcher_type),
    ("moe_grouped_gemm", FLAG.moe_grouped_gemm))}
_ROTARY_BASE = FLAG.rotary_base.default
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


def read_source(source) -> tuple[dict, list[str], frozenset[str]]:
    """Plain spec data from a path, mapping or RunSpec, with named clusters and the model preset filled in; the
    problems found on the way; and the model keys the spec did not write (its preset's, Megatron's defaults, the
    tokenizer's vocabulary), which a changed copy derives anew."""
    data, errors = _read(source), []
    if isinstance(data.get("recompute"), str) or data.get("recompute") is False:
        if str(data["recompute"]).lower() in ("none", "false", "off"):
            data["recompute"] = None
        else:
            errors.append(f"recompute: {quote(data['recompute'])} is not a setting; write `recompute: none` or a "
                          "mapping like {granularity: full, method: uniform, num_layers: 1}")
            data["recompute"] = None
    cluster = data.get("cluster")
    if isinstance(cluster, str):
        if cluster in catalog.clusters():
            data["cluster"] = {"nodes": catalog.clusters()[cluster]["nodes"]}
        else:
            hint = catalog.closest(cluster, catalog.clusters())
            errors.append(f"cluster: unknown cluster {quote(cluster)}; known: {', '.join(catalog.clusters())}"
                          + (f" (closest: {', '.join(hint)})" if hint else ""))
            data["cluster"] = None
    _zero_spellings(data, errors)
    model, derived = data.get("model", {"preset": DEFAULT_PRESET}), frozenset()
    if dataclasses.is_dataclass(model):
        # A dataclass cannot tell a field set to None from one left out: None is "not set", so the preset fills it.
        # Fields a loaded spec derived (RunSpec.derived_model_keys) are not set either.
        model = {k: v for k, v in to_plain(model).items()
                 if v is not None and k not in getattr(source, "derived_model_keys", ())}
    if isinstance(model, dict):
        data["model"] = _with_preset(model, errors)
        _data_source(data, wrote_vocab=model.get("vocab_size") is not None, errors=errors)
        derived = frozenset(data["model"]) - frozenset(k for k, v in model.items() if v is not None)
    return data, errors, derived


def _zero_spellings(data: dict, errors: list[str]) -> None:
    """optimizer.distributed: true is ZeRO stage 1 and up (megatron-core's distributed optimizer shards the optimizer
    states): the spec may write either field, or both when they agree; the one it leaves out follows the other."""
    opt = data.get("optimizer")
    if not isinstance(opt, dict):
        return
    stage, distributed = opt.get("zero_stage"), opt.get("distributed")
    # a YAML file's numbers are int subclasses that remember their source line; True is an int too
    stage_is_int = isinstance(stage, int) and not isinstance(stage, bool)
    if not stage_is_int and stage is not None or not isinstance(distributed, bool) and distributed is not None:
        return  # a value of the wrong type is named when the dataclass is built
    if stage is not None and distributed is not None and distributed != (stage >= 1):
        errors.append(f"optimizer.zero_stage: {stage} and optimizer.distributed: {str(distributed).lower()} disagree "
                      "(distributed: true is stage 1, the optimizer states sharded; stages 2 and 3 shard them too); "
                      "write only optimizer.zero_stage")
    elif stage is not None:
        opt["distributed"] = stage >= 1
    elif distributed is not None:
        opt["zero_stage"] = int(distributed)


def _data_source(data: dict, wrote_vocab: bool, errors: list[str]) -> None:
    """Mock tokens unless a dataset is given, and the vocabulary of the tokenizer that made the dataset.

    Megatron-LM builds the embedding for its tokenizer's vocabulary (--vocab-size sizes only NullTokenizer), so with a
    dataset the model's vocab_size is the tokenizer's: a preset's number gives way to it, and a number the spec wrote
    must equal it. A tokenizer file that cannot be read is left to the checks, which name it.
    """
    source = data.get("data", {})
    if dataclasses.is_dataclass(source):
        source = to_plain(source)
    if not isinstance(source, dict):
        return
    data["data"] = source = dict(source)
    path = _text(source.get("path"))
    if source.get("mock") is None:
        source["mock"] = not path
    elif source["mock"] is False and not path:
        errors.append("data.mock: false trains on a dataset, and data.path names none; give data.path (the prefix of "
                      "the dataset's .bin/.idx pair), or remove data.mock to train on mock tokens")
        return
    elif source["mock"] is True and path:
        errors.append(f"data.mock: true trains on random tokens, but data.path {quote(source['path'])} names a "
                      "dataset; remove data.mock to train on the dataset, or data.path to train on mock tokens")
        return
    if source["mock"] is not False or not path:
        return
    tokenizer = source.get("tokenizer") if isinstance(source.get("tokenizer"), dict) else {}
    kind = _text(tokenizer.get("type", "GPT2BPETokenizer"))
    if kind == "GPT2BPETokenizer":
        vocab_file = _text(source.get("vocab_file")) or str(DEFAULT_VOCAB)
        merge_file = _text(source.get("merge_file")) or str(DEFAULT_MERGES)
        files = {"vocab_file": vocab_file, "merge_file": merge_file}
        field, named = "data.vocab_file", vocab_file
    elif kind in ("HuggingFaceTokenizer", "SentencePieceTokenizer") and _text(tokenizer.get("model")):
        model = _text(tokenizer["model"])  # a HuggingFace tokenizer may be given as the directory of its tokenizer.json
        files = {"tokenizer_model": str(Path(huggingface_tokenizer_file(model) if kind == "HuggingFaceTokenizer"
                                             else model).expanduser())}
        field, named = "data.tokenizer.model", _text(tokenizer["model"])
    else:
        return
    try:
        vocab = tokenizer_vocab_size(kind, **files)
    except (OSError, ValueError):
        return
    model = data["model"]
    if wrote_vocab and model.get("vocab_size") != vocab:
        errors.append(f"model.vocab_size: {quote(model.get('vocab_size'))} does not match the {vocab} tokens of "
                      f"{field} {quote(named)}; the model's vocabulary comes from its tokenizer, so leave "
                      f"model.vocab_size out, or give the tokenizer that made the dataset")
    else:
        model["vocab_size"] = vocab


def _read(source) -> dict:
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        return {_field_key(f): getattr(source, f.name) for f in dataclasses.fields(source)}  # built anew below
    if isinstance(source, dict):
        return copy.deepcopy(source)
    return read_file(source)


def read_file(path) -> dict:
    """The plain mapping of a YAML (by the 1.2 core schema) or JSON spec file; SpecError naming `spec` when the file
    cannot be read, is not UTF-8, is too large or too deep, or holds no mapping."""
    path = Path(path)
    if not path.exists():
        raise SpecError([f"spec: file {str(path)!r} does not exist; pass a YAML or JSON run spec"])
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        with path.open("rb") as fh:
            raw = fh.read(yaml12.MAX_BYTES + 1)
    except OSError as exc:
        raise SpecError([f"spec: cannot read {path}: {exc.strerror}"]) from None
    if len(raw) > yaml12.MAX_BYTES:
        raise SpecError([f"spec: {path} is larger than {yaml12.MAX_BYTES // 1024} KiB; a spec is a few KB"])
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecError([f"spec: {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                         "save it as UTF-8"]) from None
    too_deep = SpecError([f"spec: {path} is nested deeper than {yaml12.MAX_DEPTH} levels; a spec nests four"])
    try:
        data = json.loads(text) if kind == "JSON" else yaml12.load(text)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: bad JSON, or a JSON integer too long to read
        raise SpecError([f"spec: {path} is not valid {kind}: {exc}"]) from None
    except RecursionError:  # JSON nested thousands of levels
        raise too_deep from None
    if data is None:
        raise SpecError([f"spec: empty; {path} holds no {kind} mapping, write at least `name: my-run`"])
    if not isinstance(data, dict):
        raise SpecError([f"spec: expected a mapping of keys (name, model, parallel, batch, ...), got a "
                         f"{type(data).__name__} {quote(data)}"])
    if _depth(data) > yaml12.MAX_DEPTH:
        raise too_deep
    return data


def _depth(data) -> int:
    """How deep containers nest in plain data, counted without recursion (JSON can nest thousands of levels)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= yaml12.MAX_DEPTH:
                todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _text(value) -> str | None:
    """A text value as written (a YAML number keeps its source text); None for anything else."""
    return yaml12.source_text(value) or (value if isinstance(value, str) else None)


def _with_preset(model: dict, errors: list[str]) -> dict:
    """The model mapping over its preset's values: every key the spec wrote a value for wins, whatever its value; a key
    written null keeps the preset's value (null means "not set", as in a Python-built ModelSpec)."""
    name = model.get("preset")
    merged = {}
    if name is not None and not isinstance(name, str):
        # A number is a name as written (1e3, not 1000.0). A list or a mapping is none: it stands as the unknown
        # preset it is named by below, so that the checks ask for a preset name rather than for every size.
        name = quote(name) if isinstance(name, (list, dict)) else \
            yaml12.source_text(name) or (json.dumps(name) if isinstance(name, bool) else str(name))
        model = {**model, "preset": name}
    if name is not None:
        presets = catalog.models()
        if name in presets:
            merged = {k: v for k, v in presets[name].items() if k != "source"}
        else:
            hint = catalog.closest(str(name), presets)
            errors.append(f"model.preset: unknown preset {quote(name)}; "
                          + (f"closest: {', '.join(hint)}; " if hint else "") + f"known: {', '.join(presets)}")
    merged.update({k: v for k, v in model.items() if v is not None or k not in merged})
    if merged.get("position_embedding_type") != "rope" and model.get("rotary_base") is None:
        merged.pop("rotary_base", None)  # the preset's base belongs to the rotary positions the spec turned off
    for key, default in (_MODEL_DEFAULTS | (_MOE_DEFAULTS if merged.get("num_experts") else {})).items():
        if merged.get(key) is None:
            merged[key] = default
    if merged["position_embedding_type"] == "rope" and merged.get("rotary_base") is None:
        merged["rotary_base"] = _ROTARY_BASE
    return merged


def _optional(tp) -> bool:
    return get_origin(tp) is not None and type(None) in get_args(tp)


def _coerce(value: Any, tp, path: str, errors: list[str]) -> Any:
    """`value` as the type `tp`, or None with the problem added to `errors`. Text fields keep the text the user wrote:
    a YAML number in one is its source text, never a reformatted value."""
    args = get_args(tp)
    if _optional(tp):
        if value is None:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), path, errors)
    if value is None:
        errors.append(f"{path}: missing a value; give one or leave the key out for the default")
        return None
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, errors)
    origin = get_origin(tp)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path}: expected a list, got {quote(value)}")
            return None
        items = [_coerce(v, args[0], f"{path}[{i}]", errors) for i, v in enumerate(value)]
        return [v for v in items if v is not None]  # a refused item is in `errors`; the checks see only sound ones
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping of names to values, got {quote(value)}")
            return None
        named = {yaml12.source_text(k) or str(k): v for k, v in value.items()}
        items = {k: _coerce(v, args[1], f"{path}.{k}", errors) for k, v in named.items()}
        return {k: v for k, v in items.items() if v is not None}
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(f"{path}: expected true or false, got {quote(value)}")
        return None
    if tp is int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = int(value)
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        if number is None:
            errors.append(f"{path}: expected a whole number, got {quote(value)}")
        elif not -_INT_LIMIT < number < _INT_LIMIT:
            errors.append(f"{path}: {yaml12.source_text(value) or quote(value)} does not fit in 64 bits; every count, "
                          "size and seed of a run is below 2**63")
            number = None
        return number
    if tp is float:
        return _number(value, path, errors)
    if tp is str:
        if isinstance(value, str) and "\0" in value:
            # No path, name, flag or variable can hold a NUL byte (the OS ends C strings there): refused, never cut.
            errors.append(f"{path}: contains a NUL byte (\\0) at character {value.index(chr(0)) + 1}; remove it")
            return None
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            errors.append(f'{path}: expected text, got {str(value).lower()}; write "{str(value).lower()}" in quotes '
                          "to keep it as text")
            return None
        if isinstance(value, (int, float)):  # a YAML number keeps its source text; JSON and Python ones are printed
            return yaml12.source_text(value) or str(value)
        errors.append(f"{path}: expected text, got {quote(value)}")
        return None
    return value


_INT_LIMIT = 2**63
"""Megatron and torch hold counts, sizes and seeds in 64-bit integers."""


def _number(value: Any, path: str, errors: list[str]) -> float | None:
    """A finite float: NaN or infinity in a rate, a scale or a link speed is never meant."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any float
            number = math.inf
    elif isinstance(value, str) and yaml12.core_number(value.strip()) is not None:
        number = float(yaml12.core_number(value.strip()))  # a quoted "1e-4", as JSON specs may write one
    if number is None:
        errors.append(f"{path}: expected a number, got {quote(value)}")
    elif not math.isfinite(number):
        errors.append(f"{path}: must be a finite number, got {quote(value)}")
        number = None
    return number


def build(cls, data: Any, path: str, errors: list[str]):
    """A `cls` dataclass from plain data, each unknown key and each value of the wrong type added to `errors`."""
    if isinstance(data, cls):
        data = to_plain(data)
    if not isinstance(data, dict):
        errors.append(f"{path or 'spec'}: expected a mapping with keys "
                      f"{', '.join(_field_key(f) for f in dataclasses.fields(cls))}, got {quote(data)}")
        return cls()
    hints = get_type_hints(cls)
    fields = {_field_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = yaml12.source_text(key) or str(key)
        where = f"{path}.{name}" if path else name
        if key not in fields:
            hint = catalog.closest(name, fields)
            fix = f"did you mean {' or '.join(repr(h) for h in hint)}?" if hint else f"known keys: {', '.join(fields)}"
            errors.append(f"{where}: unknown key; {fix}")
            continue
        f = fields[key]
        coerced = _coerce(value, hints[f.name], where, errors)
        if coerced is not None or (value is None and _optional(hints[f.name])):
            kwargs[f.name] = coerced
    return cls(**kwargs)

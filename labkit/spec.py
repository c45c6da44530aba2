"""The run spec: one description of a training run, from which Megatron flags, sbatch scripts and estimates are rendered.

Load it from YAML/JSON (`load_spec`) or build it in Python (`RunSpec(...)`, then `validate`). Validation collects every
problem before anything runs; each message starts with the field it is about and says how to fix it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from labkit import catalog

PRECISIONS = ("fp32", "fp16", "bf16")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class ModelSpec:
    preset: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    seq_length: int | None = None
    vocab_size: int | None = None
    swiglu: bool = False
    untie_embeddings: bool = False

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


@dataclass
class ParallelSpec:
    tensor: int = 1
    pipeline: int = 1
    data: int | None = None
    virtual_stages: int = 1
    partition: list[int] | None = None
    sequence_parallel: bool = False


@dataclass
class BatchSpec:
    micro: int = 1
    global_: int = 8  # YAML key `global`


@dataclass
class RecomputeSpec:
    granularity: str = "full"
    method: str | None = "uniform"
    num_layers: int = 1


@dataclass
class OptimizerSpec:
    name: str = "adam"
    distributed: bool = False
    lr: float = 1.5e-4
    min_lr: float = 1.0e-5
    lr_decay_style: str = "cosine"
    lr_warmup_fraction: float = 0.01
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    initial_loss_scale: float = 4294967296.0  # 2**32, Megatron's default for dynamic fp16 scaling
    loss_scale: float | None = None  # a fixed fp16 loss scale instead of the dynamic one


@dataclass
class TrainSpec:
    iters: int = 50
    log_interval: int = 10
    eval_interval: int | None = None
    eval_iters: int = 0
    seed: int = 1234
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None


@dataclass
class DataSpec:
    path: str | None = None
    mock: bool = True
    split: str = "90,5,5"
    vocab_file: str | None = None
    merge_file: str | None = None


@dataclass
class NodeGroup:
    gpu: str = "cpu"
    count: int = 1
    gpus_per_node: int = 1
    inter_node_gbps: float | None = None
    intra_node_gbps: float | None = None


@dataclass
class ClusterSpec:
    nodes: list[NodeGroup] = field(default_factory=list)
    inter_node_gbps: float | None = None
    intra_node_gbps: float | None = None


@dataclass
class ContainerSpec:
    image: str | None = None
    mounts: list[str] = field(default_factory=list)
    runtime: str = "pyxis"  # pyxis (srun --container-image) | enroot (enroot create/start, as seed 000 does)


@dataclass
class JobSpec:
    """How the job is placed on a scheduler; the local backend ignores what has no meaning there."""
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    cpus_per_task: int | None = None
    exclusive: bool = False
    container: ContainerSpec | None = None
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    master_port: int | None = None  # None: a port derived from the job id, so jobs sharing a node do not collide
    gpu_monitor_interval_s: int = 10


@dataclass
class RunSpec:
    name: str = "run"
    model: ModelSpec = field(default_factory=lambda: ModelSpec(preset="tiny"))
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    batch: BatchSpec = field(default_factory=BatchSpec)
    precision: str = "fp32"
    recompute: RecomputeSpec | None = None
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    data: DataSpec = field(default_factory=DataSpec)
    cluster: ClusterSpec | None = None
    job: JobSpec = field(default_factory=JobSpec)

    # Derived figures.
    @property
    def world_size(self) -> int:
        return sum(g.count * g.gpus_per_node for g in self.cluster_or_default().nodes)

    @property
    def data_parallel(self) -> int:
        if self.parallel.data is not None:
            return self.parallel.data
        return max(1, self.world_size // (self.parallel.tensor * self.parallel.pipeline))

    @property
    def num_micro_batches(self) -> int:
        return self.batch.global_ // (self.batch.micro * self.data_parallel)

    @property
    def layer_partition(self) -> list[int]:
        """Transformer layers per pipeline stage (the even split when no partition was given)."""
        if self.parallel.partition:
            return list(self.parallel.partition)
        p, layers = self.parallel.pipeline, self.model.num_layers
        return [layers // p + (1 if i < layers % p else 0) for i in range(p)]

    @property
    def partition_string(self) -> str:
        """The seeds' PARTITION form, e.g. 0-11-8-8-8-8-5-0."""
        return "-".join(str(n) for n in self.layer_partition)

    @property
    def stage_gpus(self) -> list[str]:
        """Catalog GPU name of each pipeline stage, filling node groups in order (stage-major, as torchrun ranks do)."""
        per_rank = [g.gpu for g in self.cluster_or_default().nodes for _ in range(g.count * g.gpus_per_node)]
        per_stage = self.parallel.tensor * self.data_parallel
        names = []
        for stage in range(self.parallel.pipeline):
            # Megatron's rank order is tp fastest, then dp, then pp: stage `stage` owns ranks [stage*tp*dp, ...).
            ranks = per_rank[stage * per_stage:(stage + 1) * per_stage] or per_rank[-1:]
            names.append(catalog.resolve_gpu_name(ranks[0]) or ranks[0])
        return names

    def cluster_or_default(self) -> ClusterSpec:
        """The cluster, or one CPU host with exactly the processes the layout needs."""
        if self.cluster is not None and self.cluster.nodes:
            return self.cluster
        procs = self.parallel.tensor * self.parallel.pipeline * (self.parallel.data or 1)
        return ClusterSpec(nodes=[NodeGroup(gpu="cpu", count=1, gpus_per_node=procs)])

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes) -> "RunSpec":
        """A copy with dotted-path changes, e.g. spec.replace(precision="bf16", **{"batch.micro": 2})."""
        return load_spec(with_changes(self.to_dict(), **changes))


def with_changes(data: dict, /, **changes) -> dict:
    """Plain spec data with dotted-path changes applied in place ("batch.micro" or batch__micro), not yet validated."""
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.replace("__", ".").split(".")
        for key in parents:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        node[leaf] = value
    return data


class SpecError(ValueError):
    """Every problem found in a spec. `errors` is a list of 'field: what is wrong; how to fix it' strings."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("invalid run spec:\n" + "\n".join(f"  - {e}" for e in self.errors))


# ---------------------------------------------------------------------------------------------------------------------
# Reading: plain data -> dataclasses, naming every unknown key and every value of the wrong type.

_YAML_KEYS = {"global_": "global"}


def _field_key(f: dataclasses.Field) -> str:
    return _YAML_KEYS.get(f.name, f.name)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_field_key(f): _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, path: str, errors: list[str]) -> Any:
    origin = get_origin(tp)
    args = get_args(tp)
    if origin is not None and type(None) in args:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path, errors)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, errors)
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


def _build(cls, data: Any, path: str, errors: list[str]):
    if isinstance(data, cls):
        data = _to_plain(data)
    if not isinstance(data, dict):
        errors.append(f"{path or 'spec'}: expected a mapping with keys {', '.join(_field_key(f) for f in dataclasses.fields(cls))}, got {data!r}")
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


def _read(source) -> dict:
    if isinstance(source, RunSpec):
        return source.to_dict()
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


def load_spec(source) -> RunSpec:
    """Read a spec (path, dict or RunSpec), apply its model preset and validate it. Raises SpecError with every problem."""
    data = _read(source)
    errors: list[str] = []
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
    spec = _build(RunSpec, data, "", errors)
    _apply_preset(spec, errors)
    errors += validate(spec, raise_errors=False)
    if errors:
        raise SpecError(errors)
    return spec


def _apply_preset(spec: RunSpec, errors: list[str]) -> None:
    model = spec.model
    if model.preset is None:
        return
    presets = catalog.models()
    if model.preset not in presets:
        hint = catalog.closest(model.preset, presets)
        errors.append(f"model.preset: unknown preset {model.preset!r}; "
                      + (f"closest: {', '.join(hint)}; " if hint else "") + f"known: {', '.join(presets)}")
        return
    for key, value in presets[model.preset].items():
        if key != "source" and getattr(model, key) in (None, False):
            setattr(model, key, value)


# ---------------------------------------------------------------------------------------------------------------------
# Checking: every rule names its field and the fix.

def validate(spec: RunSpec, raise_errors: bool = True) -> list[str]:
    errors: list[str] = []
    m, par, b = spec.model, spec.parallel, spec.batch

    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
        value = getattr(m, name)
        if value is None:
            errors.append(f"model.{name}: missing; set it or pick a model.preset ({', '.join(catalog.models())})")
        elif value <= 0:
            errors.append(f"model.{name}: must be a positive number, got {value}")
    for name in ("num_query_groups", "ffn_hidden_size"):
        value = getattr(m, name)
        if value is not None and value <= 0:
            errors.append(f"model.{name}: must be a positive number, got {value}; or leave it out for the default")
    for where, value in (("parallel.tensor", par.tensor), ("parallel.pipeline", par.pipeline),
                         ("parallel.data", par.data), ("parallel.virtual_stages", par.virtual_stages),
                         ("batch.micro", b.micro), ("batch.global", b.global_), ("train.iters", spec.train.iters),
                         ("train.log_interval", spec.train.log_interval)):
        if value is not None and value <= 0:
            errors.append(f"{where}: must be a positive number, got {value}")
    if spec.precision not in PRECISIONS:
        errors.append(f"precision: {spec.precision!r} is not one of {', '.join(PRECISIONS)}")
    if spec.optimizer.name not in OPTIMIZERS:
        errors.append(f"optimizer.name: {spec.optimizer.name!r} is not one of {', '.join(OPTIMIZERS)}")
    if spec.optimizer.lr_decay_style not in LR_DECAY_STYLES:
        errors.append(f"optimizer.lr_decay_style: {spec.optimizer.lr_decay_style!r} is not one of "
                      f"{', '.join(LR_DECAY_STYLES)}")
    if spec.optimizer.lr is not None and spec.optimizer.lr <= 0:
        errors.append(f"optimizer.lr: must be positive, got {spec.optimizer.lr}")
    errors += _check_recompute(spec)
    errors += _check_cluster(spec)
    if errors and any(e.startswith(("model.", "parallel.tensor", "parallel.pipeline", "batch.")) for e in errors):
        return _finish(errors, raise_errors)  # the layout checks below need sane sizes

    t, p = par.tensor, par.pipeline
    if m.num_attention_heads % t:
        errors.append(f"model.num_attention_heads: {m.num_attention_heads} heads do not split over parallel.tensor={t}; "
                      f"use a tensor size that divides {m.num_attention_heads}")
    if m.hidden_size % m.num_attention_heads:
        errors.append(f"model.hidden_size: {m.hidden_size} is not divisible by num_attention_heads="
                      f"{m.num_attention_heads}; each head needs an equal share")
    groups = m.query_groups
    if m.num_query_groups is not None and m.num_attention_heads % groups:
        errors.append(f"model.num_query_groups: {groups} does not divide num_attention_heads={m.num_attention_heads}")
    elif m.num_query_groups is not None and groups % t:
        errors.append(f"model.num_query_groups: {groups} query groups do not split over parallel.tensor={t}; "
                      f"use a tensor size that divides {groups}")
    if par.sequence_parallel and t == 1:
        errors.append("parallel.sequence_parallel: needs parallel.tensor > 1 (it splits activations across tensor ranks); "
                      "set it to false or raise parallel.tensor")

    world = spec.world_size
    if spec.cluster is not None and spec.cluster.nodes and par.data is not None and world != t * p * par.data:
        errors.append(f"parallel.data: world size {world} (cluster.nodes) != tensor {t} x pipeline {p} x data {par.data} "
                      f"= {t * p * par.data}; set parallel.data to {world // (t * p) if world % (t * p) == 0 else '?'} "
                      "or change cluster.nodes")
    elif world % (t * p):
        errors.append(f"parallel.pipeline: world size {world} is not divisible by tensor {t} x pipeline {p}; "
                      "change parallel.tensor/pipeline or cluster.nodes")
    d = spec.data_parallel

    errors += _check_partition(spec)
    if b.global_ % (b.micro * d):
        errors.append(f"batch.global: {b.global_} is not divisible by batch.micro {b.micro} x data {d} = {b.micro * d}; "
                      f"use a multiple of {b.micro * d}, e.g. {max(1, b.global_ // (b.micro * d)) * b.micro * d}")
    elif par.virtual_stages > 1:
        if p == 1:
            errors.append("parallel.virtual_stages: the interleaved schedule needs parallel.pipeline > 1")
        per_stage = m.num_layers // p if m.num_layers % p == 0 else None
        if par.partition:
            errors.append("parallel.virtual_stages: an explicit parallel.partition cannot be interleaved; "
                          "drop one of them")
        elif per_stage is None or per_stage % par.virtual_stages:
            errors.append(f"parallel.virtual_stages: {par.virtual_stages} does not divide the layers per stage "
                          f"({m.num_layers}/{p}); choose a divisor of {per_stage or 'the even split'}")
        if spec.num_micro_batches % p:
            errors.append(f"parallel.virtual_stages: the interleaved schedule needs the micro-batch count "
                          f"({spec.num_micro_batches}) to be a multiple of parallel.pipeline ({p}); raise batch.global")
    return _finish(errors, raise_errors)


def _finish(errors: list[str], raise_errors: bool) -> list[str]:
    if errors and raise_errors:
        raise SpecError(errors)
    return errors


def _check_recompute(spec: RunSpec) -> list[str]:
    r = spec.recompute
    if r is None:
        return []
    errors = []
    if r.granularity not in RECOMPUTE_GRANULARITIES:
        errors.append(f"recompute.granularity: {r.granularity!r} is not one of {', '.join(RECOMPUTE_GRANULARITIES)} "
                      "(or write `recompute: none`)")
    if r.granularity == "full":
        if r.method not in RECOMPUTE_METHODS:
            errors.append(f"recompute.method: {r.method!r} is not one of {', '.join(RECOMPUTE_METHODS)} "
                          "(needed with granularity full)")
        if r.num_layers is None or r.num_layers <= 0:
            errors.append(f"recompute.num_layers: must be a positive number, got {r.num_layers}")
        elif spec.model.num_layers and r.method == "block" and r.num_layers > spec.model.num_layers:
            errors.append(f"recompute.num_layers: {r.num_layers} exceeds model.num_layers {spec.model.num_layers}")
    return errors


def _check_cluster(spec: RunSpec) -> list[str]:
    if spec.cluster is None:
        return []
    errors = []
    if not spec.cluster.nodes:
        errors.append("cluster.nodes: empty; list at least one node group like {gpu: A100-80GB, count: 1, gpus_per_node: 8}")
    for i, group in enumerate(spec.cluster.nodes):
        where = f"cluster.nodes[{i}]"
        name = catalog.resolve_gpu_name(group.gpu)
        if name is None:
            hint = catalog.closest(group.gpu, [n for g in catalog.gpus().values() for n in (g.name, *g.aliases)])
            errors.append(f"{where}.gpu: unknown GPU {group.gpu!r}; " + (f"closest: {', '.join(hint)}; " if hint else "")
                          + f"known: {', '.join(catalog.gpus())}")
        else:
            gpu = catalog.gpus()[name]
            if spec.precision == "bf16" and not gpu.bf16:
                errors.append(f"precision: bf16 is not supported by {name} ({where}.gpu); use fp16 on this GPU")
            if spec.precision == "fp16" and not gpu.fp16:
                errors.append(f"precision: fp16 is not supported by {name} ({where}.gpu); use bf16 or fp32")
        for key in ("count", "gpus_per_node"):
            if getattr(group, key) <= 0:
                errors.append(f"{where}.{key}: must be a positive number, got {getattr(group, key)}")
        for key in ("inter_node_gbps", "intra_node_gbps"):
            if getattr(group, key) is not None and getattr(group, key) <= 0:
                errors.append(f"{where}.{key}: must be a positive link speed in Gbit/s, got {getattr(group, key)}")
    for key in ("inter_node_gbps", "intra_node_gbps"):
        if getattr(spec.cluster, key) is not None and getattr(spec.cluster, key) <= 0:
            errors.append(f"cluster.{key}: must be a positive link speed in Gbit/s, got {getattr(spec.cluster, key)}")
    return errors


def _check_partition(spec: RunSpec) -> list[str]:
    part, p, layers = spec.parallel.partition, spec.parallel.pipeline, spec.model.num_layers
    if part is None:
        return []  # the default split gives earlier stages one more layer when it is uneven
    errors = []
    if len(part) != p:
        errors.append(f"parallel.partition: has {len(part)} stages but parallel.pipeline is {p}; "
                      f"give one layer count per pipeline stage")
    if any(n is None or n < 0 for n in part):
        errors.append(f"parallel.partition: layer counts must be zero or more, got {part}")
    elif sum(part) != layers:
        errors.append(f"parallel.partition: sums to {sum(part)} but model.num_layers is {layers}; "
                      f"adjust the counts so they add up to {layers}")
    return errors


def resolved_summary(spec: RunSpec) -> dict:
    """What `labkit validate` prints next to the spec: the figures derived from it."""
    return {
        "world_size": spec.world_size,
        "tensor": spec.parallel.tensor,
        "pipeline": spec.parallel.pipeline,
        "data": spec.data_parallel,
        "num_micro_batches": spec.num_micro_batches,
        "partition": spec.partition_string,
        "stage_gpus": spec.stage_gpus,
        "tokens_per_iteration": spec.batch.global_ * spec.model.seq_length,
    }


__all__ = ["RunSpec", "ModelSpec", "ParallelSpec", "BatchSpec", "RecomputeSpec", "OptimizerSpec", "TrainSpec",
           "DataSpec", "NodeGroup", "ClusterSpec", "JobSpec", "ContainerSpec", "SpecError", "load_spec", "validate",
           "resolved_summary", "math"]

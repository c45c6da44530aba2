"""What the planner starts from: the spec it varies (a named cluster, a cluster file or a run spec, plus the model,
batch and precision), and the layout fields the user wrote, which it keeps.

Every layout field a run spec writes is a constraint: `parallel: {tensor: 4}` plans only tensor size 4, `recompute:
null` plans without recompute, `optimizer: {distributed: true}` keeps the distributed optimizer. Fields left out are
searched. Taught in lab 06.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from labkit import catalog
from labkit.estimate.calibration import OVERLAPS, default_calibration
from labkit.megatron import rules
from labkit.spec import RunSpec, SpecError, load_spec
from labkit.spec.checks import MAX_WORLD, SPEC_FIELDS
from labkit.spec.load import read_file

SEARCHED = object()
"""The value of a Constraints field the user left out: the planner searches it."""


@dataclass(frozen=True)
class Constraints:
    """Layout fields the input spec fixed; SEARCHED where it left them out.

    Taught in lab 06.
    """
    tensor: object = SEARCHED
    """parallel.tensor."""
    pipeline: object = SEARCHED
    """parallel.pipeline."""
    data: object = SEARCHED
    """parallel.data."""
    context: object = SEARCHED
    """parallel.context (searched on GPUs with flash attention for long sequences; see plan.search.context_sizes)."""
    virtual_stages: object = SEARCHED
    """parallel.virtual_stages."""
    partition: object = SEARCHED
    """parallel.partition: transformer layers per pipeline stage."""
    sequence_parallel: object = SEARCHED
    """parallel.sequence_parallel."""
    micro_batch: object = SEARCHED
    """batch.micro."""
    recompute: object = SEARCHED
    """recompute: a RecomputeSpec, or None for no recompute."""
    distributed_optimizer: object = SEARCHED
    """optimizer.distributed."""
    zero_stage: object = SEARCHED
    """optimizer.zero_stage (optimizer.distributed, its stage-1 spelling, fixes it too)."""
    expert: object = SEARCHED
    """parallel.expert (a mixture-of-experts model's; a dense model's is 1)."""
    expert_tensor: object = SEARCHED
    """parallel.expert_tensor: a size, or None for the tensor size."""

    @classmethod
    def written(cls, data: dict, spec: RunSpec) -> "Constraints":
        """The constraints of a spec file's mapping `data` (what the user wrote), with the values `spec` (that file
        loaded) resolved them to."""
        parallel = data.get("parallel") if isinstance(data.get("parallel"), dict) else {}
        fixed = {key: getattr(spec.parallel, key) for key in ("tensor", "pipeline", "data", "context",
                                                               "virtual_stages", "partition", "sequence_parallel",
                                                               "expert", "expert_tensor")
                 if parallel.get(key) is not None}
        if isinstance(data.get("batch"), dict) and data["batch"].get("micro") is not None:
            fixed["micro_batch"] = spec.batch.micro
        if "recompute" in data:
            fixed["recompute"] = spec.recompute
        if isinstance(data.get("optimizer"), dict) and data["optimizer"].get("distributed") is not None:
            fixed["distributed_optimizer"] = spec.optimizer.distributed
        if isinstance(data.get("optimizer"), dict) and any(data["optimizer"].get(key) is not None
                                                           for key in ("distributed", "zero_stage")):
            fixed["zero_stage"] = spec.optimizer.zero_stage
        return cls(**fixed)

    def allows(self, name: str, value) -> bool:
        wanted = getattr(self, name)
        return wanted is SEARCHED or wanted == value

    def kept(self) -> dict:
        """The fixed fields, by name."""
        return {k: v for k, v in self.__dict__.items() if v is not SEARCHED}


def planning_input(target: str, model: str | None = None, global_batch: int | None = None,
                   precision: str | None = None) -> tuple[RunSpec, Constraints]:
    """The spec the planner varies and the constraints it keeps: from a named cluster, a cluster YAML or a run spec,
    plus the model preset, global batch and precision (each over the spec's). What the GPUs must run (the precision,
    attention kernels, overlaps) is checked on the GPUs of the planner's cluster; the layout once the planner has
    chosen one. The overlaps the input does not write are what its stack runs there (`stack_overlaps`). Raises
    SpecError naming what is wrong."""
    spec_data: dict = {}
    written_data = None
    if target in catalog.clusters():
        cluster = catalog.clusters()[target]["nodes"]
    else:
        path = Path(target)
        if not path.exists():
            hint = catalog.closest(target, catalog.clusters())
            raise SpecError([f"CLUSTER_OR_SPEC: {target!r} is neither a file nor a cluster name; known clusters: "
                             f"{', '.join(catalog.clusters())}" + (f" (closest: {', '.join(hint)})" if hint else "")])
        data = read_file(path)
        if "nodes" in data and "model" not in data:
            cluster = data
        else:
            written_data = data
            cluster = data.get("cluster")
            if isinstance(cluster, str):
                if cluster not in catalog.clusters():
                    raise SpecError([f"cluster: unknown cluster {cluster!r}; known: {', '.join(catalog.clusters())}"])
                cluster = catalog.clusters()[cluster]["nodes"]
    if isinstance(cluster, list):
        cluster = {"nodes": cluster}
    if not cluster or not cluster.get("nodes"):
        raise SpecError(["cluster: the planner needs a cluster; name one from labkit/data/clusters.yaml or give a spec "
                         "with cluster.nodes"])
    # The cluster alone first: every bad node field is named, before anything is derived from it.
    on_cluster = {"model": {"preset": "tiny"}, "cluster": cluster,
                  "batch": {"micro": 1, "global": _world(cluster["nodes"])}}
    checked = load_spec(on_cluster)
    gpus = list(dict.fromkeys(g.gpu for g in checked.cluster.nodes))
    pending: dict = {}
    constraints = Constraints()
    overlap_tp = False
    written_kernels: dict = {}
    if written_data is not None:
        without, pending = _without_layout_checks(written_data)
        written = _load_on_gpus(without, gpus)
        for key, value in pending.items():
            setattr(written.parallel, key, value)
        spec_data = written.to_dict()
        constraints = Constraints.written({**written_data, "optimizer": without.get("optimizer")}, written)
        if isinstance(written_data.get("kernels"), dict):
            written_kernels = written_data["kernels"]
        overlap_tp = written_kernels.get("tp_comm_overlap") is True
    if model:
        spec_data["model"] = {"preset": model}
    elif not spec_data.get("model"):
        raise SpecError(["--model: missing; pick a preset: " + ", ".join(catalog.models())])
    if global_batch:
        spec_data["batch"] = {"micro": 1, "global": global_batch}
    elif not spec_data.get("batch"):
        raise SpecError(["--global-batch: missing; give the sequences per step, e.g. --global-batch 64"])
    _check_pending(pending, checked, spec_data, overlap_tp)
    if precision is None and "precision" not in spec_data:
        has_bf16 = all(catalog.gpu(g.gpu).bf16 for g in checked.cluster.nodes if catalog.resolve_gpu_name(g.gpu))
        precision = "bf16" if has_bf16 else "fp16"
    if precision:
        spec_data["precision"] = precision
    spec_data.setdefault("name", f"plan-{spec_data['model'].get('preset') or 'model'}")
    # validated on the cluster's GPUs without a layout (the layout is what the planner chooses), then placed on it
    spec_data.update(parallel={"tensor": 1, "pipeline": 1}, recompute=None)
    spec_data["batch"] = {**spec_data["batch"], "micro": 1}
    base = _load_on_gpus(spec_data, gpus)
    written_model = (written_data or {}).get("model")
    if not model and isinstance(written_model, dict) and written_model.get("moe_token_dispatcher_type") == "flex":
        base = _flex_dispatcher(written_model, base, spec_data, gpus,
                                pinned=_one_expert_rank(pending, constraints, _world(cluster["nodes"])))
    overlap_moe = written_kernels.get("overlap_moe_expert_parallel_comm") is True
    if overlap_moe:
        _check_moe_overlap(spec_data, gpus, pending)
    # overlaps on wherever the planner's layout allows them (labkit.plan.search): tensor-parallel overlap where it has
    # sequence parallelism, the parameter gather where it shards the optimizer
    on_gpus = not any(catalog.gpu(g.gpu).is_cpu for g in checked.cluster.nodes)
    kernels = replace(base.kernels, tp_comm_overlap=overlap_tp, overlap_moe_expert_parallel_comm=overlap_moe)
    kernels = replace(kernels, **stack_overlaps(kernels.stack, on_gpus, written_kernels))
    return replace(base, cluster=checked.cluster, kernels=kernels), constraints


def stack_overlaps(stack: str | None, on_gpus: bool, written: dict | None = None) -> dict[str, bool]:
    """The overlaps a plan takes where its input does not write them (`written`: the spec's kernels mapping): those
    the training software (kernels.stack; None: the calibration's default_stack) runs on GPUs, the stack's `overlaps`
    in labkit/data/calibration.yaml: megatron-core and megatron-bridge stand for NVIDIA's NeMo and Megatron-Bridge
    recipes, which overlap tensor-, data- and pipeline-parallel communication (labkit/data/published_runs.yaml);
    pytorch-native overlaps FSDP2's transfers but not its tensor-parallel ones; deepspeed-megatron-2020 overlaps none.
    labkit's driver on CPUs overlaps none. The parameter gather runs only beside the gradient reduce
    (labkit.megatron.rules)."""
    written = written or {}
    runs = default_calibration().stack(stack).overlaps if on_gpus else ()
    overlaps = {name: written.get(name, name in runs) is True for name in OVERLAPS}
    overlaps["overlap_param_gather"] &= overlaps["overlap_grad_reduce"]
    return {name: value for name, value in overlaps.items() if name not in written}


def assumptions(base: RunSpec) -> dict:
    """What a plan of `base` (from `planning_input`) takes the software to do, for the plan to state: the stack and
    its overlaps (each on wherever the chosen layout allows it)."""
    moe_overlap = {"overlap_moe_expert_parallel_comm": True} if base.kernels.overlap_moe_expert_parallel_comm else {}
    return {"stack": default_calibration().stack(base.kernels.stack).name,
            **{name: getattr(base.kernels, name) for name in OVERLAPS}, **moe_overlap}


def _without_layout_checks(data: dict) -> tuple[dict, dict]:
    """A spec file's mapping without what only the planner's layout settles, and the parallel fields set aside
    (LAYOUT_PENDING, checked by `_check_pending`). kernels.tp_comm_overlap needs sequence parallelism, which the
    planner turns on wherever tensor parallelism is; kernels.overlap_param_gather needs the distributed optimizer,
    which the planner then keeps (optimizer.distributed: true) where the spec left it out."""
    without = {**data, "cluster": None}
    pending = {}
    if isinstance(data.get("parallel"), dict):
        without["parallel"] = parallel = dict(data["parallel"])
        pending = {key: parallel.pop(key) for key in LAYOUT_PENDING if parallel.get(key) is not None}
    kernels = data.get("kernels") if isinstance(data.get("kernels"), dict) else {}
    if kernels.get("tp_comm_overlap") is True:
        if pending.get("sequence_parallel") is False:
            raise SpecError(["kernels.tp_comm_overlap: overlaps sequence parallelism's all-gathers and "
                             "reduce-scatters, and parallel.sequence_parallel is false; drop one of them"])
        without["kernels"] = kernels = {**kernels, "tp_comm_overlap": False}
    if kernels.get("overlap_moe_expert_parallel_comm") is True:  # needs expert ranks: `_check_moe_overlap`
        without["kernels"] = {**kernels, "overlap_moe_expert_parallel_comm": False}
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    if model.get("moe_token_dispatcher_type") == "flex":  # needs expert ranks too: `_flex_dispatcher`
        without["model"] = {key: value for key, value in model.items() if key != "moe_flex_dispatcher_backend"}
        without["model"]["moe_token_dispatcher_type"] = "alltoall"
    optimizer = data.get("optimizer") if isinstance(data.get("optimizer"), dict) else {}
    if kernels.get("overlap_param_gather") is True and optimizer.get("distributed") is None:
        without["optimizer"] = {**optimizer, "distributed": True}
    return without, pending


def _check_moe_overlap(spec_data: dict, gpus: list[str], pending: dict) -> None:
    """The checks `load_spec` makes of kernels.overlap_moe_expert_parallel_comm (set aside by `_without_layout_checks`)
    but the one on expert ranks, which the planner chooses (labkit.plan.search turns the overlap on wherever the
    layout has them, and interleaves a pipeline), unless the spec wrote parallel.expert 1."""
    kernels = {**(spec_data.get("kernels") or {}), "overlap_moe_expert_parallel_comm": True}
    _load_but_layout({**spec_data, "kernels": kernels}, gpus,
                     f"{SPEC_FIELDS['expert_model_parallel_size']}: {rules.NO_EXPERT_PARALLELISM}",
                     pinned=pending.get("expert") == 1)


def _flex_dispatcher(written_model: dict, base: RunSpec, spec_data: dict, gpus: list[str], pinned: bool) -> RunSpec:
    """`base` with the flex dispatcher a spec file wrote (set aside by `_without_layout_checks`), after the checks
    `load_spec` makes of it but the one on expert ranks, which the planner chooses (labkit.plan.search gives flex
    expert_tensor x expert ranks above 1), unless the spec or the cluster left one such rank (`pinned`)."""
    flex = {"moe_token_dispatcher_type": "flex",
            "moe_flex_dispatcher_backend": written_model.get("moe_flex_dispatcher_backend")}
    _load_but_layout({**spec_data, "model": {**spec_data["model"], **flex}}, gpus,
                     f"{SPEC_FIELDS['moe_token_dispatcher_type']}: flex: {rules.FLEX_NEEDS_RANKS}", pinned=pinned)
    return replace(base, model=replace(base.model, **flex))


def _load_but_layout(data: dict, gpus: list[str], layout_problem: str, pinned: bool) -> None:
    """`data` checked as `_load_on_gpus` checks it, every problem raised but the one that starts `layout_problem`: a
    setting's need of the layout the planner has yet to choose, raised too where the spec or the cluster leaves no
    layout that meets it (`pinned`)."""
    try:
        _load_on_gpus(data, gpus)
    except SpecError as exc:
        errors = [e for e in exc.errors if pinned or not e.startswith(layout_problem)]
        if errors:
            raise SpecError(errors) from None


def _one_expert_rank(pending: dict, constraints: Constraints, world: int) -> bool:
    """Whether every layout the planner may choose has one expert-tensor x expert rank: one GPU, or parallel.expert 1
    written with parallel.expert_tensor 1 (or left to the tensor size, written as 1)."""
    expert_tensor = pending.get("expert_tensor")
    if expert_tensor is None and constraints.tensor is not SEARCHED:
        expert_tensor = constraints.tensor
    return world == 1 or (pending.get("expert") == 1 and expert_tensor == 1)


def _load_on_gpus(data: dict, gpus: list[str]) -> RunSpec:
    """`data` loaded on one host of each GPU type of the planner's cluster, with the processes its layout needs: what
    the GPUs must run is checked on the GPUs the plan uses (fp8 on a mixed cluster needs FP8 on every type), the
    layout's fit to the cluster once the planner has chosen one. Raises SpecError with every problem, each once."""
    errors: list[str] = []
    loaded = None
    for gpu in gpus:
        host = {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": _processes(data.get("parallel"))}]}
        try:
            loaded = load_spec({**data, "cluster": host})
        except SpecError as exc:
            errors += [e for e in exc.errors if e not in errors]
    if errors:
        raise SpecError(errors)
    return loaded


def _processes(parallel) -> int:
    """Processes a written layout needs, from fields not yet checked (bad or huge ones are named by the checks, on one
    process)."""
    count = 1
    for key in ("tensor", "context", "pipeline", "data"):
        value = parallel.get(key) if isinstance(parallel, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            count *= value
    return count if count <= MAX_WORLD else 1


# parallel fields a spec may write for the planner to keep whose checks need the cluster or the tensor size it picks
LAYOUT_PENDING = ("context", "sequence_parallel", "expert", "expert_tensor")


def _check_pending(pending: dict, on_cluster: RunSpec, spec_data: dict, overlap_tp: bool = False) -> None:
    """The checks `load_spec` makes of parallel.context, parallel.sequence_parallel and kernels.tp_comm_overlap (set
    aside by `_without_layout_checks`), on the planner's cluster."""
    errors = []
    context, sp = pending.get("context", 1), pending.get("sequence_parallel", False)
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        errors.append(f"parallel.context: {context!r} is not a whole number of 1 or more; give the context-parallel "
                      "size, e.g. 2, or leave it out for the planner to choose")
    elif context > 1 and spec_data.get("model", {}).get("seq_length", 0) % (2 * context):
        errors += [f"parallel.context: {problem.message}" for problem in rules.context_split_problems(
            SPEC_FIELDS.get, seq_length=spec_data["model"]["seq_length"], context=context)]
    if not isinstance(sp, bool):
        errors.append(f"parallel.sequence_parallel: {sp!r} is not true or false")
    for key in ("expert", "expert_tensor"):
        size = pending.get(key)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            errors.append(f"parallel.{key}: {size!r} is not a whole number of 1 or more; leave it out for the planner "
                          "to choose")
    model = spec_data.get("model") or {}
    experts = model.get("num_experts") or catalog.models().get(model.get("preset"), {}).get("num_experts")
    if pending.get("expert", 1) != 1 and not errors:
        if not experts:
            errors.append("parallel.expert: splits experts over ranks; the model has none (model.num_experts)")
        elif experts % pending["expert"]:
            errors.append(f"parallel.expert: {pending['expert']} ranks cannot share model.num_experts {experts} "
                          f"evenly; use a divisor of {experts}")
    on_cpu = any(catalog.gpu(g.gpu).is_cpu for g in on_cluster.cluster.nodes)
    for key, used in (("parallel.context", context != 1), ("parallel.sequence_parallel", sp is True),
                      ("kernels.tp_comm_overlap", overlap_tp)):
        if used and on_cpu and not errors:
            errors.append(f"{key}: {rules.NEEDS_TRANSFORMER_ENGINE}")
    if errors:
        raise SpecError(errors)


def _world(nodes) -> int:
    """GPUs in all, from node groups not yet checked (a bad count is named by the check that follows)."""
    try:
        return max(1, sum(int(g.get("count", 1)) * int(g.get("gpus_per_node", 1)) for g in nodes))
    except (AttributeError, TypeError, ValueError):
        return 1

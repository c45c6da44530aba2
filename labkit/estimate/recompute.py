"""Activation recomputation, mode by mode: the memory it saves and the work it repeats, before a run.

`estimate()` prices full recomputation as every layer recomputed. Megatron's methods differ in which layers that is
(`stored_activations`; labkit.diagrams draws it): `uniform` checkpoints the input of every group of `num_layers` layers
and recomputes them all; `block` checkpoints only the first `num_layers` layers of each pipeline stage and keeps the
rest whole; `selective` keeps everything but the attention core (its softmax, dropout and score matrices), which is
cheap to recompute and large to keep. Here each layer is sized by what it keeps (labkit.estimate.memory's
activation_bytes_per_layer: what megatron-core's layers save with Megatron-LM's GPU kernels, flash attention where the
spec's attention backend picks it on its devices), for one micro-batch on the first pipeline stage: the activations
held when the backward pass begins, which is what a profiler sees the forward pass leave behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import pandas as pd

from labkit.estimate.estimator import flash_attention
from labkit.megatron.flops import layer_forward_flops, model_flops, recomputed_forward_flops
from labkit.estimate.memory import GIB, activation_bytes_per_layer, memory_per_stage
from labkit.megatron.shape import Shape
from labkit.spec import RunSpec

MIB = 2 ** 20
# What each kind of layer keeps, as activation_bytes_per_layer's recompute setting.
_KEPT_AS = {"all": None, "no-attention": "selective", "input": "full"}


@dataclass
class RecomputeCost:
    mode: str                  # "none", "selective", "full/uniform", "full/block"
    kept: list[str]            # per layer of the first stage: all | input | inner | no-attention
    recomputed_layers: int     # layers of the first stage whose forward runs again in the backward pass
    activations_mib: float     # kept for the backward pass: one micro-batch, first stage, embeddings and logits too
    extra_compute: float       # recomputed forward FLOPs over the model FLOPs of a step (all stages)


def stored_activations(layers: int, granularity: str | None, method: str | None = None,
                       num_layers: int = 1) -> list[str]:
    """What each transformer layer keeps for the backward pass, in Megatron's recompute modes:
    "all" (every activation), "input" (its input only; the rest is recomputed), "inner" (an input of a checkpointed
    group recomputed from an earlier layer's input: nothing kept), "no-attention" (selective: all but the attention
    core's softmax and dropout).

    full/uniform: layers are grouped `num_layers` at a time and each group keeps only its input.
    full/block: the first `num_layers` layers keep only their input; the others keep everything.
    """
    if granularity is None:
        return ["all"] * layers
    if granularity == "selective":
        return ["no-attention"] * layers
    if granularity != "full" or method not in ("uniform", "block"):
        raise ValueError(f"recompute {granularity}/{method}: use granularity 'full' with method 'uniform' or "
                         f"'block', or granularity 'selective'")
    if num_layers < 1:
        raise ValueError("recompute num_layers must be >= 1")
    if method == "block":
        return ["input" if i < num_layers else "all" for i in range(layers)]
    return ["input" if i % num_layers == 0 else "inner" for i in range(layers)]



def mode_name(spec: RunSpec) -> str:
    r = spec.recompute
    if r is None:
        return "none"
    if r.granularity == "selective":
        return f"selective: {' '.join(r.modules)}" if r.modules else "selective"
    return f"full/{r.method}"


def recompute_cost(spec: RunSpec) -> RecomputeCost:
    """What `spec`'s recompute setting keeps and repeats (see the module's docstring).
    """
    shape = Shape.of(spec.model)
    r, par, b = spec.recompute, spec.parallel, spec.batch
    partition = spec.layer_partition
    kept = stored_activations(partition[0], r.granularity if r else None, r.method if r else None,
                              r.num_layers if r else 1)
    kernels = {"flash_attention": flash_attention(spec.kernels.attention_backend,
                                                  [node.gpu for node in spec.cluster.nodes]),
               "context": par.context}
    kernels["recompute_modules"] = r.modules if r else None
    per_kind = {kind: activation_bytes_per_layer(shape, b.micro, par.tensor, par.sequence_parallel, setting,
                                                 spec.precision, **kernels) for kind, setting in _KEPT_AS.items()}
    layers_bytes = sum(per_kind.get(k, 0.0) for k in kept)  # "inner" layers keep nothing
    # Embedding output (first stage) and logits (when it is also the last): memory_per_stage of a stage with no layers.
    outside = memory_per_stage(shape, [0] * len(partition), tensor=par.tensor, micro_batch=b.micro,
                               precision=spec.precision)[0].activations * GIB
    tokens = b.micro * shape.seq_length
    extra = 0.0
    for layers in partition:  # every stage applies the method to its own layers
        stage = stored_activations(layers, r.granularity if r else None, r.method if r else None,
                                   r.num_layers if r else 1)
        if r is not None and r.granularity == "selective":
            extra += layers * recomputed_forward_flops(shape, tokens, "selective", r.modules)
        else:
            extra += sum(k in ("input", "inner") for k in stage) * layer_forward_flops(shape, tokens)
    step = model_flops(shape, b.micro)
    return RecomputeCost(mode=mode_name(spec), kept=kept, recomputed_layers=sum(k in ("input", "inner") for k in kept),
                         activations_mib=(layers_bytes + outside) / MIB, extra_compute=extra / step)


def recompute_table(specs: Mapping[str, RunSpec]) -> pd.DataFrame:
    """One row per spec: mode, what each layer keeps, layers recomputed, activations kept (MiB), memory saved against
    no recomputation (MiB) and the extra compute (share of the step's FLOPs).

    Taught in lab 03.
    """
    if not specs:
        raise ValueError("specs: give at least one {name: RunSpec}")
    rows = {}
    for name, spec in specs.items():
        cost = recompute_cost(spec)
        none = recompute_cost(spec.replace(recompute=None))
        rows[name] = {"mode": cost.mode, "kept": " ".join(cost.kept), "recomputed_layers": cost.recomputed_layers,
                      "activations_mib": cost.activations_mib,
                      "saved_mib": none.activations_mib - cost.activations_mib,
                      "extra_compute": cost.extra_compute}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "run"
    return table


def against_measured(predicted: pd.DataFrame, activations_mib: Mapping[str, float],
                     iteration_ms: Mapping[str, float], baseline: str = "none") -> pd.DataFrame:
    """Predicted beside measured, per run: memory saved against the `baseline` run (MiB) and time paid (the extra time
    per iteration as a share of the baseline's; predicted as the extra compute).

    `predicted` is recompute_table's; `activations_mib` the measured activations kept for the backward pass (the
    profiler's `saved_mb`), `iteration_ms` the measured steady time per iteration, each keyed by run name (mappings or
    Series indexed by run).

    Taught in lab 03.
    """
    activations_mib, iteration_ms = dict(activations_mib), dict(iteration_ms)  # a pandas Series iterates its values
    if baseline not in predicted.index:
        raise KeyError(f"baseline: {baseline!r} is not one of the runs ({', '.join(predicted.index)})")
    missing = sorted((set(predicted.index) - set(activations_mib)) | (set(predicted.index) - set(iteration_ms)))
    if missing:
        raise KeyError(f"no measurement for run(s) {', '.join(missing)}")
    return pd.DataFrame({
        "predicted_saved_mib": predicted["saved_mib"],
        "measured_saved_mib": [activations_mib[baseline] - activations_mib[name] for name in predicted.index],
        "predicted_time_paid": predicted["extra_compute"],
        "measured_time_paid": [iteration_ms[name] / iteration_ms[baseline] - 1 for name in predicted.index],
    }, index=predicted.index)

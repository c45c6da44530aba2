"""Why the planner's top row wins: it against the runner-up and against the best row of each other family of layouts
(no pipeline, no tensor parallelism, no data parallelism), part by part of the estimator's step time, and in memory
headroom. Each family's best row comes from a search of its own (the plan's ranking stops early, so it may not hold
one).

`labkit plan --explain` prints it; taught in lab 06.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from labkit import catalog
from labkit.estimate import estimate
from labkit.plan.inputs import SEARCHED, Constraints

FAMILIES = {"no pipeline": ("pipeline", 1), "no tensor parallelism": ("tensor", 1), "no data parallelism": ("data", 1),
            "no expert parallelism": ("expert", 1)}
"""The families the top row is compared with: the layouts that leave one kind of parallelism out (expert parallelism
only where the top row of a mixture-of-experts model uses it)."""

ROW_SIZE = {"pipeline": "pp", "tensor": "tp", "data": "dp", "expert": "ep"}
"""A family's parallel field -> the plan row's size of it."""

PARTS = {"compute": ("compute",), "bubble": ("bubble",), "exposed comm": ("tp_comm", "ep_comm", "pp_comm", "dp_comm",
                                                                          "embedding_comm"),
         "optimizer": ("optimizer",)}
"""The step's parts as the explanation groups the estimator's breakdown (seconds)."""


def family(row) -> str:
    """The kinds of parallelism a layout uses: 'tensor+pipeline+data', 'data', ... ('one GPU' for none)."""
    used = [name for name, size in (("tensor", row.tp), ("pipeline", row.pp), ("data", row.dp)) if size > 1]
    return "+".join(used) or "one GPU"


def headroom_gb(row) -> float:
    """The least free memory of any stage (GiB): the GPU's usable memory less the estimate; negative when it does not
    fit."""
    return min(catalog.gpu(gpu).memory_limit_gb - used for gpu, used in zip(row.spec.stage_gpus,
                                                                            row.memory_gb_per_stage))


def _layout(row) -> str:
    extras = [f"micro {row.mbs}"] + (["sp"] if row.sequence_parallel else []) + \
        ([f"{row.recompute_granularity} recompute"] if row.recompute_granularity else []) + \
        ([f"ZeRO-{row.zero_stage}"] if row.zero_stage > 1 else ["dist opt"] if row.distributed_optimizer else []) + \
        ([f"vp{row.virtual_stages}"] if row.virtual_stages > 1 else [])
    cp = f" cp{row.cp}" if row.cp > 1 else ""
    ep = f" ep{row.ep} etp{row.etp or row.tp}" if row.ep > 1 else ""
    return f"tp{row.tp}{cp}{ep} pp{row.pp} dp{row.dp} ({', '.join(extras)})"


def comparisons(plan, base=None, constraints: Constraints | None = None, **search_options) -> list[tuple[str, object]]:
    """(label, row): the top row, the runner-up, then the best row of every family of FAMILIES the top row is not in
    (searched on `base` with `constraints` and `search_options` as the plan was; skipped without `base`, or where the
    constraints rule the family out)."""
    from labkit.plan.search import search

    fitting = [r for r in plan.rows if not r.oom and r.within_budget] or plan.rows
    if not fitting:
        return []
    top = fitting[0]
    chosen = [("top", top)]
    if len(fitting) > 1:
        chosen.append(("runner-up", fitting[1]))
    constraints = constraints or Constraints()
    for label, (key, size) in FAMILIES.items():
        if base is None or getattr(top, ROW_SIZE[key]) == size or not constraints.allows(key, size):
            continue
        narrowed = replace(constraints, **{key: size}) if getattr(constraints, key) is SEARCHED else constraints
        best = search(base, constraints=narrowed, **{**search_options, "top": 1}).best
        if best is not None:
            chosen.append((f"best, {label}", best))
    return chosen


def sharding_bought(row, profiles=None, calibration=None) -> list[str]:
    """What the row's ZeRO stage buys: the same layout estimated at each lower stage, one sentence each (the most
    memory of any stage's GPU, and the step time); [] at stage 0."""
    if not row.zero_stage or row.spec is None:
        return []
    out = []
    for lower in range(row.zero_stage - 1, -1, -1):
        spec = replace(row.spec, optimizer=replace(row.spec.optimizer, zero_stage=lower, distributed=lower >= 1))
        est = estimate(spec, profiles, calibration=calibration)
        saved = max(est.memory_gb_per_stage) - max(row.memory_gb_per_stage)
        faster = est.iteration_time_s - row.estimated_s
        out.append(f"optimizer.zero_stage {row.zero_stage} saves {saved:.1f} GB per GPU over stage {lower} "
                   f"({max(est.memory_gb_per_stage):.1f} GB, {'fits' if est.fits_in_memory else 'does not fit'}) "
                   f"and is {abs(faster):.4f} s per step {'faster' if faster >= 0 else 'slower'}")
    return out


def experts_bought(row, profiles=None, calibration=None) -> list[str]:
    """What the row's expert parallelism buys and costs, per the estimate: against the same layout without it
    (parallel.expert 1, each expert tensor-parallel like the rest of the layer), the memory of the fullest GPU and
    the step time, beside the all-to-all time the row spends exchanging tokens (its exposed "ep" communication);
    for a mixture-of-experts row without expert parallelism, what the smallest expert size its layout allows would
    buy and cost. [] for a dense model."""
    if row.spec is None or not row.spec.model.num_experts:
        return []
    par = row.spec.parallel
    experts = row.spec.model.num_experts
    if row.ep > 1:
        other = replace(row.spec, parallel=replace(par, expert=1, expert_tensor=None))
    else:
        stage_ranks = row.tp * row.cp * row.dp
        sizes = [e for e in range(2, experts + 1) if experts % e == 0 and stage_ranks % e == 0]
        if not sizes:
            return [f"expert parallelism: none fits this layout ({experts} experts over {stage_ranks} ranks per "
                    "stage)"]
        other = replace(row.spec, parallel=replace(par, expert=sizes[0], expert_tensor=1))
    est = estimate(other, profiles, calibration=calibration)
    mine, theirs = max(row.memory_gb_per_stage), max(est.memory_gb_per_stage)
    alltoall = row.breakdown.get("ep_comm", 0.0)
    faster = est.iteration_time_s - row.estimated_s
    verdict = "fits" if est.fits_in_memory else "does not fit"
    if row.ep > 1:
        return [f"parallel.expert {row.ep} (expert_tensor {row.etp or row.tp}) holds {mine:.1f} GB per GPU where "
                f"expert 1 would hold {theirs:.1f} GB ({verdict}): {theirs - mine:.1f} GB saved; its token "
                f"all-to-all costs {alltoall:.4f} s per step ({100 * alltoall / row.estimated_s:.1f}% of it), and "
                f"the step is {abs(faster):.4f} s {'faster' if faster >= 0 else 'slower'} than at expert 1"]
    cost = est.breakdown.get("ep_comm", 0.0)
    return [f"without expert parallelism: parallel.expert {other.parallel.expert} would hold {theirs:.1f} GB per GPU "
            f"({verdict}, {mine - theirs:.1f} GB less) at {cost:.4f} s per step of token all-to-all, a step "
            f"{abs(faster):.4f} s {'slower' if faster >= 0 else 'faster'}"]


def explain_table(plan, base=None, constraints: Constraints | None = None, **search_options) -> pd.DataFrame:
    """One line per compared row (see `comparisons`): its layout, step time, each part of it and its memory headroom,
    with the differences from the top row."""
    chosen = comparisons(plan, base, constraints, **search_options)
    if not chosen:
        return pd.DataFrame()
    top = chosen[0][1]

    def parts(row) -> dict[str, float]:
        return {name: sum(row.breakdown.get(key, 0.0) for key in keys) for name, keys in PARTS.items()}

    records = []
    for label, row in chosen:
        rec = {"row": label, "family": family(row), "layout": _layout(row), "s/step": round(row.estimated_s, 4)}
        mine, theirs = parts(row), parts(top)
        for name in PARTS:
            rec[f"{name} s"] = round(mine[name], 4)
            rec[f"{name} vs top"] = round(mine[name] - theirs[name], 4)
        rec["headroom GB"] = round(headroom_gb(row), 2)
        records.append(rec)
    return pd.DataFrame.from_records(records)


def explain_text(plan, base=None, constraints: Constraints | None = None, **search_options) -> str:
    """The table, then a sentence per compared row: where it loses most time to the top row."""
    table = explain_table(plan, base, constraints, **search_options)
    if table.empty:
        return "nothing to explain: no layout was estimated"
    lines = [table.to_string(index=False), ""]
    top = table.iloc[0]
    lines.append(f"top: {top['layout']} at {top['s/step']} s per step, {top['headroom GB']} GB of headroom")
    top_row = comparisons(plan)[0][1]
    lines += sharding_bought(top_row, search_options.get("profiles"), search_options.get("calibration"))
    lines += experts_bought(top_row, search_options.get("profiles"), search_options.get("calibration"))
    for _, rec in table.iloc[1:].iterrows():
        worst = max(PARTS, key=lambda name: rec[f"{name} vs top"])
        lines.append(f"{rec['row']}: {rec['layout']} is {rec['s/step'] - top['s/step']:+.4f} s per step; most of it "
                     f"in {worst} ({rec[f'{worst} vs top']:+.4f} s); headroom {rec['headroom GB']} GB")
    return "\n".join(lines)

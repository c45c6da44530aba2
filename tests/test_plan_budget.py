"""Budgets and the lower bounds that prune the search: an unmeetable budget is refused without estimating every
layout, and pruning never changes what the exhaustive search ranks first."""
import contextlib
import io
import json

import pytest

from labkit.cli import main
from labkit.estimate import Shape
from labkit.estimate.estimator import flash_attention
from labkit.plan.inputs import planning_input
from labkit.plan.search import _MemoryFloor, search

# GPT 7.5B on an A100 node and three A10 nodes: most layouts are out of memory on the A10s, and no step takes 1 ms
ARGV = ["local-slurm", "--model", "gpt-7.5b", "--global-batch", "32", "--top", "3"]


def plan(*argv) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["plan", *argv, "--json"])
    return status, json.loads(out.getvalue())


@pytest.fixture(scope="module")
def hetero():
    return planning_input(*ARGV[:1], ARGV[2], int(ARGV[4]))


@pytest.fixture(scope="module")
def exhaustive(hetero):
    base, constraints = hetero
    return search(base, constraints=constraints)


def test_an_unmeetable_budget_exits_3_after_no_more_estimates_than_no_budget(capsys):
    status, free = plan(*ARGV)
    assert status == 0
    for budget in (["--max-step-s", "0.001"], ["--max-price-per-step", "0.000001"]):
        status, unmet = plan(*ARGV, *budget)
        assert status == 3 and unmet["unmet"].startswith(budget[0])
        assert unmet["configs_evaluated"] == free["configs_evaluated"]
        layouts = unmet["configs_evaluated"] + unmet["configs_pruned"]
        assert unmet["configs_evaluated"] < layouts / 10
        assert unmet["rows"][0]["estimated_s"] == free["rows"][0]["estimated_s"]  # the closest is the fastest
    assert "closest: tp" in capsys.readouterr().err


def test_the_mixed_16_node_cluster_refuses_an_unmeetable_budget_after_few_estimates(tmp_path, capsys):
    """The case that was reported: a 145.6B GPT on 4 H100 + 4 A100-80GB + 8 A10 nodes with no step within 1 s. Without
    pruning the search estimated 33,438 layouts (about two minutes); the bounds leave a few hundred."""
    cluster = tmp_path / "mixed.yaml"
    cluster.write_text("nodes: [{gpu: H100-SXM, count: 4, gpus_per_node: 8},"
                       " {gpu: A100-80GB, count: 4, gpus_per_node: 8}, {gpu: A10, count: 8, gpus_per_node: 8}]\n")
    status, unmet = plan(str(cluster), "--model", "gpt-145.6b", "--global-batch", "1536", "--max-step-s", "1")
    assert status == 3 and unmet["unmet"].startswith("--max-step-s 1")
    assert unmet["configs_evaluated"] < 1000
    assert unmet["configs_evaluated"] < (unmet["configs_evaluated"] + unmet["configs_pruned"]) / 10


@pytest.mark.parametrize("objective, budget, kept", [("time", "max_price_per_step", 2), ("cost", "max_step_s", 2),
                                                     ("time", "max_step_s", 0)])
def test_pruning_keeps_the_exhaustive_searchs_top_rows(hetero, exhaustive, objective, budget, kept):
    """A budget that the `kept` fastest layouts meet and the rest do not: the top rows mix both, or have none within."""
    base, constraints = hetero
    fitting = [r for r in exhaustive.rows if not r.oom]
    field = "price_per_step" if budget == "max_price_per_step" else "estimated_s"
    limit = {budget: (getattr(fitting[kept - 1], field) + getattr(fitting[kept], field)) / 2 if kept else 1e-9}
    everything = search(base, constraints=constraints, objective=objective, **limit)
    pruned = search(base, constraints=constraints, objective=objective, top=3, **limit)
    assert pruned.configs_evaluated < everything.configs_evaluated / 10
    assert [_layout(r) for r in pruned.rows[:3]] == [_layout(r) for r in everything.rows[:3]]
    assert [r.within_budget for r in pruned.rows[:3]] == [True] * kept + [False] * (3 - kept)


def _layout(row) -> tuple:
    return (row.tp, row.pp, row.dp, row.cp, row.mbs, row.virtual_stages, row.recompute_granularity, row.zero_stage,
            tuple(row.spec.stage_gpus), tuple(row.partition), row.oom, round(row.estimated_s, 9))


def test_the_memory_floor_rules_out_only_layouts_the_estimator_finds_out_of_memory(hetero, exhaustive):
    base, _ = hetero
    floor = _MemoryFloor(Shape.of(base.model), flash_attention(base.kernels.attention_backend, ["A100-40GB", "A10"]))
    ruled_out = [r for r in exhaustive.rows if not floor.may_fit(r.spec, tuple(r.spec.stage_gpus))]
    assert len(ruled_out) > len(exhaustive.rows) / 2
    assert all(r.oom for r in ruled_out)


def test_when_fewer_layouts_fit_than_asked_for_the_rows_out_of_memory_are_all_estimated(tmp_path):
    """Llama 2 13B on one A10 node: nothing fits, so the table is every layout out of memory, as without the floor."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes: [{gpu: A10, count: 1, gpus_per_node: 4}]\n")
    base, constraints = planning_input(str(cluster), "llama2-13b", 8)
    everything = search(base, constraints=constraints)
    top = search(base, constraints=constraints, top=5)
    assert all(r.oom for r in everything.rows)
    assert [_layout(r) for r in top.rows[:5]] == [_layout(r) for r in everything.rows[:5]]

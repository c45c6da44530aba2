"""Megatron's rank order, stage -> ranks -> GPUs, and the GPU a mixed stage runs at: one rule for validate and estimate."""
import itertools

import pytest

from labkit.estimate import estimate
from labkit.spec import load_spec, resolved_summary
from labkit.spec.layout import Layout, rank_gpus, slowest_gpu, stage_gpus


def test_rank_order_is_tensor_then_context_then_data_then_pipeline():
    layout = Layout(tensor=2, context=3, data=2, pipeline=2)
    ranks = [layout.rank(tp=t, cp=c, dp=d, pp=p)
             for p, d, c, t in itertools.product(range(2), range(2), range(3), range(2))]
    assert ranks == list(range(24))  # megatron-core's parallel_state default order "tp-cp-ep-dp-pp"
    assert all(layout.rank(**layout.coords(r)._asdict()) == r for r in range(24))
    assert layout.coords(19)._asdict() == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}


def test_groups_and_stage_ranks():
    layout = Layout(tensor=2, data=2, pipeline=3)
    assert list(layout.stage_ranks(1)) == [4, 5, 6, 7]
    assert layout.group(5, "tp") == [4, 5]
    assert layout.group(5, "dp") == [5, 7]
    assert layout.group(5, "pp") == [1, 5, 9]
    assert layout.group(5, "cp") == [5]
    with pytest.raises(ValueError, match="tp, cp, dp or pp"):
        layout.group(5, "ep")


def mixed_cluster(pipeline: int) -> dict:
    return {"name": "mixed", "model": {"preset": "gpt2-medium"}, "precision": "fp16",
            "parallel": {"tensor": 1, "pipeline": pipeline}, "batch": {"micro": 1, "global": 8},
            "cluster": {"nodes": [{"gpu": "A100-40GB", "count": 2, "gpus_per_node": 1},
                                  {"gpu": "A10", "count": 2, "gpus_per_node": 1}]}}


def test_a_stage_spanning_gpu_types_runs_at_its_slowest_for_validate_and_estimate():
    spec = load_spec(mixed_cluster(pipeline=1))  # data parallel 4 over 2 A100-40GB and 2 A10
    assert spec.data_parallel == 4
    assert resolved_summary(spec)["stage_gpus"] == ["A10"]
    assert estimate(spec).stage_gpus == ["A10"]
    two = load_spec(mixed_cluster(pipeline=2))
    assert resolved_summary(two)["stage_gpus"] == estimate(two).stage_gpus == ["A100-40GB", "A10"]


def test_the_slowest_gpu_is_the_lowest_dense_peak():
    assert slowest_gpu(["A100-40GB", "A10", "H100-SXM"]) == "A10"
    assert slowest_gpu(["T4", "V100-16GB"]) == "T4"


def test_gpus_come_in_runs_of_ranks_not_one_entry_per_rank():
    nodes = load_spec(mixed_cluster(pipeline=1)).cluster.nodes
    assert rank_gpus(nodes) == [(range(0, 2), "A100-40GB"), (range(2, 4), "A10")]
    # a trillion ranks: a per-rank list could not be built, runs and ranges cost nothing
    huge = load_spec(mixed_cluster(pipeline=1)).cluster
    huge.nodes[0].count = huge.nodes[1].count = 10 ** 12 // 2
    layout = Layout(tensor=1, data=10 ** 6, pipeline=10 ** 6)
    assert stage_gpus(huge.nodes, layout, stages=[0, 499_999, 500_000, 999_999]) == [
        "A100-40GB", "A100-40GB", "A10", "A10"]

"""Notebook calculators, exercised outside Jupyter."""
import pytest

from labkit.estimate import estimate
from labkit.estimate.views import (LLAMA_LAYOUTS, breakdown_table, compare_measured, days_per_epoch, memory_bars,
                                   memory_table, model_size_table, sizing_table, time_breakdown)
from labkit.spec import load_spec


@pytest.fixture(scope="module")
def hetero_estimate():
    return estimate(load_spec("examples/gpt2-xl-hetero.yaml"))


def test_model_size_table_lists_sc21_sizes():
    df = model_size_table()
    assert list(df["params_B"]) == [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1]
    # the model as built adds the final layer norm's weight and bias to SC21's formula
    assert (df["params"] == df["formula_params"] + 2 * df["hidden"]).all()


def test_days_per_epoch_halves_with_twice_the_gpus():
    df = days_per_epoch(175e9, 300e9, [512, 1024], 140)
    assert round(df["days"][1]) == 34
    assert df["days"][0] == pytest.approx(2 * df["days"][1])


def test_memory_views(hetero_estimate):
    df = memory_table(hetero_estimate)
    assert len(df) == 8 and df["gpu"][0] == "A100-40GB" and df["limit"][1] == pytest.approx(22.2)
    fig = memory_bars(hetero_estimate)
    assert [t.name for t in fig.data] == ["weights", "gradients", "optimizer", "activations", "GPU memory"]
    assert len(fig.data[3].y) == 8


def test_time_views(hetero_estimate):
    df = breakdown_table(hetero_estimate)
    assert df["seconds"].sum() == pytest.approx(hetero_estimate.iteration_time_s)
    assert df["share"].sum() == pytest.approx(1.0)
    fig = time_breakdown(hetero_estimate)
    assert {t.name for t in fig.data} >= {"compute", "bubble", "pp_comm", "dp_comm"}
    assert compare_measured(1.1, 1.0)["error"][0] == pytest.approx(0.1)


def test_sizing_table_sizes_each_model_at_its_layout():
    table = sizing_table("H100-SXM", 16).set_index("model")
    assert list(table.index) == list(LLAMA_LAYOUTS)
    assert table.loc["llama2-7b", "params_B"] == 6.74 and table.loc["llama2-70b", "data"] == 128 // 16
    # twice the nodes: the distributed optimizer shards over twice the data-parallel ranks, and the batch splits too
    doubled = sizing_table("H100-SXM", 32, layouts={"llama2-7b": (1, 1)}).iloc[0]
    assert doubled["memory_gb"] < table.loc["llama2-7b", "memory_gb"]
    assert doubled["iteration_s"] < 0.6 * table.loc["llama2-7b", "iteration_s"]


def test_sizing_table_reports_a_layout_the_cluster_cannot_take():
    row = sizing_table("A100-80GB", 1, layouts={"llama2-70b": (8, 2)}).iloc[0]
    assert row["problem"].startswith("parallel.pipeline: world size 8 is not divisible by parallel.tensor 8 x "
                                     "parallel.pipeline 2")

"""Recompute modes predicted layer by layer: sizes worked out by hand for the tiny model (s = 64, b = 2, h = 64,
a = 4, fp32) from what megatron-core's layers save on a GPU (labkit.estimate.memory; tests/test_activation_memory.py
measures them on the CPU)."""
import pandas as pd
import pytest

from labkit.megatron.flops import layer_forward_flops, model_flops
from labkit.estimate.params import Shape
from labkit.estimate.recompute import against_measured, recompute_cost, recompute_table
from labkit.spec import load_spec

MIB = 2 ** 20
SBH = 64 * 2 * 64
# per token and hidden unit: two norm inputs (4 + 2 x 4/h fp32 statistics), QKV and MLP-in inputs (4) and bool dropout
# masks (1), twice; Q, K, V (12), the projection input (4), the GELU and MLP-out inputs (16 each); in fp32 no fused
# softmax: torch's fp32 softmax output, its dropout mask and output (4 + 1 + 4 per score, a s / h = 4 of them) and a
# 64 x 64 causal mask per layer
SELECTIVE = SBH * (2 * (4 + 8 / 64 + 4 + 1) + 12 + 4 + 32)  # everything but the attention core
ALL = SELECTIVE + SBH * 9 * 4 * 64 / 64 + 64 * 64   # a layer that keeps everything
INPUT = 2 * SBH * 2                              # only its input, the checkpoint
OUTSIDE = (8 * 64 * 2 + SBH) * 2 + 4 * SBH * (1 + 1024 / 64)  # embedding output, fp32 logits
MODES = {"none": None, "selective": {"granularity": "selective", "method": None},
         "full/uniform": {"granularity": "full", "method": "uniform", "num_layers": 1},
         "full/block": {"granularity": "full", "method": "block", "num_layers": 1}}


@pytest.fixture(scope="module")
def tiny():
    return load_spec("examples/tiny-cpu.yaml").replace(cluster={"nodes": [{"gpu": "cpu", "count": 1,
                                                                           "gpus_per_node": 1}]})


@pytest.mark.parametrize("mode, kept, layer_bytes, recomputed", [
    ("none", ["all", "all"], 2 * ALL, 0),
    ("selective", ["no-attention", "no-attention"], 2 * SELECTIVE, 0),
    ("full/uniform", ["input", "input"], 2 * INPUT, 2),
    ("full/block", ["input", "all"], INPUT + ALL, 1),
])
def test_each_mode_keeps_what_megatron_keeps_per_layer(tiny, mode, kept, layer_bytes, recomputed):
    cost = recompute_cost(tiny.replace(recompute=MODES[mode]))
    assert cost.mode == mode and cost.kept == kept and cost.recomputed_layers == recomputed
    assert cost.activations_mib == pytest.approx((layer_bytes + OUTSIDE) / MIB)


def test_extra_compute_is_the_recomputed_forwards_over_the_model_flops(tiny):
    shape = Shape.of(tiny.model)
    layer = layer_forward_flops(shape, 2 * 64) / model_flops(shape, 2)
    costs = {mode: recompute_cost(tiny.replace(recompute=r)) for mode, r in MODES.items()}
    assert costs["none"].extra_compute == 0
    assert costs["full/uniform"].extra_compute == pytest.approx(2 * layer)
    assert costs["full/block"].extra_compute == pytest.approx(layer)
    assert 0 < costs["selective"].extra_compute < costs["full/block"].extra_compute


def test_uniform_groups_and_block_layers_follow_num_layers(tiny):
    four = tiny.replace(model={"preset": None, "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                               "seq_length": 64, "vocab_size": 1024})
    grouped = recompute_cost(four.replace(recompute={"granularity": "full", "method": "uniform", "num_layers": 2}))
    assert grouped.kept == ["input", "inner", "input", "inner"] and grouped.recomputed_layers == 4
    assert grouped.activations_mib == pytest.approx((2 * INPUT + OUTSIDE) / MIB)
    block = recompute_cost(four.replace(recompute={"granularity": "full", "method": "block", "num_layers": 3}))
    assert block.kept == ["input", "input", "input", "all"] and block.recomputed_layers == 3


def test_the_table_orders_saving_against_cost(tiny):
    table = recompute_table({mode: tiny.replace(recompute=r) for mode, r in MODES.items()})
    assert table.loc["none", "saved_mib"] == 0
    assert table["saved_mib"].sort_values().index.tolist() == ["none", "selective", "full/block", "full/uniform"]
    assert table["extra_compute"].sort_values().index.tolist() == ["none", "selective", "full/block", "full/uniform"]
    assert table.loc["full/uniform", "saved_mib"] == pytest.approx(2 * (ALL - INPUT) / MIB)
    with pytest.raises(ValueError, match="at least one"):
        recompute_table({})


def test_measurements_are_set_beside_the_prediction_against_the_baseline(tiny):
    predicted = recompute_table({mode: tiny.replace(recompute=r) for mode, r in MODES.items()})
    saved = {"none": 2.49, "selective": 1.76, "full/uniform": 0.69, "full/block": 1.59}
    times = {"none": 50.0, "selective": 51.0, "full/uniform": 60.0, "full/block": 55.0}
    table = against_measured(predicted, saved, times)
    assert table.loc["full/uniform", "measured_saved_mib"] == pytest.approx(1.8)
    assert table.loc["full/block", "measured_time_paid"] == pytest.approx(0.1)
    assert table.loc["none"].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert table["predicted_saved_mib"].tolist() == predicted["saved_mib"].tolist()
    as_series = against_measured(predicted, pd.Series(saved), pd.Series(times))
    assert as_series.equals(table)
    with pytest.raises(KeyError, match="full/block"):
        against_measured(predicted, {k: v for k, v in saved.items() if k != "full/block"}, times)
    with pytest.raises(KeyError, match="baseline"):
        against_measured(predicted, saved, times, baseline="off")

"""The NVIDIA DLI workshop's own numbers ("Model Parallelism", §4.4) and the formulas' general forms."""
import math

import pytest

from labkit.estimate import (Shape, achieved_tflops, flops_72, flops_96, gpt_params, hardware_flops,
                             megatron_logged_flops, model_flops, params_with_padding, stage_params, total_params,
                             training_days)

WORKSHOP = dict(l=40, h=6144, s=1048, V=50257)


def workshop_shape(**changes):
    base = dict(num_layers=40, hidden=6144, heads=48, seq_length=1048, vocab=50257)
    base.update(changes)
    return Shape(**base)


def test_workshop_parameter_count_is_exact():
    assert gpt_params(**WORKSHOP) == 18_437_806_080
    # the model as built adds the final layer norm (weight and bias) that the formula leaves out
    assert total_params(workshop_shape()) == 18_437_806_080 + 2 * 6144


def test_workshop_tflops_and_utilization():
    flops = flops_96(512, 1048, 40, 6144, 50257)
    tflops = achieved_tflops(flops, 32.09, 16)
    assert round(tflops, 1) == 157.7
    assert round(100 * tflops / 312, 2) == 50.55
    # the general form with full recompute is the same number
    assert hardware_flops(workshop_shape(), 512, "full") == pytest.approx(flops, rel=1e-12)


def test_workshop_training_days():
    flops = flops_96(512, 1048, 40, 6144, 50257)
    tflops = achieved_tflops(flops, 32.09, 16)
    assert round(training_days(300e9, gpt_params(**WORKSHOP), 16, tflops)) == 203
    assert round(training_days(300e9, 175e9, 1024, 140)) == 34


def test_model_flops_general_form_reduces_to_72_formula():
    shape = Shape(num_layers=24, hidden=2048, heads=16, seq_length=2048, vocab=51200)
    assert model_flops(shape, 64) == pytest.approx(flops_72(64, 2048, 24, 2048, 51200), rel=1e-12)
    assert megatron_logged_flops(shape, 64, "2024") == model_flops(shape, 64)
    # the causal count removes half of the attention-score FLOPs, so it logs less
    assert megatron_logged_flops(shape, 64, "2025") < model_flops(shape, 64)


def test_megatron_2023_formula_equals_72_formula_for_mha():
    shape = Shape(num_layers=24, hidden=2048, heads=16, seq_length=2048, vocab=51200)
    assert megatron_logged_flops(shape, 8, "2023") == pytest.approx(flops_72(8, 2048, 24, 2048, 51200), rel=1e-12)


def test_recompute_adds_one_forward_of_the_layers():
    shape = workshop_shape()
    none, full = hardware_flops(shape, 8, None), hardware_flops(shape, 8, "full")
    selective = hardware_flops(shape, 8, "selective")
    assert none == model_flops(shape, 8)
    assert none < selective < full


def test_gqa_swiglu_and_untied_change_the_count():
    mha = Shape(num_layers=32, hidden=4096, heads=32, seq_length=4096, vocab=32000)
    gqa = Shape(num_layers=32, hidden=4096, heads=32, seq_length=4096, vocab=32000, query_groups=8)
    assert total_params(gqa) < total_params(mha)
    untied = Shape(num_layers=32, hidden=4096, heads=32, seq_length=4096, vocab=32000, tied=False)
    assert total_params(untied) - total_params(mha) == 32000 * 4096
    # Llama-2 7B's sizes with GPT's biases, layer norms and learned positions: a little over its 6.74 B
    llama = Shape(num_layers=32, hidden=4096, heads=32, seq_length=4096, vocab=32000, ffn=11008, swiglu=True,
                  tied=False)
    assert 6.7e9 < total_params(llama) < 6.8e9


def test_stage_params_sum_to_the_model_plus_the_tied_copy():
    shape = Shape(num_layers=48, hidden=1600, heads=25, seq_length=1024, vocab=50257)
    # stages hold the vocabulary as Megatron pads it: 50257 -> 50304, a multiple of 128
    padding = (50304 - 50257) * 1600
    parts = stage_params(shape, [0, 11, 8, 8, 8, 8, 5, 0])
    assert sum(parts) == pytest.approx(total_params(shape) + padding + 50304 * 1600)
    single = stage_params(shape, [48])
    assert single[0] == pytest.approx(total_params(shape) + padding) == params_with_padding(shape)
    # tensor parallelism splits all but the replicated biases and norms
    split = stage_params(shape, [48], tensor=4)[0]
    assert total_params(shape) / 4 < split < total_params(shape) / 3.9


def test_awsome_size_table_matches_sc21():
    # SC21 Table 1 lists 1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1 B
    from labkit.catalog import models
    from labkit.spec import ModelSpec

    expected = {"gpt-1.7b": 1.7, "gpt-3.6b": 3.6, "gpt-7.5b": 7.5, "gpt-18.4b": 18.4, "gpt-39.1b": 39.1,
                "gpt-76.1b": 76.1, "gpt-145.6b": 145.6, "gpt-310.1b": 310.1}
    for name, billions in expected.items():
        cfg = {k: v for k, v in models()[name].items() if k != "source"}
        assert math.isclose(total_params(Shape.of(ModelSpec(**cfg))) / 1e9, billions, abs_tol=0.06), name

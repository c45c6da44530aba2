"""Mixture-of-experts in the spec: the presets count what their model cards publish, the keys render as Megatron-LM
spells them, and megatron-core's rules on experts are named by the spec field that breaks them."""
from __future__ import annotations

import dataclasses

import pytest

from labkit import catalog
from labkit.estimate import estimate
from labkit.estimate.params import active_params, total_params
from labkit.megatron import sizes
from labkit.megatron.flags import build_parser
from labkit.megatron.flops import layer_forward_flops, model_flops
from labkit.megatron.shape import Shape
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec

# (total, active) as the model cards round them, in billions, and the exact counts of their config.json files
CARDS = {
    "mixtral-8x7b": ((46.7, 12.9), (46_702_792_704, 12_879_925_248)),
    "mixtral-8x22b": ((141, 39), (140_630_071_296, 39_161_468_928)),
    "qwen3-30b-a3b": ((30.5, 3.3), (30_532_122_624, 3_353_032_704)),
    "deepseek-moe-16b": ((16.4, 2.8), (16_375_728_128, 2_828_650_496)),
}


@pytest.mark.parametrize("preset", CARDS)
def test_total_and_active_parameters_are_the_model_cards(preset):
    (card_total, card_active), exact = CARDS[preset]
    shape = Shape.of(load_spec({"model": {"preset": preset}}).model)
    assert (total_params(shape), active_params(shape)) == exact
    # a card rounds or truncates to its last digit (Qwen's 3.35 B active is "3.3B", Mixtral's 12.88 B "12.9B")
    for count, card in zip(exact, (card_total, card_active)):
        unit = 1 if float(card).is_integer() else 0.1
        assert abs(count / 1e9 - card) < unit, (count, card)


def test_the_estimate_reports_total_and_active_parameters():
    spec = load_spec({"model": {"preset": "mixtral-8x7b"}, "parallel": {"expert": 8},
                      "cluster": {"nodes": [{"gpu": "H100", "count": 1, "gpus_per_node": 8}]},
                      "batch": {"micro": 1, "global": 8}, "precision": "bf16"})
    out = estimate(spec).to_dict()
    assert (out["params"], out["active_params"]) == CARDS["mixtral-8x7b"][1]
    dense = estimate(load_spec({"model": {"preset": "llama3-8b"}})).to_dict()
    assert dense["active_params"] == dense["params"]


def test_a_token_costs_the_flops_of_its_active_experts():
    """Twice the experts at the same top-k: the same FLOPs per token but the router's; a dense layer of the same
    width costs what one expert does."""
    base = dict(num_layers=2, hidden=64, heads=4, seq_length=32, vocab=512, swiglu=True, experts=4, topk=2)
    four, eight = Shape(**base), Shape(**{**base, "experts": 8})
    tokens = 32
    assert layer_forward_flops(eight, tokens, True) - layer_forward_flops(four, tokens, True) == 2 * tokens * 64 * 4
    dense = Shape(**{**base, "experts": None})
    expert_mlp = 2 * tokens * 64 * dense.ffn_size * 3
    assert layer_forward_flops(four, tokens, True) == \
        layer_forward_flops(dense, tokens) + expert_mlp + 2 * tokens * 64 * 4
    # a pattern's dense layer costs a dense layer's
    mixed = Shape(**{**base, "moe_layer_freq": "([0]+[1]*1)"})
    assert model_flops(mixed, 1) == 3 * (layer_forward_flops(mixed, tokens, False) + layer_forward_flops(
        mixed, tokens, True) + 2 * tokens * 64 * 512)


def test_every_moe_key_renders_as_megatron_lm_spells_it_and_parses():
    spec = load_spec({"model": {"preset": "deepseek-moe-16b", "moe_grouped_gemm": True},
                      "parallel": {"expert": 8, "expert_tensor": 1},
                      "cluster": {"nodes": [{"gpu": "H100", "count": 2, "gpus_per_node": 8}]},
                      "batch": {"micro": 1, "global": 16}, "precision": "bf16"})
    argv = megatron_args(spec)
    known = catalog.megatron_lm_flags()
    assert [a for a in argv if a.startswith("--") and a not in known] == []
    args = build_parser().parse_args(argv)
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size,
            args.moe_shared_expert_intermediate_size, args.moe_layer_freq, args.moe_router_load_balancing_type,
            args.moe_aux_loss_coeff, args.moe_token_dispatcher_type, args.moe_grouped_gemm,
            args.expert_model_parallel_size, args.expert_tensor_parallel_size) == \
        (64, 6, 1408, 2816, "([0]*1+[1]*27)", "seq_aux_loss", 0.001, "alltoall", True, 8, 1)
    qwen = megatron_args(load_spec({"model": {"preset": "qwen3-30b-a3b"}}))
    assert qwen[qwen.index("--kv-channels") + 1] == "128" and "--qk-layernorm" in qwen
    assert not any(a.startswith(("--num-experts", "--moe-", "--expert-")) for a in megatron_args(load_spec({})))


def test_mxfp8_and_nvfp4_render_megatron_lms_recipes():
    def flags(precision):
        argv = megatron_args(dataclasses.replace(load_spec({}), precision=precision))
        return [a for a in argv if a.startswith(("--bf16", "--fp8", "--fp4"))] + \
            [argv[i + 1] for i, a in enumerate(argv) if a.startswith(("--fp8", "--fp4"))]
    assert flags("mxfp8") == ["--bf16", "--fp8-format", "--fp8-recipe", "e4m3", "mxfp8"]
    assert flags("nvfp4") == ["--bf16", "--fp4-format", "--fp4-recipe", "e2m1", "nvfp4"]


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4"])
def test_block_scaled_precisions_need_blackwell(precision):
    def on(gpu):
        return {"precision": precision, "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 4}]}}
    assert load_spec(on("GB200")).precision == precision
    with pytest.raises(SpecError, match=f"precision: {precision} scales blocks .* cluster GPU H100 has none; "
                                        "use fp8"):
        load_spec(on("H100"))


CPU = {"cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 4}]}}


def refused(**changes) -> list[str]:
    data = {"model": {"preset": "tiny", "num_experts": 4}, **CPU}
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        data.setdefault(section, {})[key] = value
    try:
        load_spec(data)
    except SpecError as error:
        return error.errors
    return []


@pytest.mark.parametrize("changes, field, words", [
    ({"parallel__expert": 3}, "parallel.expert", "cannot share model.num_experts 4 evenly"),
    ({"parallel__expert": 4, "parallel__expert_tensor": 2}, "parallel.expert",
     "expert_tensor 2 x parallel.expert 4 x parallel.pipeline 1"),
    ({"model__moe_router_topk": 5}, "model.moe_router_topk", "between 1 and model.num_experts 4"),
    ({"model__moe_router_topk": 1}, "model.moe_router_topk", "--moe-router-pre-softmax"),
    ({"model__moe_layer_freq": "([0]+[1]*3)"}, "model.moe_layer_freq", "the model has 2 layers"),
    ({"model__moe_layer_freq": "__import__('os')"}, "model.moe_layer_freq", "neither a number nor a pattern"),
    ({"model__moe_grouped_gemm": True}, "model.moe_grouped_gemm", "needs GPUs"),
    ({"model__moe_token_dispatcher_type": "flex"}, "model.moe_token_dispatcher_type", "needs GPUs"),
    ({"model__moe_token_dispatcher_type": "ring"}, "model.moe_token_dispatcher_type", "not one of"),
    ({"model__moe_token_dispatcher_type": "flex"}, "model.moe_token_dispatcher_type",
     "parallel.expert_tensor x parallel.expert is 1; raise either"),
    ({"model__moe_flex_dispatcher_backend": "hybridep"}, "model.moe_flex_dispatcher_backend",
     "set model.moe_token_dispatcher_type: flex"),
    ({"model__moe_token_dispatcher_type": "flex", "model__moe_flex_dispatcher_backend": "nvl"},
     "model.moe_flex_dispatcher_backend", "not one of deepep, hybridep"),
    ({"model__num_experts": 0}, "model.num_experts", "must be a positive number"),
    ({"parallel__expert_tensor": 2, "model__add_bias_linear": True}, "parallel.expert_tensor",
     "biases only when each expert is whole"),
    ({"model__moe_router_load_balancing_type": "sinkhorn", "model__moe_aux_loss_coeff": 0.01},
     "model.moe_aux_loss_coeff", "Sinkhorn routing balances the load itself"),
    ({"parallel__expert": 2, "optimizer__zero_stage": 3, "model__untie_embeddings": True}, "parallel.expert",
     "does not split experts over expert ranks"),
    ({"parallel__expert": 2, "optimizer__zero_stage": 2, "optimizer__zero_backend": "deepspeed"}, "parallel.expert",
     "every expert on every rank"),
])
def test_each_expert_rule_is_named_by_its_field(changes, field, words):
    errors = refused(**changes)
    assert any(e.startswith(f"{field}:") and words in e for e in errors), errors


def test_moe_keys_on_a_dense_model_are_refused_not_dropped():
    errors = refused(model__num_experts=None, model__moe_ffn_hidden_size=32)
    assert any(e.startswith("model.moe_ffn_hidden_size: applies to mixture-of-experts models only") for e in errors)
    errors = refused(model__num_experts=None, parallel__expert=2)
    assert any(e.startswith("parallel.expert:") and "needs model.num_experts" in e for e in errors)


def test_the_flex_dispatchers_backend_renders_as_megatron_lm_spells_it():
    data = {"model": {"preset": "qwen3-30b-a3b", "moe_token_dispatcher_type": "flex"}, "parallel": {"expert": 16},
            "batch": {"global": 64}, "cluster": {"nodes": [{"gpu": "H100", "count": 2, "gpus_per_node": 8}]}}
    assert "--moe-flex-dispatcher-backend" not in megatron_args(load_spec(data))  # megatron-core's default, deepep
    data["model"]["moe_flex_dispatcher_backend"] = "hybridep"
    args = build_parser().parse_args(megatron_args(load_spec(data)))
    assert (args.moe_token_dispatcher_type, args.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    assert refused(model__moe_flex_dispatcher_backend="hybridep", model__num_experts=None) == [
        "model.moe_flex_dispatcher_backend: applies to mixture-of-experts models only; set model.num_experts, or "
        "leave it out"]


def test_a_valid_moe_layout_is_accepted_on_cpus_and_a_tensor_split_asks_for_sequence_parallelism():
    assert refused(parallel__expert=2, model__moe_token_dispatcher_type="alltoall") == []
    plan = {"model": {"preset": "mixtral-8x7b"}, "parallel": {"tensor": 2, "expert": 4},
            "cluster": {"nodes": [{"gpu": "H100", "count": 1, "gpus_per_node": 8}]}}
    with pytest.raises(SpecError, match="parallel.sequence_parallel: needed beside parallel.tensor 2"):
        load_spec(plan)
    plan["parallel"]["sequence_parallel"] = True
    assert load_spec(plan).parallel.expert == 4


def test_the_moe_layer_pattern_is_megatron_cores_and_is_never_evaluated():
    assert sizes.moe_layer_pattern(2, 5) == [1, 0, 1, 0, 1]
    assert sizes.moe_layer_pattern("([0]*1+[1]*3)", 4) == [0, 1, 1, 1]
    assert sizes.moe_layer_pattern("([1]*3+[0]*1)*2", 8) == [1, 1, 1, 0] * 2
    for bad in ("[1]*10**9", "().__class__", "[1, 2]", "[[1], [0]]"):
        with pytest.raises(sizes.SizeError):
            sizes.moe_layer_pattern(bad, 2)
    assert sizes.expert_data_parallel_size(64, expert=8, expert_tensor=1, pipeline=4) == 2

"""Recompute by module: `recompute: {granularity: selective, modules: [...]}` renders Megatron-LM's
--recompute-modules, and megatron-core's rules on the modules are named by field."""
import pytest

from labkit.megatron.flags import build_parser
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec


def test_modules_render_as_megatron_lm_spells_them_and_parse():
    spec = load_spec({"recompute": {"granularity": "selective", "modules": ["core_attn", "mlp", "layernorm"]},
                      "cluster": {"nodes": [{"gpu": "H100", "count": 1, "gpus_per_node": 8}]}})
    args = build_parser().parse_args(megatron_args(spec))
    assert (args.recompute_granularity, args.recompute_modules) == ("selective", ["core_attn", "mlp", "layernorm"])
    plain = megatron_args(load_spec({"recompute": {"granularity": "selective"}}))
    assert "--recompute-modules" not in plain  # megatron-core's default, core_attn


@pytest.mark.parametrize("recompute, model, error", [
    ({"granularity": "full", "modules": ["mlp"]}, {}, "recompute.modules: chooses what granularity selective"),
    ({"granularity": "selective", "modules": []}, {}, "recompute.modules: empty"),
    ({"granularity": "selective", "modules": ["attention"]}, {}, "recompute.modules[0]: 'attention' is not one of"),
    ({"granularity": "selective", "modules": ["moe"]}, {}, "recompute.modules: moe recomputes an MoE layer"),
    ({"granularity": "selective", "modules": ["moe_act"]}, {"num_experts": 4}, "needs model.moe_grouped_gemm"),
    ({"granularity": "selective", "modules": ["shared_experts"]}, {"num_experts": 4},
     "needs model.moe_shared_expert_intermediate_size"),
    ({"granularity": "selective", "modules": ["mlp"]}, {"num_experts": 4}, "every layer of this model is MoE"),
    ({"granularity": "selective", "modules": ["mla_up_proj"]}, {}, "which labkit does not build"),
    ({"granularity": "selective", "modules": ["layernorm"]}, {}, "with Transformer Engine on GPUs only"),
    ({"granularity": "selective", "modules": ["mlp"]}, {}, "(model.add_bias_linear false)"),
])
def test_each_module_rule_is_named_by_its_field(recompute, model, error):
    with pytest.raises(SpecError) as refused:
        load_spec({"model": {"preset": "tiny", **model}, "recompute": recompute})
    assert any(e.startswith(error) or error in e for e in refused.value.errors), refused.value.errors


def test_a_pattern_with_dense_layers_may_recompute_their_mlps():
    spec = load_spec({"model": {"preset": "tiny", "num_experts": 4, "moe_layer_freq": "([0]+[1])"},
                      "recompute": {"granularity": "selective", "modules": ["mlp", "moe"]},
                      "cluster": {"nodes": [{"gpu": "H100", "count": 1, "gpus_per_node": 8}]}})
    assert spec.recompute.modules == ["mlp", "moe"]


def test_the_cpu_driver_recomputes_mlps_and_experts_of_a_model_without_biases():
    for model, modules in (({"preset": "tiny-llama"}, ["core_attn", "mlp"]),
                           ({"preset": "tiny-llama", "num_experts": 4, "moe_shared_expert_intermediate_size": 64},
                            ["moe", "shared_experts"])):
        spec = load_spec({"model": model, "recompute": {"granularity": "selective", "modules": modules}})
        assert spec.recompute.modules == modules


def test_each_recomputed_module_repeats_its_own_forward_flops():
    """Per mean layer of a model with one dense and three MoE layers: the dense MLP on a quarter of the layers, the
    MoE side (router, top-k experts, shared experts) on three quarters, elementwise modules none."""
    from labkit.megatron.flops import attention_core_forward_flops, mlp_forward_flops, recomputed_forward_flops
    from labkit.megatron.shape import Shape

    shape = Shape.of(load_spec({"model": {"preset": "tiny-llama", "num_layers": 4, "num_experts": 4,
                                          "moe_shared_expert_intermediate_size": 64,
                                          "moe_layer_freq": "([0]+[1]*3)"}}).model)
    tokens, h = 256, shape.hidden

    def extra(*modules):
        return recomputed_forward_flops(shape, tokens, "selective", list(modules))

    assert extra() == extra("core_attn") == attention_core_forward_flops(shape, tokens)
    assert extra("mlp") == mlp_forward_flops(shape, tokens) / 4
    assert extra("moe") == 3 / 4 * 2 * tokens * h * (4 + 2 * 3 * shape.expert_ffn_size + 3 * 64)
    assert extra("shared_experts") == 3 / 4 * 2 * tokens * h * 3 * 64
    assert extra("moe", "shared_experts") == extra("moe")  # the MoE layer holds its shared experts
    assert extra("layernorm", "moe_act") == 0
    assert recomputed_forward_flops(shape, tokens, None, ["mlp"]) == 0


def test_the_estimate_charges_each_module_its_time_and_keeps_the_rest_of_the_activations():
    """Llama-3-8B on 8 H100: recomputing the MLP saves more memory and costs more time than attention's core alone,
    full recompute the most of both; the report says which modules it assumed."""
    from labkit.estimate import estimate

    def run(recompute):
        return estimate(load_spec({"model": {"preset": "llama3-8b"}, "recompute": recompute,
                                   "parallel": {"tensor": 2}, "batch": {"micro": 1, "global": 32},
                                   "cluster": {"nodes": [{"gpu": "H100", "count": 1, "gpus_per_node": 8}]}}))

    runs = {name: run(r) for name, r in {
        "none": None, "core_attn": {"granularity": "selective"},
        "mlp": {"granularity": "selective", "modules": ["mlp"]},
        "both": {"granularity": "selective", "modules": ["core_attn", "mlp"]},
        "full": {"granularity": "full", "method": "uniform", "num_layers": 1}}.items()}
    memory = {k: v.memory_gb_per_stage[0] for k, v in runs.items()}
    time = {k: v.iteration_time_s for k, v in runs.items()}
    assert memory["none"] > memory["core_attn"] > memory["both"] > memory["full"]
    assert memory["none"] > memory["mlp"] > memory["both"]
    assert time["none"] < time["core_attn"] < time["both"] < time["full"] and time["core_attn"] < time["mlp"]
    assert runs["both"].flops_per_iteration > runs["mlp"].flops_per_iteration > runs["none"].flops_per_iteration
    assert "selective recompute of core_attn, mlp" in runs["both"].assumptions

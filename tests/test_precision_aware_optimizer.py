"""Megatron's precision-aware optimizer (optimizer.precision_aware and its four dtypes): the rules megatron-core's
OptimizerConfig asserts, the flags Megatron-LM parses, what labkit's driver hands megatron-core, and the bytes
Transformer Engine's FusedAdam keeps."""
import argparse
import importlib.util

import pytest
import torch
from megatron.core.optimizer import OptimizerConfig

from labkit.estimate import estimate
from labkit.estimate.memory import GIB, OptimizerDtypes, bytes_per_param, model_state_bytes
from labkit.estimate.params import Shape, stage_params
from labkit.megatron import rules
from labkit.megatron.flags import build_parser
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec

H100 = {"cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8}]}}
DRIVER = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--lr",
          "1e-4", "--train-iters", "1", "--bf16", "--mock-data"]
GPU = rules.Runtime(driver=False, cuda=True, transformer_engine=True, fused_adam=True)


def spec(optimizer: dict, precision: str = "bf16", **more):
    return load_spec({"model": {"preset": "llama3-8b"}, "precision": precision, "batch": {"micro": 1, "global": 64},
                      "optimizer": optimizer, **H100, **more})


def problems(argv: list[str], runtime=GPU) -> list[tuple[str, str]]:
    args = build_parser().parse_args(DRIVER + argv)
    return [(p.argument, p.message) for p in rules.problems(args, 8, runtime)]


@pytest.mark.parametrize("argv, config, refused, argument", [
    (["--use-precision-aware-optimizer", "--optimizer", "sgd", "--use-distributed-optimizer"],
     dict(use_precision_aware_optimizer=True, optimizer="sgd", use_distributed_optimizer=True),
     "only supported with adam", "use_precision_aware_optimizer"),
    (["--use-precision-aware-optimizer"], dict(use_precision_aware_optimizer=True), "with distributed optimizer",
     "use_precision_aware_optimizer"),
    (["--main-grads-dtype", "bf16"], dict(main_grads_dtype=torch.bfloat16), "main_grads_dtype can only be fp32",
     "main_grads_dtype"),
    (["--main-params-dtype", "fp16"], dict(main_params_dtype=torch.float16), "main_params_dtype can only be fp32",
     "main_params_dtype"),
])
def test_the_rules_are_megatron_cores_optimizer_configs(argv, config, refused, argument):
    with pytest.raises(AssertionError, match=refused):
        OptimizerConfig(**config)
    assert argument in [a for a, _ in problems(argv)]
    assert problems([*argv, "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer",
                     "adam"]) == []  # each mended as megatron-core asks


def test_without_transformer_engine_megatron_core_has_no_fusedadam_to_hand_it_and_the_driver_refuses_it():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    # megatron-core 0.16.1 asks Transformer Engine's version first, and fails there (None >= Version)
    with pytest.raises(TypeError):
        OptimizerConfig(use_precision_aware_optimizer=True, use_distributed_optimizer=True)
    assert problems(["--use-precision-aware-optimizer", "--use-distributed-optimizer"],
                    rules.Runtime(driver=True)) == [
        ("use_precision_aware_optimizer", "needs Transformer Engine's FusedAdam, on GPUs with the transformer_engine "
                                          "package; leave it out where they are not")]
    # and a spec on CPUs is refused before it is submitted, naming its field
    with pytest.raises(SpecError, match="optimizer.precision_aware: needs Transformer Engine's FusedAdam"):
        load_spec({"model": {"preset": "tiny"}, "optimizer": {"distributed": True, "precision_aware": True},
                   "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 1}]}})


def test_a_dtype_without_the_precision_aware_optimizer_is_refused_not_ignored():
    # megatron-core ignores exp_avg_dtype without it; a spec that writes one meant it
    with pytest.raises(SpecError, match=r"optimizer.exp_avg_dtype: bf16 needs optimizer.precision_aware; add it"):
        spec({"distributed": True, "exp_avg_dtype": "bf16"})
    with pytest.raises(SpecError, match=r"optimizer.main_grads_dtype: bf16 gradients need bf16 training \(precision\)"):
        spec({"distributed": True, "precision_aware": True, "main_grads_dtype": "bf16"}, precision="fp16")
    with pytest.raises(SpecError, match=r"optimizer.exp_avg_dtype: 'int8' is not one of fp32, fp16, bf16, fp8"):
        spec({"distributed": True, "precision_aware": True, "exp_avg_dtype": "int8"})


def test_the_spec_renders_megatron_lms_flags_and_the_driver_hands_them_to_megatron_core(monkeypatch):
    bf16_state = spec({"distributed": True, "precision_aware": True, "main_grads_dtype": "bf16",
                       "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8"})
    argv = megatron_args(bf16_state)
    flags = argv[argv.index("--use-precision-aware-optimizer"):]
    assert flags[:7] == ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16",
                         "--exp-avg-sq-dtype", "fp8"]
    assert "--main-params-dtype" not in argv  # fp32, Megatron-LM's default, is left out

    from labkit.train import training
    handed = {}
    monkeypatch.setattr(training, "OptimizerConfig", lambda **config: handed.update(config) or config)
    monkeypatch.setattr(training, "get_megatron_optimizer", lambda config, model, **_: None)
    monkeypatch.setattr(training, "OptimizerParamScheduler", lambda *_, **__: None)
    args = build_parser().parse_args(DRIVER + ["--use-distributed-optimizer", "--use-precision-aware-optimizer",
                                               "--main-grads-dtype", "bf16", "--exp-avg-sq-dtype", "fp8",
                                               "--lr-decay-iters", "1"])
    args.lr_warmup_iters = 0
    training.build_optimizer(args, [], argparse.Namespace(params_dtype=torch.bfloat16, timers=None))
    assert handed["use_precision_aware_optimizer"] is True
    # Megatron-LM's validate_args maps them so: fp8 is the uint8 Transformer Engine stores
    assert (handed["main_grads_dtype"], handed["main_params_dtype"], handed["exp_avg_dtype"],
            handed["exp_avg_sq_dtype"]) == (torch.bfloat16, torch.float32, torch.float32, torch.uint8)


def test_fusedadam_keeps_an_fp32_master_as_remainders_and_the_moments_in_their_dtypes():
    shape = Shape.of(spec({}).model)
    plain = model_state_bytes(shape, [32], data_parallel=8, distributed_optimizer=True)
    updated = plain.optimizer // 12  # fp32 main parameters and two fp32 moments before
    # (dtypes, bytes held per updated element, of which the step's fp32 working copies)
    for dtypes, per_element, working in (
            (OptimizerDtypes(), 2 + 8, 0),  # the master's 16 low bits beside the bf16 weights
            (OptimizerDtypes(exp_avg="bf16", exp_avg_sq="bf16"), 2 + 4, 0),  # the kernel unscales these itself
            (OptimizerDtypes(exp_avg="bf16"), 2 + 6 + 4, 4),  # not one alone: an fp32 copy through the step
            # an fp16 master and fp8 moments (each with its transpose), all three copied to fp32 through the step
            (OptimizerDtypes(main_params="fp16", exp_avg="fp8", exp_avg_sq="fp8"), 2 + 4 + 12, 12)):
        state = model_state_bytes(shape, [32], data_parallel=8, distributed_optimizer=True, optimizer_dtypes=dtypes)
        assert (state.weights, state.gradients, state.optimizer, state.step_only) == \
            (plain.weights, plain.gradients, updated * per_element, updated * working)
    # bf16 main gradients: a bf16 buffer, which FusedAdam reads itself (decoupled_grad): no fp32 copies
    bf16 = model_state_bytes(shape, [32], data_parallel=8, distributed_optimizer=True,
                             optimizer_dtypes=OptimizerDtypes(main_grads="bf16"))
    assert (bf16.gradients * 2, bf16.optimizer, bf16.step_only) == (plain.gradients, updated * 10, 0)
    # under MXFP8 with fp32 main parameters megatron-core keeps its own, and the step's copies of bf16 gradients
    mx = model_state_bytes(shape, [32], data_parallel=8, distributed_optimizer=True, precision="mxfp8",
                           optimizer_dtypes=OptimizerDtypes(main_grads="bf16", exp_avg="bf16", exp_avg_sq="bf16"))
    assert (mx.optimizer, mx.step_only) == (updated * (4 + 4 + 4), updated * 4)
    assert bytes_per_param("bf16", 8, True, optimizer_dtypes=OptimizerDtypes(exp_avg="bf16", exp_avg_sq="bf16")) == \
        (2, 4, 6 / 8)


def test_the_estimate_and_the_planner_count_it():
    fp32_state = spec({"distributed": True})
    bf16_state = spec({"distributed": True, "precision_aware": True, "exp_avg_dtype": "bf16",
                       "exp_avg_sq_dtype": "bf16"})
    before, after = (estimate(s).memory_detail[0] for s in (fp32_state, bf16_state))
    params = stage_params(Shape.of(fp32_state.model), [32])[0]
    assert before["optimizer"] - after["optimizer"] == pytest.approx((12 - 6) * params / 8 / GIB, rel=1e-4)
    assert after["total"] < before["total"]
    # and says what it assumed
    assert "the optimizer state as Transformer Engine's FusedAdam keeps it (optimizer.precision_aware): gradients " \
           "fp32, master weights fp32 as the 16 bits bf16 lacks, exp_avg bf16, exp_avg_sq bf16" in \
           estimate(bf16_state).assumptions


def test_megatron_fsdp_does_not_run_it():
    with pytest.raises(SpecError, match=r"optimizer.precision_aware: does not run under optimizer.zero_stage in "
                                        r"megatron-core 0.16.1; use ZeRO stage 1"):
        spec({"zero_stage": 3, "precision_aware": True}, job={"entrypoint": "megatron-lm",
                                                              "megatron_lm": "/workspace/megatron-lm"})


def test_the_planner_keeps_it_with_the_distributed_optimizer_it_needs():
    from labkit.plan.search import search
    from labkit.spec.checks import rule_errors

    base = load_spec({"model": {"preset": "gpt2-xl"}, "precision": "bf16", "batch": {"micro": 1, "global": 32},
                      "optimizer": {"distributed": True, "precision_aware": True, "exp_avg_dtype": "bf16",
                                    "exp_avg_sq_dtype": "bf16"},
                      "cluster": {"nodes": [{"gpu": "A100-40GB", "count": 1, "gpus_per_node": 8}]}})
    rows = search(base, top=5).rows
    assert rows
    for row in rows:
        opt = row.spec.optimizer
        assert (opt.precision_aware, opt.distributed, opt.zero_stage, opt.exp_avg_dtype) == (True, True, 1, "bf16")
        assert rule_errors(row.spec) == []


def test_an_evaluation_reuses_what_fusedadams_step_freed():
    """FusedAdam's fp32 working copies are local to its step; megatron-core's gradient copies (none here: it reads
    the buffer) would last until zero_grad, past an evaluation."""
    fp8_state = spec({"distributed": True, "precision_aware": True, "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"},
                     train={"eval_interval": 100, "eval_iters": 1},
                     recompute={"granularity": "full", "method": "uniform", "num_layers": 1})
    d = estimate(fp8_state).memory_detail[0]
    assert d["step_only"] == d["step_transient"] > d["evaluation"] > 0
    state = d["weights"] + d["gradients"] + d["optimizer"]
    assert d["total"] == pytest.approx(max(state - d["step_only"] + d["activations"], state))

"""FP8 parameters (optimizer.fp8_param_gather, Megatron-LM's --fp8-param-gather): the rules megatron-core's configs and
Megatron-LM's validate_args hold, the flags a spec renders and the driver hands megatron-core, and the bytes
Transformer Engine holds of the linear layers' weights with and without them."""
import re

import pytest
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

from labkit.estimate import estimate
from labkit.estimate.estimator import fp8_weights_of
from labkit.estimate.memory import GIB, FP8Weights, linear_weight_elements, model_state_bytes
from labkit.estimate.params import Shape
from labkit.megatron import rules, sharding
from labkit.megatron.flags import build_parser
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec
from labkit.spec.checks import rule_errors

MEGATRON_LM = {"entrypoint": "megatron-lm", "megatron_lm": "/workspace/megatron-lm"}
DRIVER = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--lr",
          "1e-4", "--train-iters", "1", "--bf16", "--mock-data"]
GPU = rules.Runtime(driver=False, cuda=True, transformer_engine=True, fused_adam=True)


def spec(precision: str = "fp8", gpu: str = "H100-SXM", **optimizer):
    return load_spec({"model": {"preset": "llama3-8b"}, "precision": precision, "batch": {"micro": 1, "global": 64},
                      "optimizer": {"distributed": True, **optimizer}, "job": MEGATRON_LM,
                      "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 8}]}})


def problems(argv: list[str]) -> list[str]:
    args = build_parser().parse_args(DRIVER + argv)
    return [p.argument for p in rules.problems(args, 8, GPU)]


def test_the_rules_are_megatron_cores_and_megatron_lms():
    with pytest.raises(ValueError, match="fp8_param must be used together with fp8 mode"):
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8_param=True)
    assert "fp8_param_gather" in problems(["--fp8-param-gather", "--use-distributed-optimizer"])
    with pytest.raises(AssertionError, match="Reuse grad buffer only when keeping params in MXFP8"):
        DistributedDataParallelConfig(reuse_grad_buf_for_mxfp8_param_ag=True)
    assert problems(["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--use-distributed-optimizer",
                     "--reuse-grad-buf-for-mxfp8-param-ag"]) == ["reuse_grad_buf_for_mxfp8_param_ag"]
    # validate_args: "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp"
    assert problems(["--fp8-format", "hybrid", "--fp8-param-gather"]) == ["fp8_param_gather"]
    # FSDP2 (Megatron-LM turns it off with Transformer Engine 2), and the reuse with another recipe
    assert problems(["--fp8-format", "hybrid", "--fp8-param-gather", "--use-torch-fsdp2",
                     "--untie-embeddings-and-output-weights", "--ckpt-format", "torch_dist"]) == ["fp8_param_gather"]
    assert problems(["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer",
                     "--reuse-grad-buf-for-mxfp8-param-ag"]) == ["reuse_grad_buf_for_mxfp8_param_ag"]
    # each mended as asked
    assert problems(["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather",
                     "--use-distributed-optimizer", "--reuse-grad-buf-for-mxfp8-param-ag"]) == []


def test_a_spec_keeps_fp8_parameters_where_megatron_lm_can_as_nvidias_recipes_do():
    def flags(s):
        return [a for a in megatron_args(s) if a in ("--fp8-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag")]

    assert flags(spec("fp8")) == ["--fp8-param-gather"]
    assert flags(spec("mxfp8", "B200")) == ["--fp8-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag"]
    assert flags(spec("bf16")) == flags(spec("nvfp4", "B200")) == []
    assert flags(spec("fp8", fp8_param_gather=False)) == []
    # without the distributed optimizer there is nothing to gather; Megatron-FSDP gathers, without the MXFP8 reuse
    assert flags(spec("fp8", distributed=False)) == []
    assert flags(spec("mxfp8", "B200", zero_stage=3)) == ["--fp8-param-gather"]
    # labkit's driver runs ZeRO-3 as FSDP2, under which Megatron-LM turns the flag off: the default leaves it out,
    # and a job that asks for it is refused naming its field (a plan is judged as Megatron-LM runs it, Megatron-FSDP)
    fsdp2 = dict(model={"preset": "llama3-8b", "untie_embeddings": True}, precision="fp8",
                 batch={"micro": 1, "global": 64}, cluster={"nodes": [{"gpu": "H100-SXM", "count": 1,
                                                                       "gpus_per_node": 8}]})
    assert flags(load_spec({**fsdp2, "optimizer": {"zero_stage": 3}})) == []
    asked = load_spec({**fsdp2, "optimizer": {"zero_stage": 3, "fp8_param_gather": True}})
    assert [e for e in rule_errors(asked, layout="slurm") if e.startswith("optimizer.fp8_param_gather")] == [
        "optimizer.fp8_param_gather: ZeRO stage 3 runs as PyTorch FSDP2 (optimizer.zero_stage), under which "
        "Megatron-LM turns it off (Transformer Engine 2); leave it out, or use ZeRO stage 1"]
    with pytest.raises(SpecError, match=r"optimizer.fp8_param_gather: keeps the linear layers' weights in FP8 and "
                                        r"needs FP8 training \(precision\)"):
        spec("bf16", fp8_param_gather=True)
    with pytest.raises(SpecError, match=r"optimizer.fp8_param_gather: all-gathers sharded weights; needs "
                                        r"optimizer.distributed or Megatron-FSDP"):
        spec("fp8", distributed=False, fp8_param_gather=True)


def test_the_precision_aware_optimizer_keeps_bf16_weights():
    """megatron-core hands Transformer Engine's FusedAdam the model's weights and keeps the master as the 16 bits bf16
    lacks: with FP8 weights there are none. The default keeps bf16 weights beside it; asking for both is refused."""
    both = dict(precision_aware=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert "--fp8-param-gather" not in megatron_args(spec("fp8", **both))
    with pytest.raises(SpecError, match="optimizer.fp8_param_gather: conflicts with optimizer.precision_aware"):
        spec("fp8", fp8_param_gather=True, **both)


def test_labkits_driver_refuses_the_mxfp8_reuse_beside_the_overlapped_gather():
    """Megatron-LM's training loop copies MXFP8 weights back into the gradient buffer around its forwards,
    evaluations and checkpoints under the overlapped gather; the driver's loop does not, and says so."""
    args = build_parser().parse_args(DRIVER + ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather",
                                               "--use-distributed-optimizer", "--reuse-grad-buf-for-mxfp8-param-ag",
                                               "--overlap-grad-reduce", "--overlap-param-gather"])
    on_driver = rules.Runtime(driver=True, cuda=True, transformer_engine=True, fused_adam=True)
    assert [p.argument for p in rules.problems(args, 8, on_driver)] == ["reuse_grad_buf_for_mxfp8_param_ag"]
    assert rules.problems(args, 8, GPU) == []  # Megatron-LM's pretrain_gpt.py runs it
    job = load_spec({"model": {"preset": "llama3-8b"}, "precision": "mxfp8", "batch": {"micro": 1, "global": 64},
                     "optimizer": {"distributed": True},
                     "kernels": {"overlap_grad_reduce": True, "overlap_param_gather": True},
                     "cluster": {"nodes": [{"gpu": "B200", "count": 1, "gpus_per_node": 8}]}})
    assert [e for e in rule_errors(job, layout="slurm") if e.startswith("optimizer.fp8_param_gather")] == [
        "optimizer.fp8_param_gather: labkit's driver does not gather MXFP8 weights through the gradient buffer beside "
        "kernels.overlap_param_gather (Megatron-LM's training loop copies them back around its evaluations and "
        "checkpoints); leave out kernels.overlap_param_gather, keep bf16 weights (optimizer.fp8_param_gather off), or "
        "run Megatron-LM's pretrain_gpt.py"]


def test_the_driver_hands_them_to_megatron_core(monkeypatch):
    from labkit.train import arguments
    from labkit.train import model as driver_model
    from labkit.train.arguments import parse_args

    monkeypatch.setattr(arguments, "runtime", lambda cuda, args: GPU)  # a GPU node with Transformer Engine
    args = parse_args(DRIVER + ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather",
                                "--use-distributed-optimizer", "--reuse-grad-buf-for-mxfp8-param-ag",
                                "--transformer-impl", "transformer_engine"],
                      world_size=8, rank=0, cuda=True)
    config = driver_model.transformer_config(args)
    assert (config.fp8, config.fp8_recipe, config.fp8_param) == ("e4m3", "mxfp8", True)
    ddp = driver_model.ddp_config(args)
    assert (ddp.fp8_param_gather, ddp.reuse_grad_buf_for_mxfp8_param_ag, ddp.use_distributed_optimizer) == \
        (True, True, True)

    from labkit.train import training
    handed = {}
    monkeypatch.setattr(training, "OptimizerConfig", lambda **config: handed.update(config) or config)
    monkeypatch.setattr(training, "get_megatron_optimizer", lambda config, model, **_: None)
    monkeypatch.setattr(training, "OptimizerParamScheduler", lambda *_, **__: None)
    args.lr_warmup_iters, args.lr_decay_iters = 0, 1
    training.build_optimizer(args, [], config)
    assert (handed["fp8_recipe"], handed["reuse_grad_buf_for_mxfp8_param_ag"]) == ("mxfp8", True)


def test_linear_weights_are_megatron_cores_linear_layers():
    """The elements labkit counts as the linear layers' weights against the weights of megatron-core's linear layers
    in labkit's driver's model (QKV, output projection, fc1, fc2; the local experts' too), per tensor rank."""
    from labkit.train.model_state import on_driver_ranks

    def measure(args):
        from labkit.train.model import build_model, transformer_config

        linear = re.compile(r"linear_(qkv|proj|fc1|fc2)\.weight\d*$")
        chunks = build_model(args, transformer_config(args))
        return sum(p.numel() for chunk in chunks for name, p in chunk.named_parameters() if linear.search(name))

    cpu = {"cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}, "batch": {"micro": 1, "global": 2}}
    dense = load_spec({"model": {"preset": "tiny-llama"}, "parallel": {"tensor": 2}, **cpu})
    moe = load_spec({"model": {"preset": "tiny", "num_experts": 4, "moe_router_topk": 2}, "parallel": {"expert": 2},
                     "batch": {"micro": 1, "global": 2}, "cluster": cpu["cluster"]})
    measured = on_driver_ranks([dense], measure)[0] + on_driver_ranks([moe], measure)[0]
    counted = [linear_weight_elements(Shape.of(dense.model), dense.model.num_layers, tensor=2)] * 2 + \
              [linear_weight_elements(Shape.of(moe.model), moe.model.num_layers, expert=2)] * 2
    assert measured == counted


def test_what_transformer_engine_holds_of_the_weights():
    shape = Shape.of(spec().model)
    bf16 = model_state_bytes(shape, [32], data_parallel=8, distributed_optimizer=True, precision="fp8")
    linear = linear_weight_elements(shape, 32)
    for weights, added in ((FP8Weights.of("fp8", True, any_layout=False), 0),  # Hopper: the FP8 data and transpose
                           (FP8Weights.of("fp8", True, any_layout=True), -1),  # Blackwell: the FP8 data alone
                           (FP8Weights.of("fp8", False, any_layout=False), 2),  # bf16 beside a cached FP8 + transpose
                           (FP8Weights.of("fp8", False, any_layout=True), 1),
                           (FP8Weights.of("mxfp8", True, any_layout=True), 1 / 16),  # two layouts, a scale per 32
                           (FP8Weights.of("nvfp4", True, any_layout=True), 1.125)):  # no FP4 parameters here
        state = model_state_bytes(shape, [32], data_parallel=8, distributed_optimizer=True, precision="fp8",
                                  fp8_weights=weights)
        assert state.weights - bf16.weights == int(linear * added) or \
            state.weights - bf16.weights == pytest.approx(linear * added, abs=1)
        assert (state.gradients, state.optimizer) == (bf16.gradients, bf16.optimizer)
    assert FP8Weights.of("bf16", True, True) is None
    # the estimate reads the GPUs: Blackwell's FP8 weights a byte each, Hopper's two
    hopper, blackwell = (estimate(spec("fp8", gpu)).memory_detail[0]["weights"] for gpu in ("H100-SXM", "B200"))
    assert hopper - blackwell == pytest.approx(linear / GIB, rel=1e-6)
    assert fp8_weights_of(spec("fp8", "B200")) == FP8Weights(1.0, True)


def test_the_estimate_says_which_it_assumed():
    said = [a for a in estimate(spec("fp8", "B200")).assumptions if "linear layers' weights" in a]
    assert said == ["the linear layers' weights kept in FP8 at 1 byte each (--fp8-param-gather: "
                    "optimizer.fp8_param_gather, the default where Megatron-LM can, as NVIDIA's recipes set it), no "
                    "bf16 copy"]
    said = [a for a in estimate(spec("fp8", fp8_param_gather=False)).assumptions if "linear layers' weights" in a]
    assert said == ["the linear layers' weights in bf16 with Transformer Engine's cached FP8 copy, 2 bytes each "
                    "beside their 2 (optimizer.fp8_param_gather false)"]
    assert not [a for a in estimate(spec("bf16")).assumptions if "linear layers' weights" in a]


def test_deepspeed_holds_transformer_engines_cached_copies():
    shape = Shape.of(spec().model)

    def weights(precision):
        return estimate(load_spec({"model": {"preset": "llama3-8b"}, "precision": precision,
                                   "batch": {"micro": 1, "global": 64},
                                   "optimizer": {"zero_stage": 1, "zero_backend": "deepspeed"},
                                   "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8}]}})
                        ).memory_detail[0]["weights"]

    assert weights("fp8") - weights("bf16") == pytest.approx(2 * linear_weight_elements(shape, 32) / GIB)


def test_megatron_fsdp_keeps_its_weight_buffer_in_fp8():
    shape = Shape.of(spec().model)
    kw = dict(data_parallel=8, precision="fp8", zero_stage=3, entrypoint=sharding.MEGATRON_LM)
    plain = model_state_bytes(shape, [32], **kw)
    kept = model_state_bytes(shape, [32], fp8_weights=FP8Weights.of("fp8", True, any_layout=True), **kw)
    cached = model_state_bytes(shape, [32], fp8_weights=FP8Weights.of("fp8", False, any_layout=True), **kw)
    linear = linear_weight_elements(shape, 32)
    # sharded and gathered, the linear layers' share at a byte instead of two
    assert 0 < plain.weights - kept.weights < plain.weights / 2
    assert cached.weights - plain.weights == pytest.approx(linear, abs=1)  # the whole gathered weights' FP8 cache

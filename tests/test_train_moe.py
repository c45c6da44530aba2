"""Mixture-of-experts GPT on labkit's driver, with megatron-core's own MoE layer: the configuration and layer spec it
builds from Megatron-LM's flags, what the CPU layer answers for the MoE path, the flags a CPU refuses, and (slow) the
tiny MoE trained on two gloo processes at expert parallel 1 and 2 with the allgather and alltoall dispatchers.

Expert parallelism changes how megatron-core initialises the experts (each expert rank draws only its own experts'
weights), so runs at expert parallel 1 and 2 start from different weights even with the same seed. The comparison
therefore starts both from one torch_dist checkpoint written at expert parallel 1: from there the losses must agree to
fp32 rounding, iteration by iteration.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from labkit.estimate.params import stage_params
from labkit.logs.parse import parse_log
from labkit.megatron.shape import Shape
from labkit.megatron_args import megatron_args
from labkit.spec import load_spec
from labkit.train.arguments import ArgumentError, build_parser, finish

PARAMETERS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)")
LM_LOSS = re.compile(r"iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")
LINE = re.compile(r"iteration +\d+/ *\d+ \|.*")
TINY_MOE = {"preset": "tiny", "num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
            "hidden_dropout": 0.0, "attention_dropout": 0.0}
"""The tiny preset (2 layers, hidden 64, with biases as Megatron-LM's default) with 4 experts, 2 per token, and
GShard's load-balancing loss; no dropout: resumed runs under another layout keep their own RNG streams."""


def run_spec(model: dict | None = None, expert: int = 1, **train) -> dict:
    """A spec dict for two CPU processes, global batch 8 as 2 micro-batches of 2 on each of 2 data-parallel ranks,
    fp32, 3 iterations each logged."""
    return {"model": {**TINY_MOE, **(model or {})}, "precision": "fp32", "batch": {"micro": 2, "global": 8},
            "parallel": {"expert": expert}, "train": {"iters": 3, "log_interval": 1, **train},
            "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}}


def driver_args(spec: dict, *extra: str):
    return build_parser().parse_args([*map(str, megatron_args(load_spec(spec))), *extra])


# --- arguments, configuration and layer spec (no processes) ---------------------------------------------------------

def test_moe_config_takes_megatron_lms_defaults_and_the_pattern_as_a_list():
    from labkit.train.model import transformer_config

    args = finish(driver_args(run_spec({"num_layers": 4, "swiglu": True, "moe_layer_freq": "([0]+[1]*3)",
                                        "moe_shared_expert_intermediate_size": 256, "qk_layernorm": True,
                                        "kv_channels": 32, "add_bias_linear": False}, expert=2)),
                  world_size=2, rank=0, cuda=False)
    # Megatron-LM's validate_args: an expert as wide as the MLP, experts on the model's tensor size
    assert args.moe_ffn_hidden_size == args.ffn_hidden_size == 128
    assert args.moe_layer_freq == [0, 1, 1, 1] and args.expert_tensor_parallel_size == 1
    config = transformer_config(args)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 128)
    assert config.moe_layer_freq == [0, 1, 1, 1] and config.moe_shared_expert_intermediate_size == 256
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == ("aux_loss", 0.01)
    assert config.moe_token_dispatcher_type == "allgather" and not config.moe_grouped_gemm
    assert config.qk_layernorm and config.kv_channels == 32


def test_a_dense_model_takes_kv_channels_and_qk_layernorm_and_no_expert_fields():
    from labkit.train.model import transformer_config

    args = finish(build_parser().parse_args([*map(str, megatron_args(load_spec(
        {"model": {"preset": "tiny", "qk_layernorm": True, "kv_channels": 8}})))]), world_size=1, rank=0, cuda=False)
    config = transformer_config(args)
    assert config.num_moe_experts is None and config.moe_ffn_hidden_size is None
    assert config.qk_layernorm and config.kv_channels == 8
    assert args.moe_layer_freq == 1


@pytest.mark.parametrize("freq, expected", [("1", 1), ("2", 2), ("([1]*3+[0]*1)", [1, 1, 1, 0])])
def test_moe_layer_freq_reads_as_megatron_lms_parser_reads_it(freq, expected):
    from labkit.train.arguments import moe_layer_freq

    assert moe_layer_freq(freq, 4) == expected
    assert moe_layer_freq(expected, 4) == expected  # already read


@pytest.mark.parametrize("flag, value", [("--moe-grouped-gemm", None), ("--moe-token-dispatcher-type", "flex")])
def test_the_cpu_driver_refuses_what_moe_needs_gpus_for_naming_the_flag(flag, value):
    args = driver_args(run_spec(), *([flag] if value is None else [flag, value]))
    with pytest.raises(ArgumentError, match=f"^{flag}: needs GPUs"):
        finish(args, world_size=2, rank=0, cuda=False)


def test_moe_grouped_gemm_on_a_cpu_exits_2_naming_the_flag(tmp_path):
    cmd = [sys.executable, "-m", "labkit.train", *map(str, megatron_args(load_spec(run_spec()))), "--moe-grouped-gemm"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--moe-grouped-gemm: needs GPUs" in done.stderr
    assert "iteration" not in done.stdout


def test_load_balancing_losses_are_tracked_under_megatron_lms_names():
    from labkit.train.training import moe_track_names

    assert moe_track_names("aux_loss") == ["load_balancing_loss"]
    # Megatron-LM tests by substring: the sequence and global kinds also track the plain one (it stays 0, unprinted)
    assert moe_track_names("seq_aux_loss") == ["load_balancing_loss", "seq_load_balancing_loss"]
    assert moe_track_names("global_aux_loss") == ["load_balancing_loss", "global_load_balancing_loss"]
    assert moe_track_names("sinkhorn") == moe_track_names("none") == []


def test_auxiliary_losses_average_over_advanced_iterations_and_print_after_the_lm_loss():
    from labkit.train import megatron_log
    from labkit.train.training import IntervalStats

    stats = IntervalStats()
    stats.add({"lm loss": 7.0}, skipped=False)
    stats.add_aux({"load_balancing_loss": 1.5, "load_balancing_loss_unused": 0.0})
    stats.add({"lm loss": 5.0}, skipped=False)
    stats.add_aux({"load_balancing_loss": 0.5, "load_balancing_loss_unused": 0.0})
    assert list(stats.mean_losses().items()) == [("lm loss", 6.0), ("load_balancing_loss", 1.0)]
    line = megatron_log.iteration_line(iteration=2, train_iters=3, consumed_samples=16, elapsed_ms=1.0, throughput=None,
                                       learning_rate=1e-3, global_batch_size=8, losses=stats.mean_losses(),
                                       loss_scale=1.0, grad_norm=0.5, skipped=0, nan=0)
    # Megatron-LM's training_log: ' {key}: {value:.6E} |' for each loss, the MoE ones after the model's
    assert " lm loss: 6.000000E+00 | load_balancing_loss: 1.000000E+00 | loss scale: 1.0 |" in line


# --- the CPU layer on the MoE path ----------------------------------------------------------------------------------

@pytest.fixture
def compat():
    from labkit.train import cpu_compat

    if torch.cuda.is_available():
        pytest.skip("the layer is for machines without CUDA")
    was_applied = cpu_compat.is_applied()
    assert cpu_compat.apply()
    yield cpu_compat
    if not was_applied:
        cpu_compat.remove()


def test_moe_streams_and_events_are_in_order_on_the_cpu(compat):
    dispatcher = sys.modules["megatron.core.transformer.moe.token_dispatcher"]
    side = dispatcher.torch.cuda.Stream()
    main = dispatcher.torch.cuda.current_stream()
    assert main is dispatcher.torch.cuda.current_stream() and main != side
    side.wait_stream(main)
    with dispatcher.torch.cuda.stream(side):
        x = torch.ones(2) * 3
    side.record_event().synchronize()
    assert x.tolist() == [3.0, 3.0]
    # the tracker's sums land on the CPU
    assert sys.modules["megatron.core.transformer.moe.moe_utils"].torch.zeros(2, device="cuda").device.type == "cpu"


def test_token_counts_reach_all_to_all_as_numpy_split_sizes(compat):
    import numpy

    moe_utils = sys.modules["megatron.core.transformer.moe.moe_utils"]
    dispatcher = sys.modules["megatron.core.transformer.moe.token_dispatcher"]
    counts = torch.tensor([3, 5])
    splits = dispatcher.maybe_move_tensor_to_cpu(counts, as_numpy=True)
    assert isinstance(splits, numpy.ndarray) and splits.tolist() == [3, 5]
    counts[0] = 9
    assert splits.tolist() == [3, 5]  # a copy, as the GPU's device-to-host copy is
    assert moe_utils.maybe_move_tensor_to_cpu(counts) is counts
    compat.remove()
    try:
        assert isinstance(dispatcher.maybe_move_tensor_to_cpu(counts, as_numpy=True), torch.Tensor)  # megatron's own
    finally:
        compat.apply()


# --- training on two gloo processes ---------------------------------------------------------------------------------

def _lm_losses(text: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LM_LOSS.findall(text)}


@pytest.fixture(scope="module")
def trained(train_in_parallel, tmp_path_factory):
    """Expert parallel 1 with the allgather dispatcher, saving a torch_dist checkpoint after every iteration (the
    reference); expert parallel 1 with alltoall from the same seed; expert parallel 2 without biases (Mixtral's
    layers). Then expert parallel 2 with each dispatcher resumes the reference after iteration 1."""
    ckpt = tmp_path_factory.mktemp("moe-ep1-ckpt")
    dist_ckpt = {"ckpt_format": "torch_dist"}
    first = train_in_parallel({
        "ep1-allgather": load_spec(run_spec(save=str(ckpt), save_interval=1, **dist_ckpt)),
        "ep1-alltoall": load_spec(run_spec({"moe_token_dispatcher_type": "alltoall"})),
        "ep2-alltoall-nobias": load_spec(run_spec({"moe_token_dispatcher_type": "alltoall", "add_bias_linear": False},
                                                  expert=2)),
    })
    resumed = {f"ep2-{d}-resumed": load_spec({**run_spec({"moe_token_dispatcher_type": d}, expert=2, load=str(ckpt),
                                                         **dist_ckpt),
                                              "job": {"extra_args": ["--ckpt-step", "1"]}})
               for d in ("allgather", "alltoall")}
    return {**first, **train_in_parallel(resumed)}


@pytest.mark.slow
def test_the_iteration_lines_carry_the_load_balancing_loss_as_megatron_lm_prints_it(trained, tmp_path):
    _, text = trained["ep1-allgather"]
    lines = LINE.findall(text)
    assert len(lines) == 3
    for line in lines:
        assert re.search(r"\| lm loss: \d\.\d{6}E[+-]\d\d \| load_balancing_loss: \d\.\d{6}E[+-]\d\d \| loss scale:",
                         line), line
    # the log reader keeps it as a column of its own, beside the lm loss
    (tmp_path / "train.log").write_text(text)
    frame = parse_log([tmp_path / "train.log"]).iterations
    assert frame["lm_loss"].notna().all() and (frame["load_balancing_loss"] > 0.5).all()


@pytest.mark.slow
def test_both_dispatchers_compute_the_same_steps_at_expert_parallel_1(trained):
    allgather, alltoall = _lm_losses(trained["ep1-allgather"][1]), _lm_losses(trained["ep1-alltoall"][1])
    assert sorted(allgather) == [1, 2, 3] and all(0 < v < 10 for v in allgather.values())
    assert alltoall == pytest.approx(allgather, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_expert_parallel_2_resumes_expert_parallel_1_with_the_same_losses(trained, dispatcher):
    """Data parallel 2 x expert parallel 2 against data parallel 2 x expert parallel 1, both on two ranks, from the
    same weights and Adam state: each rank holds half the experts and tokens travel to them, the arithmetic is the
    same to fp32 rounding."""
    reference = _lm_losses(trained["ep1-allgather"][1])
    _, text = trained[f"ep2-{dispatcher}-resumed"]
    assert "(expert, expert tensor) = (2, 1) resumes a checkpoint written at (1, 1)" in text
    resumed = _lm_losses(text)
    assert sorted(resumed) == [2, 3]
    assert resumed == pytest.approx({i: reference[i] for i in (2, 3)}, rel=1e-5)
    lb = [float(x) for x in re.findall(r"load_balancing_loss: ([0-9.E+-]+)", text)]
    reference_lb = [float(x) for x in re.findall(r"load_balancing_loss: ([0-9.E+-]+)", trained["ep1-allgather"][1])]
    assert lb == pytest.approx(reference_lb[1:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name, expert", [("ep1-alltoall", 1), ("ep2-alltoall-nobias", 2),
                                          ("ep2-alltoall-resumed", 2)])
def test_each_ranks_logged_parameters_are_the_estimates_with_its_share_of_the_experts(trained, name, expert):
    """Megatron-LM logs the parameters one rank holds: at expert parallel 2 half the experts of each MoE layer."""
    spec, text = trained[name]
    logged = {(int(t), int(p)): int(n) for t, p, n in PARAMETERS.findall(text)}
    shape = Shape.of(spec.model)
    expected = round(stage_params(shape, spec.layer_partition, 1, expert=expert)[0])
    assert logged == {(0, 0): expected}


@pytest.mark.parametrize("swiglu, bias, fused", [(False, True, False), (True, True, False), (True, False, True)])
def test_experts_take_the_bias_activation_fusion_only_as_swiglu_without_biases(monkeypatch, swiglu, bias, fused):
    """megatron-core fuses an expert's activation with its routing weights for SwiGLU without biases only; otherwise
    its MLP raises at the first forward on a GPU, so the driver keeps that fusion off there and says why."""
    import importlib.util

    from labkit.train.model import fusions

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "triton" else find_spec(name, *a))
    args = finish(driver_args(run_spec({"swiglu": swiglu, "add_bias_linear": bias})), world_size=2, rank=0, cuda=False)
    on, why = fusions(args, cuda=True)["bias_activation_fusion"]
    assert on == fused
    assert why == ("" if fused else "megatron-core fuses an expert's routing weights with SwiGLU without biases only")

"""Steady state, throughput, TFLOP/s and MFU from parsed logs; expected values worked out from the logs' own numbers."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from labkit import catalog
from labkit.estimate.flops import flops_72
from labkit.logs import parse_log, parse_text
from labkit.logs.derive import (leaf_phases, mean_phase_times, memory_per_rank, per_rank_timers, phase_times,
                                steady_state, summarize, throughput)
from labkit.spec import load_spec

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "logs"

# Log 03's "elapsed time per iteration (ms)" for iterations 20..260, as printed.
LOG03_MS = [820.7, 821.8, 849.8, 904.5, 837.6, 840.3, 849.5, 832.5, 869.1, 1069.8, 774.3, 792.7, 860.2, 1296.2, 822.7,
            839.6, 867.7, 1265.2, 901.4, 832.4, 970.0, 992.3, 842.4, 824.3, 973.8]


def frame(elapsed, start=10, step=10):
    return pd.DataFrame({"iteration": range(start, start + step * len(elapsed), step), "elapsed_ms": elapsed})


def test_steady_state_leaves_out_warmup_and_spikes():
    s = steady_state(frame([2000.0, 1200.0, 1000.0, 1010.0, 990.0, 3000.0]))
    assert s.warmup_iterations == [10, 20]  # the first interval, then one still 10% over the rest's median
    assert s.outlier_iterations == [60]  # 3000 > 1.5 x 1005
    assert s.steady_iterations == [30, 40, 50]
    assert s.iteration_ms == pytest.approx(1000.0) and s.median_ms == pytest.approx(1000.0)


def test_steady_state_explicit_warmup_and_single_interval():
    s = steady_state(frame([2000.0, 1200.0, 1000.0]), warmup=0)
    assert s.warmup_iterations == [] and s.outlier_iterations == [10]
    one = steady_state(frame([500.0]))
    assert one.iteration_ms == 500.0 and one.warmup_iterations == []
    assert steady_state(frame([])).iteration_ms is None


def test_computed_tflops_and_mfu_from_the_arguments_block():
    p = parse_log(FIXTURES / "03-mlm2025-gpt2-fp16-autodl.log")
    speed = throughput(p, gpu="A100-80GB")
    steady = [ms for ms in LOG03_MS if ms != 1296.2]  # iteration 150 holds an evaluation
    assert speed.steady.warmup_iterations == [10] and speed.steady.outlier_iterations == [150]
    t = sum(steady) / len(steady)
    assert speed.iteration_ms == pytest.approx(t)
    # GPT-2 124M: 12 layers, hidden 768, seq 512, padded vocab 50304, global batch 16, one GPU, fp16
    flops = flops_72(16, 512, 12, 768, 50304)
    assert speed.tflops_source == "model FLOPs"
    assert speed.tflops_per_gpu == pytest.approx(flops / (t / 1000) / 1 / 1e12)
    assert speed.tokens_per_s == pytest.approx(16 * 512 / (t / 1000))
    assert speed.precision == "fp16"
    assert speed.mfu == pytest.approx(speed.tflops_per_gpu / catalog.gpu("A100-80GB").peak("fp16"))


def test_logged_tflops_are_used_when_printed():
    p = parse_log(FIXTURES / "04-mlm-core080-7b-2node-throughput.log")
    speed = throughput(p)
    printed = [793.1, 801.7, 807.3, 805.9, 802.9, 801.6, 800.9, 802.6, 799.6]  # iterations 20..100
    assert speed.tflops_source == "log" and speed.tflops_per_gpu == pytest.approx(sum(printed) / len(printed))
    assert speed.mfu is None  # no GPU named, none in the log
    assert speed.global_batch_size == 1024 and speed.seq_length is None and speed.tokens_per_s is None


def test_mfu_of_fasop_heterogeneous_job_from_its_spec():
    """The GPT-2 XL log of FASOP's Megatron-LM scripts (32 A10, global batch 64, about 1.4 s per iteration) read with
    the heterogeneous example spec (1 node of 4 A100 + 7 nodes of 4 A10): the peaks come from the spec's GPUs."""
    spec = load_spec(ROOT / "examples" / "gpt2-xl-hetero.yaml")
    p = parse_log(FIXTURES / "fasop-get-result.txt")
    speed = throughput(p, spec=spec)
    # get_result's summary "iteration 10 : 4.5416 s" is the warm-up; 20..50 print 1401.5, 1423.8, 1373.9, 1409.8 ms
    assert speed.steady.warmup_iterations == [10]
    t = (1401.5 + 1423.8 + 1373.9 + 1409.8) / 4
    assert speed.iteration_ms == pytest.approx(t)
    m = spec.model
    flops = flops_72(64, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size)
    assert speed.world_size == 32 and speed.tflops_per_gpu == pytest.approx(flops / (t / 1000) / 32 / 1e12)
    peaks = 4 * catalog.gpu("A100-40GB").peak("fp16") + 28 * catalog.gpu("A10").peak("fp16")
    assert speed.mfu == pytest.approx(flops / (t / 1000) / (peaks * 1e12))


def test_leaf_phases_drop_totals_and_duplicates():
    names = ["forward-backward", "forward-compute", "backward-compute", "optimizer", "optimizer-inner-step", "fwd",
             "fwd_microstep", "bwd", "bwd_inner", "bwd_allreduce", "evaluate", "save-checkpoint"]
    assert leaf_phases(names) == ["forward-compute", "backward-compute", "optimizer-inner-step", "fwd", "bwd_inner",
                                  "bwd_allreduce"]
    assert leaf_phases(["forward-backward", "optimizer"]) == ["forward-backward", "optimizer"]


ALL_RANKS = """ iteration       10/     100 | elapsed time per iteration (ms): 100.0 | lm loss: 5.0 |
times across ranks (ms):
  forward-compute:
     rank  0: 40.00
     rank  1: 44.00
  backward-compute:
     rank  0: 50.00
     rank  1: 56.00
 iteration       20/     100 | elapsed time per iteration (ms): 100.0 | lm loss: 4.0 |
times across ranks (ms):
  forward-compute:
     rank  0: 42.00
     rank  1: 46.00
  backward-compute:
     rank  0: 52.00
     rank  1: 58.00
"""


def test_phase_times_and_per_rank_table():
    p = parse_text(ALL_RANKS)
    table = phase_times(p)
    assert table.loc[10, "forward-compute"] == 44.0 and table.loc[20, "backward-compute"] == 58.0  # slowest rank
    ranks = per_rank_timers(p)
    assert list(ranks.index) == ["rank 0", "rank 1"]
    assert ranks.loc["rank 1", "forward-compute"] == pytest.approx(45.0)  # mean of 44 and 46
    assert mean_phase_times(p)["backward-compute"] == pytest.approx(58.0)  # iteration 10 is warm-up


def test_per_rank_timers_fall_back_to_min_and_max():
    p = parse_log(FIXTURES / "05-megads-2026-pdsh-2node-tp4dp2.log")
    assert per_rank_timers(p).empty  # set-up timers only, no training iteration timed
    text = (" iteration 10/ 100 | elapsed time per iteration (ms): 100.0 |\n(min, max) time across ranks (ms):\n"
            "    forward-compute ................................: (10.00, 12.50)\n")
    table = per_rank_timers(parse_text(text))
    assert table.loc["fastest rank", "forward-compute"] == 10.0 and table.loc["slowest rank", "forward-compute"] == 12.5


def test_memory_per_rank_keeps_last_report_and_peak():
    text = "\n".join(
        f"[Rank {r}] (after {i} iterations) memory (MB) | allocated: {a} | max allocated: {mx} | reserved: 900.0 | "
        f"max reserved: 900.0" for r, i, a, mx in [(0, 1, 100.0, 800.0), (1, 1, 110.0, 700.0), (0, 2, 120.0, 500.0)])
    table = memory_per_rank(parse_text(text + "\n")).set_index("rank")
    assert table.loc[0, "allocated_mb"] == 120.0 and table.loc[0, "peak_allocated_mb"] == 800.0
    assert table.loc[1, "iteration"] == 1


def test_summary_of_a_real_log():
    s = summarize(parse_log(FIXTURES / "03-mlm2025-gpt2-fp16-autodl.log"))
    assert (s["first_iteration"], s["last_iteration"], s["train_iters"], s["iterations_logged"]) == (10, 260, 1000, 26)
    assert s["last_lm_loss"] == pytest.approx(6.939181) and s["min_lm_loss"] == pytest.approx(6.923337)
    assert s["skipped_iterations"] == 10 + 6 + 5 and s["nan_iterations"] == 0
    assert s["warmup_iterations_excluded"] == [10] and s["outlier_iterations_excluded"] == [150]
    assert s["max_allocated_mb"] == pytest.approx(1464.3408203125) and s["errors"] == 0 and s["warnings"] > 0


def test_a_llama_shape_is_read_back_from_the_arguments_block_the_driver_prints():
    import dataclasses

    from labkit.estimate.params import Shape
    from labkit.logs.derive import shape_from_arguments
    from labkit.megatron_args import megatron_args
    from labkit.train import megatron_log
    from labkit.train.arguments import build_parser, finish

    spec = load_spec({"model": {"preset": "tiny-llama", "hidden_dropout": 0.0, "attention_dropout": 0.0}})
    args = finish(build_parser().parse_args(megatron_args(spec)), world_size=1, rank=0, cuda=False)
    args.padded_vocab_size = 1024
    shape = shape_from_arguments(parse_text(megatron_log.arguments_block(args)).arguments)
    assert dataclasses.astuple(shape) == dataclasses.astuple(Shape.of(spec.model))
    assert (shape.norm, shape.positions, shape.bias, shape.hidden_dropout) == ("RMSNorm", "rope", False, 0.0)


@pytest.mark.parametrize("model", [
    {"preset": "tiny", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 96, "num_layers": 4,
     "moe_layer_freq": "([0]+[1]*3)", "moe_shared_expert_intermediate_size": 64},
    {"preset": "tiny-llama", "num_experts": 8, "kv_channels": 8, "qk_layernorm": True, "moe_layer_freq": "2"}])
def test_an_moe_shape_is_read_back_with_its_experts_and_pattern(model):
    """The log's FLOPs and MFU count an MoE model's active experts only, so the reader must see the experts, their
    width, the layer pattern (printed by validate_args as its list) and Qwen3-style heads."""
    from labkit.estimate.params import Shape, active_params, total_params
    from labkit.logs.derive import shape_from_arguments
    from labkit.megatron.flops import model_flops
    from labkit.megatron_args import megatron_args
    from labkit.train import megatron_log
    from labkit.train.arguments import build_parser, finish

    spec = load_spec({"model": {**model, "hidden_dropout": 0.0, "attention_dropout": 0.0}})
    args = finish(build_parser().parse_args(megatron_args(spec)), world_size=1, rank=0, cuda=False)
    args.padded_vocab_size = spec.model.vocab_size
    shape = shape_from_arguments(parse_text(megatron_log.arguments_block(args)).arguments)
    expected = Shape.of(spec.model)
    assert shape.moe_layers == expected.moe_layers and (shape.experts, shape.topk) == (expected.experts, expected.topk)
    assert (total_params(shape), active_params(shape)) == (total_params(expected), active_params(expected))
    assert model_flops(shape, 8) == model_flops(expected, 8) < model_flops(Shape(**{**vars(expected), "topk": 3}), 8)


def test_a_logged_throughput_that_rounds_to_zero_gives_way_to_the_model_flops():
    """A tiny model on a CPU logs `throughput per GPU (TFLOP/s/GPU): 0.0`; with the model's shape known, the table
    shows the model FLOPs per second instead, and says so."""
    p = parse_log(FIXTURES / "04-mlm-core080-7b-2node-throughput.log")
    p.iterations["tflops_per_gpu"] = 0.0
    with_shape = throughput(p, spec=load_spec({"model": {"preset": "llama2-7b"}, "batch": {"global": 1024}}))
    assert with_shape.tflops_source == "model FLOPs (the log rounds to 0.0)" and with_shape.tflops_per_gpu > 0
    assert throughput(p).tflops_source == "log" and throughput(p).tflops_per_gpu == 0.0  # nothing better known


def test_a_run_on_the_cpu_gets_no_mfu_against_the_catalogs_placeholder_peak():
    p = parse_log(FIXTURES / "03-mlm2025-gpt2-fp16-autodl.log")
    assert throughput(p, gpu="cpu").mfu is None and throughput(p, gpu="cpu").tflops_per_gpu > 0
    assert throughput(p, gpu="A100-80GB").mfu > 0

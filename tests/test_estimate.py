"""Iteration time, memory and the `estimate` entry point."""
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit import catalog
from labkit.cli import main
from labkit.estimate import (Pipeline, Profile, Shape, Stack, allreduce_time, default_calibration, estimate,
                             memory_per_stage, pipeline_lower_bound, pipeline_time, stage_time)
from labkit.estimate.memory import activation_bytes_per_layer
from labkit.estimate.timing import schedule_1f1b, steady_times
from labkit.spec import load_spec

GPT2_XL = Shape(num_layers=48, hidden=1600, heads=25, seq_length=1024, vocab=50257)


def fasop_gpt2_xl(**changes):
    data = {"name": "fasop-gpt2-xl", "model": {"preset": "gpt2-xl"},
            "parallel": {"tensor": 1, "pipeline": 8, "data": 4, "partition": [0, 11, 8, 8, 8, 8, 5, 0]},
            "batch": {"micro": 1, "global": 64}, "precision": "fp16", "recompute": "none", "cluster": "a10x8"}
    for key, value in changes.items():
        data[key] = value
    return load_spec(data)


def test_allreduce_is_the_ring_formula():
    latency = default_calibration().link_latency_s
    assert allreduce_time(1e9, 1, 100, latency) == 0
    # 2 (n-1)/n x 1 GB over 100 Gbit/s = 1.5 x 0.08 s, plus 6 latency steps
    assert allreduce_time(1e9, 4, 100, latency_s=0) == pytest.approx(0.12)
    assert allreduce_time(1e9, 4, 100, latency) == pytest.approx(0.12 + 6 * latency)
    assert latency > 0


def test_homogeneous_pipeline_is_m_plus_p_minus_1_stage_times():
    result = pipeline_time([0.1] * 4, [0.0] * 3, num_micro_batches=8)
    assert result.total_s == pytest.approx((8 + 4 - 1) * 0.1)
    assert result.bubble_s == pytest.approx(3 * 0.1)  # bubble fraction (p - 1)/m of the busy time
    assert result.busy_s == pytest.approx(0.8)


def test_interleaving_divides_the_bubble_by_v():
    plain = pipeline_time([0.1] * 4, [0.0] * 3, 8)
    interleaved = pipeline_time([0.1] * 4, [0.0] * 3, 8, virtual_stages=3)
    assert interleaved.bubble_s == pytest.approx(plain.bubble_s / 3)


def test_slowest_stage_sets_the_steady_state_and_sends_add_up():
    # The slowest stage last: it starts once the first micro-batch has come through, then never waits; after its
    # last backward the gradient goes back through the others. That is the critical-path closed form.
    result = pipeline_time([0.1, 0.1, 0.3], [0.01, 0.01], 10)
    assert result.bottleneck_stage == 2
    assert result.total_s == pytest.approx(9 * (0.3 + 0.01) + 0.5 + 0.04)
    with pytest.raises(ValueError, match="boundary_times"):
        pipeline_time([0.1, 0.1], [], 4)


def test_warm_up_forwards_of_an_early_slow_stage_hide_the_round_trip_behind_it():
    # Stage 1 is slowest (0.1 s forward + 0.2 s backward, plus a 0.01 s send after each). Its one warm-up forward
    # covers stage 2's round trip, so from the moment stage 0's first forward (and send) is done, stage 1 is busy
    # for 10 x 0.32 s; stage 0's last backward follows. The closed form would charge stage 2's work as fill/drain.
    result = pipeline_time([0.1, 0.3, 0.1], [0.01, 0.01], 10)
    assert result.bottleneck_stage == 1
    assert result.total_s == pytest.approx((0.1 / 3 + 0.01) + 10 * 0.32 + 0.2 / 3)
    assert result.total_s < 9 * (0.3 + 0.02) + 0.5 + 0.04


def test_stage_time_from_gpu_scales_with_layers_tensor_and_recompute():
    one = stage_time("A100-40GB", 4, 1, 1, shape=GPT2_XL)
    assert stage_time("A100-40GB", 8, 1, 1, shape=GPT2_XL).forward_s == pytest.approx(2 * one.forward_s)
    assert one.backward_s == pytest.approx(2 * one.forward_s)
    tp2 = stage_time("A100-40GB", 4, 1, 2, shape=GPT2_XL)
    gemm_only = Stack("matrix multiplies only", memory_passes=0.0, tp_allreduce_s=0.0, p2p_message_s=0.0,
                             p2p_messages=1, overlap_p2p=False)
    assert (stage_time("A100-40GB", 4, 1, 2, shape=GPT2_XL, stack=gemm_only).forward_s
            == pytest.approx(stage_time("A100-40GB", 4, 1, 1, shape=GPT2_XL, stack=gemm_only).forward_s / 2))
    assert tp2.tp_comm_s > 0
    full = stage_time("A100-40GB", 4, 1, 1, shape=GPT2_XL, recompute="full")
    assert full.backward_s == pytest.approx(3 * one.forward_s)
    slow_link = stage_time("A100-40GB", 4, 1, 2, shape=GPT2_XL, tp_gbps=10)
    assert slow_link.tp_comm_s > tp2.tp_comm_s


def test_memory_recompute_distributed_optimizer_and_pipeline_depth():
    kwargs = dict(tensor=1, data_parallel=8, micro_batch=1, num_micro_batches=16, precision="bf16")
    plain = memory_per_stage(GPT2_XL, [12, 12, 12, 12], **kwargs)
    full = memory_per_stage(GPT2_XL, [12, 12, 12, 12], recompute="full", **kwargs)
    dist = memory_per_stage(GPT2_XL, [12, 12, 12, 12], distributed_optimizer=True, **kwargs)
    assert full[0].activations < plain[0].activations / 5
    assert dist[1].optimizer == pytest.approx(plain[1].optimizer / 8)
    # 1F1B: the first stage holds p micro-batches, the last one
    assert [s.in_flight for s in plain] == [4, 3, 2, 1]
    assert plain[1].activations > plain[2].activations
    # bf16 mixed precision: 18 bytes per parameter of model state
    state = plain[1].weights + plain[1].gradients + plain[1].optimizer
    assert state == pytest.approx(plain[1].weights * 9)


def test_zero_stages_shrink_model_state():
    kwargs = dict(data_parallel=8, precision="fp16", zero_backend="deepspeed")
    stages = [memory_per_stage(GPT2_XL, [48], zero_stage=z, **kwargs)[0] for z in (1, 2, 3)]
    states = [s.weights + s.gradients + s.optimizer for s in stages]
    assert states[0] > states[1] > states[2]
    assert states[2] == pytest.approx(stages[2].weights * 8)  # 16/d bytes, 2/d of them weights


def test_estimate_fasop_gpt2_xl_has_every_key_and_a_consistent_breakdown():
    est = estimate(fasop_gpt2_xl())
    d = est.to_dict()
    for key in ("params", "flops_per_iteration", "model_flops_per_iteration", "iteration_time_s", "tflops_per_gpu",
                "mfu", "memory_gb_per_stage", "fits_in_memory", "breakdown"):
        assert key in d
    for key in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "embedding_comm"):
        assert d["breakdown"][key] >= 0
    assert sum(est.breakdown.values()) == pytest.approx(est.iteration_time_s)
    assert len(est.memory_gb_per_stage) == 8 and est.fits_in_memory
    assert all(src.startswith("profile gpt2-xl/A10") for src in est.stage_sources)
    assert est.breakdown["embedding_comm"] > 0 and est.breakdown["dp_comm"] > 0
    assert "training_days" not in d


def test_heterogeneous_stage_uses_its_own_gpu_and_profile():
    est = estimate(load_spec("examples/gpt2-xl-hetero.yaml"))
    assert est.stage_gpus[0] == "A100-40GB" and est.stage_gpus[1] == "A10"
    assert est.stage_sources[0].startswith("profile gpt2-xl/A100-40GB")


def test_a_slower_network_costs_time_only_where_traffic_crosses_nodes():
    fast = estimate(fasop_gpt2_xl())
    slow = estimate(fasop_gpt2_xl(cluster={"nodes": [{"gpu": "A10", "count": 8, "gpus_per_node": 4}],
                                     "inter_node_gbps": 10}))
    assert slow.breakdown["pp_comm"] > fast.breakdown["pp_comm"]
    assert slow.breakdown["compute"] == pytest.approx(fast.breakdown["compute"])


def test_profiles_argument_overrides_the_catalog_and_analytic_fallback():
    spec = fasop_gpt2_xl()
    analytic = estimate(spec, profiles={})
    assert all(src.startswith("analytic A10") for src in analytic.stage_sources)
    assert analytic.iteration_time_s != estimate(spec).iteration_time_s


def test_oom_verdict_for_a_model_too_big_for_its_gpus():
    spec = load_spec({"model": {"preset": "gpt-18.4b"}, "parallel": {"tensor": 1, "pipeline": 1},
                      "batch": {"micro": 1, "global": 8}, "precision": "bf16",
                      "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 1}]}})
    est = estimate(spec)
    assert not est.fits_in_memory and est.memory_gb_per_stage[0] > 80


def test_cli_json_keys_and_training_days(capsys, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(fasop_gpt2_xl().to_yaml())
    assert main(["estimate", str(path), "--json", "--tokens", "1e9"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["training_days"] == pytest.approx(1e9 / (64 * 1024) * out["iteration_time_s"] / 86400)
    assert isinstance(out["memory_gb_per_stage"], list) and isinstance(out["fits_in_memory"], bool)
    assert main(["estimate", str(path)]) == 0
    text = capsys.readouterr().out
    assert "iteration time" in text and "bubble" in text


def test_cli_rejects_a_bad_spec(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {preset: gpt2-xl}\nparallel: {tensor: 3}\n")
    assert main(["estimate", str(path)]) == 2
    assert "parallel.tensor" in capsys.readouterr().err


def test_a_single_gpu_profile_is_split_over_tensor_ranks_with_all_reduces_added():
    model = {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024, "vocab_size": 50257}
    profile = Profile(model="m", gpu="A10", tensor=1, embedding_s=0.001, layers_s=[0.004] * 8, output_s=0.002,
                      seq_length=1024)
    one = estimate(fasop_gpt2_xl(model=model, parallel={"tensor": 1, "pipeline": 2, "data": 16}), profiles={("A10", 1): profile})
    two = estimate(fasop_gpt2_xl(model=model, parallel={"tensor": 2, "pipeline": 2, "data": 8}), profiles={("A10", 1): profile})
    assert two.stage_sources == ["profile m/A10/tp1"] * 2
    assert two.breakdown["tp_comm"] > 0 and one.breakdown["tp_comm"] == 0
    # half the data-parallel width doubles the micro-batches; each takes half the compute
    assert two.breakdown["compute"] == pytest.approx(one.breakdown["compute"])


def test_bus_bandwidth_is_a_fraction_of_the_link_by_link_class():
    cal = default_calibration()
    assert cal.bus_gbps(2400, inter_node=False) == pytest.approx(2400 * cal.nvlink_bus_fraction)
    assert cal.bus_gbps(252, inter_node=False) == pytest.approx(252 * cal.pcie_bus_fraction)
    assert cal.bus_gbps(100, inter_node=True) == pytest.approx(100 * cal.network_bus_fraction)


AMP_SHAPE = Shape(num_layers=24, hidden=1024, heads=16, seq_length=1024, vocab=52256)
DS = "deepspeed-megatron-2020"


def test_stack_memory_passes_add_activation_traffic_at_memory_bandwidth():
    plain = stage_time("T4", 6, 2, 1, shape=AMP_SHAPE, precision="fp16")
    ds = stage_time("T4", 6, 2, 1, shape=AMP_SHAPE, precision="fp16", stack=DS)
    act = activation_bytes_per_layer(AMP_SHAPE, 2, 1, precision="fp16")
    passes = default_calibration().stack(DS).memory_passes - default_calibration().stack().memory_passes
    expected = 6 * passes * act / (catalog.gpu("T4").memory_bw_gb_s * 1e9)
    assert ds.forward_s + ds.backward_s - plain.forward_s - plain.backward_s == pytest.approx(expected)


def test_tensor_parallel_compute_splits_less_than_linearly_when_memory_bound_work_is_replicated():
    one = stage_time("T4", 6, 1, 1, shape=AMP_SHAPE, precision="fp16", stack=DS)
    two = stage_time("T4", 6, 1, 2, shape=AMP_SHAPE, precision="fp16", stack=DS)
    compute = lambda st: st.forward_s + st.backward_s  # noqa: E731
    assert compute(one) / 2 < compute(two) < compute(one)


def test_stack_charges_a_fixed_cost_per_tensor_parallel_all_reduce():
    plain = stage_time("T4", 6, 1, 2, shape=AMP_SHAPE, precision="fp16", tp_gbps=30)
    ds = stage_time("T4", 6, 1, 2, shape=AMP_SHAPE, precision="fp16", tp_gbps=30, stack=DS)
    assert ds.tp_comm_s - plain.tp_comm_s == pytest.approx(6 * 4 * default_calibration().stack(DS).tp_allreduce_s)


def test_blocking_pipeline_transfers_double_the_steady_state_exchange():
    one = pipeline_time([0.1, 0.1], [0.01], 8)
    two = pipeline_time([0.1, 0.1], [0.01], 8, messages=2)
    assert two.total_s - one.total_s == pytest.approx(7 * 0.01)


def test_unknown_stack_names_the_choices():
    with pytest.raises(ValueError, match="megatron-core"):
        estimate(fasop_gpt2_xl(), stack="colossal")


def amp_spec(t, p, d, micro, cluster="t4"):
    nodes = {"t4": [{"gpu": "T4", "count": 4, "gpus_per_node": 4, "inter_node_gbps": 50}],
             "het": [{"gpu": "V100-16GB", "count": 3, "gpus_per_node": 4, "inter_node_gbps": 10},
                     {"gpu": "T4", "count": 1, "gpus_per_node": 4, "inter_node_gbps": 50}]}[cluster]
    return load_spec({"name": "amp", "model": {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
                                               "seq_length": 1024, "vocab_size": 52256},
                      "parallel": {"tensor": t, "pipeline": p, "data": d,  # uneven: earlier stages one more layer
                                   "partition": [24 // p + (i < 24 % p) for i in range(p)] if 24 % p else None},
                      "batch": {"micro": micro, "global": 32},
                      "precision": "fp16", "recompute": "none", "cluster": {"nodes": nodes}})


def test_a_stage_over_several_gpu_types_runs_at_its_slowest():
    est = estimate(amp_spec(1, 1, 16, 1, cluster="het"), stack=DS)
    assert est.stage_gpus == ["T4"]


def test_fp32_gradient_reduction_doubles_the_data_parallel_bytes():
    fp16 = estimate(amp_spec(1, 1, 16, 1), stack=DS)
    fp32 = estimate(amp_spec(1, 1, 16, 1), stack=DS, grad_reduce_bytes=4)
    assert fp32.breakdown["dp_comm"] == pytest.approx(2 * fp16.breakdown["dp_comm"], rel=0.01)


@pytest.mark.parametrize("layout, measured", [
    # AMP's real trials on 4 x g4dn.12xlarge (DachengLi1/AMP src/results/homogeneous_results.txt; uniform partitions)
    ((1, 2, 8, 1), 1.28), ((2, 1, 8, 4), 1.55), ((4, 1, 4, 1), 2.48), ((4, 1, 4, 8), 1.94), ((1, 16, 1, 8), 3.25),
])
def test_amp_t4_trials_within_fifteen_percent(layout, measured):
    est = estimate(amp_spec(*layout), stack=DS, grad_reduce_bytes=4)
    assert est.iteration_time_s == pytest.approx(measured, rel=0.15)


def test_amp_tensor_parallel_gets_faster_with_fewer_larger_micro_batches():
    times = [estimate(amp_spec(4, 1, 4, b), stack=DS, grad_reduce_bytes=4).iteration_time_s for b in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)


@given(st.lists(st.floats(0.001, 1.0), min_size=1, max_size=8), st.integers(1, 40), st.sampled_from([1, 2]),
       st.data())
@settings(max_examples=80, deadline=None)
def test_planner_bound_never_exceeds_the_pipeline_time(stages, m, messages, data):
    sends = data.draw(st.lists(st.floats(0.0, 0.3), min_size=len(stages) - 1, max_size=len(stages) - 1))
    bound = pipeline_lower_bound(stages, sends, m, messages=messages)
    assert bound <= pipeline_time(stages, sends, m, messages=messages).total_s * (1 + 1e-9)
    assert bound >= m * max(stages)
    # interleaved: the same bound over the played-out schedule, whatever the wrap-around send costs
    v, wrap = data.draw(st.sampled_from([2, 4])), data.draw(st.floats(0.0, 0.3))
    m_v = len(stages) * (1 + m // len(stages))
    bound = pipeline_lower_bound(stages, sends, m_v, v, messages)
    assert bound <= pipeline_time(stages, sends, m_v, v, messages, wrap_time=wrap).total_s * (1 + 1e-9)
    assert bound >= m_v * max(stages)


def test_schedule_splits_each_stage_into_its_own_forward_and_backward():
    # full recompute makes a stage's backward 3 of its 4 forward-equivalents; a CPU profile may measure 1:1
    events = schedule_1f1b([1.0, 1.0], [0.0], 2, backward_shares=[0.75, 0.5])
    lengths = {(stage, op): end - start for stage, _, _, op, start, end in events}
    assert lengths == {(0, "forward"): 0.25, (0, "backward"): 0.75, (1, "forward"): 0.5, (1, "backward"): 0.5}
    assert {(s, op): e - b for s, _, _, op, b, e in schedule_1f1b([0.9, 0.9], [0.0], 2)} == pytest.approx(
        {(0, "forward"): 0.3, (0, "backward"): 0.6, (1, "forward"): 0.3, (1, "backward"): 0.6})


def test_a_custom_calibration_changes_the_estimate_and_leaves_the_default_alone():
    spec, analytic = fasop_gpt2_xl(), {}  # no profiles: compute is FLOPs / (peak x efficiency)
    default = estimate(spec, analytic)
    cal = default_calibration()
    halved = cal.with_efficiency("A10", cal.gpu_efficiency("A10") / 2)
    slow = estimate(spec, analytic, calibration=halved)
    assert slow.breakdown["compute"] > 1.3 * default.breakdown["compute"]
    assert slow.iteration_time_s > default.iteration_time_s
    # the bus fraction of inter-node links sets the sends between stages on different nodes
    slow_net = estimate(spec, analytic,
                        calibration=dataclasses.replace(cal, network_bus_fraction=cal.network_bus_fraction / 2))
    assert sum(slow_net.pipeline.boundary_times_s) > 1.5 * sum(default.pipeline.boundary_times_s)
    # no global state: the default calibration and the estimate made with it are unchanged
    assert default_calibration() == cal and cal.gpu_efficiency("A10") == halved.gpu_efficiency("A10") * 2
    assert estimate(spec, analytic).iteration_time_s == default.iteration_time_s
    assert estimate(spec, analytic, calibration=cal).to_dict() == default.to_dict()


def test_calibration_is_immutable_and_says_where_each_constant_comes_from():
    cal = default_calibration()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cal.network_bus_fraction = 1.0
    with pytest.raises(TypeError):
        cal.efficiency["A10"] = 1.0
    constants = ([f"efficiency.{g}" for g in cal.efficiency] + [f"intra_node_gbps.{g}" for g in cal.intra_node_gbps]
                 + [f"stacks.{s}" for s in cal.stacks] + [f"moe_launch_scale.{g}" for g in cal.moe_launch_scale]
                 + ["nvlink_bus_fraction", "pcie_bus_fraction", "network_bus_fraction", "link_latency_s"])
    kinds = ("fitted", "derived", "published", "assumed", "as A100-80GB (same compute)")
    assert all(cal.sources.get(c, "").split(":")[0] in kinds for c in constants), cal.sources
    assert "SC21" in cal.sources["efficiency.A100-80GB"] and "FASOP" in cal.sources["efficiency.A10"]
    assert "AMP" in cal.sources["stacks.deepspeed-megatron-2020"]
    # every GPU the catalog knows can be estimated analytically
    assert set(catalog.gpus()) <= set(cal.efficiency)
    assert set(cal.moe_launch_scale) <= set(catalog.gpus()) and "moe_launch_scale.H100-SXM" in constants


def test_fitted_link_rates_take_the_catalogs_place_unless_the_spec_names_one():
    cal = default_calibration()
    t4 = catalog.gpu("T4")
    assert cal.intra_node_link(t4) == cal.intra_node_gbps["T4"] < t4.intra_node_gbps
    base = stage_time("T4", 6, 1, 2, shape=AMP_SHAPE, precision="fp16")
    faster = stage_time("T4", 6, 1, 2, shape=AMP_SHAPE, precision="fp16",
                        calibration=cal.with_intra_node_gbps("T4", t4.intra_node_gbps))
    assert faster.tp_comm_s < base.tp_comm_s
    named = amp_spec(4, 1, 4, 1)
    named.cluster.nodes[0].intra_node_gbps = 126
    assert estimate(named, stack=DS).breakdown["tp_comm"] < estimate(amp_spec(4, 1, 4, 1), stack=DS).breakdown["tp_comm"]


def test_a_calibration_without_a_gpu_names_what_it_knows():
    cal = dataclasses.replace(default_calibration(), efficiency={"A100-40GB": 0.7})
    with pytest.raises(KeyError, match="A100-40GB"):
        stage_time("T4", 1, 1, 1, shape=AMP_SHAPE, calibration=cal)


@pytest.mark.parametrize("p, v", [(4, 2), (4, 4), (8, 2), (2, 3)])
def test_interleaving_divides_the_bubble_by_the_chunk_count(p, v):
    """SC21 section 2.2: the interleaved bubble is (p - 1)/(v m) of the ideal time, 1/v of 1F1B's (p - 1)/m."""
    for m in (p, 4 * p, 32 * p):
        plain = Pipeline((1.0,) * p, (0.0,) * (p - 1), m).events()
        interleaved = Pipeline((1.0,) * p, (0.0,) * (p - 1), m, virtual_stages=v).events()
        # the bubble measured from the events: each stage's idle time over the step, against its m stage times of work
        idle = [(events[-1].end_s - sum(e.end_s - e.start_s for e in events if e.stage == 0)) / m
                for events in (plain, interleaved)]
        assert idle[0] == pytest.approx((p - 1) / m)
        assert idle[1] == pytest.approx((p - 1) / (v * m))
        assert idle[0] / idle[1] == pytest.approx(v)
        assert {e.chunk for e in interleaved} == set(range(v)) and len(interleaved) == 2 * p * m * v


def test_interleaved_sends_cross_every_chunk_boundary():
    # each micro-batch crosses v times as many boundaries: with sends that cost, part of the gain goes to them
    p, m, send = 4, 16, 0.05
    plain = pipeline_time([1.0] * p, [send] * (p - 1), m)
    two = pipeline_time([1.0] * p, [send] * (p - 1), m, 2)
    wrapped = pipeline_time([1.0] * p, [send] * (p - 1), m, 2, wrap_time=0.3)
    free = pipeline_time([1.0] * p, [0.0] * (p - 1), m, 2)
    assert free.total_s < two.total_s < plain.total_s
    assert two.total_s < wrapped.total_s
    # blocking, an interleaved stage's steady pair sends its two outputs side by side: v x the longer of its links
    # per micro-batch, against plain 1F1B's sum of both, equal here, and more on a stage with a link of 0 (the ends)
    assert two.pp_comm_s >= plain.pp_comm_s
    assert steady_times([1.0] * p, [send] * (p - 1), virtual_stages=2)[0] > steady_times([1.0] * p, [send] * (p - 1))[0]


def test_an_interleaved_estimate_is_timed_by_the_played_out_schedule():
    spec = lambda v: load_spec({"model": {"preset": "gpt2-medium"},  # noqa: E731
                                "parallel": {"pipeline": 4, "virtual_stages": v}, "batch": {"micro": 1, "global": 16},
                                "precision": "bf16", "cluster": {"nodes": [{"gpu": "A100-40GB", "count": 1,
                                                                           "gpus_per_node": 4}]}})
    plain, interleaved = estimate(spec(1)), estimate(spec(2))
    pipe = interleaved.pipeline
    assert pipe.virtual_stages == 2 and pipe.wrap_time_s > 0
    pipeline_s = sum(interleaved.breakdown[k] for k in ("compute", "bubble", "tp_comm", "pp_comm"))
    assert max(e.end_s for e in pipe.events()) == pytest.approx(pipeline_s)
    assert interleaved.breakdown["bubble"] < 0.6 * plain.breakdown["bubble"]
    assert interleaved.iteration_time_s < plain.iteration_time_s


def test_interleaved_sends_overlap_compute_on_gpus_as_megatron_posts_them():
    from labkit.estimate.timing import pipeline_time, schedule_1f1b

    stages, sends, m, v = [1.0] * 4, [0.1] * 3, 16, 2
    blocking = pipeline_time(stages, sends, m, v, wrap_time=0.1)
    overlapped = pipeline_time(stages, sends, m, v, wrap_time=0.1, overlap_sends=True)
    free = pipeline_time(stages, [0.0] * 3, m, v)
    # each stage posts v x 2 sends of 0.1 s per micro-batch: blocking pays them (a steady pair's two side by side),
    # overlapped hides them behind compute but for the first forward's and the last backward's trips through the
    # p x v model chunks
    assert blocking.total_s > overlapped.total_s + (m - 4) * 0.2
    assert free.total_s <= overlapped.total_s <= free.total_s + 2 * (4 * v - 1) * 0.1 + 1e-9
    # a stage whose sends outlast its work is paced by them: 2 chunks x (0.5 + 0.5) s per micro-batch against 0.5 s
    slow_link = pipeline_time([0.5] * 4, [0.5] * 3, 64, 2, wrap_time=0.5, overlap_sends=True)
    assert slow_link.total_s > 64 * 2.0 - 1e-9
    # the max-plus shortcut gives what playing every operation out gives
    for times, links in (([1.0, 1.2, 0.9, 1.1], [0.1, 0.3, 0.05]), ([0.5] * 4, [0.5] * 3)):
        played = max(e.end_s for e in schedule_1f1b(times, links, 64, virtual_stages=2, wrap_time=0.2,
                                                   overlap_sends=True))
        assert pipeline_time(times, links, 64, 2, wrap_time=0.2, overlap_sends=True).total_s == \
            pytest.approx(played)


def test_nvidias_interleaved_llama3_70b_pays_no_pipeline_transfers_on_its_critical_path():
    # Megatron-Bridge's recipe (tensor 4, pipeline 8, 5 virtual stages) sends 2 x 5 activations per micro-batch and
    # stage across nodes; overlapped, what stays exposed is the fill and the drain, not 64 micro-batches' worth
    spec = load_spec({"model": {"preset": "llama3-70b"}, "precision": "fp8", "batch": {"micro": 1, "global": 128},
                      "optimizer": {"distributed": True}, "recompute": None,
                      "parallel": {"tensor": 4, "pipeline": 8, "virtual_stages": 5, "sequence_parallel": True},
                      "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 8, "gpus_per_node": 8}]}})
    est = estimate(spec)
    assert est.breakdown["pp_comm"] < 0.005 * est.iteration_time_s


def test_blocking_interleaved_pairs_send_a_forwards_output_after_the_backward_that_follows_it():
    """megatron-core's interleaved schedule without overlap_p2p_comm (gloo) runs a steady forward and backward, then
    one batched exchange: the next stage receives that forward's output only once the backward is done, and the
    next pair waits for both of its inputs."""
    p, v, m = 2, 2, 4
    events = schedule_1f1b([1.0] * p, [0.0], m, virtual_stages=v, chunk_shares=[[0.2, 0.8], [0.8, 0.2]])
    ops = {(e.stage, e.chunk, e.micro_batch, e.op): e for e in events}
    from labkit.estimate.timing import _stage_order, _warmup

    order = _stage_order(0, p, m, v)
    warmup = _warmup(0, p, m, v)
    forward, backward = order[warmup], order[warmup + 1]  # stage 0's first steady pair
    (_, j, c), (_, k, c_back) = forward, backward
    paired_backward_end = ops[(0, c_back, k, "backward")].end_s
    consumer = ops[(1, c, j, "forward")]  # the same chunk on the next stage takes that output
    assert consumer.start_s >= paired_backward_end - 1e-12
    assert ops[(0, c, j, "forward")].end_s < paired_backward_end
    overlapped = schedule_1f1b([1.0] * p, [0.0], m, virtual_stages=v, chunk_shares=[[0.2, 0.8], [0.8, 0.2]],
                               overlap_sends=True)
    assert max(e.end_s for e in events) > max(e.end_s for e in overlapped)  # unequal chunks pace each other


def test_megatron_cores_gradient_accumulation_is_a_memory_pass_per_micro_batch_without_its_fused_kernel(monkeypatch):
    """On CPUs megatron-core's DDP adds every gradient to its fp32 main_grad in each micro-batch's backward
    (4 + 4 + 4 bytes a parameter at the memory bandwidth); on GPUs Transformer Engine's weight-gradient GEMMs do it."""
    from labkit.estimate import estimator

    def both(spec):
        charged = estimate(spec).iteration_time_s
        with monkeypatch.context() as patch:
            patch.setattr(estimator, "_add_main_grad_accumulation", lambda *args: None)
            return charged, estimate(spec).iteration_time_s

    on_cpu = load_spec({"model": {"preset": "tiny"}, "batch": {"micro": 1, "global": 4}, "precision": "fp32",
                        "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 1}]}})
    charged, uncharged = both(on_cpu)
    params = estimate(on_cpu).params_with_padding
    assert charged - uncharged == pytest.approx(4 * params * 12 / (catalog.gpu("cpu").memory_bw_gb_s * 1e9))
    on_gpu = load_spec({**on_cpu.to_dict(), "precision": "bf16",
                        "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 1}]}})
    charged, uncharged = both(on_gpu)
    assert charged == uncharged
    # FSDP2 accumulates into its own sharded gradients, not megatron-core's buffer
    fsdp = load_spec({**on_cpu.to_dict(), "optimizer": {"zero_stage": 3},
                      "model": {"preset": "tiny", "untie_embeddings": True},
                      "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}})
    charged, uncharged = both(fsdp)
    assert charged == uncharged

"""The estimate for today's stack: flash attention's memory, the FLOPs Megatron-LM logs, overlapped gradient reduction,
FP8 and context parallelism, each worked out by hand."""
from pathlib import Path

import pytest

from labkit.estimate import estimate
from labkit.megatron.flops import megatron_logged_flops, model_flops
from labkit.estimate.memory import GIB, activation_bytes_per_layer, linear_weight_elements
from labkit.estimate.params import Shape
from labkit.spec import load_spec


def h100_spec(**sections):
    return load_spec({"model": {"preset": "llama2-7b"}, "batch": {"micro": 1, "global": 256}, "precision": "bf16",
                      "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 4, "gpus_per_node": 8}]}, **sections})


def test_flash_attention_keeps_a_log_sum_exp_where_unfused_keeps_the_scores():
    shape = Shape.of(load_spec({"model": {"preset": "gpt2-small"}}).model)  # dropout 0.1: scores, mask, dropped
    s, b, a = shape.seq_length, 2, shape.heads
    unfused = activation_bytes_per_layer(shape, b)
    flash = activation_bytes_per_layer(shape, b, flash_attention=True)
    # Korthikanti's 5as^2b bytes of scores (softmax 2, mask 1, dropout output 2) against fp32 statistics, 4 per head
    assert unfused - flash == pytest.approx(5 * a * s * s * b - 4 * a * s * b)


def test_auto_attention_is_flash_on_h100_and_the_2021_stack_is_not():
    auto, unfused = h100_spec(), h100_spec(kernels={"attention_backend": "unfused"})
    assert estimate(auto).flash_attention and not estimate(unfused).flash_attention
    assert max(estimate(auto).memory_gb_per_stage) < max(estimate(unfused).memory_gb_per_stage)
    assert estimate(auto).iteration_time_s < estimate(unfused).iteration_time_s  # no memory-bound score passes
    v100 = load_spec({"model": {"preset": "gpt2-small"}, "cluster": {"nodes": [{"gpu": "V100-32GB", "count": 1,
                                                                                 "gpus_per_node": 8}]}})
    assert not estimate(v100).flash_attention  # Transformer Engine's flash attention needs Ampere or later


def test_megatron_logs_causal_attention_flops():
    """Megatron-LM's num_floating_point_operations: 3 passes x (attention 4bsh(h + h g/a + s/2) + SwiGLU MLP 6bshf)
    per layer, plus the logits' 6bshV over the padded vocabulary."""
    shape = Shape.of(load_spec({"model": {"preset": "llama2-7b"}}).model)
    B, s, h, f, L = 4, shape.seq_length, shape.hidden, shape.ffn_size, shape.num_layers
    g, a, V = shape.groups, shape.heads, shape.padded_vocab()
    by_hand = 3 * L * (4 * B * s * h * (h + h * g / a + s / 2) + 6 * B * s * h * f) + 6 * B * s * h * V
    assert megatron_logged_flops(shape, B) == pytest.approx(by_hand)
    # labkit's model FLOPs count the full s x s product: the difference is half the attention core
    assert model_flops(shape, B) - megatron_logged_flops(shape, B) == pytest.approx(3 * L * 2 * B * s * s * h, rel=1e-3)


def test_megatron_logs_an_moe_models_routed_and_shared_experts_but_not_its_router():
    """num_floating_point_operations for a DeepSeek-style pattern: dense MLPs on the dense layers, top-k routed experts
    of their own width and the shared experts on the MoE layers; no router GEMM."""
    shape = Shape.of(load_spec({"model": {"preset": "tiny-llama", "num_layers": 4, "num_experts": 8,
                                          "moe_router_topk": 2, "moe_ffn_hidden_size": 48,
                                          "moe_shared_expert_intermediate_size": 96,
                                          "moe_layer_freq": "([0]+[1]*3)"}}).model)
    B, s, h, f, V = 4, shape.seq_length, shape.hidden, shape.ffn_size, shape.vocab
    g, a, d = shape.groups, shape.heads, shape.head_dim
    attention = 4 * B * s * h * (a * d + g * d + s * a * d / h / 2)
    mlp = 6 * B * s * h * (f * 1 + (48 * 2 + 96) * 3)
    by_hand = 3 * (4 * attention + mlp) + 6 * B * s * h * V
    assert megatron_logged_flops(shape, B) == pytest.approx(by_hand)
    assert model_flops(shape, B) - megatron_logged_flops(shape, B, "2024") == pytest.approx(3 * 3 * 2 * B * s * h * 8)


def test_overlapped_gradient_reduction_hides_what_the_last_backward_covers():
    plain = estimate(h100_spec())
    overlapped = estimate(h100_spec(kernels={"overlap_grad_reduce": True}))
    assert plain.exposed_comm_s["dp"] > 0 and overlapped.exposed_comm_s["dp"] == 0  # a backward outlasts the reduce
    assert plain.iteration_time_s - overlapped.iteration_time_s == pytest.approx(plain.exposed_comm_s["dp"])
    assert estimate(h100_spec(), overlap_dp=True).iteration_time_s == overlapped.iteration_time_s
    assert "exposed_comm_s" in overlapped.to_dict()["breakdown"]


def test_fp8_runs_the_linear_gemms_faster_and_context_parallel_splits_the_activations():
    bf16, fp8 = estimate(h100_spec()), estimate(h100_spec(precision="fp8"))
    assert fp8.iteration_time_s < bf16.iteration_time_s
    # the model state and, without the distributed optimizer's FP8 parameters, Transformer Engine's cached FP8 copy of
    # each linear weight beside its bf16 one (2 bytes with Hopper's transpose); 1-byte copies of the GEMM inputs
    # kept for the backward pass
    linear = linear_weight_elements(Shape.of(h100_spec().model), h100_spec().model.num_layers)
    assert [m["weights"] + m["gradients"] + m["optimizer"] for m in fp8.memory_detail] == pytest.approx(
        [m["weights"] + m["gradients"] + m["optimizer"] + 2 * linear / GIB for m in bf16.memory_detail])
    assert fp8.memory_detail[0]["activations"] < bf16.memory_detail[0]["activations"]
    cp2 = estimate(h100_spec(parallel={"context": 2}))
    assert cp2.memory_detail[0]["activations"] == pytest.approx(bf16.memory_detail[0]["activations"] / 2, rel=0.02)
    assert cp2.num_gpus == 32 and cp2.megatron_logged_tflops_per_gpu > 0


def test_profiles_are_found_by_the_models_shape_not_its_name():
    by_name = load_spec(Path(__file__).parent.parent / "examples" / "gpt2-xl-hetero.yaml")
    m = by_name.model
    by_fields = by_name.replace(model={"num_layers": m.num_layers, "hidden_size": m.hidden_size, "seq_length":
                                       m.seq_length, "num_attention_heads": m.num_attention_heads,
                                       "vocab_size": m.vocab_size})
    assert by_fields.model.preset is None
    assert estimate(by_fields).stage_sources == estimate(by_name).stage_sources
    assert estimate(by_fields).iteration_time_s == estimate(by_name).iteration_time_s
    resized = by_name.replace(**{"model.hidden_size": 1800})  # gpt2-xl's name, another layer: no profile of it
    assert all(source.startswith("analytic") for source in estimate(resized).stage_sources)


def test_tp_comm_overlap_hides_the_tensor_parallel_transfers_behind_the_gemms():
    """By hand: without overlap the stage pays its all-reduces in full; with it, only what the stage's forward and
    backward GEMMs (3 x the forward GEMM time) cannot cover."""
    from labkit.estimate.timing import stage_time

    shape = Shape.of(load_spec({"model": {"preset": "llama2-7b"}}).model)
    kw = dict(shape=shape, precision="bf16", tp_gbps=100.0, flash_attention=True)
    plain = stage_time("H100-SXM", 8, 1, 8, **kw)
    hidden = stage_time("H100-SXM", 8, 1, 8, tp_comm_overlap=True, **kw)
    assert hidden.forward_s == plain.forward_s and hidden.backward_s == plain.backward_s
    gemm = stage_time("H100-SXM", 8, 1, 8, **{**kw, "tp_gbps": 1e12}).forward_s  # the forward is GEMMs and passes
    assert 0 < hidden.tp_comm_s < plain.tp_comm_s
    assert hidden.tp_comm_s >= plain.tp_comm_s - 3 * gemm
    tp8 = {"tensor": 8, "sequence_parallel": True}
    overlapped = estimate(h100_spec(parallel=tp8, kernels={"tp_comm_overlap": True}))
    assert overlapped.exposed_comm_s["tp"] < estimate(h100_spec(parallel=tp8)).exposed_comm_s["tp"]


def test_sequence_parallelism_shrinks_the_layernorm_and_dropout_passes_not_the_tensor_parallel_bytes():
    from labkit.estimate.timing import stage_time

    shape = Shape.of(load_spec({"model": {"preset": "gpt-18.4b"}}).model)
    kw = dict(shape=shape, precision="bf16", stack="megatron-core", tp_gbps=2400.0)
    plain = stage_time("A100-80GB", 4, 1, 8, **kw)
    split = stage_time("A100-80GB", 4, 1, 8, sequence_parallel=True, **kw)
    assert split.tp_comm_s == plain.tp_comm_s  # all-gather + reduce-scatter move what the all-reduce moved
    # the memory-bound third of the forward: LayerNorm and dropout bytes go from 10 sbh to 10 sbh / t per layer
    memory_before = activation_bytes_per_layer(shape, 1, 8)
    memory_after = activation_bytes_per_layer(shape, 1, 8, sequence_parallel=True)
    assert memory_after < memory_before and split.forward_s < plain.forward_s
    assert stage_time("A100-80GB", 4, 1, 1, sequence_parallel=True, **kw).forward_s == \
        stage_time("A100-80GB", 4, 1, 1, **kw).forward_s  # nothing to split without tensor parallelism


def test_attention_core_runs_at_its_head_dimension_share_and_flash_skips_the_masked_half():
    """By hand, one layer of llama2-7b (head dimension 128) on an H100 with no memory passes: the linear layers' FLOPs
    at peak x efficiency, attention's core (4 s^2 h per sequence) at d / (d + d_half) of that rate, and a flash
    kernel does half of the core's work (the causal mask's upper half is skipped)."""
    import dataclasses

    from labkit import catalog
    from labkit.estimate import default_calibration
    from labkit.megatron.flops import attention_core_forward_flops, layer_forward_flops
    from labkit.estimate.timing import stage_time

    cal = default_calibration()
    cal = dataclasses.replace(cal, stacks={**cal.stacks, "none": dataclasses.replace(cal.stack(), memory_passes=0.0)},
                              attention_head_dim_half={"unfused": 384.0, "flash": 128.0})
    shape = Shape.of(load_spec({"model": {"preset": "llama2-7b"}}).model)
    s, rate = shape.seq_length, catalog.gpu("H100-SXM").peak("bf16") * 1e12 * cal.gpu_efficiency("H100-SXM")
    core = 4 * s * s * shape.hidden
    assert attention_core_forward_flops(shape, s) == core
    linear_s = (layer_forward_flops(shape, s) - core) / rate
    kw = dict(shape=shape, precision="bf16", stack="none", calibration=cal)
    unfused = stage_time("H100-SXM", 1, 1, **kw).forward_s
    flash = stage_time("H100-SXM", 1, 1, flash_attention=True, **kw).forward_s
    assert unfused == pytest.approx(linear_s + core / (rate * 128 / (128 + 384)))  # a quarter of the rate
    assert flash == pytest.approx(linear_s + core / 2 / (rate * 128 / (128 + 128)))  # half the work at half the rate


def test_the_distributed_optimizer_hides_its_reduce_scatter_and_its_parameter_gather_separately():
    """By hand: the distributed optimizer's traffic is a reduce-scatter and an all-gather, half the all-reduce's ring
    each; overlap_grad_reduce hides the first behind the backward, overlap_param_gather the second behind the next
    forward. What is hidden and what stays exposed add up to the whole."""
    dist = {"distributed": True}
    plain = estimate(h100_spec(optimizer=dist))
    scatter_only = estimate(h100_spec(optimizer=dist, kernels={"overlap_grad_reduce": True}))
    both = estimate(h100_spec(optimizer=dist, kernels={"overlap_grad_reduce": True, "overlap_param_gather": True}))
    whole = plain.exposed_comm_s["dp"]
    assert whole > 0 and plain.hidden_comm_s["dp"] == 0
    assert scatter_only.exposed_comm_s["dp"] == pytest.approx(whole / 2)
    assert scatter_only.hidden_comm_s["dp"] == pytest.approx(whole / 2)
    assert both.exposed_comm_s["dp"] == 0 and both.hidden_comm_s["dp"] == pytest.approx(whole)
    assert "hidden_comm_s" in both.to_dict()["breakdown"]


@pytest.mark.parametrize("virtual", [1, 2])
def test_a_long_steps_span_is_extrapolated_exactly_from_its_steady_state(virtual):
    """The span of a long step from a few short ones equals playing out every micro-batch, for unequal stages and
    sends (the planner relies on it for steps of hundreds of micro-batches)."""
    import random

    from labkit.estimate.timing import schedule_1f1b, schedule_span

    rng = random.Random(7)
    for _ in range(20):
        p = rng.randint(2, 6)
        stages = [rng.uniform(0.5, 2.0) for _ in range(p)]
        sends = [rng.uniform(0.0, 0.3) for _ in range(p - 1)]
        m = p * rng.randint(6, 20) + (0 if virtual > 1 else rng.randint(0, p - 1))
        messages = rng.choice([1, 2])
        full = schedule_1f1b(stages, sends, m, messages, None, virtual, 0.1)[-1].end_s
        assert schedule_span(stages, sends, m, messages, None, virtual, 0.1) == pytest.approx(full, rel=1e-9)


def test_context_ranks_reduce_gradients_with_the_data_ranks_and_pass_keys_over_their_own_links():
    """megatron-core reduces gradients over data x context ranks, so a layout whose data-parallel size is 1 still
    moves them; a context ring whose tensor ranks fill a node leaves the node (rank order tp-cp-dp-pp)."""
    from labkit.estimate.topology import Topology

    alone = estimate(h100_spec(parallel={"tensor": 8, "pipeline": 4}, optimizer={"distributed": True}))
    shared = estimate(h100_spec(parallel={"tensor": 8, "pipeline": 2, "context": 2}, optimizer={"distributed": True}))
    assert alone.exposed_comm_s["dp"] == 0 and alone.hidden_comm_s["dp"] == 0  # one rank holds each shard
    assert shared.exposed_comm_s["dp"] + shared.hidden_comm_s["dp"] > 0     # two context ranks reduce theirs
    within = Topology(h100_spec(parallel={"tensor": 4, "context": 2}))
    across = Topology(h100_spec(parallel={"tensor": 8, "context": 2}))
    assert within.cp_gbps(0) > 4 * across.cp_gbps(0)  # NVLink in one node against the network between two
    assert across.dp_gbps(0) == across.cp_gbps(0)     # data 2 x context 2 on four nodes: the network


def test_every_context_rank_sends_its_pipeline_messages_across_the_node_boundary_too():
    """tensor 4 x context 2 fill an 8-GPU node: all 8 ranks of a stage send to the next node at once, sharing its
    network interface, as tensor 8's do."""
    from labkit.estimate.topology import Topology

    tensor8 = Topology(h100_spec(parallel={"tensor": 8, "pipeline": 4}))
    context2 = Topology(h100_spec(parallel={"tensor": 4, "pipeline": 4, "context": 2}))
    assert context2.pair_gbps(0, 1) == pytest.approx(tensor8.pair_gbps(0, 1))


@pytest.mark.parametrize("virtual_stages", [1, 2])
def test_a_billion_micro_batches_are_timed_from_the_schedules_period_not_played_out(virtual_stages, monkeypatch):
    """The span of a long step grows by one period per p micro-batches once the pipeline is full: extrapolated from
    that period it equals the played-out span, and a billion micro-batches cost no more than a few hundred."""
    from labkit.estimate import timing

    args = ([1.0, 1.2, 0.9, 1.1], [0.05, 0.02, 0.04], 1000, 1, None, virtual_stages, 0.03, None, True)
    played = timing.schedule_span(*args)
    monkeypatch.setattr(timing, "MAX_PLAYED_MICRO_BATCHES", 64)
    assert timing.schedule_span(*args) == pytest.approx(played, rel=1e-12)
    calls = []
    real = timing._play_1f1b
    monkeypatch.setattr(timing, "_play_1f1b", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    huge = timing.schedule_span(*args[:2], 10 ** 9, *args[3:])
    assert huge == pytest.approx(played / 1000 * 10 ** 9, rel=5e-3) and max(calls) < 100  # fill and drain aside


def test_a_cpu_pipelines_messages_take_gloos_measured_send_rate_and_latency():
    """Two gloo processes pass each micro-batch's activations with send/recv: the catalog's measured point-to-point
    rate and latency on a CPU host (not a collective's bus rate, not NCCL's latency); GPUs keep theirs."""
    from labkit import catalog

    cpu = catalog.gpu("cpu")
    spec = load_spec({"model": {"preset": "tiny"}, "parallel": {"pipeline": 2}, "batch": {"micro": 2, "global": 8},
                      "precision": "fp32", "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}})
    message = 2 * spec.model.seq_length * spec.model.hidden_size * 4
    boundary = estimate(spec).pipeline.boundary_times_s[0]
    assert boundary == pytest.approx(cpu.message_latency_s + message * 8 / (cpu.p2p_gbps * 1e9), rel=1e-6)
    h100 = estimate(spec.replace(**{"precision": "bf16", "cluster": {"nodes": [{"gpu": "H100", "count": 1,
                                                                                "gpus_per_node": 2}]}}))
    assert h100.pipeline.boundary_times_s[0] < 1e-4

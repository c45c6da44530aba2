"""Mixture-of-experts in the estimator: expert weights sharded over the expert ranks, their optimizer state over the
expert-data-parallel ranks, an MoE layer's activations, the token all-to-all as exposed communication of kind "ep",
the expert groups in megatron-core's rank order, and the Blackwell precisions."""
import dataclasses
import math

import pytest

from labkit.estimate import estimate
from labkit.estimate.calibration import default_calibration
from labkit.estimate.estimator import expert_params_per_stage
from labkit.estimate.memory import (GIB, MOE_TOKEN_IMBALANCE, activation_bytes_per_layer, chunk_expert_parameters,
                                    chunk_parameters, expert_data_parallel, memory_per_stage, model_state_bytes)
from labkit.estimate.params import mlp_params, stage_params
from labkit.estimate.timing import ExpertLinks, allreduce_time, expert_dispatch_time
from labkit.estimate.topology import Topology
from labkit.megatron.shape import Shape
from labkit.spec import load_spec


def spec(preset="mixtral-8x7b", gpu="H100", nodes=8, per_node=8, parallel=None, micro=1, global_=256,
         precision="bf16", optimizer=None, model=None):
    return load_spec({"model": {"preset": preset, **(model or {})}, "parallel": {"pipeline": 4, "expert": 8,
                                                                              **(parallel or {})},
                      "cluster": {"nodes": [{"gpu": gpu, "count": nodes, "gpus_per_node": per_node}]},
                      "batch": {"micro": micro, "global": global_}, "precision": precision,
                      "optimizer": {"distributed": True, **(optimizer or {})}})


def shape_of(preset):
    return Shape.of(load_spec({"model": {"preset": preset}}).model)


MIXTRAL = shape_of("mixtral-8x7b")


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-moe-16b"])
@pytest.mark.parametrize("tensor, expert, expert_tensor", [(1, 1, 1), (1, 8, 1), (2, 4, 1), (2, 4, 2)])
def test_the_dense_and_expert_buffers_hold_the_ranks_parameters(preset, tensor, expert, expert_tensor):
    shape = shape_of(preset)
    layers = shape.num_layers
    dense = sum(n for n, _ in chunk_parameters(shape, layers, tensor, expert=expert, expert_tensor=expert_tensor))
    experts = sum(n for n, _ in chunk_expert_parameters(shape, layers, expert=expert, expert_tensor=expert_tensor))
    assert dense + experts == round(stage_params(shape, [layers], tensor, expert=expert,
                                                 expert_tensor=expert_tensor)[0])
    # the expert buffer exists with expert parallelism only (megatron-core's `allreduce` attribute)
    assert (experts > 0) == (expert > 1)
    assert experts == expert_params_per_stage(shape, [layers], tensor, expert, expert_tensor)[0]


def test_expert_parallelism_drops_a_ranks_weights_by_the_expert_share():
    partition = [8, 8, 8, 8]
    weights = {}
    for ep in (1, 2, 4, 8):
        state = model_state_bytes(MIXTRAL, [8], stage=1, pipeline=4, data_parallel=16, expert=ep, expert_tensor=1)
        # without the distributed optimizer the buffers are unpadded: 2 bytes per parameter the rank holds
        assert state.weights == 2 * round(stage_params(MIXTRAL, partition, expert=ep, expert_tensor=1)[1])
        weights[ep] = state.weights
    experts = 8 * 8 * mlp_params(MIXTRAL, MIXTRAL.expert_ffn_size)  # a stage's 8 layers x 8 experts
    for ep in (2, 4, 8):
        assert weights[1] - weights[ep] == pytest.approx(2 * experts * (1 - 1 / ep))
    # each Mixtral rank at expert 8 keeps one expert of each MoE layer: 1/8 of the 45 B expert parameters
    assert weights[8] / weights[1] < 0.2


def test_the_distributed_optimizer_shards_experts_over_the_expert_data_parallel_ranks():
    # 64 GPUs, pipeline 4: data 16; expert 8 leaves 64 / (1 x 8 x 4) = 2 replicas of each expert
    assert expert_data_parallel(1, 1, 16, 8, 1) == 2
    state = model_state_bytes(MIXTRAL, [8], stage=1, pipeline=4, data_parallel=16, distributed_optimizer=True,
                              expert=8, expert_tensor=1)
    total = stage_params(MIXTRAL, [8, 8, 8, 8], expert=8, expert_tensor=1)[1]
    experts = expert_params_per_stage(MIXTRAL, [8, 8, 8, 8], 1, 8, 1)[1]
    # fp32 main parameters and Adam's moments (12 bytes) for a 16th of the dense and half of the local experts
    assert state.optimizer == pytest.approx(12 * ((total - experts) / 16 + experts / 2), rel=1e-3)
    # sharding the experts over all 16 data ranks, as if they were dense, would hold 8 times less of them
    assert state.optimizer > 12 * total / 16 * 4


def test_an_moe_layer_keeps_the_dispatched_tokens():
    dense = activation_bytes_per_layer(MIXTRAL, 1, flash_attention=True)
    moe = activation_bytes_per_layer(MIXTRAL, 1, flash_attention=True, moe=True)
    s, h, f = MIXTRAL.seq_length, MIXTRAL.hidden, MIXTRAL.expert_ffn_size
    # topk = 2 copies of each token: fc1's input, the SwiGLU's 2f input and fc2's f input, in 2 bytes, and the probs
    routed = 2 * MOE_TOKEN_IMBALANCE * s * (2 * h + 6 * f + 4)
    mlp = s * 6 * f  # the dense MLP of the same width: one copy
    assert moe - dense == pytest.approx(routed - mlp + s * MIXTRAL.experts * 12, rel=1e-9)
    # each expert-tensor rank receives every token its expert group gathers
    assert activation_bytes_per_layer(MIXTRAL, 1, 2, True, flash_attention=True, moe=True, expert_tensor=2) > \
        activation_bytes_per_layer(MIXTRAL, 1, 2, True, flash_attention=True, moe=True, expert_tensor=1)
    # full recompute keeps the layer's input, MoE or not
    assert activation_bytes_per_layer(MIXTRAL, 1, recompute="full", moe=True) == \
        activation_bytes_per_layer(MIXTRAL, 1, recompute="full")


def test_a_stage_keeps_moe_activations_for_its_moe_layers_only():
    deepseek = shape_of("deepseek-moe-16b")  # its first layer is dense
    assert deepseek.moe_layers[:2] == (0, 1)
    first, second = memory_per_stage(deepseek, [14, 14], data_parallel=2, num_micro_batches=1,
                                     flash_attention=True, expert=2, expert_tensor=1)
    dense = activation_bytes_per_layer(deepseek, 1, flash_attention=True)
    moe = activation_bytes_per_layer(deepseek, 1, flash_attention=True, moe=True)
    ends = 4 * deepseek.seq_length * deepseek.hidden * (1 + deepseek.vocab / deepseek.hidden)
    assert second.activations * GIB == pytest.approx(14 * moe + ends)
    assert first.activations * GIB == pytest.approx(13 * moe + dense + 8 * deepseek.seq_length)


def test_estimate_memory_drops_with_expert_parallelism():
    plain, sharded = estimate(spec(parallel={"expert": 1})), estimate(spec())
    assert max(sharded.memory_gb_per_stage) < max(plain.memory_gb_per_stage) - 40
    assert sharded.params_per_stage[1] == pytest.approx(stage_params(MIXTRAL, [8] * 4, expert=8, expert_tensor=1)[1])
    assert sharded.active_params == plain.active_params and sharded.params == plain.params


def test_the_token_all_to_all_is_exposed_communication_of_kind_ep():
    est = estimate(spec())
    assert est.exposed_comm_s["ep"] > 0 and est.hidden_comm_s["ep"] == 0
    assert est.breakdown["ep_comm"] == est.exposed_comm_s["ep"]
    assert sum(est.breakdown.values()) == pytest.approx(est.iteration_time_s)
    assert estimate(spec(parallel={"expert": 1})).exposed_comm_s["ep"] == 0


def test_the_all_to_all_grows_when_the_expert_group_leaves_the_node():
    # Qwen3 30B-A3B's 128 experts on two nodes of 8 H100: expert 8 stays on NVLink, 16 crosses the network
    def qwen(expert, gpu="H100", nodes=2, per_node=8):
        return estimate(spec("qwen3-30b-a3b", gpu=gpu, nodes=nodes, per_node=per_node,
                             parallel={"pipeline": 1, "expert": expert}, global_=64))
    inside, across = qwen(8), qwen(16)
    assert across.exposed_comm_s["ep"] > 3 * inside.exposed_comm_s["ep"]
    # on four GB200 trays the 16 GPUs share one NVLink domain: the larger group costs about the same
    tray, rack = qwen(8, "GB200", 4, 4), qwen(16, "GB200", 4, 4)
    assert rack.exposed_comm_s["ep"] < 1.2 * tray.exposed_comm_s["ep"]


def test_the_flex_dispatcher_sends_a_token_once_to_each_other_node_holding_its_experts():
    # Qwen3 30B-A3B (topk 8 of 128 experts) at expert 16 on two nodes of 8 H100, as Megatron-Bridge's recipe runs it
    def rate(dispatcher, nodes=2):
        return Topology(spec("qwen3-30b-a3b", nodes=nodes, parallel={"pipeline": 1, "expert": 8 * nodes},
                             model={"moe_token_dispatcher_type": dispatcher})).expert_links(0).alltoall_gbps
    topo = Topology(spec("qwen3-30b-a3b", nodes=2, parallel={"pipeline": 1, "expert": 16}))
    network = topo.calibration.bus_gbps(topo.slots[0].inter_gbps, inter_node=True) / 8
    # the alltoall sends the half of a token's 8 copies bound for the other node's experts over the network
    assert rate("alltoall") == pytest.approx(15 / 16 / (8 / 16 / network))
    # the flex dispatcher sends it there once when any of its experts lie there (all but (64 choose 8)/(128 choose 8))
    once = 1 - math.comb(64, 8) / math.comb(128, 8)
    assert rate("flex") == pytest.approx(15 / 16 / (once / 8 / network))
    assert rate("flex") > 3.5 * rate("alltoall")
    # inside one node it sends a token once to each other rank holding any of its experts (16 of the 128 each), where
    # the alltoall sends 8 x 7/8 copies
    per_rank = 1 - math.comb(112, 8) / math.comb(128, 8)
    assert rate("flex", nodes=1) == pytest.approx(rate("alltoall", nodes=1) * 8 * 7 / 8 / (7 * per_rank))
    across = estimate(spec("qwen3-30b-a3b", nodes=2, parallel={"pipeline": 1, "expert": 16}, global_=64,
                           model={"moe_token_dispatcher_type": "flex"}))
    assert any("flex dispatcher sends a token once to each rank" in line and "other node" in line
               and "use hybridep" not in line for line in across.assumptions)  # DeepEP, megatron-core's default
    assert across.exposed_comm_s["ep"] < estimate(spec("qwen3-30b-a3b", nodes=2, parallel={"pipeline": 1, "expert": 16},
                                                       global_=64)).exposed_comm_s["ep"] / 2


def test_deepep_crosses_a_racks_trays_over_the_network_where_hybridep_stays_on_nvlink():
    """megatron-core 0.16.1 runs DeepEP inside a node only (moe_flex_dispatcher_backend: "only hybridep supports the
    MNNVL case"): on four GB200 trays of one NVL72 rack, DeepEP's expert group of 16 sends between trays over their
    network cards, HybridEP's over NVLink; on H100 nodes, whose NVLink domain is the node, the two read the same."""
    def dispatch(backend, gpu="GB200", nodes=4, per_node=4):
        return spec("qwen3-30b-a3b", gpu=gpu, nodes=nodes, per_node=per_node, parallel={"pipeline": 1, "expert": 16},
                    global_=64, model={"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": backend})

    deepep, hybridep = (Topology(dispatch(b)).expert_links(0).alltoall_gbps for b in ("deepep", "hybridep"))
    assert Topology(dispatch("deepep")).flex_crosses_network(list(range(16)))
    assert not Topology(dispatch("hybridep")).flex_crosses_network(list(range(16)))
    assert deepep < hybridep / 2
    assert any("other node" in line and "use hybridep" in line for line in estimate(dispatch("deepep")).assumptions)
    on_nvlink = estimate(dispatch("hybridep")).assumptions
    assert "the flex dispatcher sends a token once to each rank holding any of its experts" in on_nvlink
    assert "" not in on_nvlink and not any("over the network" in line for line in on_nvlink)
    on_h100 = [Topology(dispatch(b, "H100", 2, 8)).expert_links(0).alltoall_gbps for b in ("deepep", "hybridep")]
    assert on_h100[0] == pytest.approx(on_h100[1])


def test_the_all_to_all_moves_topk_copies_of_the_ranks_tokens():
    links = ExpertLinks(800.0, 800.0, 800.0)
    tokens, h = 4096, MIXTRAL.hidden
    one = expert_dispatch_time(MIXTRAL, tokens, 1, 8, 1, "bf16", links, 0.0, "alltoall")
    # 4 all-to-alls (dispatch and combine, forward and backward) of 7/8 of tokens x topk x h x 2 bytes
    assert one == pytest.approx(4 * 7 / 8 * tokens * 2 * h * 2 / (800e9 / 8))
    assert expert_dispatch_time(MIXTRAL, tokens, 1, 8, 1, "bf16", links, 0.0, "alltoall", "full") == \
        pytest.approx(1.5 * one)
    # the allgather dispatcher gathers each token once, whatever topk
    gathered = expert_dispatch_time(MIXTRAL, tokens, 1, 8, 1, "bf16", links, 0.0, "allgather")
    assert gathered == pytest.approx(4 * 7 * tokens * h * 2 / (800e9 / 8))
    assert expert_dispatch_time(MIXTRAL, tokens, 1, 1, 1, "bf16", links, 0.0) == 0
    assert expert_dispatch_time(shape_of("gpt2-small"), tokens, 1, 8, 1, "bf16", links, 0.0) == 0


def test_expert_groups_follow_megatron_cores_expert_rank_order():
    # tensor 2, expert_tensor 1, expert 8 on 64 GPUs, pipeline 4: a stage's 16 ranks are etp x ep x edp = 1 x 8 x 2
    topo = Topology(spec(parallel={"tensor": 2, "expert": 8, "expert_tensor": 1, "sequence_parallel": True}))
    assert topo.expert_group(1, "ep") == list(range(16, 24))
    assert topo.expert_group(1, "edp") == [16, 24]
    topo = Topology(spec(parallel={"tensor": 2, "expert": 4, "sequence_parallel": True}))  # expert_tensor 2
    assert topo.expert_group(0, "ep") == [0, 2, 4, 6]
    assert topo.expert_group(0, "etp") == [0, 1]
    assert topo.expert_group(0, "tp_ep") == list(range(8))
    assert topo.expert_group(0, "edp") == [0, 8]


def test_expert_gradients_reduce_over_the_expert_data_parallel_group():
    # without the distributed optimizer or overlap every gradient is all-reduced after the last backward: the dense
    # ones over the 64 data ranks, each expert's over its 8 replicas (one per node, 8 such rings sharing each node)
    layout = spec(parallel={"pipeline": 1}, optimizer={"distributed": False}, global_=64, nodes=8)
    est, topo = estimate(layout), Topology(layout)
    experts = expert_params_per_stage(MIXTRAL, [32], 1, 8, 1)[0]
    dense = est.params_per_stage[0] - experts
    latency = topo.calibration.link_latency_s
    assert topo.expert_group(0, "edp") == list(range(0, 64, 8))
    assert est.exposed_comm_s["dp"] == pytest.approx(allreduce_time(4 * dense, 64, topo.dp_gbps(0), latency)
                                                     + allreduce_time(4 * experts, 8, topo.edp_gbps(0), latency))
    assert topo.edp_gbps(0) == pytest.approx(topo.dp_gbps(0) / 8)


def test_dense_estimates_carry_no_expert_terms():
    dense = estimate(load_spec({"model": {"preset": "llama3-8b"}, "parallel": {"pipeline": 2},
                                "cluster": {"nodes": [{"gpu": "H100", "count": 1, "gpus_per_node": 8}]},
                                "batch": {"micro": 1, "global": 32}, "precision": "bf16"}))
    assert dense.breakdown["ep_comm"] == 0 and dense.exposed_comm_s["ep"] == 0 and dense.hidden_comm_s["ep"] == 0
    assert dense.active_params == dense.params


def test_an_moe_layers_launch_cost_grows_with_the_experts_a_rank_holds_not_with_its_tokens():
    """The stack's moe_launch_s_per_local_expert, charged per MoE layer and micro-batch on a GPU: a micro-batch twice
    as large pays it once, expert parallelism twice as wide halves it, a CPU host pays none, and a Hopper GPU its
    fitted multiple of it (calibration.yaml moe_launch_scale), which `labkit estimate` states."""
    from labkit.estimate.calibration import default_calibration
    from labkit.estimate.timing import stage_time

    rate = default_calibration().stack(None).moe_launch_s_per_local_expert
    qwen = shape_of("qwen3-30b-a3b")

    def launch_s(gpu, micro, expert):
        times = [stage_time(gpu, 4, micro, shape=qwen, expert=expert, calibration=calibration)
                 for calibration in (default_calibration(), default_calibration().with_stack(
                     dataclasses.replace(default_calibration().stack(None), moe_launch_s_per_local_expert=0.0)))]
        return (times[0].forward_s + times[0].backward_s) - (times[1].forward_s + times[1].backward_s)

    assert rate > 0
    assert launch_s("B200", 1, 8) == pytest.approx(4 * 16 * rate)  # 128 experts over 8 ranks: 16 a rank
    assert launch_s("B200", 4, 8) == pytest.approx(launch_s("B200", 1, 8))
    assert launch_s("B200", 1, 16) == pytest.approx(launch_s("B200", 1, 8) / 2)
    assert launch_s("cpu", 1, 8) == 0
    hopper = default_calibration().moe_launch_scale["H100-SXM"]
    assert hopper > 1 and default_calibration().sources["moe_launch_scale.H100-SXM"].startswith("fitted:")
    assert launch_s("H100", 1, 8) == pytest.approx(4 * 16 * rate * hopper)
    assert default_calibration().moe_launch_scale.get("B200", 1.0) == 1.0
    on_h100 = spec(preset="qwen3-30b-a3b", gpu="H100", nodes=1, parallel={"pipeline": 1}, global_=64)
    stated = estimate(on_h100)
    assert any(f"{1e3 * rate * hopper:.2g} ms on H100-SXM per local expert" in line for line in stated.assumptions)
    # a stage timed from a profile of its GPU: the host's launches are in the profile's time, and not said to be added
    from labkit.estimate.profiles import Profile
    profiled = estimate(on_h100, profiles={("H100-SXM", 1): Profile(
        model="qwen3", gpu="H100-SXM", tensor=1, embedding_s=1e-3, layers_s=[4e-3] * 48, output_s=2e-3,
        seq_length=on_h100.model.seq_length)})
    assert profiled.stage_sources == ["profile qwen3/H100-SXM/tp1"]
    assert not any("per local expert" in line for line in profiled.assumptions)
    assert estimate(spec(preset="qwen3-30b-a3b", gpu="B200", nodes=1, parallel={"pipeline": 1}, global_=64)) \
        .iteration_time_s > estimate(spec(preset="qwen3-30b-a3b", gpu="B200", nodes=1, parallel={"pipeline": 1},
                                          micro=4, global_=64)).iteration_time_s


@pytest.mark.parametrize("gpu", ["B200", "GB200", "GB300"])
def test_blackwell_runs_mxfp8_at_its_share_of_the_fp8_rate(gpu):
    per_node = 4 if gpu.startswith("GB") else 8
    fp8 = estimate(spec(gpu=gpu, nodes=64 // per_node, per_node=per_node, precision="fp8"))
    mx = estimate(spec(gpu=gpu, nodes=64 // per_node, per_node=per_node, precision="mxfp8"))
    bf16 = estimate(spec(gpu=gpu, nodes=64 // per_node, per_node=per_node))
    assert fp8.iteration_time_s < mx.iteration_time_s < bf16.iteration_time_s
    # at the FP8 peak, its GEMMs at mxfp8_share of FP8's efficiency (fitted: calibration.yaml)
    cal = default_calibration()
    assert 0.85 <= cal.mxfp8_share < 1 and cal.sources["mxfp8_share"].startswith("fitted:")
    at_fp8_rate = estimate(spec(gpu=gpu, nodes=64 // per_node, per_node=per_node, precision="mxfp8"),
                           calibration=dataclasses.replace(cal, mxfp8_share=1.0))
    assert at_fp8_rate.iteration_time_s == pytest.approx(fp8.iteration_time_s)
    assert max(mx.memory_gb_per_stage) < max(bf16.memory_gb_per_stage)  # 1-byte GEMM inputs kept
    # FP8 parameters (the distributed optimizer's default): a byte a linear weight on Blackwell, MXFP8's two block
    # layouts 2 and their scales; the bf16 weights they replace would be 2
    bf16_weights = estimate(spec(gpu=gpu, nodes=64 // per_node, per_node=per_node, precision="fp8",
                                 optimizer={"fp8_param_gather": False}))
    for i, (m, f, b) in enumerate(zip(mx.memory_detail, fp8.memory_detail, bf16_weights.memory_detail)):
        assert m["weights"] - f["weights"] == pytest.approx((b["weights"] - f["weights"]) * 1.0625 / 2), i
        assert m["activations"] == f["activations"]


def _tiny_moe(expert, world, layers=2, pipeline=1, distributed=True, **model):
    """A small MoE GPT (4 experts of width 40, top-2, alltoall) on `world` CPU processes."""
    return load_spec({"model": {"num_layers": layers, "hidden_size": 72, "num_attention_heads": 4, "seq_length": 32,
                                "vocab_size": 1000, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 40,
                                "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
                                "add_bias_linear": False, "untie_embeddings": True, "hidden_dropout": 0.0,
                                "attention_dropout": 0.0, "moe_token_dispatcher_type": "alltoall", **model},
                      "parallel": {"expert": expert, "pipeline": pipeline},
                      "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": world}]},
                      "batch": {"micro": 1, "global": world}, "precision": "bf16",
                      "optimizer": {"distributed": distributed}})


@pytest.mark.slow
@pytest.mark.parametrize("expert, world, layers, pipeline, distributed, model", [
    (2, 2, 2, 1, True, {}),
    (1, 2, 2, 1, True, {}),  # no expert parallelism: the experts share the dense buffer
    (2, 2, 2, 1, False, {}),
    (2, 2, 2, 1, True, {"moe_shared_expert_intermediate_size": 48, "moe_layer_freq": "([0]*1+[1]*1)"}),
    (2, 4, 2, 1, True, {}),  # two replicas of each expert: its optimizer state in halves
    (2, 4, 4, 2, True, {}),
])
def test_moe_model_state_equals_megatron_core_bytes(expert, world, layers, pipeline, distributed, model):
    """labkit's driver builds the model and optimizer with megatron-core 0.16.1 in gloo processes
    (labkit.train.model_state.measure_model_state): every byte of weights, DDP's dense and expert buffers and the
    distributed optimizer's shards is as model_state_bytes counts it, on the fullest rank of each stage."""
    from labkit.train.model_state import measure_model_state

    layout = _tiny_moe(expert, world, layers, pipeline, distributed, **model)
    measured = measure_model_state([layout])[0]
    shape = Shape.of(layout.model)
    per_stage = world // pipeline
    for stage in range(pipeline):
        state = model_state_bytes(shape, [layers // pipeline], stage=stage, pipeline=pipeline,
                                  data_parallel=layout.data_parallel, precision="bf16",
                                  distributed_optimizer=distributed, expert=expert)
        ranks = measured[stage * per_stage:(stage + 1) * per_stage]
        assert {(w, g) for w, g, _ in ranks} == {(state.weights, state.gradients)}
        assert max(o for _, _, o in ranks) == state.optimizer

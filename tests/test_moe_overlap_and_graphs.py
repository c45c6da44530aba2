"""CUDA graphs (kernels.cuda_graph_impl, cuda_graph_scope) and the MoE all-to-all's overlap
(kernels.overlap_moe_expert_parallel_comm): the rules megatron-core 0.16.1's TransformerConfig and Megatron-LM's
validate_args hold, the flags a spec renders, where labkit's driver refuses them, and what the estimate charges."""
import pytest
import yaml
from megatron.core.transformer import TransformerConfig

from labkit.cli import main
from labkit.estimate import estimate
from labkit.estimate.calibration import default_calibration
from labkit.estimate.timing import ExpertLinks, stage_time
from labkit.megatron import rules
from labkit.megatron.flags import build_parser
from labkit.megatron.shape import Shape
from labkit.megatron_args import megatron_args
from labkit.plan.cli import _assumed_line
from labkit.plan.inputs import assumptions, planning_input
from labkit.plan.search import search
from labkit.spec import SpecError, load_spec
from labkit.spec.checks import rule_errors

MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--lr",
       "1e-4", "--train-iters", "1", "--bf16", "--mock-data", "--num-experts", "8", "--moe-token-dispatcher-type",
       "alltoall", "--expert-model-parallel-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
GPU = rules.Runtime(driver=False, cuda=True, transformer_engine=True, fused_adam=True)
MEGATRON_LM = {"entrypoint": "megatron-lm", "megatron_lm": "/workspace/megatron-lm"}
CONFIG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True, num_moe_experts=8,
              moe_token_dispatcher_type="alltoall", expert_model_parallel_size=4, hidden_dropout=0.0,
              attention_dropout=0.0)
"""megatron-core's TransformerConfig of the same MoE model as MOE's command line."""


def problems(argv: list[str], base=MOE, runtime=GPU) -> list[str]:
    return [p.argument for p in rules.problems(build_parser().parse_args(base + argv), 8, runtime)]


def qwen(**kernels):
    """Qwen3 30B-A3B on a GB200 rack's 8 GPUs as NVIDIA's 26.06 recipe lays it out, with Megatron-LM."""
    return load_spec({"model": {"preset": "qwen3-30b-a3b"}, "parallel": {"expert": 8},
                      "batch": {"micro": 4, "global": 512}, "precision": "mxfp8",
                      "optimizer": {"distributed": True}, "kernels": kernels,
                      "job": MEGATRON_LM,
                      "cluster": {"nodes": [{"gpu": "GB200", "count": 2, "gpus_per_node": 4}]}})


@pytest.mark.parametrize("config, argv, argument, message", [
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["full_iteration"]),
     ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "full_iteration"], "cuda_graph_scope",
     "please use cuda_graph_impl=local"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe", "moe_router"]),
     ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "moe", "moe_router"], "cuda_graph_scope",
     "must not contain both moe and moe_router"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_preprocess"]),
     ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "moe_preprocess"], "cuda_graph_scope",
     "only supported with moe_router"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["mlp"]),
     ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "mlp"], "cuda_graph_scope",
     "mlp cuda graph is only supported for dense layers"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe"]),
     ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "moe"], "cuda_graph_scope",
     "only supported with drop-padding MoE"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"], recompute_granularity="full",
          recompute_method="uniform", recompute_num_layers=1),
     ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--recompute-num-layers", "1"], "recompute_granularity",
     "full recompute is only supported with full iteration CUDA graph"),
    (dict(cuda_graph_impl="transformer_engine", recompute_granularity="selective", attention_dropout=0.1),
     ["--cuda-graph-impl", "transformer_engine", "--recompute-granularity", "selective", "--attention-dropout", "0.1"],
     "attention_dropout", "attention dropout is not supported with graphed attention recomputation"),
    (dict(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=1),
     ["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "1"], "expert_model_parallel_size",
     "only supported with expert model parallelism"),
    (dict(overlap_moe_expert_parallel_comm=True, moe_token_dispatcher_type="allgather"),
     ["--overlap-moe-expert-parallel-comm", "--moe-token-dispatcher-type", "allgather"], "moe_token_dispatcher_type",
     "supported with alltoall/flex token dispatcher"),
    (dict(overlap_moe_expert_parallel_comm=True, recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1),
     ["--overlap-moe-expert-parallel-comm", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "recompute_granularity", "disable full recomputation"),
    (dict(overlap_moe_expert_parallel_comm=True, cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]),
     ["--overlap-moe-expert-parallel-comm", "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
      "--no-check-for-nan-in-loss-and-grad", "--moe-pad-experts-for-cuda-graph-inference"], "cuda_graph_impl",
     "not supported with overlap_moe_expert_parallel_comm"),
])
def test_each_rule_is_megatron_cores(config, argv, argument, message):
    with pytest.raises((AssertionError, ValueError), match=message):
        TransformerConfig(**{**CONFIG, **config})
    assert argument in problems(argv)


def test_what_megatron_core_accepts_the_rules_accept():
    for config, argv in (
            (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "moe_router", "moe_preprocess"]),
             ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "moe_router", "moe_preprocess"]),
            (dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"], recompute_granularity="full",
                  recompute_method="uniform", recompute_num_layers=1),
             ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--recompute-granularity", "full",
              "--recompute-method", "uniform", "--recompute-num-layers", "1", "--no-check-for-nan-in-loss-and-grad",
              "--moe-pad-experts-for-cuda-graph-inference"]),
            (dict(overlap_moe_expert_parallel_comm=True, cuda_graph_impl="transformer_engine",
                  cuda_graph_scope=["moe_router", "moe_preprocess"]),
             ["--overlap-moe-expert-parallel-comm", "--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope",
              "moe_router", "moe_preprocess"])):
        TransformerConfig(**{**CONFIG, **config})
        assert problems(argv) == []
    # Megatron-LM's validate_args on a whole-iteration graph: no NaN check, and the router's padding beside experts
    assert problems(["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]) == [
        "check_for_nan_in_loss_and_grad", "moe_pad_experts_for_cuda_graph_inference"]
    # the overlap pairs micro-batches inside the interleaved schedule when there is a pipeline
    assert "num_layers_per_virtual_pipeline_stage" in problems(["--overlap-moe-expert-parallel-comm",
                                                                "--pipeline-model-parallel-size", "2"])


def test_a_spec_renders_the_graphs_megatron_lm_needs_and_names_its_fields():
    def flags(s):
        return [a for a in megatron_args(s) if "graph" in a or "nan" in a or "overlap-moe" in a or a in ("local", "full_iteration")]

    assert flags(qwen(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])) == [
        "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration", "--no-check-for-nan-in-loss-and-grad",
        "--moe-pad-experts-for-cuda-graph-inference"]
    assert flags(qwen(overlap_moe_expert_parallel_comm=True)) == ["--overlap-moe-expert-parallel-comm"]
    assert flags(qwen()) == []
    with pytest.raises(SpecError) as refused:
        qwen(cuda_graph_scope=["attn"])
    assert "kernels.cuda_graph_scope: chooses what a CUDA graph captures; set kernels.cuda_graph_impl" in str(
        refused.value)
    with pytest.raises(SpecError, match=r"kernels.cuda_graph_scope\[1\]: 'whole' is not one of attn, mlp"):
        qwen(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "whole"])
    with pytest.raises(SpecError, match=r"kernels.cuda_graph_impl: megatron-core runs the overlap beside Transformer "
                                        r"Engine's graphs of attn, moe_router and moe_preprocess only; use "
                                        r"kernels.cuda_graph_impl transformer_engine without moe or mlp scopes "
                                        r"\(kernels.overlap_moe_expert_parallel_comm\)"):
        qwen(overlap_moe_expert_parallel_comm=True, cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])


def test_labkits_driver_refuses_both_naming_the_field():
    tiny = {"model": {"preset": "tiny", "num_experts": 4, "moe_token_dispatcher_type": "alltoall"},
            "parallel": {"expert": 2}, "batch": {"micro": 1, "global": 2}, "precision": "bf16", "train": {"iters": 1, "log_interval": 1}, "data": {"mock": True},
            "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 2}]}}
    for kernels, field in (({"overlap_moe_expert_parallel_comm": True}, "kernels.overlap_moe_expert_parallel_comm"),
                           ({"cuda_graph_impl": "transformer_engine"}, "kernels.cuda_graph_impl")):
        errors = rule_errors(load_spec({**tiny, "kernels": kernels}), layout="slurm")
        assert [e for e in errors if e.startswith(field)] == [
            f"{field}: labkit's driver " + ("runs the plain 1F1B schedule, not megatron-core's combined one"
                                             if "overlap" in field else "captures no CUDA graph")
            + "; leave it out, or run Megatron-LM's pretrain_gpt.py"]


def test_a_whole_iteration_graph_drops_the_host_launch_cost_and_nothing_else():
    plain, graphed = estimate(qwen()), estimate(qwen(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]))
    shape, rate = Shape.of(qwen().model), default_calibration().stack(None).moe_launch_s_per_local_expert
    per_step = shape.num_layers * (shape.experts / 8) * rate * qwen().num_micro_batches
    assert rate > 0
    assert plain.iteration_time_s - graphed.iteration_time_s == pytest.approx(per_step, rel=1e-6)
    assert graphed.memory_gb_per_stage == plain.memory_gb_per_stage
    assert "no host launch cost per expert: the whole iteration is one CUDA graph" in graphed.assumptions
    assert "CUDA graphs (local: full_iteration); the static buffers they keep are not counted in memory" in \
        graphed.assumptions
    assert any(a.startswith("the host launches each MoE layer's kernels at") for a in plain.assumptions)


def test_the_overlap_hides_the_all_to_all_up_to_the_other_micro_batchs_compute():
    common = dict(shape=Shape.of(qwen().model), precision="bf16", expert=8, expert_tensor=1, dispatcher="alltoall",
                  graphed_iteration=True)  # no host launches: the stage's forward and backward are all compute
    for gbps, covered in ((900.0, True), (1.0, False)):  # NVLink's all-to-all, and one far slower than the compute
        links = ExpertLinks(gbps, gbps, gbps)
        exposed = stage_time("H100-SXM", 48, 1, expert_links=links, **common)
        hidden = stage_time("H100-SXM", 48, 1, expert_links=links, moe_comm_overlap=True, **common)
        compute = exposed.forward_s + exposed.backward_s
        assert (hidden.forward_s, hidden.backward_s) == (exposed.forward_s, exposed.backward_s)
        assert (exposed.ep_comm_s < compute) is covered
        assert hidden.ep_comm_s == pytest.approx(max(0.0, exposed.ep_comm_s - compute))
        assert exposed.ep_comm_s > 0


@pytest.mark.parametrize("pipeline, virtual", [(1, 1), (2, 2), (4, 3)])
def test_the_overlap_holds_one_more_layer_as_megatron_cores_combined_steps_run(pipeline, virtual):
    """Under the all-to-all's overlap megatron-core's warm-up runs one forward more (schedules.get_pp_rank_microbatches,
    asked through a stand-in for its p2p communicator): the first steady step's, so that the chunks held when the
    combined steps begin are labkit's in-flight count, plain 1F1B's peak, on the first stage; each combined step then
    runs a forward beside a backward layer by layer, and the estimate adds one MoE layer's activations."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from labkit.estimate.memory import activation_bytes_per_layer, in_flight_micro_batches

    micro_batches = 4 * pipeline
    if pipeline > 1:
        def warmup(overlap: bool) -> int:
            group = SimpleNamespace(size=lambda: pipeline, rank=lambda: 0)
            p2p = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=virtual)
            return get_pp_rank_microbatches(micro_batches, virtual, pipeline, forward_only=False,
                                            overlap_moe_expert_parallel_comm=overlap, p2p_communicator=p2p)[2]

        assert warmup(True) == warmup(False) + 1
        assert in_flight_micro_batches(0, pipeline, micro_batches, virtual) * virtual == pytest.approx(warmup(True))
    layout = {"pipeline": pipeline, "expert": 8, "data": 8, **({"virtual_stages": virtual} if virtual > 1 else {})}
    spec = load_spec({"model": {"preset": "qwen3-30b-a3b", "num_layers": 4 * pipeline * virtual},
                      "parallel": layout, "batch": {"micro": 1, "global": 8 * micro_batches},
                      "precision": "bf16", "optimizer": {"distributed": True}, "job": MEGATRON_LM,
                      "cluster": {"nodes": [{"gpu": "H100", "count": pipeline, "gpus_per_node": 8}]}})
    plain, overlapped = (estimate(s).memory_detail[0] for s in (spec, load_spec(
        {**spec.to_dict(), "kernels": {"overlap_moe_expert_parallel_comm": True}})))
    assert overlapped["in_flight"] == plain["in_flight"]
    moe_layer = activation_bytes_per_layer(Shape.of(spec.model), 1, 1, False, flash_attention=True, moe=True,
                                           expert_tensor=1) / 2 ** 30
    assert overlapped["activations"] - plain["activations"] == pytest.approx(moe_layer)


def test_a_local_graph_of_the_dispatch_takes_the_router_with_it_as_megatron_core_does():
    config = dict(cuda_graph_impl="local", cuda_graph_scope=["moe_preprocess"])
    TransformerConfig(**{**CONFIG, **config})
    assert problems(["--cuda-graph-impl", "local", "--cuda-graph-scope", "moe_preprocess",
                     "--moe-pad-experts-for-cuda-graph-inference"]) == []
    assert problems(["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "moe_preprocess"]) == [
        "cuda_graph_scope"]


def planned(tmp_path, spec: dict, top: int) -> list:
    """The planner's top rows for a spec file, each with the run spec it would write."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    base, constraints = planning_input(str(path))
    return search(base, top=top, constraints=constraints).rows[:top]


def test_the_planner_keeps_the_overlap_where_the_layout_runs_it_and_every_row_validates(capsys, tmp_path):
    spec = {"model": {"preset": "qwen3-30b-a3b"}, "batch": {"global": 256}, "precision": "bf16",
            "kernels": {"overlap_moe_expert_parallel_comm": True}, "job": MEGATRON_LM,
            "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 4, "gpus_per_node": 8}]}}
    rows = planned(tmp_path, spec, 20)
    assert rows
    for row in rows:
        chosen = load_spec(row.spec.to_dict())  # validated: the rule book accepts every row
        runs_it = row.ep > 1 and (row.pp == 1 or row.virtual_stages > 1) and row.recompute_granularity != "full"
        assert chosen.kernels.overlap_moe_expert_parallel_comm is runs_it
    assert any(row.spec.kernels.overlap_moe_expert_parallel_comm for row in rows)
    base, _ = planning_input(str(tmp_path / "spec.yaml"))
    assert "overlap_moe_expert_parallel_comm on where the layout has expert ranks" in _assumed_line(assumptions(base))
    # a dense model has no all-to-all to hide: refused before any search, naming the field
    (tmp_path / "dense.yaml").write_text(yaml.safe_dump({**spec, "model": {"preset": "llama3-8b"}}))
    assert main(["plan", str(tmp_path / "dense.yaml")]) == 2
    assert "model.num_experts: missing: the overlap hides a mixture-of-experts model's all-to-all" in \
        capsys.readouterr().err


def test_the_planner_recomputes_only_as_the_graphs_allow(tmp_path):
    # Llama 2 13B on 8 A100-40GB needs full recompute to fit; under Transformer Engine's per-layer graphs megatron-core
    # recomputes whole layers only inside a whole-iteration graph, so the planner offers none
    spec = {"model": {"preset": "llama2-13b"}, "batch": {"global": 128}, "precision": "bf16", "job": MEGATRON_LM,
            "cluster": {"nodes": [{"gpu": "A100-40GB", "count": 1, "gpus_per_node": 8}]}}
    plain = planned(tmp_path, spec, 20)
    graphed = planned(tmp_path, {**spec, "kernels": {"cuda_graph_impl": "transformer_engine"}}, 20)
    assert any(row.spec.recompute and row.spec.recompute.granularity == "full" for row in plain)
    assert graphed and not any(row.spec.recompute and row.spec.recompute.granularity == "full" for row in graphed)
    for row in graphed:
        load_spec(row.spec.to_dict())

"""ZeRO stages: the spec's two spellings, Megatron-LM's flags for Megatron-FSDP, the checks that name the field, and
the estimator's per-rank model state and data-parallel traffic by stage, with worked numbers for Llama-2-7B."""
from dataclasses import replace

import pytest
import yaml

from labkit import catalog
from labkit.estimate.calibration import default_calibration
from labkit.estimate.estimator import estimate
from labkit.estimate.memory import FSDP_MIN_COMMUNICATION_UNIT, chunk_parameters, model_state_bytes
from labkit.estimate.params import Shape, total_params
from labkit.estimate.published import published_runs
from labkit.estimate.timing import data_parallel_time
from labkit.jobs.render import job_env
from labkit.megatron.flags import FLAG, ArgumentError, build_parser
from labkit.megatron_args import megatron_args
from labkit.plan.explain import sharding_bought
from labkit.plan.inputs import SEARCHED, Constraints
from labkit.plan.search import search
from labkit.spec import SpecError, load_spec
from labkit.jobs.submission import submission_errors
from labkit.spec.checks import check_job
from labkit.train.arguments import finish

LLAMA2_7B_ON_8_A100 = {"model": {"preset": "llama2-7b"}, "precision": "bf16", "parallel": {"data": 8},
                       "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 8}]},
                       "batch": {"micro": 1, "global": 64}, "recompute": {"granularity": "selective"}}


def with_optimizer(**optimizer):
    return load_spec({**LLAMA2_7B_ON_8_A100, "optimizer": optimizer})


@pytest.mark.parametrize("written, stage, distributed", [
    ({}, 0, False), ({"distributed": True}, 1, True), ({"zero_stage": 1}, 1, True), ({"zero_stage": 3}, 3, True),
    ({"zero_stage": 2, "distributed": True}, 2, True), ({"zero_stage": 0, "distributed": False}, 0, False)])
def test_distributed_is_stage_ones_other_spelling(written, stage, distributed):
    opt = with_optimizer(**written).optimizer
    assert (opt.zero_stage, opt.distributed, opt.zero_backend) == (stage, distributed, "megatron")


def test_the_spellings_follow_each_other_in_a_yaml_file_too(tmp_path):
    # a YAML file's numbers load as int subclasses that remember their line: they are stages all the same
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**LLAMA2_7B_ON_8_A100, "job": {"entrypoint": "megatron-lm",
                                                                   "megatron_lm": "/opt/megatron-lm"},
                                    "optimizer": {"zero_stage": 1}}))
    spec = load_spec(path)
    assert spec.optimizer.distributed is True
    assert str(FLAG.use_distributed_optimizer) in [str(a) for a in megatron_args(spec)]
    path.write_text(yaml.safe_dump({**LLAMA2_7B_ON_8_A100, "optimizer": {"zero_stage": 2, "distributed": False}}))
    with pytest.raises(SpecError, match=r"optimizer\.zero_stage: 2 and optimizer\.distributed: false disagree"):
        load_spec(path)


@pytest.mark.parametrize("written", [{"zero_stage": 0, "distributed": True}, {"zero_stage": 1, "distributed": False},
                                     {"zero_stage": 3, "distributed": False}])
def test_spellings_that_disagree_are_refused_naming_both(written):
    with pytest.raises(SpecError, match=r"optimizer\.zero_stage: \d and optimizer\.distributed: \w+ disagree"):
        with_optimizer(**written)


def test_a_changed_copy_moves_both_spellings():
    spec = with_optimizer(distributed=True)
    assert spec.replace(**{"optimizer.zero_stage": 3}).optimizer.distributed is True
    assert spec.replace(**{"optimizer.zero_stage": 0}).optimizer.distributed is False
    assert spec.replace(**{"optimizer.distributed": False}).optimizer.zero_stage == 0


def test_bad_stage_and_backend_name_their_field():
    with pytest.raises(SpecError) as err:
        with_optimizer(zero_stage=4, zero_backend="fsdp")
    assert "optimizer.zero_stage: 4 is not 0" in str(err.value)
    assert "optimizer.zero_backend: 'fsdp' is not one of megatron, deepspeed" in str(err.value)


@pytest.mark.parametrize("backend, why", [
    ("megatron", "optimizer.zero_stage: ZeRO stage 2 runs as PyTorch FSDP2, which does not run under megatron-core's "
                 "pipeline schedules; use parallel.pipeline 1"),
    ("deepspeed", "optimizer.zero_stage: 2 with parallel.pipeline 2: DeepSpeed's pipeline")])
def test_sharded_gradients_under_pipeline_parallelism_are_refused(backend, why):
    with pytest.raises(SpecError) as err:
        load_spec({"parallel": {"pipeline": 2, "data": 2}, "optimizer": {"zero_stage": 2, "zero_backend": backend}})
    assert why in str(err.value)
    assert load_spec({"parallel": {"pipeline": 2, "data": 2}, "optimizer": {"zero_stage": 1}}).optimizer.distributed


def test_megatron_fsdp_renders_megatron_lms_flags_and_leaves_cuda_connections_alone():
    spec = load_spec({"parallel": {"tensor": 2, "data": 2}, "optimizer": {"zero_stage": 3},
                      "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/Megatron-LM"}})
    args = megatron_args(spec)
    known = catalog.megatron_lm_flags()
    assert all(a in known for a in args if a.startswith("--"))
    at = args.index(str(FLAG.data_parallel_sharding_strategy))
    assert args[at + 1] == "optim_grads_params" and args[args.index(str(FLAG.ckpt_format)) + 1] == "fsdp_dtensor"
    assert str(FLAG.use_megatron_fsdp) in args and str(FLAG.use_distributed_optimizer) in args
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in job_env(spec)  # Megatron-LM's validate_args refuses it with FSDP
    stage_2 = megatron_args(spec.replace(**{"optimizer.zero_stage": 2}))
    assert stage_2[stage_2.index(str(FLAG.data_parallel_sharding_strategy)) + 1] == "optim_grads"
    stage_1 = megatron_args(spec.replace(**{"optimizer.zero_stage": 1}))
    assert str(FLAG.use_megatron_fsdp) not in stage_1 and str(FLAG.use_distributed_optimizer) in stage_1
    assert job_env(spec.replace(**{"optimizer.zero_stage": 1}))["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_labkits_driver_shards_stages_2_and_3_with_torch_fsdp2():
    spec = load_spec({"model": {"preset": "tiny", "untie_embeddings": True}, "parallel": {"data": 2},
                      "optimizer": {"zero_stage": 2}})
    args = megatron_args(spec)
    assert [str(FLAG.use_torch_fsdp2), str(FLAG.torch_fsdp2_no_reshard_after_forward)] == \
        [a for a in args if "fsdp" in a]
    assert str(FLAG.use_distributed_optimizer) not in args  # FSDP2 replaces it (Megatron-LM's validate_args)
    stage_3 = megatron_args(spec.replace(**{"optimizer.zero_stage": 3}))
    assert [a for a in stage_3 if "fsdp" in a] == [str(FLAG.use_torch_fsdp2)]
    parsed = finish(build_parser().parse_args(stage_3), world_size=2, rank=0, cuda=False)
    assert parsed.use_torch_fsdp2 and parsed.torch_fsdp2_reshard_after_forward


@pytest.mark.parametrize("extra, message", [
    (["--pipeline-model-parallel-size", "2"], "--use-torch-fsdp2: .*does not run under megatron-core's pipeline"),
    (["--use-distributed-optimizer"], "--use-torch-fsdp2: conflicts with --use-distributed-optimizer"),
    ([], "--untie-embeddings-and-output-weights: .*PyTorch FSDP2 .*needs untied embeddings")])
def test_the_driver_checks_torch_fsdp2_as_megatron_lm_does(extra, message):
    argv = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8", "--lr",
            "1", "--train-iters", "1", "--mock-data", "--vocab-size", "64", "--use-torch-fsdp2", *extra]
    if "untie" not in message:
        argv.append("--untie-embeddings-and-output-weights")
    with pytest.raises(ArgumentError, match=message):
        finish(build_parser().parse_args(argv), world_size=4, rank=0, cuda=False)


def test_at_submission_a_stage_the_entrypoint_cannot_run_is_refused():
    fsdp = load_spec({"parallel": {"data": 2}, "optimizer": {"zero_stage": 2}, "precision": "bf16",
                      "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 2}]},
                      "job": {"exclusive": True}})  # tiny: tied embeddings
    assert check_job(fsdp) == []  # a valid plan on GPUs: estimated as Megatron-LM runs it (Megatron-FSDP)
    assert any(e.startswith("model.untie_embeddings: ZeRO stage 2 runs as PyTorch FSDP2 (optimizer.zero_stage), which "
                            "needs untied embeddings") for e in submission_errors(fsdp, "multinode"))
    untied = submission_errors(fsdp.replace(**{"model.untie_embeddings": True}), "multinode")
    assert not [e for e in untied if "zero_stage" in e]
    # DeepSpeed's engine runs on labkit's driver (tests/test_deepspeed.py), not under Megatron-LM's pretrain_gpt.py
    deepspeed = fsdp.replace(**{"optimizer.zero_backend": "deepspeed"})
    assert not [e for e in submission_errors(deepspeed, "multinode") if "zero_backend" in e]
    on_megatron_lm = deepspeed.replace(**{"job.entrypoint": "megatron-lm", "job.megatron_lm": "/opt/Megatron-LM"})
    assert any(e.startswith("optimizer.zero_backend: deepspeed (zero_stage 2) needs DeepSpeed's engine, which "
                            "Megatron-LM's pretrain_gpt.py does not start") for e in submission_errors(on_megatron_lm, "multinode"))


def test_the_driver_refuses_megatron_fsdp_naming_the_stage():
    argv = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8", "--lr",
            "1", "--train-iters", "1", "--mock-data", "--vocab-size", "64", "--use-distributed-optimizer",
            "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    with pytest.raises(ArgumentError, match="--use-megatron-fsdp: ZeRO stage 3 runs as Megatron-FSDP, which labkit's "
                                             "driver does not run: .* CUDA streams"):
        finish(build_parser().parse_args(argv), world_size=2, rank=0, cuda=False)


# Llama-2-7B, bf16 with Adam, data-parallel 8: P = 6,738,415,616 parameters (its 32000-token vocabulary needs no
# padding). Per rank, as megatron-core keeps them: bf16 weights (2P), fp32 gradients (4P), fp32 main weights and
# Adam's two moments (12P). Stage 1 shards the 12P, stage 2 the gradients too, stage 3 the weights too:
#   stage 0: 2P + 4P + 12P          = 18P    = 121.29 GB
#   stage 1: 2P + 4P + 12P/8        =  7.5P  =  50.54 GB
#   stage 2: 2P + (4P + 12P)/8      =  4P    =  26.95 GB
#   stage 3: (2P + 4P + 12P)/8      =  2.25P =  15.16 GB
# plus, at stages 2 and 3, Megatron-FSDP's unsharded working buffers (the layers gathered, the gradient buckets queued
# for reduce-scatter).
P = 6_738_415_616


def llama2_7b_state(stage: int, overlap_grad_reduce: bool = False, entrypoint: str = "megatron-lm"):
    shape = Shape.of(with_optimizer().model)
    return model_state_bytes(shape, [32], data_parallel=8, precision="bf16", zero_stage=stage,
                             overlap_grad_reduce=overlap_grad_reduce, entrypoint=entrypoint)


def test_llama2_7b_model_state_per_rank_falls_stage_by_stage_as_the_definitions_say():
    assert total_params(Shape.of(with_optimizer().model)) == P
    sharded = []
    for stage in range(4):
        s = llama2_7b_state(stage)
        sharded.append((s.weights - s.weights_working, s.gradients - s.gradients_working, s.optimizer))
    assert sharded == [(2 * P, 4 * P, 12 * P), (2 * P, 4 * P, 12 * P // 8), (2 * P, 4 * P // 8, 12 * P // 8),
                       (2 * P // 8, 4 * P // 8, 12 * P // 8)]
    assert [round(sum(s) / 1e9, 2) for s in sharded] == [121.29, 50.54, 26.95, 15.16]


def test_labkits_driver_holds_fsdp2s_shards_and_only_the_layers_it_gathers():
    """FSDP2 on labkit's driver: 16-bit weight and gradient shards and Megatron's fp32 main copies, their fp32
    gradients and Adam's moments, all over 8 ranks (Llama-2-7B's rows divide by 8: no padding): 20P/8 at stages 2 and
    3 alike, and at stage 2 (ZeRO-2) the whole 16-bit weights beside them. Unsharded only while it computes, at the
    backward's peak: at stage 3 two layers (the one computing, the one prefetched), the gradients of one and the
    reduce-scatter input of the other, and the root unit's final norm and output layer; at stage 2 those gradients.
    No billion-element gradient unit: that is Megatron-FSDP's."""
    shape = Shape.of(with_optimizer().model)
    layer = sum(n for n, _ in chunk_parameters(shape, 1, pre_process=False, post_process=False))
    root = 4096 + 32000 * 4096
    for stage in (2, 3):
        s = llama2_7b_state(stage, entrypoint="labkit")
        assert (s.weights - s.weights_working, s.gradients - s.gradients_working, s.optimizer) == \
            (2 * P // 8 + (2 * P if stage == 2 else 0), 2 * P // 8, 16 * P // 8)
    stage_3, stage_2 = llama2_7b_state(3, entrypoint="labkit"), llama2_7b_state(2, entrypoint="labkit")
    assert stage_3.weights_working == stage_3.gradients_working == (2 * layer + root) * 2
    assert (stage_2.weights_working, stage_2.gradients_working) == (0, (2 * layer + root) * 2)

    def held(state):
        return state.weights + state.gradients + state.optimizer

    assert held(llama2_7b_state(3)) - held(llama2_7b_state(3, entrypoint="labkit")) > 3e9  # 19.0 GB against 22.6


def test_megatron_fsdp_working_buffers_follow_its_communication_unit():
    shape = Shape.of(with_optimizer().model)
    layer = sum(n for n, _ in chunk_parameters(shape, 1, pre_process=False, post_process=False))
    assert layer == 202_383_360
    # stage 3: the layer computing and the prefetch up to half the unit (1e9 elements: twice a layer is less), in bf16;
    # gradients queued up to the unit, plus the bucket reducing and the one filling, in fp32
    s3 = llama2_7b_state(3)
    assert s3.weights_working == (FSDP_MIN_COMMUNICATION_UNIT // 2 + 2 * layer) * 2
    assert s3.gradients_working == (FSDP_MIN_COMMUNICATION_UNIT + 2 * layer) * 4
    # stage 2 without --overlap-grad-reduce: Megatron-LM's get_model leaves one bucket, all of the gradients unsharded
    # until the reduce-scatter; with it, 40M-element buckets
    assert llama2_7b_state(2).gradients_working == 4 * P
    with_overlap = llama2_7b_state(2, overlap_grad_reduce=True)
    assert with_overlap.gradients_working == (FSDP_MIN_COMMUNICATION_UNIT + 2 * 40_000_000) * 4


def test_llama2_7b_fits_on_a100_80gb_from_stage_1_and_stage_3_moves_the_most_data():
    estimates = [estimate(with_optimizer(zero_stage=z)) for z in range(4)]
    totals = [e.memory_gb_per_stage[0] for e in estimates]
    assert [e.fits_in_memory for e in estimates] == [False, True, True, True]
    assert totals[0] > totals[1] > totals[3] and totals[2] > totals[3]
    traffic = [e.breakdown["dp_comm"] + e.hidden_comm_s["dp"] for e in estimates]
    assert traffic[3] > traffic[0]  # 16 micro-batches, each gathering the parameters twice


def test_data_parallel_time_by_stage():
    kw = dict(params=1e9, n=8, gbps=800.0, latency_s=0.0, grad_bytes=4, param_bytes=2)
    all_reduce = data_parallel_time(**kw)[1]
    # stage 3: per micro-batch, two half-ring all-gathers of 2-byte parameters and a half-ring reduce-scatter of
    # 4-byte gradients: (2 x 2 + 4) / 2 / 4 = the all-reduce's time, once per micro-batch
    assert data_parallel_time(**kw, zero_stage=3, micro_batches=4)[1] == pytest.approx(4 * all_reduce)
    # with no computation to hide behind, all of it is exposed; with plenty, only the first layer's gathers
    assert data_parallel_time(**kw, zero_stage=3, micro_batches=4)[0] == pytest.approx(4 * all_reduce)
    hidden = data_parallel_time(**kw, zero_stage=3, micro_batches=4, forward_s=10, backward_s=20, layers=10)[0]
    assert hidden == pytest.approx(4 * 2 * all_reduce / 4 / 10)
    # stage 2 reduce-scatters every micro-batch; stage 1 once per step
    assert data_parallel_time(**kw, zero_stage=2, micro_batches=4)[1] > data_parallel_time(**kw, zero_stage=1)[1]
    # a stack that leaves part of the transfers exposed although compute could hide them (Stack.zero3_exposed)
    partly = data_parallel_time(**kw, zero_stage=3, micro_batches=4, forward_s=10, backward_s=20, layers=10,
                                zero3_exposed=0.6)
    assert partly == (pytest.approx(0.6 * 4 * all_reduce), pytest.approx(4 * all_reduce))
    assert data_parallel_time(**kw, zero_stage=3, micro_batches=4, zero3_exposed=0.6)[0] == pytest.approx(4 * all_reduce)


def test_the_pytorch_native_stack_leaves_fsdp2_transfers_exposed_that_megatron_core_hides():
    """The KempnerForge row that crosses nodes with FSDP: PyTorch's stack charges the fitted share of its ZeRO-3
    traffic, megatron-core's prefetch almost none; the traffic itself is the same."""
    row = next(r for r in published_runs() if r.label == "KempnerForge 7B TP 4 FSDP 8")
    assert (row.spec.kernels.stack, row.spec.optimizer.zero_stage, row.spec.kernels.tp_comm_overlap) == \
        ("pytorch-native", 3, False)
    native = estimate(row.spec)
    core = estimate(row.spec, stack="megatron-core")
    traffic = native.exposed_comm_s["dp"] + native.hidden_comm_s["dp"]
    assert traffic == pytest.approx(core.exposed_comm_s["dp"] + core.hidden_comm_s["dp"])
    assert native.exposed_comm_s["dp"] == pytest.approx(default_calibration().stack("pytorch-native").zero3_exposed
                                                        * traffic)
    assert core.exposed_comm_s["dp"] < 0.1 * native.exposed_comm_s["dp"]


def test_megatron_bridge_llama3_8b_fsdp_rows_fit_their_h100s():
    rows = [r for r in published_runs() if r.label.startswith("Bridge") and "Llama 3 8B" in r.label]
    assert len(rows) == 2
    for row in rows:
        assert row.spec.optimizer.zero_stage == 3
        est = estimate(row.spec)
        assert est.fits_in_memory and est.memory_gb_per_stage[0] < 70


def test_the_planner_shards_further_where_memory_needs_it_and_says_what_it_bought():
    base = load_spec({**LLAMA2_7B_ON_8_A100, "parallel": {}, "recompute": None,
                      "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/m"}})
    fixed = Constraints(tensor=1, pipeline=1, context=1, micro_batch=2, recompute=None)
    best = search(base, constraints=fixed, top=1).best
    assert (best.dp, best.zero_stage, best.oom) == (8, 3, False)  # stage 1 holds 84 GB at micro-batch 2
    assert best.spec.optimizer.distributed
    bought = sharding_bought(best)
    assert [line.split(" GB per GPU over ")[1][:7] for line in bought] == ["stage 2", "stage 1", "stage 0"]
    assert all("does not fit" in line for line in bought)
    kept = search(base, constraints=replace(fixed, zero_stage=1), top=1).best
    assert kept.zero_stage == 1 and kept.oom


def test_a_written_stage_is_a_planning_constraint():
    for written, stage in (({"distributed": True}, 1), ({"zero_stage": 2}, 2), ({}, SEARCHED)):
        data = {**LLAMA2_7B_ON_8_A100, "optimizer": written}
        assert Constraints.written(data, load_spec(data)).zero_stage == stage


def test_a_written_sharding_stage_is_planned_without_pipeline_parallelism():
    base = load_spec({**LLAMA2_7B_ON_8_A100, "parallel": {}, "recompute": None})
    rows = search(base, constraints=Constraints(zero_stage=2, tensor=1, context=1, micro_batch=1, recompute=None)).rows
    assert rows and {r.pp for r in rows} == {1} and {r.zero_stage for r in rows} == {2}


def test_the_planner_offers_stages_2_and_3_only_where_the_entrypoint_runs_them():
    data = {**LLAMA2_7B_ON_8_A100, "model": {"preset": "llama2-7b", "untie_embeddings": False}, "parallel": {},
            "recompute": None}
    fixed = Constraints(tensor=1, pipeline=1, context=1, micro_batch=2, recompute=None)
    on_driver = search(load_spec(data), constraints=fixed).rows  # FSDP2 on labkit's driver needs untied embeddings
    assert {r.zero_stage for r in on_driver} == {0, 1}
    on_megatron_lm = search(load_spec({**data, "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/m"}}),
                            constraints=fixed).rows
    assert {r.zero_stage for r in on_megatron_lm} == {0, 1, 2, 3}


def test_the_driver_refusal_names_the_one_setting_that_stops_fsdp2():
    spec = load_spec({**LLAMA2_7B_ON_8_A100, "model": {"preset": "llama2-7b", "untie_embeddings": False},
                      "optimizer": {"zero_stage": 3}})
    errors = [e for e in submission_errors(spec, "multinode") if "FSDP2" in e]
    assert len(errors) == 1 and errors[0].startswith("model.untie_embeddings: ")
    assert "untied embeddings" in errors[0] and "fp16" not in errors[0] and "Megatron-LM's pretrain_gpt.py" in errors[0]


def test_the_estimate_says_which_fsdp_it_assumed_and_that_stage_3_gathers_every_micro_batch():
    on_driver = estimate(with_optimizer(zero_stage=3))
    assert "ZeRO stage 3 as PyTorch FSDP2 (labkit's): gathered unit by unit, each transformer layer, the embedding " \
        "and the output layer (the final norm with the root)" in on_driver.assumptions
    assert any(line.startswith("the parameters are all-gathered in each of the 8 micro-batches, in its forward and "
                               "again in its backward: 16 all-gathers of 13.5 GB per step")
               for line in on_driver.assumptions)
    megatron_lm = estimate(load_spec({**LLAMA2_7B_ON_8_A100, "optimizer": {"zero_stage": 3},
                                      "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/m"}}))
    assert "ZeRO stage 3 as Megatron-FSDP (Megatron-LM's)" in megatron_lm.assumptions
    assert on_driver.memory_gb_per_stage[0] < megatron_lm.memory_gb_per_stage[0] - 3  # no billion-element unit

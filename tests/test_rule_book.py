"""One rule book (labkit.megatron.rules): a spec is accepted at submission exactly when labkit's driver accepts the
command line it renders, over a few hundred seeded random CPU specs that mix the settings whose combinations Megatron
has rules for (layout, batch, precision, optimizer and ZeRO backend, overlaps, recompute, checkpoints, experts)."""
from __future__ import annotations

import importlib.util
import random

import pytest

from labkit.deepspeed_config import ds_config_text, uses_deepspeed
from labkit.megatron import rules, sharding
from labkit.megatron.flags import ArgumentError, build_parser
from labkit.megatron_args import megatron_args
from labkit.jobs.submission import submission_errors
from labkit.spec import SpecError, load_spec
from labkit.train.arguments import finish

SPECS = 400
"""Random specs drawn (seeded): about 6 s here; 22 of the 343 that render disagreed before the rule book."""


def random_spec(rng: random.Random, save_dir: str) -> dict:
    """A CPU spec whose every value is one its field accepts alone; only combinations may break a rule."""
    tensor, pipeline, data = rng.choice([1, 1, 2]), rng.choice([1, 1, 2, 4]), rng.choice([1, 2])
    stage = rng.choice([0, 1, 2, 3])
    spec = {
        "model": {"preset": "tiny", "num_layers": rng.choice([2, 3, 4, 8]), "num_attention_heads": rng.choice([2, 4]),
                  "untie_embeddings": rng.random() < 0.5},
        "parallel": {"tensor": tensor, "pipeline": pipeline, "data": data,
                     "virtual_stages": rng.choice([1, 1, 1, 2]),
                     "sequence_parallel": rng.random() < 0.1,
                     "account_for_loss_in_pipeline_split": rng.random() < 0.1},
        "batch": {"micro": rng.choice([1, 2]), "global": rng.choice([2, 4, 6, 8, 16])},
        "precision": rng.choice(["fp32", "bf16", "fp16"]),
        "optimizer": {"name": rng.choice(["adam", "adam", "sgd"]), "zero_stage": stage,
                      "zero_backend": rng.choice(["megatron", "megatron", "deepspeed"]) if stage else "megatron",
                      "precision_aware": rng.random() < 0.05, "exp_avg_sq_dtype": rng.choice(["fp32"] * 9 + ["bf16"])},
        "kernels": {"overlap_grad_reduce": rng.random() < 0.3, "overlap_param_gather": rng.random() < 0.2},
        "recompute": rng.choice([None, {"granularity": "selective"},
                                 {"granularity": "full", "method": "uniform", "num_layers": 1}]),
        "train": {"iters": 2, "log_interval": 1},
        "data": {"mock": True},
        "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": tensor * pipeline * data}]},
    }
    if rng.random() < 0.2:
        spec["train"].update(save=save_dir, ckpt_format=rng.choice([None, "torch", "torch_dist"]))
    if rng.random() < 0.3:  # a mixture of experts, with its own grid over the same ranks
        spec["model"].update(num_experts=rng.choice([2, 4, 4, 3]), moe_router_topk=rng.choice([2, 2, 2, 1, 4]),
                             moe_token_dispatcher_type=rng.choice(["allgather", "alltoall"]),
                             moe_layer_freq=rng.choice([None, None, 2, "([0]+[1]*3)"]),
                             add_bias_linear=rng.random() < 0.2)
        spec["parallel"].update(expert=rng.choice([1, 2, 2, 4]), expert_tensor=rng.choice([None, None, 1, 2]),
                                tensor=1, sequence_parallel=False)
        spec["kernels"]["overlap_moe_expert_parallel_comm"] = rng.random() < 0.1  # Megatron-LM's only
        spec["cluster"]["nodes"][0]["gpus_per_node"] = pipeline * data
    return spec


def verdicts(data: dict, tmp_path) -> tuple[list[str], str | None]:
    """(what `labkit validate` and then `labkit run --backend local` refuse, [] when the job would be submitted;
    what labkit's driver refuses of the command line the spec renders, None when it starts, or "unrendered" for sizes
    that render no command line)."""
    try:
        spec = load_spec(data)
        refused = submission_errors(spec, "local")
    except SpecError as error:
        refused, spec = error.errors, _unchecked(data)
        if spec is None:
            return refused, "unrendered"
    config = tmp_path / "ds_config.json"
    if uses_deepspeed(spec):
        config.write_text(ds_config_text(spec))
    try:
        argv = megatron_args(spec, ds_config=config)
        finish(build_parser().parse_args(argv), world_size=spec.world_size, rank=0, cuda=False)
    except ArgumentError as error:
        return refused, str(error)
    except (ValueError, ZeroDivisionError, TypeError):
        return refused, "unrendered"
    return refused, None


def spec_verdict(data: dict) -> list[str]:
    """What `labkit validate` and then `labkit run --backend local` refuse; [] when the job would be submitted."""
    try:
        return submission_errors(load_spec(data), "local")
    except SpecError as refused:
        return refused.errors


def _unchecked(data: dict):
    """The spec as written, its checks skipped (RunSpec built from the mapping), for a spec `load_spec` refuses."""
    from labkit.spec.load import build, read_source
    from labkit.spec.schema import RunSpec

    merged, errors, _ = read_source(data)
    return None if errors else build(RunSpec, merged, "", [])


def test_the_spec_accepts_a_run_exactly_when_the_driver_does(tmp_path):
    rng = random.Random(38)
    disagreements, accepted, compared = [], 0, 0
    for i in range(SPECS):
        data = random_spec(rng, str(tmp_path / f"ckpt{i}"))
        spec, driver = verdicts(data, tmp_path)
        if driver == "unrendered":
            assert spec, data  # sizes that render nothing are refused by the spec's own checks
            continue
        compared += 1
        accepted += not spec
        if bool(spec) != (driver is not None):
            disagreements.append((data, spec, driver))
    assert not disagreements, f"{len(disagreements)} of {compared} disagree, e.g. {disagreements[:3]}"
    assert compared > SPECS // 2 and 0.1 * compared < accepted < 0.9 * compared  # both verdicts well represented


def test_each_problem_of_the_rule_book_is_reported_under_the_field_that_rendered_its_flag():
    base = {"model": {"preset": "tiny"}, "parallel": {"data": 2}, "batch": {"micro": 1, "global": 2},
            "data": {"mock": True}, "train": {"iters": 2, "log_interval": 1}}
    sgd = spec_verdict({**base, "optimizer": {"name": "sgd", "zero_stage": 1}})
    assert sgd == ["optimizer.distributed: megatron-core's distributed optimizer steps Adam only; use optimizer.name "
                   "adam, or leave it out"]
    gather = spec_verdict({**base, "optimizer": {"zero_stage": 1, "zero_backend": "deepspeed"},
                           "kernels": {"overlap_grad_reduce": True, "overlap_param_gather": True}})
    assert gather == ["kernels.overlap_param_gather: DeepSpeed's ZeRO engine (optimizer.zero_backend) gathers its own "
                      "parameters; leave it out"] + \
        (["optimizer.zero_backend: needs the deepspeed package, which this environment lacks; pip install "
          "'labkit[deepspeed]'"] if importlib.util.find_spec("deepspeed") is None else [])
    written = spec_verdict({**base, "job": {"extra_args": ["--use-distributed-optimizer", "--optimizer=sgd"]}})
    assert written and all(e.startswith("job.extra_args[") for e in written), written


@pytest.mark.parametrize("zero_stage, backend, entrypoint, implementation", [
    (0, "megatron", "labkit", sharding.DDP), (1, "megatron", "labkit", sharding.DISTRIBUTED_OPTIMIZER),
    (2, "megatron", "labkit", sharding.TORCH_FSDP2), (3, "megatron", "megatron-lm", sharding.MEGATRON_FSDP),
    (3, "deepspeed", "labkit", sharding.DEEPSPEED), (0, "deepspeed", "labkit", sharding.DEEPSPEED)])
def test_the_driver_reads_back_the_sharding_the_spec_chose(tmp_path, zero_stage, backend, entrypoint, implementation):
    """labkit.megatron.sharding decides once: the flags rendered from its choice parse back to the same choice."""
    data = {"model": {"preset": "tiny", "untie_embeddings": True}, "parallel": {"data": 2},
            "batch": {"micro": 1, "global": 2}, "data": {"mock": True}, "train": {"iters": 2, "log_interval": 1},
            "optimizer": {"zero_stage": zero_stage, "zero_backend": backend},
            "job": {"entrypoint": entrypoint, "megatron_lm": "/opt/Megatron-LM"},
            "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 2}]}}
    spec = load_spec(data)
    chosen = sharding.of_spec(spec)
    assert chosen.implementation == implementation and chosen.stage == zero_stage
    if entrypoint == "labkit" or implementation != sharding.DEEPSPEED:
        args = build_parser().parse_args(megatron_args(spec, ds_config=tmp_path / "ds_config.json"))
        assert sharding.from_args(args) == chosen


def test_a_plan_on_gpus_is_judged_as_megatron_lm_runs_it_and_a_job_as_the_driver_does():
    """tp_comm_overlap is a valid plan (Megatron-LM runs it) and refused when labkit's driver is to run it."""
    spec = load_spec({"model": {"preset": "gpt2-small"}, "precision": "bf16",
                      "parallel": {"tensor": 2, "sequence_parallel": True},
                      "kernels": {"tp_comm_overlap": True}, "batch": {"micro": 1, "global": 4},
                      "job": {"exclusive": True},
                      "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8}]}})
    assert [e for e in submission_errors(spec, "multinode") if e.startswith("kernels.tp_comm_overlap:")] == \
        [f"kernels.tp_comm_overlap: {p.message}" for p in rules.problems(
            build_parser().parse_args(megatron_args(spec)), 8, rules.Runtime(driver=True, cuda=True,
                                                                            transformer_engine=True))]

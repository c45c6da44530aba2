import copy
from pathlib import Path

import pytest
import yaml

from labkit.spec import RunSpec, SpecError, load_spec, resolved_summary

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def hetero() -> dict:
    return yaml.safe_load((EXAMPLES / "gpt2-xl-hetero.yaml").read_text())


def changed(data: dict, dotted: str, value) -> dict:
    """A copy of `data` with one dotted path ("cluster.nodes.1.gpu") set to `value`."""
    data = copy.deepcopy(data)
    node = data
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value
    return data


def errors_of(data: dict) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(data)
    return info.value.errors


def test_hetero_example_resolves():
    spec = load_spec(EXAMPLES / "gpt2-xl-hetero.yaml")
    summary = resolved_summary(spec)
    assert summary["world_size"] == 32
    assert summary["data"] == 4
    assert summary["num_micro_batches"] == 16
    assert summary["partition"] == "0-11-8-8-8-8-5-0"
    assert summary["stage_gpus"] == ["A100-40GB"] + ["A10"] * 7
    assert spec.model.hidden_size == 1600 and spec.model.num_layers == 48


def test_data_size_is_derived_from_the_cluster_when_omitted():
    data = hetero()
    del data["parallel"]["data"]
    spec = load_spec(data)
    assert spec.data_parallel == 4
    assert spec.num_micro_batches == 64 // (1 * 4)


def test_explicit_model_fields_override_the_preset():
    data = hetero()
    data["model"]["num_layers"] = 40
    data["parallel"]["partition"] = [0, 10, 8, 8, 8, 6, 0, 0]
    spec = load_spec(data)
    assert spec.model.num_layers == 40
    assert spec.model.hidden_size == 1600


def test_vendor_gpu_spellings_resolve():
    data = changed(hetero(), "cluster.nodes.0.gpu", "A100-SXM4-40GB")
    data["cluster"]["nodes"][1]["gpu"] = "a10"
    assert load_spec(data).stage_gpus[:2] == ["A100-40GB", "A10"]
    data["cluster"]["nodes"][0]["gpu"] = "H100-SXM5-80GB"
    assert load_spec(data).stage_gpus[0] == "H100-SXM"


def test_named_cluster_and_recompute_none():
    spec = load_spec(EXAMPLES / "tiny-cpu.yaml")
    assert spec.recompute is None
    assert spec.world_size == 2 and spec.data_parallel == 2


def test_round_trip_through_dict_keeps_everything():
    spec = load_spec(EXAMPLES / "gpt2-xl-hetero.yaml")
    again = load_spec(spec.to_dict())
    assert again == spec
    assert yaml.safe_load(spec.to_yaml())["batch"]["global"] == 64


def test_replace_makes_a_validated_copy():
    spec = load_spec(EXAMPLES / "tiny-cpu.yaml")
    bf16 = spec.replace(precision="bf16", **{"batch.micro": 4})
    assert (bf16.precision, bf16.batch.micro, spec.precision) == ("bf16", 4, "fp32")
    with pytest.raises(SpecError, match="batch.global"):
        spec.replace(**{"batch.micro": 3})


def test_python_built_spec_defaults_to_one_cpu_host():
    spec = load_spec(RunSpec())
    assert spec.world_size == 1 and spec.stage_gpus == ["cpu"]


# Each case: a change to the valid gpt2-xl-hetero example, and the field the error must name (plus a fragment of
# the fix).
INVALID = {
    "world size mismatch": ({"parallel.data": 2}, "parallel.data", "set parallel.data to 4"),
    "heads vs tensor": ({"parallel.tensor": 2, "parallel.data": 2}, "model.num_attention_heads", "divides 25"),
    "partition length": ({"parallel.partition": [0, 24, 24, 0]}, "parallel.partition", "pipeline is 8"),
    "partition sum": ({"parallel.partition": [0, 11, 8, 8, 8, 8, 6, 0]}, "parallel.partition", "add up to 48"),
    "negative partition": ({"parallel.partition": [-1, 12, 8, 8, 8, 8, 5, 0]}, "parallel.partition", "zero or more"),
    "global vs micro*data": ({"batch.global": 66}, "batch.global", "multiple of 4"),
    "zero micro batch": ({"batch.micro": 0}, "batch.micro", "positive"),
    "negative layers": ({"model.num_layers": -4}, "model.num_layers", "positive"),
    "zero tensor": ({"parallel.tensor": 0}, "parallel.tensor", "positive"),
    "unknown preset": ({"model.preset": "gpt2-xxl"}, "model.preset", "gpt2-xl"),
    "unknown gpu": ({"cluster.nodes.1.gpu": "A10X"}, "cluster.nodes[1].gpu", "A10"),
    "precision name": ({"precision": "fp4"}, "precision", "fp32, fp16, bf16, fp8"),
    "fp8 on an A10": ({"precision": "fp8"}, "precision", "A10 has none"),
    "seq parallel without tp": ({"parallel.sequence_parallel": True}, "parallel.sequence_parallel", "tensor > 1"),
    "virtual stages with partition": ({"parallel.virtual_stages": 2}, "parallel.virtual_stages", "partition"),
    "recompute granularity": ({"recompute": {"granularity": "partial"}}, "recompute.granularity", "selective"),
    "recompute method": ({"recompute": {"granularity": "full", "method": "zigzag", "num_layers": 1}},
                         "recompute.method", "uniform, block"),
    "recompute as bad string": ({"recompute": "sometimes"}, "recompute", "recompute: none"),
    "unknown top-level key": ({"paralel": {"tensor": 1}}, "paralel", "did you mean 'parallel'"),
    "unknown nested key": ({"batch.globl": 64}, "batch.globl", "'global'"),
    "typo in optimizer": ({"optimizer.lr_decay": "cosine"}, "optimizer.lr_decay", "lr_decay_style"),
    "wrong type": ({"train.iters": "many"}, "train.iters", "whole number"),
    "bool as text": ({"optimizer.distributed": "yes"}, "optimizer.distributed", "true or false"),
    "node count zero": ({"cluster.nodes.0.count": 0}, "cluster.nodes[0].count", "positive"),
    "link speed negative": ({"cluster.inter_node_gbps": -5}, "cluster.inter_node_gbps", "Gbit/s"),
    "unknown optimizer": ({"optimizer.name": "lion"}, "optimizer.name", "adam, sgd"),
    "unknown cluster name": ({"cluster": "a10x9"}, "cluster", "a10x8"),
    "pipeline does not divide the layers": ({"parallel.partition": None, "parallel.pipeline": 32, "parallel.data": 1},
                                            "parallel.pipeline", "set parallel.partition"),
    "job time limit": ({"job": {"time_limit": "ten minutes"}}, "job.time_limit", "H:MM:SS"),
    "job partition with a line break": ({"job": {"partition": "debug\n#SBATCH --uid=0"}}, "job.partition", "letters"),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_spec_names_the_field_and_the_fix(name):
    changes, field, fix = INVALID[name]
    data = hetero()
    for dotted, value in changes.items():
        data = changed(data, dotted, value)
    errors = errors_of(data)
    matching = [e for e in errors if e.startswith(field + ":") or e.startswith(field + " ")]
    assert matching, f"no error names {field!r}: {errors}"
    assert any(fix in e for e in matching), f"no fix {fix!r} in {matching}"


def test_bf16_on_v100_and_t4_is_refused_with_the_alternative():
    data = hetero()
    data["cluster"]["nodes"] = [{"gpu": "V100-16GB", "count": 4, "gpus_per_node": 4},
                                {"gpu": "T4", "count": 4, "gpus_per_node": 4}]
    data["precision"] = "bf16"
    errors = errors_of(data)
    assert any("V100-16GB" in e and "use fp16" in e for e in errors)
    assert any("T4" in e and "use fp16" in e for e in errors)


def test_query_groups_must_divide_heads_and_split_over_tensor():
    data = hetero()
    data["model"] = {"preset": "llama2-7b", "num_query_groups": 6}
    data["parallel"] = {"tensor": 4, "pipeline": 8, "data": 1}
    errors = errors_of(data)
    assert any(e.startswith("model.num_query_groups:") and "does not divide" in e for e in errors)
    data["model"]["num_query_groups"] = 2
    errors = errors_of(data)
    assert any(e.startswith("model.num_query_groups:") and "parallel.tensor 4" in e for e in errors)


def test_interleaving_needs_micro_batches_in_multiples_of_pipeline():
    data = {"model": {"preset": "gpt2-medium"}, "parallel": {"pipeline": 4, "virtual_stages": 2},
            "batch": {"micro": 1, "global": 6}, "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 4}]}}
    errors = errors_of(data)
    assert any(e.startswith("batch.global:") and "multiple of parallel.pipeline 4" in e for e in errors)
    data["parallel"]["virtual_stages"] = 4  # 24 layers / 4 stages = 6 per stage, not divisible by 4
    data["batch"]["global"] = 8
    errors = errors_of(data)
    assert any(e.startswith("parallel.virtual_stages:") and "does not divide the layers per stage" in e for e in errors)
    data["parallel"]["virtual_stages"] = 3
    data["batch"]["global"] = 8
    assert load_spec(data).parallel.virtual_stages == 3


def test_all_errors_are_collected_not_only_the_first():
    data = hetero()
    data["batch"]["global"] = 66
    data["parallel"]["partition"] = [0, 11, 8, 8, 8, 8, 6, 0]
    data["traing"] = {}
    data["cluster"]["nodes"][1]["gpu"] = "A1O"
    errors = errors_of(data)
    fields = {e.split(":")[0] for e in errors}
    assert {"traing", "cluster.nodes[1].gpu"} <= fields
    data.pop("traing")
    data["cluster"]["nodes"][1]["gpu"] = "A10"
    fields = {e.split(":")[0] for e in errors_of(data)}
    assert {"batch.global", "parallel.partition"} <= fields


def test_missing_spec_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(broken)


@pytest.mark.parametrize("field, value", [("hidden_size", 0), ("seq_length", 0), ("num_layers", -2),
                                          ("vocab_size", 0.0)])
def test_a_value_the_user_wrote_wins_over_the_preset_and_is_checked(field, value):
    errors = errors_of({"model": {"preset": "gpt2-xl", field: value}})
    assert any(e.startswith(f"model.{field}:") for e in errors), errors


def test_false_written_by_the_user_wins_over_the_preset():
    assert load_spec({"model": {"preset": "llama2-7b"}}).model.swiglu is True
    spec = load_spec({"model": {"preset": "llama2-7b", "swiglu": False, "untie_embeddings": False}})
    assert (spec.model.swiglu, spec.model.untie_embeddings) == (False, False)
    assert load_spec(spec) == spec and load_spec(spec.to_dict()) == spec


def test_a_python_built_model_takes_what_it_leaves_unset_from_the_preset():
    from labkit.spec import ModelSpec
    spec = load_spec(RunSpec(model=ModelSpec(preset="llama2-7b", num_layers=4)))
    assert (spec.model.num_layers, spec.model.hidden_size, spec.model.swiglu) == (4, 4096, True)
    assert load_spec(RunSpec(model=ModelSpec(preset="llama2-7b", swiglu=False))).model.swiglu is False


def test_pipeline_must_divide_the_layers_unless_a_partition_is_given():
    errors = errors_of({"model": {"preset": "gpt2-xl"}, "parallel": {"pipeline": 64}})
    assert any(e.startswith("parallel.pipeline:") and "48" in e and "parallel.partition" in e for e in errors), errors
    assert load_spec({"model": {"preset": "gpt2-xl"}, "parallel": {"pipeline": 5, "partition": [10, 10, 10, 10, 8]}})
    assert load_spec({"model": {"preset": "gpt2-xl"}, "parallel": {"pipeline": 6}}).layer_partition == [8] * 6


def test_star_import_gives_every_public_name():
    import labkit.spec
    namespace: dict = {}
    exec("from labkit.spec import *", namespace)
    assert {"RunSpec", "load_spec", "SpecError", "validate", "resolved_summary", "with_changes"} <= set(namespace)
    assert all(namespace[name] is getattr(labkit.spec, name) for name in labkit.spec.__all__)


def test_an_unknown_preset_is_one_error_not_five_missing_fields():
    with pytest.raises(SpecError) as refused:
        load_spec({"name": "x", "model": {"preset": "gpt2-smal"}})
    assert len(refused.value.errors) == 1
    assert refused.value.errors[0].startswith("model.preset: unknown preset 'gpt2-smal'; closest: gpt2-small")


# --- what a cluster admin would flag: the CPUs of a node's task, a container image that is not there ---------------
def test_a_slurm_node_group_of_several_processes_must_say_its_cpus_naming_the_field():
    from labkit.jobs.render import render
    from labkit.jobs.submission import submission_errors
    from labkit.spec import check_job

    data = changed(hetero(), "job", {})  # FASOP's nodes: 4 processes each, no cpus_per_node
    spec = load_spec(data)
    errors = submission_errors(spec, "hetjob")
    assert [e.split(":")[0] for e in errors] == ["cluster.nodes[0].cpus_per_node", "cluster.nodes[1].cpus_per_node"]
    assert "4 training processes a single CPU" in errors[0] and "job.exclusive: true" in errors[0]
    with pytest.raises(SpecError, match=r"cluster.nodes\[1\].cpus_per_node"):
        render(spec, "/runs/RUN/logs", layout="hetjob")
    assert check_job(spec) == [] and submission_errors(spec, "local") == []  # validate and a laptop run need no Slurm CPUs
    known = load_spec(changed(data, "cluster.nodes.1.cpus_per_node", 96))
    assert [e.split(":")[0] for e in submission_errors(known, "hetjob")] == ["cluster.nodes[0].cpus_per_node"]
    for job in ({"cpus_per_task": 8}, {"exclusive": True}):
        fixed = load_spec(changed(data, "job", job))
        assert submission_errors(fixed, "hetjob") == [] and submission_errors(fixed, "pair") == []
    script = render(load_spec(hetero()), "/runs/RUN/logs", layout="hetjob").scripts["job.sbatch"]
    assert script.count("#SBATCH --exclusive") == 2 and "--cpus-per-task" not in script  # every CPU of each node
    one_each = load_spec(changed(data, "cluster.nodes", [{"gpu": "A10", "count": 2, "gpus_per_node": 1}]) |
                         {"parallel": {"tensor": 1, "pipeline": 1}, "batch": {"micro": 1, "global": 2}})
    assert submission_errors(one_each, "multinode") == []  # one process per task: Slurm's one CPU is its own


def test_a_container_image_file_must_exist_here_unless_it_lives_on_the_cluster_only(tmp_path):
    from labkit.spec.files import path_notes

    base = {"model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8}}
    missing = str(tmp_path / "images" / "megatron.sqsh")
    [error] = errors_of({**base, "job": {"container": {"image": missing}}})
    assert error.startswith(f"job.container.image: '{missing}' does not exist on this machine")
    assert "job.cluster_paths" in error
    assert errors_of({**base, "job": {"container": {"image": "~/no-such-labkit-image.sqsh", "runtime": "enroot"}}})
    on_cluster = load_spec({**base, "job": {"container": {"image": missing}, "cluster_paths": [str(tmp_path)]}})
    assert any("not checked here (under job.cluster_paths): job.container.image" in n for n in path_notes(on_cluster))
    load_spec({**base, "job": {"container": {"image": "nvcr.io#nvidia/pytorch:25.04-py3"}}})  # a registry image
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "megatron.sqsh").write_bytes(b"hsqs")
    here = load_spec({**base, "job": {"container": {"image": missing}}})
    assert f"note: checked here: job.container.image {missing}" in path_notes(here)


def test_every_env_preset_variable_names_its_source_and_aws_efa_cites_the_right_ones():
    from labkit import catalog
    from labkit.jobs.render import render

    for name, preset in catalog.env_presets().items():
        assert set(preset["sources"]) == set(preset["env"]), name
    efa = catalog.env_presets()["aws-efa"]
    # AWS's Megatron-LM sbatch scripts export none of the FI_* variables: those come from AWS's EFA documentation.
    for variable in ("FI_PROVIDER", "FI_EFA_USE_HUGE_PAGE"):
        assert "aws-ofi-nccl doc/efa-env-var.md" in efa["sources"][variable]
    assert "fi_efa(7)" in efa["sources"]["FI_EFA_SET_CUDA_SYNC_MEMOPS"]
    assert all("3.test_cases/megatron" not in efa["sources"][v] for v in efa["env"] if v.startswith("FI_"))
    for variable, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")):
        assert efa["env"][variable] == value
        assert "3.test_cases/megatron/megatron-lm/slurm/llama2/pretrain-llama2.sbatch" in efa["sources"][variable]
    spec = load_spec({"model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8},
                      "job": {"env_preset": "aws-efa"}, "cluster": {"nodes": [{"gpu": "A10", "count": 2}]}})
    lines = render(spec, "/runs/RUN/logs").scripts["job.sbatch"].splitlines()
    assert {"export NCCL_NVLS_ENABLE=0", "export TORCH_NCCL_AVOID_RECORD_STREAMS=1", "export FI_PROVIDER=efa"} <= \
        set(lines)


@pytest.mark.parametrize("data, field", [
    ({"model": {"preset": "tiny", "num_layers": 4294967296}}, "model.num_layers"),
    ({"model": {"preset": "tiny", "seq_length": 1 << 30}}, "model.seq_length"),
    ({"model": {"preset": "tiny"}, "batch": {"micro": 1, "global": 10 ** 12}}, "batch.global")])
def test_sizes_beyond_any_run_are_refused_naming_the_field_and_the_bound(data, field):
    with pytest.raises(SpecError) as refused:
        load_spec(data)
    assert any(e.startswith(f"{field}: ") and "at most" in e for e in refused.value.errors), refused.value.errors


def test_the_estimate_of_a_spec_at_the_bounds_takes_well_under_five_seconds():
    import time

    from labkit.estimate import estimate
    from labkit.spec.checks import SIZE_BOUNDS

    start = time.process_time()
    for model in ({"num_layers": SIZE_BOUNDS["num_layers"]},
                  {"num_layers": 4, "vocab_size": SIZE_BOUNDS["vocab_size"]}):
        estimate(load_spec({"model": {"preset": "tiny", **model}, "parallel": {"pipeline": 2, "virtual_stages": 2},
                            "batch": {"micro": 1, "global": SIZE_BOUNDS["global_batch"]},
                            "cluster": {"nodes": [{"gpu": "H100", "count": 1, "gpus_per_node": 2}]}}))
    assert time.process_time() - start < 5

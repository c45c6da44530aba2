import json

import pytest
import yaml

from labkit.cli import main
from labkit.megatron_args import megatron_args, pipeline_layout
from labkit.spec import load_spec

ROW_KEYS = {"mbs", "tp", "dp", "pp", "placement", "partition", "estimated_s", "pipeline_s", "dp_allreduce_s",
            "embedding_allreduce_s", "price_per_step", "oom", "memory_gb_per_stage"}


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def hetero_json():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "a100-a10-hetero", "--model", "gpt2-xl", "--global-batch", "64", "--top", "5",
                     "--json"]) == 0
    return json.loads(out.getvalue())


def test_json_contract(hetero_json):
    out = hetero_json
    assert {"rows", "search_seconds", "configs_evaluated", "spec"} <= set(out)
    assert 0 < len(out["rows"]) <= 5
    assert out["configs_evaluated"] >= len(out["rows"]) and out["search_seconds"] > 0
    times = [r["estimated_s"] for r in out["rows"] if not r["oom"]]
    assert times == sorted(times)
    for row in out["rows"]:
        assert ROW_KEYS <= set(row)
        assert sum(row["partition"]) == 48 and len(row["partition"]) == row["pp"]
        assert len(row["memory_gb_per_stage"]) == row["pp"]
        assert len(row["placement"]) == 8
    spec = load_spec(out["spec"])
    best = out["rows"][0]
    assert (spec.parallel.tensor, spec.parallel.pipeline, spec.data_parallel, spec.batch.micro) == \
           (best["tp"], best["pp"], best["dp"], best["mbs"])
    assert spec.layer_partition == best["partition"]
    if spec.parallel.partition:
        assert spec.partition_string == "-".join(map(str, best["partition"]))
        flags = megatron_args(spec)
        assert flags[flags.index("--pipeline-model-parallel-layout") + 1] == pipeline_layout(best["partition"])


def test_plan_from_run_spec_and_cluster_yaml(tmp_path, capsys):
    spec_file = tmp_path / "run.yaml"
    spec_file.write_text(yaml.safe_dump({"model": {"preset": "gpt2-medium"}, "batch": {"micro": 1, "global": 32},
                                         "precision": "fp16", "cluster": "local-slurm"}))
    out = run_json(capsys, str(spec_file), "--top", "3")
    assert load_spec(out["spec"]).model.num_layers == 24
    assert sum(g["count"] * g["gpus_per_node"] for g in out["spec"]["cluster"]["nodes"]) == 16

    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump({"nodes": [{"gpu": "A10", "count": 2, "gpus_per_node": 4}]}))
    out = run_json(capsys, str(cluster_file), "--model", "gpt2-medium", "--global-batch", "16", "--objective", "cost",
                   "--top", "3")
    prices = [r["price_per_step"] for r in out["rows"] if not r["oom"]]
    assert prices == sorted(prices)


def test_text_output_shows_table_and_partition(capsys):
    assert main(["plan", "local-slurm", "--model", "gpt2-medium", "--global-batch", "32", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "s/step" in out and "DP all-reduce s" in out
    assert 'PARTITION="' in out and "--pipeline-model-parallel-size" in out


def test_bad_input_names_the_problem(capsys):
    assert main(["plan", "a100-a10-hetro", "--model", "gpt2-xl", "--global-batch", "64"]) == 2
    err = capsys.readouterr().err
    assert "a100-a10-hetro" in err and "a100-a10-hetero" in err
    assert main(["plan", "a100-a10-hetero", "--global-batch", "64"]) == 2
    assert "--model" in capsys.readouterr().err

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


@pytest.mark.parametrize("cluster_file", ["nodes: [{gpu: A10, count: 2, gpus: 4}]\n", "nodes: 7\n",
                                          "nodes: [{gpu: A10, count: two, gpus_per_node: 4}]\n", "nodes: [[1, 2]]\n"])
def test_a_malformed_cluster_file_is_refused_naming_the_field(tmp_path, capsys, cluster_file):
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_file)
    assert main(["plan", str(path), "--model", "gpt2-medium", "--global-batch", "32"]) == 2
    assert "labkit plan: cluster" in capsys.readouterr().err


def plan_json(*argv) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


def test_prices_given_on_the_command_line_and_in_the_spec_set_the_cost(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes: [{gpu: A10, count: 2, gpus_per_node: 4, price_per_gpu_hour: 0.5}]\n")
    rows = plan_json(str(path), "--model", "gpt2-medium", "--global-batch", "32", "--top", "1")["rows"]
    assert rows[0]["price_per_step"] == pytest.approx(8 * 0.5 / 3600 * rows[0]["estimated_s"])
    rows = plan_json(str(path), "--model", "gpt2-medium", "--global-batch", "32", "--top", "1",
                     "--price", "A10=2")["rows"]
    assert rows[0]["price_per_step"] == pytest.approx(8 * 2 / 3600 * rows[0]["estimated_s"])
    assert main(["plan", str(path), "--model", "gpt2-medium", "--global-batch", "32", "--price", "A10=cheap"]) == 2
    assert "--price: 'A10=cheap'" in capsys.readouterr().err


def test_a_budget_no_layout_meets_exits_3_naming_it_and_the_closest_row(capsys):
    argv = ["plan", "local-slurm", "--model", "gpt2-medium", "--global-batch", "32", "--top", "3"]
    assert main([*argv, "--objective", "cost", "--max-step-s", "0.0001"]) == 3
    err = capsys.readouterr().err
    assert "cannot keep --max-step-s 0.0001" in err and "closest: tp" in err
    assert main([*argv, "--max-price-per-step", "0", "--json"]) == 3
    assert "--max-price-per-step 0" in json.loads(capsys.readouterr().out)["unmet"]


def test_a_missed_budget_says_why_first_names_the_closest_layout_in_full_and_writes_no_spec(tmp_path, capsys):
    """Llama 3 8B on two H100 nodes: the closest layout has context parallelism, which the reason names with every
    other layout field; the reason is stderr's first line, the output is the table alone, and -o writes nothing."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "llama3-8b"}, "batch": {"global": 128}, "precision": "bf16",
                                    "parallel": {"context": 2}, "job": MEGATRON_LM,
                                    "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]}}))
    chosen = tmp_path / "chosen.yaml"
    for budget in (["--max-step-s", "0.5"], ["--max-price-per-step", "0.0001"]):
        assert main(["plan", str(spec), "--top", "3", "-o", str(chosen), *budget]) == 3
        out, err = capsys.readouterr()
        first, second = err.splitlines()[:2]
        assert first.startswith(f"labkit plan: cannot keep {budget[0]} {budget[1]}: no fitting layout is that")
        assert " cp2 " in first and all(f in first for f in (" pp", " vp", " dp", "micro ", "sequence parallel",
                                                             "optimizer", "recompute", "on H100-SXMx2"))
        assert second == f"labkit plan: {chosen} not written: no layout keeps that"
        assert not chosen.exists()
        assert "s/step" in out and "megatron:" not in out and "model:" not in out  # the table, no spec
        assert len(out.splitlines()) < 10
    assert main(["plan", str(spec), "--top", "3", "-o", str(chosen), "--max-step-s", "1000"]) == 0
    assert load_spec(chosen).parallel.context == 2


MEGATRON_LM = {"entrypoint": "megatron-lm", "megatron_lm": "/opt/megatron-lm"}
"""A production job: FP8, context parallelism and tensor-parallel overlap run in Megatron-LM, not the CPU driver."""
H100 = {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]}


def test_fp8_is_planned_on_the_clusters_gpus_not_the_default_cpu(tmp_path, capsys):
    """A run spec with precision fp8, and --precision fp8 over a cluster file: both planned on the H100s (the spec
    was once checked against a CPU stand-in and refused)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "llama3-8b"}, "batch": {"global": 128}, "precision": "fp8",
                                    "job": MEGATRON_LM, "cluster": H100}))
    out = run_json(capsys, str(spec), "--top", "5")
    assert out["rows"] and out["spec"]["precision"] == "fp8" and not out["rows"][0]["oom"]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(H100))
    out = run_json(capsys, str(cluster), "--model", "gpt-7.5b", "--precision", "fp8", "--global-batch", "64",
                   "--top", "3")
    assert out["spec"]["precision"] == "fp8"
    bf16 = run_json(capsys, str(cluster), "--model", "gpt-7.5b", "--precision", "bf16", "--global-batch", "64",
                    "--top", "3")
    assert out["rows"][0]["estimated_s"] < bf16["rows"][0]["estimated_s"]  # FP8 GEMMs on the H100s


def test_fp8_on_a_cluster_with_a_gpu_without_it_is_refused_naming_the_gpu(tmp_path, capsys):
    """Every layout uses every GPU, and Megatron runs FP8 on every rank: an H100 + A100 cluster cannot run it."""
    mixed = {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8},
                       {"gpu": "A100-80GB", "count": 1, "gpus_per_node": 8}]}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "llama2-7b"}, "batch": {"global": 64}, "precision": "fp8",
                                    "cluster": mixed}))
    assert main(["plan", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "precision: fp8 needs FP8 tensor cores" in err and "A100-80GB" in err and "H100" not in err
    spec.write_text(yaml.safe_dump({"model": {"preset": "llama2-7b"}, "batch": {"global": 64}, "precision": "bf16",
                                    "job": MEGATRON_LM, "cluster": mixed}))
    assert run_json(capsys, str(spec), "--top", "1")["rows"]


def test_kernels_a_spec_writes_are_planned_with_what_they_need(tmp_path, capsys):
    """Flash attention and the overlaps are checked on the H100s; overlap_param_gather keeps the distributed optimizer
    the planner would otherwise search; tp_comm_overlap is on where the layout has sequence parallelism."""
    kernels = {"attention_backend": "flash", "overlap_grad_reduce": True, "overlap_param_gather": True,
               "tp_comm_overlap": True}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "gpt-7.5b"}, "batch": {"global": 64}, "precision": "fp8",
                                    "kernels": kernels, "job": MEGATRON_LM, "cluster": H100}))
    out = run_json(capsys, str(spec), "--top", "30")
    assert out["rows"] and all(r["distributed_optimizer"] for r in out["rows"])
    assert {r["tp"] for r in out["rows"]} > {1}
    assert out["spec"]["kernels"] == {**kernels, "stack": None, "overlap_moe_expert_parallel_comm": False,
                                      "cuda_graph_impl": "none", "cuda_graph_scope": None,
                                      "tp_comm_overlap": out["spec"]["parallel"]["sequence_parallel"]}
    spec.write_text(yaml.safe_dump({"model": {"preset": "gpt-7.5b"}, "batch": {"global": 64},
                                    "kernels": {"overlap_param_gather": True}, "optimizer": {"distributed": False},
                                    "cluster": H100}))
    assert main(["plan", str(spec)]) == 2
    assert "kernels.overlap_param_gather" in capsys.readouterr().err
    for key, value in (("attention_backend", "flash"), ("tp_comm_overlap", True)):  # on the CPU laptop
        spec.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "batch": {"global": 8}, "precision": "fp32",
                                        "kernels": {key: value}, "cluster": "laptop"}))
        assert main(["plan", str(spec)]) == 2
        assert f"kernels.{key}: needs Transformer Engine on GPUs" in capsys.readouterr().err


def test_nothing_fitting_in_memory_exits_3_with_the_row_closest_to_fitting(capsys):
    assert main(["plan", "laptop", "--model", "llama2-70b", "--global-batch", "8", "--top", "2"]) == 3
    err = capsys.readouterr().err
    assert "cannot keep memory: no layout fits; closest:" in err and "of its GPUs' memory" in err


def test_the_clusters_own_link_rate_is_kept(tmp_path):
    slow, fast = tmp_path / "slow.yaml", tmp_path / "fast.yaml"
    slow.write_text("nodes: [{gpu: A10, count: 4, gpus_per_node: 4}]\ninter_node_gbps: 1\n")
    fast.write_text("nodes: [{gpu: A10, count: 4, gpus_per_node: 4}]\ninter_node_gbps: 400\n")
    argv = ["--model", "gpt2-medium", "--global-batch", "64", "--top", "1"]
    slow_plan, fast_plan = plan_json(str(slow), *argv), plan_json(str(fast), *argv)
    assert slow_plan["spec"]["cluster"]["inter_node_gbps"] == 1
    assert slow_plan["rows"][0]["estimated_s"] > fast_plan["rows"][0]["estimated_s"]


def test_what_the_spec_writes_is_kept_and_what_it_leaves_out_is_searched(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "kept", "model": {"preset": "gpt-7.5b"}, "batch": {"global": 64},
        "parallel": {"tensor": 2}, "recompute": None, "optimizer": {"distributed": True},
        "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 2, "gpus_per_node": 8}], "inter_node_gbps": 40}}))
    out = run_json(capsys, str(spec), "--top", "20")
    assert out["rows"] and {(r["tp"], r["recompute"], r["distributed_optimizer"]) for r in out["rows"]} == \
        {(2, False, True)}
    assert len({(r["pp"], r["dp"], r["mbs"]) for r in out["rows"]}) > 1  # the rest was searched
    assert all(r["sequence_parallel"] for r in out["rows"])  # searched: on wherever tensor parallelism is
    assert out["spec"]["cluster"]["inter_node_gbps"] == 40


def test_a_spec_without_a_layout_is_not_refused_for_the_layout_it_does_not_have(tmp_path, capsys):
    # 1536 is not a multiple of the 1024 GPUs: as tensor 1 pipeline 1 it would be refused, most layouts take it
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "gpt-145.6b"}, "batch": {"global": 1536},
                                    "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 128, "gpus_per_node": 8}]}}))
    out = run_json(capsys, str(spec), "--top", "1", "--orders", "grouped")
    assert out["rows"][0]["dp"] * out["rows"][0]["tp"] * out["rows"][0]["pp"] == 1024


def test_a_layout_that_needs_memory_saving_gets_the_cheapest_that_fits(tmp_path, capsys):
    # With unfused attention the s x s scores dominate activations: on tp2 dp2 without a pipeline, at 4096 tokens,
    # the model does not fit without recompute; selective recompute drops the scores, and is cheaper than full
    # recompute (with flash attention there is nothing for it to drop).
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "gpt-7.5b", "seq_length": 4096}, "batch": {"global": 16},
                                    "parallel": {"tensor": 2, "pipeline": 1},
                                    "kernels": {"attention_backend": "unfused"}, "cluster": "workshop-a100x2"}))
    out = run_json(capsys, str(spec), "--top", "3")
    assert out["rows"][0]["recompute_granularity"] == "selective" and not out["rows"][0]["oom"]
    for row in out["rows"]:
        assert row["idle_gpus"] == sum(1 for n in row["partition"] if n == 0) * row["tp"] * row["dp"]


def test_explain_compares_the_top_row_with_the_runner_up_and_each_other_family(capsys):
    out = run_json(capsys, "a100-a10-hetero", "--model", "gpt2-xl", "--global-batch", "64", "--top", "3",
                   "--explain")
    rows = {r["row"]: r for r in out["explain"]}
    assert {"top", "runner-up", "best, no pipeline", "best, no data parallelism"} <= set(rows)
    assert rows["top"]["compute vs top"] == 0 and rows["best, no pipeline"]["family"] == "data"
    assert rows["best, no pipeline"]["s/step"] >= rows["top"]["s/step"]
    assert rows["best, no pipeline"]["bubble vs top"] < 0  # no pipeline, no bubble: it loses elsewhere
    assert main(["plan", "a100-a10-hetero", "--model", "gpt2-xl", "--global-batch", "64", "--explain"]) == 0
    assert "best, no pipeline: tp1 pp1 dp32" in capsys.readouterr().out


def test_context_parallelism_is_searched_for_long_sequences_on_gpus_and_kept_where_written(tmp_path, capsys):
    """Llama 3 8B's 8K-token sequences on two H100 nodes: the planner tries context-parallel sizes 1, 2 and 4 (4 leaves
    2K tokens per rank); a spec that writes parallel.context keeps it; 2K-token GPT-2 XL never tries it."""
    spec = {"model": {"preset": "llama3-8b"}, "batch": {"global": 128}, "precision": "bf16",
            "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    rows = run_json(capsys, str(path), "--top", "200")["rows"]
    assert {r["cp"] for r in rows} == {1, 2, 4}
    assert all(r["tp"] * r["cp"] * r["pp"] * r["dp"] == 16 for r in rows)
    path.write_text(yaml.safe_dump({**spec, "parallel": {"context": 2}}))
    assert {r["cp"] for r in run_json(capsys, str(path), "--top", "50")["rows"]} == {2}
    short = run_json(capsys, "a100-a10-hetero", "--model", "gpt2-xl", "--global-batch", "64", "--top", "50")
    assert {r["cp"] for r in short["rows"]} == {1}


def test_a_written_sequence_parallel_or_context_is_kept_and_checked_on_the_clusters_gpus(tmp_path, capsys):
    spec = {"model": {"preset": "llama3-8b"}, "batch": {"global": 128}, "precision": "bf16",
            "parallel": {"sequence_parallel": True},
            "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    rows = run_json(capsys, str(path), "--top", "20")["rows"]
    assert rows and all(r["sequence_parallel"] and r["tp"] > 1 for r in rows)
    path.write_text(yaml.safe_dump({**spec, "parallel": {"context": 3}}))
    assert main(["plan", str(path)]) == 2
    assert "parallel.context: model.seq_length 8192 must be a multiple of 2 x 3" in capsys.readouterr().err
    on_cpu = {**spec, "model": {"preset": "tiny"}, "batch": {"global": 8}, "precision": "fp32",
              "cluster": "laptop"}
    path.write_text(yaml.safe_dump(on_cpu))
    assert main(["plan", str(path)]) == 2
    assert "parallel.sequence_parallel: needs Transformer Engine on GPUs" in capsys.readouterr().err

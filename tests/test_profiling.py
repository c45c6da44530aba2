"""Profiling readers against real files from tiny runs of the training driver on CPU: a data-parallel run on 2
processes (a trace per rank, TensorBoard scalars with timers and memory), tensor- and pipeline-parallel runs on 2
processes, and one-process runs with and without full activation recomputation. The runs start together once per
module."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from labkit.net import free_port
from labkit.profiling import tensorboard as tb
from labkit.profiling import trace as tr

pytestmark = pytest.mark.slow

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 0.00015 --log-interval 1 --seed 1234 --eval-iters 0 "
        "--mock-data --vocab-size 1023").split()
PROFILE = "--profile --profile-step-start 1 --profile-step-end 3".split()  # iterations 2 and 3
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()


def _start(run_dir, processes: int, *flags: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
           f"--master-port={free_port()}", "-m", "labkit.train", *TINY, *PROFILE,
           "--tensorboard-dir", str(run_dir / "tensorboard"), *flags]
    log = open(run_dir / "train.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("profiled")
    started = {
        "dp2": _start(root / "dp2", 2, "--train-iters", "4", "--profile-ranks", "0", "1",
                      "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--timing-log-level", "2"),
        "tp2": _start(root / "tp2", 2, "--train-iters", "3", "--profile-ranks", "0",
                      "--tensor-model-parallel-size", "2"),
        "pp2": _start(root / "pp2", 2, "--train-iters", "3", "--profile-ranks", "0",
                      "--pipeline-model-parallel-size", "2"),
        "plain": _start(root / "plain", 1, "--train-iters", "3"),
        "recompute": _start(root / "recompute", 1, "--train-iters", "3", *RECOMPUTE),
    }
    for name, proc in started.items():
        proc.wait(timeout=300)
        assert proc.returncode == 0, (root / name / "train.log").read_text()[-3000:]
    return {name: root / name for name in started}


@pytest.fixture(scope="module")
def dp2(runs):
    return tr.load_traces(runs["dp2"])


@pytest.fixture(scope="module")
def plain_and_recompute(runs):
    return {name: tr.load_traces(runs[name])[0] for name in ("plain", "recompute")}


def _log_value(log: str, pattern: str) -> float:
    return float(re.findall(pattern, log)[-1])


# ---------------------------------------------------------------------------------------------- traces, dp2

def test_a_trace_per_profiled_rank_with_the_profiled_steps(dp2):
    assert [t.rank for t in dp2] == [0, 1]
    for t in dp2:
        assert (t.world_size, t.backend, t.device) == (2, "gloo", "cpu")
        steps = tr.steps(t)
        assert len(steps) == 2
        assert (steps["duration_ms"] > 0).all()


def test_dp2_all_reduces_the_gradients_in_the_data_parallel_group(runs, dp2):
    parameters = int(re.search(r"number of parameters on .*: (\d+)", (runs["dp2"] / "train.log").read_text()).group(1))
    for t in dp2:
        comm = tr.communication(t)
        all_reduce = comm[comm["collective"] == "all_reduce"].set_index("group")
        assert "dp" in all_reduce.index and all_reduce.loc["dp", "time_ms"] > 0
        # the gradient buffer, every parameter once, is all-reduced once per profiled step
        calls = tr.communication_calls(t)
        gradients = calls[(calls["elements"] == parameters) & (calls["collective"] == "all_reduce")]
        assert gradients["group"].tolist() == ["dp", "dp"]


def test_tp2_all_reduces_activations_in_the_tensor_group(runs):
    (t,) = tr.load_traces(runs["tp2"])
    calls = tr.communication_calls(t, tensor=2)
    # activations: seq x micro-batch x hidden
    activations = calls[calls["operator"].eq("c10d::allreduce_") & calls["elements"].eq(64 * 2 * 64)]
    assert len(activations) > 0 and set(activations["group"]) == {"tp"}
    parameters = int(re.search(r"number of parameters on .*: (\d+)", (runs["tp2"] / "train.log").read_text()).group(1))
    assert set(calls.loc[calls["elements"] == parameters, "group"]) == {"dp"}  # gradients: a data-parallel group of 1
    groups = tr.communication_by_group(t, tensor=2).set_index("group")
    assert groups.loc["tp", "time_ms"] > groups.loc["dp", "time_ms"]


def test_pp2_sends_activations_between_stages(runs):
    (t,) = tr.load_traces(runs["pp2"])
    comm = tr.communication(t, pipeline=2).set_index(["collective", "group"])
    sends = comm.loc[("send_recv", "pp")]
    assert sends["calls"] > 0 and sends["time_ms"] > 0
    assert sends["elements"] == sends["calls"] * 64 * 2 * 64
    assert comm.loc[("all_reduce", "embedding"), "calls"] == 2  # tied embedding gradients, once per step


def test_compute_communication_split_adds_up_per_rank(dp2):
    split = tr.compute_communication(dp2)
    assert split["rank"].tolist() == [0, 1] and split["steps"].tolist() == [2, 2]
    parts = split[["computation_ms", "overlapping_ms", "communication_ms", "other_ms"]]
    assert parts.sum(axis=1).to_numpy() == pytest.approx(split["span_ms"].to_numpy())
    assert (parts >= 0).all().all()
    assert (split["computation_ms"] > 0).all() and (split["communication_ms"] > 0).all()
    groups = tr.communication_by_group(dp2)
    assert "dp" in set(groups["group"]) and (groups["share"] < 1).all()


def test_operators_and_category_shares(dp2):
    t = dp2[0]
    ops = tr.operators(t).set_index("operator")
    assert ops.loc["aten::mm", "category"] == "matmul"
    assert ops.loc["aten::gelu", "category"] == "elementwise"
    assert ops.loc["aten::native_layer_norm", "category"] == "normalization"
    assert ops.loc["c10d::allreduce_", "category"] == "communication"
    assert (ops["self_ms"] <= ops["total_ms"] + 1e-9).all()
    parts = tr.breakdown(t).set_index("category")
    assert parts["share"].sum() == pytest.approx(1.0)
    # Shares depend on the machine's load; what holds anywhere: every category's time is its operators' self time.
    assert parts.loc["matmul", "share"] > 0 and parts.loc["communication", "share"] > 0
    assert parts.loc["matmul", "time_ms"] >= ops.loc["aten::mm", "self_ms"] - 1e-6
    assert tr.kernels(t).empty and tr.tensor_core_share(t) is None


def test_memory_curve_covers_the_profiled_steps(dp2):
    t = dp2[0]
    curve = tr.memory_curve(t)
    assert set(tr.steps(t)["step"]) <= set(curve["step"])
    per_step = tr.memory_per_step(t)
    assert len(per_step) == 2 and (per_step["growth_mb"] > 0).all()


def test_summary_cli_json(runs, capsys):
    from labkit.cli import main

    assert main(["profiling", "summary", str(runs["dp2"]), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["world_size"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert all(len(r["profiled_steps"]) == 2 for r in summary["ranks"])
    assert summary["ranks"][1]["communication_ms_by_group"]["dp"] > 0
    assert summary["tensorboard_command"] == f"tensorboard --logdir {runs['dp2']}"
    assert main(["profiling", "summary", summary["ranks"][1]["path"]]) == 0
    out = capsys.readouterr().out
    assert "rank 1 (cpu, gloo): 2 profiled steps" in out and "communication by group (ms): dp" in out


# ---------------------------------------------------------------------------------------------- recompute

def test_recompute_saves_fewer_activations_and_runs_the_forward_again(plain_and_recompute):
    memory = {name: tr.memory_per_step(t) for name, t in plain_and_recompute.items()}
    # only each recomputed layer's input is kept for backward, not every activation inside it
    assert memory["recompute"]["saved_mb"].max() < 0.5 * memory["plain"]["saved_mb"].max()
    assert memory["recompute"]["growth_mb"].max() < 0.8 * memory["plain"]["growth_mb"].max()
    ops = {name: tr.operators(t).set_index("operator") for name, t in plain_and_recompute.items()}
    assert "CheckpointFunctionBackward" in ops["recompute"].index
    assert "CheckpointFunctionBackward" not in ops["plain"].index
    assert ops["recompute"].loc["aten::mm", "calls"] > ops["plain"].loc["aten::mm", "calls"]


def test_memory_timelines_read_by_category(runs):
    # torch's memory profiler fails on some op mixes (the driver then warns and writes none); read those written
    timelines = [f for name in runs for f in tr.find_memory_timelines(runs[name])]
    if not timelines:
        pytest.skip("torch.profiler built no memory timeline in these runs")
    for path in timelines:
        timeline = tr.memory_timeline(path)
        assert timeline["parameter_mb"].max() > 0 and timeline["activation_mb"].max() > 0
        assert (timeline["total_mb"] >= timeline["activation_mb"]).all()


# ---------------------------------------------------------------------------------------------- tensorboard

def test_tensorboard_scalars_match_the_log(runs):
    scalars = tb.read_scalars(runs["dp2"])
    tags = set(scalars["tag"])
    assert {"lm loss", "learning-rate", "iteration-time", "grad-norm", "loss-scale"} <= tags
    assert "forward-backward-time" in tags and "mem-allocated-bytes" in tags  # timers and memory flags
    table = tb.scalar_table(scalars, ["lm loss", "grad-norm"])
    assert table.index.tolist() == [1, 2, 3, 4]
    log = (runs["dp2"] / "train.log").read_text()
    assert table.loc[4, "lm loss"] == pytest.approx(_log_value(log, r"lm loss: ([\d.E+-]+)"), rel=1e-5)
    assert table.loc[4, "grad-norm"] == pytest.approx(_log_value(log, r"grad norm: ([\d.]+)"), abs=1e-3)
    with pytest.raises(KeyError, match="no scalar tag"):
        tb.scalar_table(scalars, ["throughput-not-logged"])


# ---------------------------------------------------------------------------------------------- views

def test_views_compare_runs_and_ranks(runs, dp2, plain_and_recompute):
    from labkit.profiling import views

    table = views.comparison_table(plain_and_recompute).set_index("run")
    assert table.loc["recompute", "peak_growth_mb"] < table.loc["plain", "peak_growth_mb"]
    assert table.loc["recompute", "saved_mb"] < table.loc["plain", "saved_mb"]
    assert table["profiled_steps"].tolist() == [2, 2]

    fig = views.comparison_figure(plain_and_recompute)
    bars = [d for d in fig.data if d.type == "bar"]
    assert {d.name for d in bars} == set(tr.CATEGORIES)
    assert [d.name for d in fig.data if d.type == "scatter"] == ["plain", "recompute"]
    matmul = next(d for d in bars if d.name == "matmul")
    assert list(matmul.x) == ["plain", "recompute"] and all(0 < y < 1 for y in matmul.y)

    split = views.compute_communication_figure(dp2)
    assert [d.name for d in split.data] == ["computation", "overlapping", "communication", "other"]
    assert list(split.data[0].y) == ["rank 0", "rank 1"]
    assert "dp" in {d.name for d in views.communication_group_figure(dp2).data}
    assert sum(len(d.y) for d in views.operator_figure(dp2[0], top=5).data) == 5
    assert len(views.memory_figure(plain_and_recompute).data) == 2
    with pytest.raises(ValueError, match="no GPU kernels"):
        views.kernel_figure(dp2[0])
    scalars = views.scalars_figure(tb.read_scalars(runs["dp2"]), ["lm loss", "iteration-time"])
    assert len(scalars.data) == 2 and all(len(d.x) == 4 for d in scalars.data)
    timelines = tr.find_memory_timelines(runs["recompute"])
    if timelines:
        assert [d.name for d in views.memory_timeline_figure(timelines[0]).data] == list(tr.MEMORY_TIMELINE_CATEGORIES)


def test_a_scalar_spanning_orders_of_magnitude_gets_a_log_axis_of_its_own():
    import pandas as pd

    from labkit.profiling import views

    rows = [{"run": run, "tag": tag, "step": step, "value": value}
            for run in ("fp16", "bf16") for step in range(10)
            for tag, value in (("loss-scale", 2.0 ** (32 - 2 * step)), ("lm loss", 7 - 0.1 * step))]
    fig = views.scalars_figure(pd.DataFrame(rows), ["lm loss", "loss-scale"])
    axis_type = {trace.hovertemplate.split("tag=")[1].split("<br>")[0]: fig.layout["yaxis" + trace.yaxis[1:]].type
                 for trace in fig.data}
    assert axis_type == {"loss-scale": "log", "lm loss": None}
    assert fig.layout.height >= 300 * 2

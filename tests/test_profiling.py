"""Profiling readers against real files: a 2-process gloo run (trace per rank, TensorBoard scalars) and a one-process
run with and without activation checkpointing, all made here with torch.profiler and SummaryWriter on tiny models."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pandas as pd
import pytest
import torch

from labkit.profiling import tensorboard as tb
from labkit.profiling import trace as tr

PROFILED_STEPS = [2, 3, 4]  # schedule(wait=1, warmup=1, active=3) over steps 0..5

_RUN = r'''
import os, sys, time
import torch, torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter

run_dir, recompute, timeline = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
if world > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
hidden, seq, layers = 64, 32, 4

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.qkv, self.proj = torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)
    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

blocks = torch.nn.ModuleList(Block() for _ in range(layers))
optimizer = torch.optim.SGD(blocks.parameters(), lr=0.01)
writer = SummaryWriter(os.path.join(run_dir, "tensorboard")) if rank == 0 else None

def on_trace_ready(prof):
    os.makedirs(os.path.join(run_dir, "profile"), exist_ok=True)
    prof.export_chrome_trace(os.path.join(run_dir, "profile", f"rank{rank}.pt.trace.json"))
    if timeline:
        prof.export_memory_timeline(os.path.join(run_dir, "profile", f"rank{rank}.memory_timeline.json"), device="cpu")

with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3), record_shapes=True,
             profile_memory=True, with_stack=timeline, on_trace_ready=on_trace_ready) as prof:
    for step in range(6):
        start = time.perf_counter()
        x = torch.randn(16, seq, hidden)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        loss = x.pow(2).mean()
        loss.backward()
        if world > 1:
            for p in blocks.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        prof.step()
        if writer:
            writer.add_scalar("lm loss", loss.item(), step + 1)
            writer.add_scalar("learning-rate", 0.01, step + 1)
            writer.add_scalar("iteration-time", time.perf_counter() - start, step + 1)
if writer:
    writer.close()
if world > 1:
    dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(run_dir, processes: int, recompute: bool = False, timeline: bool = False):
    script = run_dir / "run.py"
    run_dir.mkdir(parents=True, exist_ok=True)
    script.write_text(_RUN)
    args = [str(script), str(run_dir), "1" if recompute else "0", "1" if timeline else "0"]
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
               f"--master-port={_free_port()}", *args]
    else:
        cmd = [sys.executable, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("dp2"), processes=2)


@pytest.fixture(scope="module")
def recompute_pair(tmp_path_factory):
    return {on: _run(tmp_path_factory.mktemp(f"recompute{int(on)}"), processes=1, recompute=on, timeline=True)
            for on in (False, True)}


# ---------------------------------------------------------------------------------------------- traces, dp2

def test_one_trace_per_rank_with_the_profiled_steps(dp2):
    traces = tr.load_traces(dp2)
    assert [t.rank for t in traces] == [0, 1]
    assert all(t.world_size == 2 and t.backend == "gloo" and t.device == "cpu" for t in traces)
    for t in traces:
        assert tr.steps(t)["step"].tolist() == PROFILED_STEPS
        assert (tr.steps(t)["duration_ms"] > 0).all()


def test_dp2_shows_all_reduce_in_the_data_parallel_group(dp2):
    traces = tr.load_traces(dp2)
    comm = tr.communication(traces)
    assert set(comm["collective"]) == {"all_reduce"}
    assert set(comm["group"]) == {"dp"}
    per_rank = comm.set_index("rank")
    # every parameter's gradient (4 blocks x 5 modules x weight and bias) is all-reduced once per profiled step
    assert per_rank.loc[0, "calls"] == per_rank.loc[1, "calls"] == len(PROFILED_STEPS) * 4 * 10
    assert per_rank.loc[0, "elements"] == len(PROFILED_STEPS) * 4 * (
        (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64) + 2 * 64)
    assert (per_rank["time_ms"] > 0).all()


def test_compute_communication_split_adds_up_per_rank(dp2):
    split = tr.compute_communication(tr.load_traces(dp2))
    assert split["rank"].tolist() == [0, 1]
    parts = split[["computation_ms", "overlapping_ms", "communication_ms", "other_ms"]].sum(axis=1)
    assert parts.to_numpy() == pytest.approx(split["span_ms"].to_numpy())
    assert (split["computation_ms"] > 0).all() and (split["communication_ms"] > 0).all()
    assert (split[["computation_ms", "overlapping_ms", "communication_ms", "other_ms"]] >= 0).all().all()


def test_one_process_run_has_no_communication(recompute_pair):
    t = tr.load_traces(recompute_pair[False])[0]
    assert t.world_size == 1 and tr.communication(t).empty
    assert tr.compute_communication(t)["communication_ms"].item() == 0


def test_operator_table_and_category_shares(dp2):
    t = tr.load_traces(dp2)[0]
    ops = tr.operators(t).set_index("operator")
    assert ops.loc["aten::addmm", "category"] == "matmul"
    assert ops.loc["aten::gelu", "category"] == "elementwise"
    assert ops.loc["aten::native_layer_norm", "category"] == "normalization"
    assert ops.loc["c10d::allreduce_", "category"] == "communication"
    # 4 blocks x 4 linears per step in the forward pass
    assert ops.loc["aten::linear", "calls"] == 16 * len(PROFILED_STEPS)
    assert (ops["self_ms"] <= ops["total_ms"] + 1e-9).all()
    parts = tr.breakdown(t).set_index("category")
    assert parts["share"].sum() == pytest.approx(1.0)
    assert parts.loc["matmul", "share"] > 0.05 and parts.loc["attention", "share"] > 0
    assert parts.loc["communication", "share"] > 0
    assert tr.kernels(t).empty and tr.tensor_core_share(t) is None


def test_memory_curve_covers_the_profiled_steps(dp2):
    t = tr.load_traces(dp2)[0]
    curve = tr.memory_curve(t)
    assert set(PROFILED_STEPS) <= set(curve["step"])
    assert curve["allocated_mb"].max() > 0
    per_step = tr.memory_per_step(t)
    assert per_step["step"].tolist() == PROFILED_STEPS
    assert (per_step["growth_mb"] > 0).all()


def test_summary_is_json_ready(dp2):
    s = tr.summary(tr.load_traces(dp2))
    text = json.dumps(s)
    assert s["world_size"] == 2 and len(s["ranks"]) == 2
    assert s["ranks"][0]["profiled_steps"] == PROFILED_STEPS
    assert s["ranks"][1]["communication_ms_by_group"]["dp"] > 0
    assert "aten::" in text


# ---------------------------------------------------------------------------------------------- recompute

def test_recompute_lowers_the_memory_peak_and_saved_activations(recompute_pair):
    plain, ckpt = (tr.load_traces(recompute_pair[on])[0] for on in (False, True))
    assert tr.memory_per_step(ckpt)["growth_mb"].max() < 0.7 * tr.memory_per_step(plain)["growth_mb"].max()
    # the categorised timeline: activations saved for backward shrink
    act = {on: tr.memory_timeline(tr.find_memory_timelines(recompute_pair[on])[0])["activation_mb"].max()
           for on in (False, True)}
    assert 0 < act[True] < 0.7 * act[False]
    # and the forward runs again in backward: more matmul calls
    calls = {on: tr.operators(t).set_index("operator").loc["aten::linear", "calls"] for on, t in ((0, plain), (1, ckpt))}
    assert calls[1] == 2 * calls[0]


def test_memory_timeline_categories_follow_torch():
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    names = [("unknown" if c is None else c.name.lower()) for c in sorted(_CATEGORY_TO_INDEX, key=_CATEGORY_TO_INDEX.get)]
    assert tuple(names) == tr.MEMORY_TIMELINE_CATEGORIES


# ---------------------------------------------------------------------------------------------- tensorboard

def test_tensorboard_scalars_read_back(dp2):
    scalars = tb.read_scalars(dp2)
    assert set(scalars["run"]) == {"tensorboard"}
    assert {"lm loss", "learning-rate", "iteration-time"} <= set(scalars["tag"])
    table = tb.scalar_table(scalars, ["lm loss", "learning-rate"])
    assert table.index.tolist() == [1, 2, 3, 4, 5, 6]
    assert table["learning-rate"].tolist() == pytest.approx([0.01] * 6)
    assert (table["lm loss"] > 0).all()
    with pytest.raises(KeyError, match="no scalar tag"):
        tb.scalar_table(scalars, ["grad-norm"])


def test_tensorboard_command_and_missing_files(tmp_path):
    assert tb.tensorboard_command("runs/my run") == "tensorboard --logdir 'runs/my run'"
    assert tb.tensorboard_command("runs/a", port=6007, bind_all=True) == "tensorboard --logdir runs/a --port 6007 --bind_all"
    with pytest.raises(FileNotFoundError, match="--tensorboard-dir"):
        tb.read_scalars(tmp_path)
    with pytest.raises(FileNotFoundError, match="--profile"):
        tr.load_traces(tmp_path)

"""Distributed checkpoints (--ckpt-format torch_dist, train.ckpt_format): megatron-core's dist_checkpointing on CPU
through labkit's compatibility layer, and a run that resumes under another tensor/pipeline layout."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit.megatron.flags import FLAG, ArgumentError, build_parser
from labkit.megatron_args import megatron_args
from labkit.net import free_port
from labkit.spec.schema import load_spec
from labkit.spec.checks import SpecError
from labkit.train import cpu_compat
from labkit.train.arguments import _fused_adam_importable, finish

ITERATION = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")


def _spec(name: str, tensor: int, pipeline: int, train: dict, **extra):
    return load_spec({"name": name, "model": {"preset": "tiny", "hidden_dropout": 0.0, "attention_dropout": 0.0},
                      "parallel": {"tensor": tensor, "pipeline": pipeline}, "batch": {"micro": 2, "global": 8},
                      "data": {"mock": True}, "train": {"iters": 4, "log_interval": 1, **train},
                      "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}, **extra})


# ---------------------------------------------------------------------------------------------------------------------
# The spec key and the driver's flag

def test_the_spec_renders_the_format_beside_save_and_load_for_both_entrypoints(tmp_path):
    flag = str(FLAG.ckpt_format)
    for entrypoint in ("labkit", "megatron-lm"):
        job = {"job": {"entrypoint": entrypoint, "megatron_lm": str(tmp_path)}} if entrypoint != "labkit" else {}
        args = megatron_args(_spec("f", 2, 1, {"save": str(tmp_path), "ckpt_format": "torch_dist"}, **job))
        assert args[args.index(flag) + 1] == "torch_dist" and args.count(flag) == 1
        # left out, each entrypoint keeps its own default (the driver torch, Megatron-LM torch_dist)
        assert flag not in megatron_args(_spec("f", 2, 1, {"save": str(tmp_path)}, **job))
    assert flag not in megatron_args(_spec("f", 2, 1, {"ckpt_format": "torch_dist"}))  # nothing to save or load


def test_an_unknown_format_or_one_megatron_fsdp_cannot_save_is_refused_naming_the_field(tmp_path):
    with pytest.raises(SpecError, match=r"- train.ckpt_format: 'torch_dcp' is not torch or torch_dist"):
        _spec("f", 2, 1, {"ckpt_format": "torch_dcp"})
    with pytest.raises(SpecError, match=r"- train.ckpt_format: ZeRO stage 3 runs as Megatron-FSDP, which saves only "
                                        "fsdp_dtensor"):
        _spec("f", 1, 1, {"ckpt_format": "torch_dist", "save": str(tmp_path)},
              optimizer={"distributed": True, "zero_stage": 3},
              job={"entrypoint": "megatron-lm", "megatron_lm": str(tmp_path)})
    with pytest.raises(SpecError, match=r"- train.ckpt_format: torch_dist with the distributed optimizer needs "
                                        "Transformer Engine's or Apex's FusedAdam, absent where this run goes \(CPU"):
        _spec("f", 1, 1, {"ckpt_format": "torch_dist", "save": str(tmp_path)}, optimizer={"distributed": True})


@pytest.mark.parametrize("fmt", ["torch_dcp", "fsdp_dtensor"])
def test_the_driver_refuses_the_formats_it_does_not_write(fmt):
    args = build_parser().parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                      "--seq-length", "64", "--mock-data", "--vocab-size", "1023", "--train-iters",
                                      "2", "--lr", "1e-3", "--ckpt-format", fmt])
    with pytest.raises(ArgumentError, match=f"^--ckpt-format: labkit's driver writes .* not {fmt}"):
        finish(args, world_size=1, rank=0, cuda=False)


@pytest.mark.skipif(_fused_adam_importable(), reason="megatron-core reloads FusedAdam's resharded state")
def test_the_driver_refuses_torch_dist_with_the_distributed_optimizer_on_torch_adam():
    args = build_parser().parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                      "--seq-length", "64", "--mock-data", "--vocab-size", "1023", "--train-iters",
                                      "2", "--lr", "1e-3", "--ckpt-format", "torch_dist",
                                      "--use-distributed-optimizer"])
    with pytest.raises(ArgumentError, match="^--ckpt-format: torch_dist with the distributed optimizer needs "
                                            "Transformer Engine's or Apex's FusedAdam"):
        finish(args, world_size=1, rank=0, cuda=False)


# ---------------------------------------------------------------------------------------------------------------------
# The compatibility layer's patches for dist_checkpointing

@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is for machines without CUDA")
def test_the_checkpoint_writer_and_its_save_flags_need_the_layer_on_cpu_and_run_with_it():
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver

    bucket = [("file", "key", ([], [("item", torch.ones(3))]))]
    cpu_compat.remove()
    # CPU torch: "not compiled with CUDA"; CUDA torch on a machine without a GPU: "no NVIDIA driver"
    with pytest.raises((AssertionError, RuntimeError), match="not compiled with CUDA|no NVIDIA driver"):
        filesystem_async.FileSystemWriterAsync.preload_tensors(bucket, non_blocking=True)
    assert cpu_compat.apply()
    try:
        (_, _, (_, [(_, copied)])), = filesystem_async.FileSystemWriterAsync.preload_tensors(bucket,
                                                                                              non_blocking=True)
        assert torch.equal(copied, torch.ones(3))
        # the flags the save all-reduces and broadcasts (verify_global_md_reuse, save_state_dict_async_finalize)
        saver_torch = state_dict_saver.torch
        assert saver_torch.tensor([1], dtype=torch.int, device="cuda").device.type == "cpu"
        assert saver_torch.tensor([1], device=saver_torch.cuda.current_device()).device.type == "cpu"
    finally:
        cpu_compat.remove()


# ---------------------------------------------------------------------------------------------------------------------
# Save at tensor 2 / pipeline 1, resume at tensor 1 / pipeline 2

# Both runs in the same two processes, one after the other: a start-up (imports, rendezvous) costs more than the runs
# on a loaded 2-core machine. The second run builds its process groups, model and optimizer anew and reads only the
# checkpoint; the gloo process group is kept because torchrun's rendezvous store cannot be joined twice.
TWO_RUNS = """
import sys

if __name__ == "__main__":  # megatron-core's checkpoint writer starts helper processes that import this file
    from megatron.core import parallel_state

    from labkit.train import cpu_compat, training
    from labkit.train.arguments import parse_args

    cpu_compat.apply()
    at = sys.argv.index("--then")
    code = training.run(parse_args(sys.argv[1:at]))
    parallel_state.destroy_model_parallel()
    sys.exit(code or training.run(parse_args(sys.argv[at + 1:])))
"""


def _train_then_resume(tmp_path: Path, first: list, second: list) -> tuple[str, str]:
    script = tmp_path / "two_runs.py"
    script.write_text(TWO_RUNS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(script), *map(str, first), "--then", *map(str, second)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    at = log.index("resumes a checkpoint written at")
    return log[:at], log[at:]


def _losses(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in ITERATION.finditer(log)}


@pytest.mark.slow
def test_a_checkpoint_saved_at_tensor_2_resumes_at_pipeline_2_and_the_loss_continues(tmp_path):
    ckpt = tmp_path / "checkpoints"
    started = time.monotonic()
    full, resumed = _train_then_resume(
        tmp_path,
        megatron_args(_spec("tp2", 2, 1, {"save": str(ckpt), "save_interval": 2, "ckpt_format": "torch_dist"})),
        [*megatron_args(_spec("pp2", 1, 2, {"load": str(ckpt), "ckpt_format": "torch_dist"})),
         str(FLAG.ckpt_step), "2"])
    took = time.monotonic() - started
    assert (ckpt / "iter_0000002" / "metadata.json").is_file() and (ckpt / "iter_0000002" / "common.pt").is_file()
    assert "(tensor, pipeline) = (1, 2) resumes a checkpoint written at (2, 1)" in full + resumed
    assert f"successfully loaded checkpoint from {ckpt} [ t 1/1, p 1/2 ] at iteration 2" in resumed
    before, after = _losses(full), _losses(resumed)
    assert sorted(before) == [1, 2, 3, 4] and sorted(after) == [3, 4]
    for i in (3, 4):
        # The same weights, Adam moments, learning rate and batches; only the order of the fp32 sums differs between
        # the layouts (tensor-parallel partial products all-reduced vs. whole matmuls), so the losses agree to float
        # rounding rather than bit for bit.
        assert after[i] == pytest.approx(before[i], rel=1e-5), (i, before, after)
    print(f"\ntorch_dist tp2/pp1 -> tp1/pp2: continuous {before}, resumed {after}; {took:.0f} s")

"""Checkpoints under requeue: torch_dist resumes under another layout on Megatron-LM too, and `labkit validate`
warns when a checkpoint cannot be written between Slurm's warning signal and the time limit."""
import subprocess
import sys

import yaml

from labkit.estimate.checkpoint import checkpoint_bytes, requeue_notes, write_seconds
from labkit.megatron_args import megatron_args
from labkit.spec import load_spec

H100 = {"nodes": [{"gpu": "H100", "count": 2, "gpus_per_node": 8, "cpus_per_node": 96}]}


def requeued(preset, signal_s=120):
    return {"model": {"preset": preset}, "cluster": H100, "precision": "bf16",
            "parallel": {"tensor": 8, "pipeline": 2, "sequence_parallel": True},
            "optimizer": {"distributed": True}, "train": {"save": "/ckpt"},
            "job": {"requeue": True, "requeue_signal_s": signal_s, "time_limit": "4:00:00"}}


def test_a_checkpoint_is_the_weights_and_the_fp32_optimizer_state():
    spec = load_spec(requeued("llama2-70b"))
    assert checkpoint_bytes(spec) == 14 * 68_976_648_192
    assert write_seconds(spec) == checkpoint_bytes(spec) / 2e9  # two nodes at the assumed 1 GB/s each


def test_validate_warns_when_the_signal_leaves_too_little_time(tmp_path):
    assert requeue_notes(load_spec(requeued("llama2-7b"))) == []
    notes = requeue_notes(load_spec(requeued("llama2-70b")))
    assert len(notes) == 1 and notes[0].startswith("warning: job.requeue_signal_s 120 s may not leave time to save")
    assert requeue_notes(load_spec(requeued("llama2-70b", signal_s=900))) == []
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(requeued("llama2-70b")))
    out = subprocess.run([sys.executable, "-m", "labkit", "validate", str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and "warning: job.requeue_signal_s 120 s" in out.stderr


def test_megatron_lm_saves_the_distributed_optimizer_reshardable_under_torch_dist():
    data = {**requeued("llama2-7b"), "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/megatron-lm"}}
    assert "--dist-ckpt-optim-fully-reshardable" in megatron_args(load_spec(data))
    data["train"] = {"save": "/ckpt", "ckpt_format": "torch"}
    assert "--dist-ckpt-optim-fully-reshardable" not in megatron_args(load_spec(data))
    driver = {**requeued("llama2-7b"), "job": {}}
    assert "--dist-ckpt-optim-fully-reshardable" not in megatron_args(load_spec(driver))  # it always does

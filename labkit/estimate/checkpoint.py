"""How long a checkpoint takes to write, against the time a requeued job has to write it.

A checkpoint holds the weights and, for training to resume, the optimizer's state: with Adam in 16-bit training the
fp32 master weights and two fp32 moments (12 bytes per parameter) besides the 16-bit weights (2), 12 bytes in all in
fp32 training (4 + 8); SGD keeps one fp32 momentum instead of two moments. Every rank writes its shard at once, so the
time is the checkpoint's bytes over the nodes' aggregate write bandwidth to the shared filesystem.

WRITE_GB_S_PER_NODE is a stated assumption, not a measurement: about what one client node reaches on the parallel
filesystems clusters mount for checkpoints (Lustre, FSx for Lustre, GPFS), which a fast one exceeds and an NFS home
falls far below. Pass the figure measured on your cluster (e.g. `dd` of a few GB to the checkpoint directory).
"""
from __future__ import annotations

from labkit.estimate.params import total_params
from labkit.megatron.shape import Shape
from labkit.spec import RunSpec

WRITE_GB_S_PER_NODE = 1.0
"""Assumed write bandwidth of one node to the checkpoint directory, GB/s (10^9 bytes)."""


def checkpoint_bytes(spec: RunSpec) -> float:
    """Bytes of one checkpoint of this run: weights in the training precision plus the optimizer's fp32 state."""
    params = total_params(Shape.of(spec.model))
    weight = 4 if spec.precision == "fp32" else 2
    master = 0 if spec.precision == "fp32" else 4
    moments = 8 if spec.optimizer.name == "adam" else 4
    return params * (weight + master + moments)


def write_seconds(spec: RunSpec, write_gb_s_per_node: float = WRITE_GB_S_PER_NODE) -> float:
    """Seconds to write one checkpoint, every node writing its ranks' shards at `write_gb_s_per_node`."""
    nodes = sum(group.count for group in spec.cluster_or_default().nodes)
    return checkpoint_bytes(spec) / (nodes * write_gb_s_per_node * 1e9)


def requeue_notes(spec: RunSpec, write_gb_s_per_node: float = WRITE_GB_S_PER_NODE) -> list[str]:
    """What `labkit validate` warns of a requeued job: a checkpoint that cannot be written between Slurm's warning
    signal and the time limit, at the stated write bandwidth. Notes, not errors: the bandwidth is an assumption."""
    job = spec.job
    if not job.requeue or not spec.train.save:
        return []
    seconds = write_seconds(spec, write_gb_s_per_node)
    if seconds < job.requeue_signal_s:
        return []
    return [f"warning: job.requeue_signal_s {job.requeue_signal_s} s may not leave time to save: one checkpoint is "
            f"about {checkpoint_bytes(spec) / 1e9:,.0f} GB, {seconds:,.0f} s to write at an assumed "
            f"{write_gb_s_per_node:g} GB/s per node; raise job.requeue_signal_s above that (plus one iteration), "
            "or measure your filesystem's write speed"]

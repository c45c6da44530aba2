"""Estimators: parameters, FLOPs, MFU, memory and iteration time of a run, before it is submitted.

    from labkit.estimate import estimate
    est = estimate(spec)                 # spec: labkit.spec.RunSpec
    est.iteration_time_s, est.breakdown, est.memory_gb_per_stage, est.fits_in_memory, est.to_dict()

`estimate(spec, profiles=None, tokens=None, overlap_dp=False, stack=None, grad_reduce_bytes=None, calibration=None)`
-> `Estimate`. Per-layer compute comes from a measured profile for the stage's (GPU, tensor size) when one exists
(labkit/data/profiles/, or `profiles=` a mapping {(gpu, tensor): Profile} or a callable), otherwise from
FLOPs / (peak x efficiency), plus the stack's memory-bound passes. `stack` names the training software
("megatron-core", the default; "megatron-bridge", NVIDIA's tuned 2025-26 recipes, which ran faster; or
"deepspeed-megatron-2020", fitted to AMP's trials); links run at their NCCL bus
bandwidth. Every fitted constant (efficiency per GPU, bus fractions, latency, stacks) is in a `Calibration`:
`default_calibration()` reads labkit/data/calibration.yaml, which says what each was fitted to; pass another as
`calibration=` (built with dataclasses.replace or its `with_*` methods) to see what a constant does.

Pieces to call in a hot loop without building a RunSpec (all times in seconds, links in Gbit/s per direction):
- `Shape(num_layers, hidden, heads, seq_length, vocab, ...)` or `Shape.of(spec.model)`: the model sizes.
- `stage_time(profile_or_gpu, layers, micro_batch, tensor, shape=..., precision=..., first=, last=, recompute=,
  first_layer=, tp_gbps=, stack=, calibration=)` -> StageTime(forward_s, backward_s, tp_comm_s, total_s): one
  micro-batch on one stage.
- `pipeline_time(stage_times, boundary_times, num_micro_batches, virtual_stages=1, messages=1, wrap_time=0)` ->
  PipelineTime(total_s, busy_s, bubble_s, pp_comm_s, bottleneck_stage): 1F1B, or interleaved 1F1B when
  virtual_stages > 1, over heterogeneous stages, played out by `schedule_1f1b` (the one pipeline schedule: every
  forward and backward as an `Event(stage, chunk, micro_batch, op, start_s, end_s)`; `bubble_fraction(events)`);
  `pipeline_lower_bound`: a cheap bound below it. `Pipeline(stage_times_s, boundary_times_s, num_micro_batches, ...)`
  holds those inputs; `Estimate.pipeline` is the one an estimate was timed with (`.time()`, `.events()`), which
  labkit.diagrams and the planner's schedule view draw.
- `allreduce_time(nbytes, n, gbps, latency_s)`, `p2p_time(nbytes, gbps, latency_s)`: ring all-reduce and one
  pipeline send.
- `memory_per_stage(shape, partition, tensor=, data_parallel=, micro_batch=, num_micro_batches=, precision=,
  recompute=, sequence_parallel=, virtual_stages=, distributed_optimizer=, zero_stage=, context=,
  grad_reduce_in_bf16=, chunks=, expert=, expert_tensor=)` -> [StageMemory] in GiB; `model_state_bytes(shape, chunks,
  stage=, ...)` -> ModelState(weights, gradients, optimizer): one GPU's bytes exactly as megatron-core allocates them
  (an MoE model's experts sharded over `expert` ranks, their optimizer state over the expert-data-parallel ranks).
- `stage_time(..., expert=, expert_tensor=, expert_links=, dispatcher=)`: an MoE model's token dispatch is its
  StageTime.ep_comm_s (labkit.estimate.timing.expert_dispatch_time; Topology.expert_links gives the links).
- `stage_params(shape, partition, tensor)`, `total_params(shape)` (vocabulary unpadded), `params_with_padding(shape,
  tensor)`, `rank_params(spec, tensor_rank, pipeline_rank)` (the count Megatron logs for that rank),
  `gpt_params(l, h, s, V)`.
- `model_flops(shape, B)`, `hardware_flops(shape, B, recompute)`, `megatron_logged_flops(shape, B, version)`,
  `flops_96`, `flops_72`, `achieved_tflops`, `utilization`, `training_days(tokens, params, n, tflops)`.
- Profiles: `Profile` (with `MicroBatchTimes` at further micro-batch sizes), `load_profile(path)` (labkit JSON or
  FASOP .npy), `save_profile(profile, path=None)`, `find_profile(model, gpu, tensor)`, `available_profiles()`.
"""
from labkit.estimate.calibration import Calibration, Stack, default_calibration
from labkit.estimate.estimator import MEMORY_MARGIN, Estimate, estimate
from labkit.estimate.flops import achieved_tflops, flops_72, flops_96, hardware_flops, training_days, utilization
from labkit.estimate.memory import ModelState, StageMemory, bytes_per_param, memory_per_stage, model_state_bytes
from labkit.estimate.params import (gpt_params, layer_params, params_with_padding, rank_params, stage_params,
                                    total_params)
from labkit.estimate.profiles import (MicroBatchTimes, Profile, ProfileError, available_profiles, find_profile,
                                      load_profile, save_profile)
from labkit.megatron.flops import megatron_logged_flops, model_flops
from labkit.megatron.shape import Shape
from labkit.estimate.timing import (Event, Pipeline, PipelineTime, StageTime, allreduce_time, bubble_fraction,
                                    optimizer_step_time, p2p_time, pipeline_lower_bound, pipeline_time, schedule_1f1b,
                                    stage_time)

__all__ = [
    "estimate", "Estimate", "MEMORY_MARGIN",
    "Shape", "gpt_params", "layer_params", "stage_params", "total_params", "params_with_padding", "rank_params",
    "model_flops", "hardware_flops", "megatron_logged_flops", "flops_96", "flops_72", "achieved_tflops",
    "utilization", "training_days",
    "memory_per_stage", "bytes_per_param", "StageMemory", "model_state_bytes", "ModelState",
    "stage_time", "pipeline_time", "pipeline_lower_bound", "schedule_1f1b", "bubble_fraction", "allreduce_time",
    "p2p_time", "optimizer_step_time", "StageTime", "Pipeline", "PipelineTime", "Event",
    "Calibration", "Stack", "default_calibration",
    "Profile", "MicroBatchTimes", "ProfileError", "load_profile", "save_profile", "find_profile", "available_profiles",
]

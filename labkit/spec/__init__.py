"""The run spec: one description of a training run, from which Megatron flags, job scripts and estimates are made.

    schema   the dataclasses (a docstring per field, naming its Megatron-LM flag), load_spec, resolved_summary
    load     YAML/JSON/mapping -> plain data with the model preset merged under it -> the dataclasses
    yaml12   YAML read by the 1.2 core schema (text stays the text written), with bounded nesting and aliases
    checks   every rule on the spec, spec.job's fields included
    errors   SpecError and how a problem is worded
    files    the files a spec names: which are read here, which are left to the job on the cluster
    layout   Megatron's rank order, stage -> ranks -> GPUs, and the GPU a mixed stage runs at

Load it from YAML/JSON (`load_spec`) or build it in Python (`RunSpec(...)`, then `load_spec` or `validate`). Checking
collects every problem before anything runs; each message starts with the field it is about and says how to fix it.
"""
from labkit.spec.checks import SpecError, check_job, validate
from labkit.spec.load import with_changes
from labkit.spec.schema import (BatchSpec, ClusterSpec, ContainerSpec, DataSpec, JobSpec, KernelsSpec, ModelSpec,
                                NodeGroup, OptimizerSpec, ParallelSpec, RecomputeSpec, RunSpec, TokenizerSpec, TrainSpec,
                                WandbSpec, load_spec, resolved_summary)

__all__ = ["RunSpec", "ModelSpec", "ParallelSpec", "BatchSpec", "RecomputeSpec", "OptimizerSpec", "TrainSpec",
           "WandbSpec", "DataSpec", "TokenizerSpec", "KernelsSpec", "NodeGroup", "ClusterSpec", "JobSpec", "ContainerSpec", "SpecError",
           "load_spec", "validate", "check_job", "resolved_summary", "with_changes"]

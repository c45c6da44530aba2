"""Which implementation shards a run's model state over its data-parallel ranks, decided once.

A spec says what it wants sharded (optimizer.zero_stage, ZeRO's stages: Rajbhandari et al., arXiv:1910.02054) and by
whose code (optimizer.zero_backend); which program runs it (job.entrypoint) decides the rest:

| stage | zero_backend | labkit's driver                               | Megatron-LM's pretrain_gpt.py          |
|-------|--------------|-----------------------------------------------|----------------------------------------|
| 0     | megatron     | DDP (megatron-core's DistributedDataParallel) | DDP                                    |
| 1     | megatron     | megatron-core's distributed optimizer         | the distributed optimizer              |
| 2, 3  | megatron     | PyTorch FSDP2 through megatron-core           | Megatron-FSDP                          |
| 0-3   | deepspeed    | DeepSpeed's ZeRO engine                       | refused (Megatron-DeepSpeed is a fork) |

labkit's driver runs stages 2 and 3 as FSDP2 because Megatron-FSDP issues its reduce-scatters and all-gathers on CUDA
streams (megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py), which the driver does not set up on CPUs.

The flags (labkit.megatron_args), the job's environment (labkit.jobs.render), the checks (labkit.megatron.rules and
labkit.spec.checks), the estimate (labkit.estimate) and the driver (`from_args`) all read this module's answer.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.megatron.flags import SHARDING_STRATEGIES

DDP, DISTRIBUTED_OPTIMIZER, TORCH_FSDP2, MEGATRON_FSDP, DEEPSPEED = (
    "ddp", "distributed_optimizer", "torch_fsdp2", "megatron_fsdp", "deepspeed")
IMPLEMENTATIONS = (DDP, DISTRIBUTED_OPTIMIZER, TORCH_FSDP2, MEGATRON_FSDP, DEEPSPEED)
"""Every implementation, in the order of the table above."""
DESCRIPTIONS = {DDP: "megatron-core's DDP", DISTRIBUTED_OPTIMIZER: "megatron-core's distributed optimizer",
                TORCH_FSDP2: "PyTorch FSDP2", MEGATRON_FSDP: "Megatron-FSDP", DEEPSPEED: "DeepSpeed's ZeRO engine"}
"""Each implementation as messages name it."""
STAGES = (0, 1, 2, 3)
"""ZeRO's stages: 0 nothing sharded, 1 optimizer states, 2 and gradients, 3 and parameters."""
BACKENDS = ("megatron", "deepspeed")
"""optimizer.zero_backend values: megatron-core (the distributed optimizer, FSDP2, Megatron-FSDP) or DeepSpeed."""
MEGATRON_LM = "megatron-lm"
"""job.entrypoint of Megatron-LM's pretrain_gpt.py (labkit's driver is every other)."""


@dataclass(frozen=True)
class Sharding:
    """What shards a run's model state, and how far."""
    stage: int
    """The ZeRO stage that runs: 0 nothing sharded, 1 optimizer states, 2 and gradients, 3 and parameters."""
    implementation: str
    """Whose code shards: one of IMPLEMENTATIONS."""

    @property
    def fsdp(self) -> bool:
        """Parameters gathered layer by layer (FSDP2 or Megatron-FSDP), where megatron-core's DDP is replaced."""
        return self.implementation in (TORCH_FSDP2, MEGATRON_FSDP)

    @property
    def megatron_gathers(self) -> bool:
        """megatron-core all-gathers the sharded parameters itself (the distributed optimizer after each step,
        Megatron-FSDP layer by layer): what --overlap-param-gather and --fp8-param-gather act on, and why Megatron-LM
        runs Megatron-FSDP beside --use-distributed-optimizer."""
        return self.implementation in (DISTRIBUTED_OPTIMIZER, MEGATRON_FSDP)

    @property
    def megatron_core(self) -> bool:
        """megatron-core's own buffers (DDP and the distributed optimizer), whose bytes it counts exactly."""
        return self.implementation in (DDP, DISTRIBUTED_OPTIMIZER)


def choose(zero_stage: int, zero_backend: str = "megatron", entrypoint: str = "labkit") -> Sharding:
    """The implementation that runs `zero_stage` with `zero_backend` under `entrypoint` (the table above). A
    combination the table refuses (DeepSpeed under Megatron-LM) gets the implementation it would need; the checks
    refuse it, naming optimizer.zero_backend."""
    if zero_backend == "deepspeed":
        return Sharding(zero_stage, DEEPSPEED)
    if zero_stage == 0:
        return Sharding(0, DDP)
    if zero_stage == 1:
        return Sharding(1, DISTRIBUTED_OPTIMIZER)
    return Sharding(zero_stage, MEGATRON_FSDP if entrypoint == MEGATRON_LM else TORCH_FSDP2)


def of_spec(spec) -> Sharding:
    """`choose` for a run spec (its optimizer and job sections; nothing of the spec's code runs)."""
    return choose(spec.optimizer.zero_stage, spec.optimizer.zero_backend, spec.job.entrypoint)


def from_args(args) -> Sharding:
    """The implementation a parsed Megatron command line asks for (labkit.megatron.flags' names), as the driver
    builds it: --deepspeed with --zero-stage, --use-torch-fsdp2 (stage 2 with --torch-fsdp2-no-reshard-after-forward),
    --use-megatron-fsdp with --data-parallel-sharding-strategy, --use-distributed-optimizer."""
    if args.deepspeed:
        return Sharding(args.zero_stage or 0, DEEPSPEED)
    if args.use_torch_fsdp2:
        return Sharding(3 if args.torch_fsdp2_reshard_after_forward else 2, TORCH_FSDP2)
    if args.use_megatron_fsdp:
        return Sharding(SHARDING_STRATEGIES.index(args.data_parallel_sharding_strategy), MEGATRON_FSDP)
    if args.use_distributed_optimizer:
        return Sharding(1, DISTRIBUTED_OPTIMIZER)
    return Sharding(0, DDP)


FP8_PARAMETER_PRECISIONS = ("fp8", "mxfp8")
"""Precisions whose linear layers' weights Megatron-LM can keep in FP8 (--fp8-param-gather needs --fp8-format:
megatron-core's TransformerConfig refuses fp8_param without fp8)."""


def fp8_param_gather(spec) -> bool:
    """Whether a run keeps its linear layers' weights in FP8 (Megatron-LM's --fp8-param-gather): the spec's
    optimizer.fp8_param_gather where it writes one; else wherever Megatron-LM core_v0.16.1 runs it, precision fp8 or
    mxfp8 with the distributed optimizer or Megatron-FSDP (validate_args; under PyTorch FSDP2 it turns the flag off
    with Transformer Engine 2) and without the precision-aware optimizer (whose FusedAdam would take the FP8 weights
    for the bf16 ones it keeps the master's low bits beside), as NVIDIA's recipes set it: Megatron-Bridge's
    bf16_with_fp8_delayed_scaling_mixed, bf16_with_fp8_current_scaling_mixed and bf16_with_mxfp8_mixed
    (src/megatron/bridge/training/mixed_precision.py, github NVIDIA-NeMo/Megatron-Bridge), which its Llama and Qwen
    performance recipes take unchanged."""
    if spec.optimizer.fp8_param_gather is not None:
        return spec.optimizer.fp8_param_gather
    return spec.precision in FP8_PARAMETER_PRECISIONS and not spec.optimizer.precision_aware and \
        of_spec(spec).megatron_gathers

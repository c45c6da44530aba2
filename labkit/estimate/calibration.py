"""The estimator's fitted and assumed constants, as one immutable value.

    from labkit.estimate import default_calibration, estimate
    cal = default_calibration()                       # read from labkit/data/calibration.yaml, with its sources
    slower = cal.with_efficiency("A100-40GB", 0.35)   # a new Calibration; `cal` is unchanged
    estimate(spec, calibration=slower)

A fit builds Calibration objects (`dataclasses.replace`, `with_efficiency`, `with_stack`) and estimates with each:
nothing in labkit is patched, so two calibrations can be compared side by side.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from labkit import catalog

# Intra-node links up to PCIe Gen5 x16 (504 Gbit/s) are PCIe; faster ones are NVLink-class. A classification of link
# rates, not a fitted figure.
PCIE_MAX_GBPS = 512

OVERLAPS = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap")
"""The kernels fields that overlap communication with computation, which a stack's `overlaps` name."""


@dataclass(frozen=True)
class Stack:
    """What the training software adds on top of the hardware (see labkit.estimate.timing).

    name: the stack's key in Calibration.stacks ("megatron-core", ...).
    memory_passes: analytic compute, passes over a layer's activation bytes at memory bandwidth, forward + backward.
    tp_allreduce_s: fixed cost of each tensor-parallel all-reduce, beyond the ring's bytes and latency.
    p2p_message_s: fixed cost of each pipeline send or receive.
    p2p_messages: blocking transfers per neighbour per micro-batch on the pipeline's critical path (k in timing).
    overlap_p2p: whether the interleaved schedule overlaps its sends and receives with compute on GPUs (megatron-core's
        overlap_p2p_comm; see labkit.estimate.timing).
    compute_scale: analytic compute (a layer's GEMMs and memory passes, the loss's) takes this multiple of what the
        calibration's efficiencies give: the same GPU runs one software generation's kernels faster than another's.
    moe_launch_s_per_local_expert: on a GPU, seconds an MoE layer adds per micro-batch (forward and backward) for
        each expert its rank holds, beyond its FLOPs and transfers: the layer waits on the host for its tokens per
        expert and then runs as fast as the host launches its many small kernels (see labkit.estimate.timing).
    fsdp_master_shards: how the stack runs PyTorch FSDP2 (ZeRO stages 2 and 3 on labkit's driver): True as PyTorch's
        own trainers do (torchtitan: fp32 parameters, MixedPrecisionPolicy with bf16 parameters and fp32
        reduction), the fp32 shards are the master weights, gathered in bf16, and a plain optimizer steps them;
        False as megatron-core's FSDP2 wrapper does, bf16 shards beside Megatron's optimizer's fp32 main copies
        (see labkit.estimate.memory.torch_fsdp2_model_state_bytes).
    zero3_exposed: under ZeRO stage 3, the fraction of each micro-batch's parameter all-gathers and gradient
        reduce-scatters that stays exposed although the computation could cover them (the collectives' kernels take
        SMs and memory bandwidth from the layers', and each unit's gather waits on the one before); 0 for a stack
        whose prefetch hides them completely (see labkit.estimate.timing.data_parallel_time). Stage 3 only: stage 2
        keeps the parameters gathered, and its per-micro-batch reduce-scatters are charged as megatron-core's.
    overlaps: the kernels overlaps (OVERLAPS) the stack runs on GPUs, which a plan assumes where its input does not
        say (labkit.plan.inputs.stack_overlaps).
    description: what the stack is and why its figures are what they are.
    """
    name: str
    memory_passes: float
    tp_allreduce_s: float
    p2p_message_s: float
    p2p_messages: int
    overlap_p2p: bool
    compute_scale: float = 1.0
    moe_launch_s_per_local_expert: float = 0.0
    zero3_exposed: float = 0.0
    fsdp_master_shards: bool = False
    overlaps: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class Calibration:
    """Every constant the estimator fitted or assumed (labkit/data/calibration.yaml says where each comes from).

    efficiency: GPU catalog name -> fraction of dense peak a transformer layer's matrix multiplies reach.
    intra_node_gbps: GPU catalog name -> fitted intra-node link rate (Gbit/s), in place of the catalog's.
    nvlink_bus_fraction, pcie_bus_fraction, network_bus_fraction: NCCL bus bandwidth / link rate, by link class.
    link_latency_s: least cost of one ring step or one p2p message.
    tp_overlap_exposed: with kernels.tp_comm_overlap, the fraction of the tensor-parallel transfers that stays exposed
    although the GEMMs could cover them (Transformer Engine's userbuffers split each GEMM into chunks; the first
    chunk's transfer, the last one's, and the SMs the transfers take are not hidden).
    fp8_efficiency: GPU catalog name -> fraction of the FP8 peak the linear layers' FP8 GEMMs reach (with their
    casts and scaling); `efficiency` where a GPU has none.
    mxfp8_share: MXFP8's linear layers run at this share of FP8's fp8_efficiency on the same GPU: the same FP8
    peak, with a scale per 32 elements to compute and every tensor quantized in two block layouts.
    attention_head_dim_half: attention kernel ("unfused", "flash") -> the head dimension d_half at which attention's
    core (QK^T and attention x V, whose inner or outer size is the head dimension d) runs at half the layer GEMMs'
    efficiency; it runs at d / (d + d_half) of it.
    moe_launch_scale: GPU catalog name -> multiple of a stack's moe_launch_s_per_local_expert (fitted on Blackwell)
    that an MoE layer spends per local expert and micro-batch on that GPU; 1 where a GPU has none.
    cpu_host_s_per_pass, cpu_host_s_per_step: on CPUs, the training loop's host time around each model chunk's
    forward and backward pass of a micro-batch, and once per step (the optimizer's work per tensor, the loop's own),
    which a GPU's asynchronous launches hide and labkit profile's timing of the layers leaves out.
    stacks: stack name -> Stack; default_stack: the one `estimate` charges when none is named.
    sources: constant ("efficiency.A100-40GB", "network_bus_fraction", "stacks.megatron-core") -> what it was fitted
    to or taken from; documentation, not compared.
    """
    efficiency: Mapping[str, float]
    intra_node_gbps: Mapping[str, float]
    nvlink_bus_fraction: float
    pcie_bus_fraction: float
    network_bus_fraction: float
    link_latency_s: float
    tp_overlap_exposed: float
    stacks: Mapping[str, Stack]
    fp8_efficiency: Mapping[str, float] = field(default_factory=dict)
    mxfp8_share: float = 1.0
    moe_launch_scale: Mapping[str, float] = field(default_factory=dict)
    attention_head_dim_half: Mapping[str, float] = field(default_factory=lambda: {"unfused": 0.0, "flash": 0.0})
    default_stack: str = "megatron-core"
    cpu_host_s_per_pass: float = 0.0
    cpu_host_s_per_step: float = 0.0
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        # read-only views, so that a Calibration cannot be changed through its mappings either
        for name in ("efficiency", "fp8_efficiency", "moe_launch_scale", "attention_head_dim_half", "intra_node_gbps",
                     "stacks", "sources"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        if self.default_stack not in self.stacks:
            raise ValueError(f"default_stack: {self.default_stack!r} is not one of {', '.join(self.stacks)}")

    def gpu_efficiency(self, gpu: str) -> float:
        if gpu not in self.efficiency:
            raise KeyError(f"no matrix-multiply efficiency for GPU {gpu!r} in the calibration "
                           f"(known: {', '.join(self.efficiency)})")
        return self.efficiency[gpu]

    def gemm_efficiency(self, gpu: str, precision: str) -> float:
        """Fraction of the GPU's peak at `precision` that the linear layers' GEMMs reach. Blackwell's block-scaled
        formats (mxfp8 at the FP8 peak, nvfp4 at the FP4 peak: labkit.catalog.BLOCK_SCALED) take the FP8 fraction,
        MXFP8 at `mxfp8_share` of it (both fitted: calibration.yaml); for NVFP4 it is assumed."""
        if precision in ("fp8", "mxfp8", "nvfp4") and gpu in self.fp8_efficiency:
            return self.fp8_efficiency[gpu] * (self.mxfp8_share if precision == "mxfp8" else 1.0)
        return self.gpu_efficiency(gpu)

    def moe_launch_s(self, stack: Stack, gpu: str) -> float:
        """Seconds an MoE layer adds per micro-batch and local expert on `gpu` under `stack`: the stack's cost, fitted
        on Blackwell GPUs, at the GPU's `moe_launch_scale`."""
        return stack.moe_launch_s_per_local_expert * self.moe_launch_scale.get(gpu, 1.0)

    def attention_core_share(self, kernel: str, head_dim: float, gpu) -> float:
        """Attention's core runs at this fraction of the layer GEMMs' efficiency on `gpu` (a catalog.GPU):
        d / (d + d_half) on GPUs, whose tensor cores lose efficiency on head-wide GEMMs; 1 on a CPU, whose core is
        timed like its other GEMMs."""
        if gpu.is_cpu:
            return 1.0
        half = self.attention_head_dim_half[kernel]
        return head_dim / (head_dim + half)

    def intra_node_link(self, gpu) -> float:
        """The intra-node link rate of a catalog GPU's nodes: the fitted rate where there is one, else the catalog's."""
        return self.intra_node_gbps.get(gpu.name, gpu.intra_node_gbps)

    def bus_gbps(self, link_gbps: float, inter_node: bool) -> float:
        """What a collective or p2p transfer reaches on a link of `link_gbps`: the bus fraction of its link class."""
        if inter_node:
            return link_gbps * self.network_bus_fraction
        return link_gbps * (self.pcie_bus_fraction if link_gbps <= PCIE_MAX_GBPS else self.nvlink_bus_fraction)

    def stack(self, stack: Stack | str | None = None) -> Stack:
        """A Stack as given, the one of that name, or the default one for None."""
        if isinstance(stack, Stack):
            return stack
        name = self.default_stack if stack is None else stack
        if name not in self.stacks:
            raise ValueError(f"stack: {name!r} is not one of {', '.join(self.stacks)}")
        return self.stacks[name]

    def with_efficiency(self, gpu: str, value: float) -> Calibration:
        return replace(self, efficiency={**self.efficiency, gpu: value})

    def with_fp8_efficiency(self, gpu: str, value: float) -> Calibration:
        return replace(self, fp8_efficiency={**self.fp8_efficiency, gpu: value})

    def with_moe_launch_scale(self, gpu: str, value: float) -> Calibration:
        return replace(self, moe_launch_scale={**self.moe_launch_scale, gpu: value})

    def with_intra_node_gbps(self, gpu: str, value: float) -> Calibration:
        return replace(self, intra_node_gbps={**self.intra_node_gbps, gpu: value})

    def with_stack(self, stack: Stack) -> Calibration:
        return replace(self, stacks={**self.stacks, stack.name: stack})


def calibration_from_dict(data: Mapping) -> Calibration:
    """A Calibration from calibration.yaml's layout: each constant a {value, source} mapping, stacks spelled out."""
    sources = {}

    def value(key: str, entry) -> float:
        sources[key] = entry["source"]
        return float(entry["value"])

    stacks = {}
    for name, entry in data["stacks"].items():
        sources[f"stacks.{name}"] = entry["source"]
        overlaps = entry.get("overlaps")
        if not isinstance(overlaps, list) or not set(overlaps) <= set(OVERLAPS):
            raise ValueError(f"stacks.{name}.overlaps: {overlaps!r} is not a list of {', '.join(OVERLAPS)}; list "
                             "the overlaps the stack runs on GPUs ([] for none)")
        stacks[name] = Stack(name, memory_passes=float(entry["memory_passes"]),
                             tp_allreduce_s=float(entry["tp_allreduce_s"]), p2p_message_s=float(entry["p2p_message_s"]),
                             p2p_messages=int(entry["p2p_messages"]), overlap_p2p=bool(entry["overlap_p2p"]),
                             compute_scale=float(entry.get("compute_scale", 1.0)),
                             moe_launch_s_per_local_expert=float(entry.get("moe_launch_s_per_local_expert", 0.0)),
                             zero3_exposed=float(entry.get("zero3_exposed", 0.0)),
                             fsdp_master_shards=bool(entry.get("fsdp_master_shards", False)),
                             overlaps=tuple(overlaps),
                             description=entry.get("description", ""))
    return Calibration(
        efficiency={gpu: value(f"efficiency.{gpu}", e) for gpu, e in data["efficiency"].items()},
        fp8_efficiency={gpu: value(f"fp8_efficiency.{gpu}", e) for gpu, e in data.get("fp8_efficiency", {}).items()},
        mxfp8_share=value("mxfp8_share", data["mxfp8_share"]),
        moe_launch_scale={gpu: value(f"moe_launch_scale.{gpu}", e)
                          for gpu, e in data.get("moe_launch_scale", {}).items()},
        attention_head_dim_half={kernel: value(f"attention_head_dim_half.{kernel}", e)
                                 for kernel, e in data["attention_head_dim_half"].items()},
        intra_node_gbps={gpu: value(f"intra_node_gbps.{gpu}", e) for gpu, e in data["intra_node_gbps"].items()},
        nvlink_bus_fraction=value("nvlink_bus_fraction", data["nvlink_bus_fraction"]),
        pcie_bus_fraction=value("pcie_bus_fraction", data["pcie_bus_fraction"]),
        network_bus_fraction=value("network_bus_fraction", data["network_bus_fraction"]),
        link_latency_s=value("link_latency_s", data["link_latency_s"]),
        tp_overlap_exposed=value("tp_overlap_exposed", data["tp_overlap_exposed"]),
        cpu_host_s_per_pass=value("cpu_host_s_per_pass", data["cpu_host_s_per_pass"]),
        cpu_host_s_per_step=value("cpu_host_s_per_step", data["cpu_host_s_per_step"]),
        stacks=stacks, default_stack=data["default_stack"], sources=sources)


@functools.cache
def default_calibration() -> Calibration:
    """The shipped calibration (labkit/data/calibration.yaml); immutable, so one object serves every caller."""
    return calibration_from_dict(catalog.calibration())


def resolve(calibration: Calibration | None) -> Calibration:
    return default_calibration() if calibration is None else calibration

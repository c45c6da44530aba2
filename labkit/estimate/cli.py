"""`labkit estimate SPEC [--json] [--tokens N]`: parameters, FLOPs, memory per stage and iteration time of a run."""
from __future__ import annotations

import json
import sys

from labkit import catalog


def register(sub) -> None:
    p = sub.add_parser("estimate", help="predict parameters, FLOPs, MFU, memory per stage and iteration time of a spec")
    p.add_argument("spec", help="YAML or JSON run spec")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--tokens", type=float, default=None, help="training tokens, to add training_days (e.g. 300e9)")
    p.add_argument("--overlap-dp", action="store_true",
                   help="overlap the gradient all-reduce with the backward pass (Megatron --overlap-grad-reduce)")
    p.add_argument("--stack", default=None,
                   help="training software whose overheads to charge, a stack of labkit/data/calibration.yaml "
                        "(megatron-core, megatron-bridge, deepspeed-megatron-2020), in place of the spec's "
                        "kernels.stack (default: that, else megatron-core, labkit's driver)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from labkit.spec.errors import print_spec_errors
    from labkit.estimate import estimate
    from labkit.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
    except SpecError as exc:
        return print_spec_errors(args.spec, exc)
    stacks = catalog.calibration()["stacks"]
    if args.stack is not None and args.stack not in stacks:
        print(f"--stack: {args.stack!r} is not one of {', '.join(stacks)}", file=sys.stderr)
        return 2
    if args.tokens is not None and args.tokens <= 0:
        print(f"--tokens: must be a positive number of tokens, got {args.tokens:g}", file=sys.stderr)
        return 2
    est = estimate(spec, tokens=args.tokens, overlap_dp=args.overlap_dp, stack=args.stack)
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(render(spec, est))
    return 0


def render(spec, est) -> str:
    """The human-readable report."""
    from labkit.estimate import MEMORY_MARGIN

    par = spec.parallel
    expert = ""
    if par.expert > 1:
        expert = f", expert {par.expert}" + (f" x expert-tensor {par.expert_tensor}" if par.expert_tensor else "")
    lines = [
        f"{spec.name}: {est.num_gpus} GPUs (tensor {par.tensor} x pipeline {par.pipeline} x data {spec.data_parallel}"
        f"{expert}), {spec.num_micro_batches} micro-batches of {spec.batch.micro}, {spec.precision}",
        f"  parameters            {est.params:,} ({est.params / 1e9:.2f} B)"
        + (f"; {est.params_with_padding:,} as Megatron builds it (vocabulary padded to {est.padded_vocab_size:,})"
           if est.params_with_padding != est.params else ""),
        *([f"  active parameters     {est.active_params:,} ({est.active_params / 1e9:.2f} B) per token: the router, "
           f"the shared experts and {spec.model.moe_router_topk} of {spec.model.num_experts} experts per MoE layer"]
          if spec.model.moe else []),
        f"  FLOPs / iteration     {est.flops_per_iteration:.4g} executed, {est.model_flops_per_iteration:.4g} model",
        f"  iteration time        {est.iteration_time_s:.4g} s",
        f"  throughput            {est.tflops_per_gpu:.1f} TFLOP/s/GPU, MFU {100 * est.mfu:.1f}%, "
        f"HFU {100 * est.hfu:.1f}%",
    ]
    if est.training_days is not None:
        lines.append(f"  training time         {est.training_days:.1f} days for {est.tokens:.4g} tokens")
    lines.append("  time breakdown (s)")
    for key, value in est.breakdown.items():
        if key == "ep_comm" and not spec.model.moe:  # a dense model exchanges no tokens
            continue
        share = value / est.iteration_time_s if est.iteration_time_s else 0.0
        lines.append(f"    {key:<16}{value:10.4g}  {100 * share:5.1f}%")
    lines.append("  per stage            GPU            layers  fwd+bwd/micro-batch  memory GiB (limit)  source")
    for i, (gpu, layers) in enumerate(zip(est.stage_gpus, spec.layer_partition)):
        mem, limit = est.memory_gb_per_stage[i], est.memory_limit_gb_per_stage[i]
        flag = "" if mem <= (1 - MEMORY_MARGIN) * limit else "  OOM"
        lines.append(f"    stage {i:<14}{gpu:<15}{layers:>6}  {est.stage_times_s[i]:>17.4g} s  "
                     f"{mem:8.2f} ({limit:g}){flag}  {est.stage_sources[i]}")
    verdict = "fits" if est.fits_in_memory else "does NOT fit"
    lines.append(f"  memory: {verdict} (itemised memory within {100 * (1 - MEMORY_MARGIN):.0f}% of each GPU's)")
    lines += ["  assumed"] + [f"    {line}" for line in est.assumptions]
    return "\n".join(lines)

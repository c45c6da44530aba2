"""`labkit profile`: per-layer forward time of megatron-core's GPTModel on this machine, for the estimator and planner.

The model is built exactly as the training driver builds it (labkit.train: same flags from the run spec, same config,
same layer spec, CPU compatibility layer when there is no GPU) in `tensor` worker processes, one per tensor-parallel
rank, so that a layer's time includes its tensor-parallel all-reduces as it will in training. Forward hooks time the
embedding, every transformer layer and the output (final norm, logits and loss) of each forward pass; a backward pass
after each forward gives the backward/forward ratio. Medians over `repeats` timed passes after `warmup` untimed ones
(several micro-batch sizes are taken in turn, one pass of each per round, so that a busy spell of a shared machine
slows every size alike; training repeats one size, so a pass here follows one of another size, a smaller difference)
go to
~/.labkit/profiles/<model>_<gpu>_tp<t>.json in the format of labkit/data/profiles/README.md, one entry per micro-batch
size measured.

On a CPU the profile is taken under training's load: as many workers as training runs processes on the host (the
embedded laptop cluster's two, or `host_processes`; data-parallel replicas beside a smaller tensor-parallel group),
each with the threads one training process gets (the cores divided among them, as the job script sets
OMP_NUM_THREADS, whose value wins where it is set), all timing the same passes at once. Alone, one process would have
every core, cache and memory channel to itself, and measure a layer up to twice as fast as training then runs it.
"""
from __future__ import annotations

import contextlib
import io
import os
import platform
import statistics
import time
from pathlib import Path

from labkit import catalog
from labkit.estimate.profiles import MicroBatchTimes, Profile, save_profile
from labkit.net import free_port
from labkit.spec import ParallelSpec, RunSpec, SpecError, load_spec

TRAINING_PROCESSES_PER_HOST = catalog.clusters()["laptop"]["nodes"][0]["gpus_per_node"]


def profiling_spec(model: str | RunSpec, tensor: int = 1, micro_batch: int = 1, precision: str | None = None,
                   data: int = 1) -> RunSpec:
    """The run spec profiled: a model preset (or a run spec's model, or a run spec file's) on `tensor` x `data`
    processes, one micro-batch each."""
    import torch

    if isinstance(model, RunSpec):
        spec = model
    elif Path(model).exists():
        spec = load_spec(model)
    elif model in catalog.models():
        spec = load_spec({"name": f"profile-{model}", "model": {"preset": model}})
    else:
        hint = catalog.closest(model, catalog.models())
        raise SpecError([f"--model: {model!r} is neither a run spec file nor a preset; known presets: "
                         f"{', '.join(catalog.models())}" + (f" (closest: {', '.join(hint)})" if hint else "")])
    if precision is None:
        precision = "bf16" if torch.cuda.is_available() else "fp32"
    return load_spec({**spec.to_dict(), "cluster": None, "precision": precision, "recompute": None,
                      "parallel": vars(ParallelSpec(tensor=tensor, pipeline=1, data=data)),
                      "batch": {"micro": micro_batch, "global": micro_batch * data}})


def device_name() -> str:
    """The catalog name of this machine's accelerator ("cpu" without one)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    raw = torch.cuda.get_device_name(0)
    return catalog.resolve_gpu_name(raw) or raw


def cpu_threads(processes_per_host: int = TRAINING_PROCESSES_PER_HOST) -> int:
    """Threads of one training process on this CPU host: its cores shared by the processes that train on it, unless
    OMP_NUM_THREADS says otherwise (as in the job script, a value already set wins)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // processes_per_host)


def profile_model(model: str | RunSpec, tensor: int = 1, micro_batch: int | tuple[int, ...] = 1, repeats: int = 5,
                  warmup: int = 2, precision: str | None = None, path=None,
                  host_processes: int = TRAINING_PROCESSES_PER_HOST) -> tuple[Path, Profile]:
    """Measure and save the profile at one micro-batch size or several; returns where it was written and the
    profile. `host_processes`: how many training processes the profile stands for on a CPU host (the laptop
    cluster's by default).

    Taught in lab 06.
    """
    import torch.multiprocessing as mp

    sizes = sorted(set((micro_batch,) if isinstance(micro_batch, int) else micro_batch))
    if repeats < 1 or warmup < 0:
        raise ValueError("--repeats: time at least one forward pass")
    if not sizes or sizes[0] < 1:
        raise ValueError("--micro-batch: give one or more sizes of at least 1, e.g. 1 or 1,2,4")
    on_cpu = device_name() == "cpu"
    if host_processes < 1:
        raise ValueError("--host-processes: at least 1")
    data = max(1, host_processes // tensor) if on_cpu else 1
    world = tensor * data
    spec = profiling_spec(model, tensor, sizes[0], precision, data)
    from labkit.megatron.flags import FLAG as F
    from labkit.megatron_args import megatron_args

    argv = megatron_args(spec) + [F.distributed_backend.name, "gloo" if on_cpu else "nccl"]
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    threads = cpu_threads(max(world, host_processes)) if on_cpu else None
    workers = [ctx.Process(target=_worker, args=(rank, world, argv, sizes, repeats, warmup, port, threads, results))
               for rank in range(world)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    failed = [w.exitcode for w in workers if w.exitcode != 0]
    if failed or results.empty():
        raise RuntimeError(f"profiling workers failed (exit codes {[w.exitcode for w in workers]}); "
                           "see their output above")
    measured = results.get()
    import torch

    first, *others = [MicroBatchTimes(m["embedding"], m["layers"], m["output"], m["backward_factor"])
                      for m in measured]
    on = f"{os.cpu_count()} CPUs, {threads} thread{'s' if threads != 1 else ''} per process" if threads else \
        f"{os.cpu_count()} CPUs"
    profile = Profile(
        model=spec.model.preset or spec.name, gpu=device_name(), tensor=tensor,
        embedding_s=first.embedding_s, layers_s=first.layers_s, output_s=first.output_s,
        micro_batch=sizes[0], seq_length=spec.model.seq_length, precision=spec.precision,
        backward_factor=first.backward_factor, other_micro_batches=dict(zip(sizes[1:], others)),
        source=f"labkit profile: megatron-core GPTModel forward hooks, median of {repeats} passes",
        measured_on=f"{platform.node()} ({device_name()}, torch {torch.__version__}, {on}) "
                    f"{time.strftime('%Y-%m-%d')}")
    return save_profile(profile, path), profile


def _worker(rank: int, world: int, argv: list[str], sizes: list[int], repeats: int, warmup: int, port: int,
            threads: int | None, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)

    from labkit.train import cpu_compat

    if not torch.cuda.is_available():
        cpu_compat.apply()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from labkit.train.arguments import parse_args
    from labkit.train.data import build_tokenizer
    from labkit.train.model import layer_spec, transformer_config
    from labkit.megatron.sizes import padded_vocab_size
    from labkit.train.training import initialize

    args = parse_args(argv, world_size=world, rank=rank)
    if args.tensor_model_parallel_size > 1:  # as a tensor-parallel job script exports it
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with contextlib.redirect_stdout(io.StringIO()):  # the driver's start-up lines say nothing about the profile
        device = initialize(args)
    args.padded_vocab_size = padded_vocab_size(build_tokenizer(args).vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)  # as the driver pads it
    config = transformer_config(args)
    gpt = GPTModel(config=config, transformer_layer_spec=layer_spec(args), vocab_size=args.padded_vocab_size,
                   max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   position_embedding_type="learned_absolute", parallel_output=True)
    if device.type == "cuda":
        gpt.cuda(device)
    model = Float16Module(config, gpt) if (args.fp16 or args.bf16) else gpt

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    spans: dict[str, list[float]] = {}
    starts: dict[str, float] = {}

    def timed(name, module):
        def before(*_):
            sync()
            starts[name] = time.perf_counter()

        def after(*_):
            sync()
            spans.setdefault(name, []).append(time.perf_counter() - starts[name])

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    timed("embedding", gpt.embedding)
    for i, layer in enumerate(gpt.decoder.layers):
        timed(f"layer{i}", layer)
    timed("final_norm", gpt.decoder.final_layernorm)
    output_start: list[float] = []

    def output_begins(*_):  # the output is timed to the end of forward: logits projection and the loss
        sync()
        output_start.append(time.perf_counter())

    gpt.output_layer.register_forward_pre_hook(output_begins)

    measured = _time_passes(model, output_start, spans, sync, device, args, sizes, repeats, warmup)
    if rank == 0:
        results.put(measured)
    dist.barrier()
    dist.destroy_process_group()


def _time_passes(model, output_start, spans, sync, device, args, sizes: list[int], repeats: int,
                 warmup: int) -> list[dict]:
    """Forward and backward passes at each micro-batch size, taken in turn: each round runs one pass of every size, so
    that a slow spell of a shared machine slows every size alike instead of all of one size's passes. Per size, the
    hooks' medians and the backward's factor."""
    import torch

    s = args.seq_length
    generator = torch.Generator().manual_seed(1234)
    inputs = {micro: (torch.randint(0, args.padded_vocab_size, (micro, s), generator=generator).to(device),
                      torch.arange(s).unsqueeze(0).expand(micro, s).to(device)) for micro in sizes}
    passes: dict[int, list[dict]] = {micro: [] for micro in sizes}
    for i in range(warmup + repeats):
        for micro in sizes:
            spans.clear()
            output_start.clear()
            tokens, position_ids = inputs[micro]
            sync()
            t0 = time.perf_counter()
            loss = model(tokens, position_ids, None, labels=tokens).float().mean()
            sync()
            t1 = time.perf_counter()
            loss.backward()
            sync()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if i >= warmup:
                passes[micro].append({**{name: times[0] for name, times in spans.items()},
                                      "forward": t1 - t0, "step": t2 - t0, "output": t1 - output_start[-1]})
    return [_medians(passes[micro]) for micro in sizes]


def _medians(passes: list[dict]) -> dict:
    """One micro-batch size's passes as a profile entry: each part's median time and the backward's factor."""
    median = lambda key: statistics.median(p[key] for p in passes)  # noqa: E731
    layers = sum(1 for name in passes[0] if name.startswith("layer"))
    forward = median("forward")
    return {
        "embedding": median("embedding"),
        "layers": [median(f"layer{i}") for i in range(layers)],
        "output": median("final_norm") + median("output"),
        "backward_factor": (median("step") - forward) / forward,
    }

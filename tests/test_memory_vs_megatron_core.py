"""Static memory per rank as megatron-core allocates it: labkit's estimate against megatron-core's own objects.

`measure` starts gloo processes on the CPU and, in each, builds labkit's driver model (labkit.train.arguments.
parse_args of a driver command line, labkit.train.model.build_model: Float16Module and megatron-core's DDP) and its
optimizer (labkit.train.training.build_optimizer: get_megatron_optimizer), takes one optimizer step so that Adam's
moments exist, and sums the bytes each rank holds: parameter storage, DDP's gradient buffers, and the optimizer's
main parameters, their gradients and its state. The estimate (labkit.estimate.memory.model_state_bytes) must match to
the byte. The CPU driver refuses context parallelism (it needs Transformer Engine), so those points initialise
megatron-core's parallel state with context_parallel_size themselves; every context rank holds the whole model, and
only the data x context group the distributed optimizer shards over changes.
benchmarks/bench_memory_vs_megatron_core.py runs the whole grid.
"""
from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from labkit.estimate import estimate
from labkit.estimate.memory import GIB, ModelState, bytes_per_param, memory_per_stage, model_state_bytes
from labkit.estimate.params import Shape, stage_params
from labkit.megatron_args import megatron_args
from labkit.net import free_port
from labkit.spec import SpecError, load_spec
from labkit.train.model_state import built_after_one_step, held_bytes

# Odd widths on purpose: a hidden size of 72 leaves gaps before the 64-element-aligned parameters, a vocabulary of
# 1000 is padded to 1024 rows.
GPT = {"num_layers": 2, "hidden": 72, "heads": 4, "seq_length": 32, "vocab": 1000}
LLAMA = {**GPT, "query_groups": 2, "swiglu": True, "tied": False, "norm": "RMSNorm", "positions": "rope",
         "bias": False, "hidden_dropout": 0.0, "attention_dropout": 0.0}
MODELS = {"gpt": GPT, "llama": LLAMA}


@dataclass(frozen=True)
class Point:
    """One configuration of the grid."""
    model: str = "gpt"
    """gpt (LayerNorm, biases, learned positions, tied embeddings) or llama (RMSNorm, SwiGLU, GQA, rope, untied)."""
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    data: int = 1
    precision: str = "bf16"
    """bf16 or fp16."""
    distributed: bool = False
    """--use-distributed-optimizer."""
    grad_reduce_in_bf16: bool = False
    """--grad-reduce-in-bf16 (bf16 only)."""
    virtual_stages: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B), one layer each; 1: the model's two layers split evenly."""

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline * self.context * self.data

    @property
    def shape(self) -> Shape:
        layers = self.pipeline * self.virtual_stages if self.virtual_stages > 1 else GPT["num_layers"]
        return Shape(**{**MODELS[self.model], "num_layers": layers})

    def argv(self) -> list[str]:
        """The driver's command line (without --context-parallel-size, which the CPU driver refuses)."""
        s = self.shape
        argv = ["--num-layers", s.num_layers, "--hidden-size", s.hidden, "--num-attention-heads", s.heads,
                "--seq-length", s.seq_length, "--max-position-embeddings", s.seq_length,
                "--mock-data", "--vocab-size", s.vocab, "--lr", "1e-4", "--train-iters", "1",
                "--tensor-model-parallel-size", self.tensor, "--pipeline-model-parallel-size", self.pipeline,
                f"--{self.precision}", "--distributed-backend", "gloo"]
        if self.model == "llama":
            argv += ["--group-query-attention", "--num-query-groups", s.query_groups, "--swiglu",
                     "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
                     "--position-embedding-type", "rope", "--disable-bias-linear",
                     "--hidden-dropout", "0", "--attention-dropout", "0"]
        if self.distributed:
            argv.append("--use-distributed-optimizer")
        if self.grad_reduce_in_bf16:
            argv.append("--grad-reduce-in-bf16")
        if self.virtual_stages > 1:  # the interleaved schedule needs micro-batches in multiples of the stages
            argv += ["--num-layers-per-virtual-pipeline-stage", 1,
                     "--global-batch-size", self.data * self.pipeline]
        return [str(a) for a in argv]

    def estimate(self, stage: int, rank: int | None = None) -> ModelState:
        """labkit's estimate for one GPU of `stage`, at `rank` of the data x context group."""
        chunks = [1] * self.virtual_stages if self.virtual_stages > 1 else [self.shape.num_layers // self.pipeline]
        return model_state_bytes(self.shape, chunks, stage=stage, pipeline=self.pipeline, tensor=self.tensor,
                                 data_parallel=self.data, context=self.context, precision=self.precision,
                                 distributed_optimizer=self.distributed,
                                 grad_reduce_in_bf16=self.grad_reduce_in_bf16, rank=rank)


@dataclass(frozen=True)
class Held:
    """What one rank holds, measured."""
    rank: int
    stage: int
    """Pipeline rank."""
    shard: int
    """Rank in the data x context group."""
    weights: int
    gradients: int
    optimizer: int
    step_only: int
    """Of `optimizer`, what the next iteration's zero_grad frees before its forward: the step's gradient copies."""


def _driver_args(point: Point, rank: int):
    """The driver's arguments for `point` (parse_args of its command line), with the padded vocabulary it derives."""
    from labkit.train import data
    from labkit.train.arguments import parse_args
    from labkit.train.training import padded_vocab_size

    args = parse_args(point.argv(), world_size=point.world // point.context, rank=rank, cuda=False)
    args.padded_vocab_size = padded_vocab_size(data.build_tokenizer(args).vocab_size,
                                               args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    return args


def _initialize(point: Point, rank: int) -> None:
    """megatron-core's parallel state for the point's layout: the driver's initialize, or, with context
    parallelism, initialize_model_parallel with context_parallel_size."""
    from megatron.core import parallel_state, tensor_parallel

    from labkit.train.training import initialize

    parallel_state.destroy_model_parallel()
    if point.context == 1:
        initialize(_driver_args(point, rank))
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=point.tensor,
                                                 pipeline_model_parallel_size=point.pipeline,
                                                 context_parallel_size=point.context)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _build(point: Point, rank: int):
    """labkit's driver model and optimizer for `point` on this rank, after one optimizer step."""
    return built_after_one_step(_driver_args(point, rank))


def _layout(point: Point) -> tuple[int, int, int, int, int]:
    return point.tensor, point.pipeline, point.context, point.data, point.virtual_stages


def _worker(rank: int, world: int, address: str, points: list[Point], out: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from labkit.train import cpu_compat

    torch.set_num_threads(1)
    cpu_compat.apply()
    dist.init_process_group("gloo", init_method=address, world_size=world, rank=rank)
    results = []
    for i, point in enumerate(points):
        if i == 0 or _layout(point) != _layout(points[i - 1]):  # process groups are made once per layout
            with contextlib.redirect_stdout(io.StringIO()):  # the driver's set-up lines
                _initialize(point, rank)
        model, optimizer = _build(point, rank)
        weights, gradients, optimizer_state = held_bytes(model, optimizer)
        optimizer.zero_grad()  # as the driver's train_step begins
        held = Held(rank, parallel_state.get_pipeline_model_parallel_rank(),
                    parallel_state.get_data_parallel_rank(with_context_parallel=True), weights, gradients,
                    optimizer_state, optimizer_state - held_bytes(model, optimizer)[2])
        results.append(asdict(held))
        del model, optimizer
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def measure(points: list[Point], timeout_s: float = 900) -> dict[Point, list[Held]]:
    """Each point's measured bytes on every rank; points of one world size share one group of processes, which
    must finish within `timeout_s`."""
    import torch.multiprocessing as mp

    measured: dict[Point, list[Held]] = {}
    for world in sorted({p.world for p in points}):
        group = sorted((p for p in points if p.world == world), key=_layout)
        address = f"tcp://127.0.0.1:{free_port()}"
        with tempfile.TemporaryDirectory() as tmp:
            processes = mp.spawn(_worker, args=(world, address, group, tmp), nprocs=world, join=False)
            deadline = time.monotonic() + timeout_s
            while not processes.join(timeout=5):  # raises when a worker fails
                if time.monotonic() > deadline:
                    for process in processes.processes:
                        process.kill()
                    raise TimeoutError(f"{len(group)} points on {world} processes took over {timeout_s} s")
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        for i, point in enumerate(group):
            measured[point] = [Held(**ranks[r][i]) for r in range(world)]
    return measured


# A few representative points in one pair of processes; the benchmark runs the whole grid.
POINTS = [
    Point("gpt", data=2, distributed=True),
    Point("gpt", context=2, distributed=True, grad_reduce_in_bf16=True),  # shards over data x context
    Point("gpt", pipeline=2, distributed=True),  # the tied embedding's two copies: buckets of their own
    Point("llama", tensor=2, precision="fp16", distributed=True),  # fp16 gradients, fp32 copies in the step
    Point("llama", data=2, precision="fp16"),  # no distributed optimizer
    Point("gpt", pipeline=2, distributed=True, virtual_stages=2),  # a buffer per model chunk
]


@pytest.mark.slow
def test_estimate_equals_megatron_core_bytes_on_every_rank():
    measured = measure(POINTS)
    for point, ranks in measured.items():
        for held in ranks:
            estimate = point.estimate(held.stage, held.shard)
            assert (held.weights, held.gradients, held.optimizer, held.step_only) == \
                (estimate.weights, estimate.gradients, estimate.optimizer, estimate.step_only), (point, held)
    # the ranks of a group update slices that differ by alignment gaps; the estimator reports the fullest
    first = measured[POINTS[0]]
    assert len({h.optimizer for h in first}) > 1
    assert max(h.optimizer for h in first) == POINTS[0].estimate(0).optimizer


def test_parameters_as_registered_add_up_to_the_stage_counts():
    for model in MODELS.values():
        shape = Shape(**model)
        for tensor, partition in ((1, [2]), (2, [1, 1]), (2, [2, 0])):
            state = [model_state_bytes(shape, [n], stage=i, pipeline=len(partition), tensor=tensor, precision="fp32")
                     for i, n in enumerate(partition)]
            assert [s.weights // 4 for s in state] == [round(n) for n in stage_params(shape, partition, tensor)]


def test_distributed_optimizer_pads_buckets_and_aligns_parameters():
    shape = Shape(**GPT)
    plain = model_state_bytes(shape, [2], data_parallel=4, distributed_optimizer=True)
    unpadded = model_state_bytes(shape, [2], data_parallel=4)
    assert plain.gradients > unpadded.gradients and plain.gradients // 4 % 128 == 0
    # each rank updates a quarter of the parameters, give or take an alignment gap
    quarter = unpadded.optimizer / 4
    assert quarter <= plain.optimizer < quarter + 12 * 64 * 12


def test_context_parallel_ranks_share_the_distributed_optimizer():
    shape = Shape(**GPT)
    alone = model_state_bytes(shape, [2], data_parallel=4, distributed_optimizer=True)
    with_context = model_state_bytes(shape, [2], data_parallel=2, context=2, distributed_optimizer=True)
    assert with_context == alone


def test_bf16_gradient_reduction_halves_the_buffer_and_adds_fp32_copies():
    shape = Shape(**GPT)
    fp32_grads = model_state_bytes(shape, [2], precision="bf16")
    bf16_grads = model_state_bytes(shape, [2], precision="bf16", grad_reduce_in_bf16=True)
    assert bf16_grads.gradients * 2 == fp32_grads.gradients
    assert bf16_grads.optimizer == fp32_grads.optimizer * 16 // 12
    # the copies are the step's alone: zero_grad frees them before the next forward
    assert (fp32_grads.step_only, bf16_grads.step_only) == (0, bf16_grads.optimizer // 4)
    assert bytes_per_param("bf16", grad_reduce_in_bf16=True) == bytes_per_param("fp16") == (2, 2, 16)
    assert bytes_per_param("bf16", 4, True, context=2)[2] == 12 / 8


def test_llama31_8b_at_context_2_data_4_shards_optimizer_over_eight_gpus():
    """The issue's example: Llama 3.1 8B at tensor 1, context 2, data 4 on 8 H100 held 22.4 GiB of optimizer state
    per GPU in the estimate while megatron-core shards it over all eight data x context ranks."""
    def spec(context, extra=None):
        return load_spec({"model": {"preset": "llama3-8b"}, "parallel": {"tensor": 1, "pipeline": 1,
                                                                         "context": context},
                          "precision": "bf16", "optimizer": {"distributed": True, **(extra or {})},
                          "batch": {"micro": 1, "global": 32},
                          "job": {"entrypoint": "megatron-lm", "megatron_lm": "/workspace/megatron-lm"},
                          "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8}]}})
    context, data_only = estimate(spec(2)), estimate(spec(1))
    params = stage_params(Shape.of(spec(2).model), [32])[0]
    assert context.memory_detail[0]["optimizer"] == pytest.approx(12 * params / 8 / GIB, rel=1e-6)  # 11.2 GiB
    assert context.memory_detail[0]["optimizer"] == data_only.memory_detail[0]["optimizer"]
    bf16_grads = estimate(spec(2, {"grad_reduce_in_bf16": True})).memory_detail[0]
    assert bf16_grads["gradients"] == context.memory_detail[0]["gradients"] / 2
    assert bf16_grads["optimizer"] == pytest.approx(context.memory_detail[0]["optimizer"] * 16 / 12)


def test_grad_reduce_in_bf16_needs_bf16():
    with pytest.raises(SpecError, match="optimizer.grad_reduce_in_bf16: .* precision is fp16"):
        load_spec({"model": {"preset": "tiny"}, "precision": "fp16", "optimizer": {"grad_reduce_in_bf16": True}})


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4"])
def test_block_scaled_runs_reduce_gradients_in_bf16_as_megatron_lm_takes_it(precision):
    """MXFP8 and NVFP4 train under --bf16, whose gradients Megatron-LM's validate_args reduces in bf16 with
    --grad-reduce-in-bf16 (Megatron-Bridge's recipes for them set grad_reduce_in_fp32 False)."""
    def spec(bf16_grads):
        return load_spec({"model": {"preset": "llama3-8b"}, "precision": precision,
                          "optimizer": {"distributed": True, "grad_reduce_in_bf16": bf16_grads},
                          "job": {"entrypoint": "megatron-lm", "megatron_lm": "/workspace/megatron-lm"},
                          "cluster": {"nodes": [{"gpu": "B200", "count": 1, "gpus_per_node": 8}]}})
    args = megatron_args(spec(True))
    assert "--bf16" in args and "--grad-reduce-in-bf16" in args
    assert estimate(spec(True)).memory_detail[0]["gradients"] == estimate(spec(False)).memory_detail[0]["gradients"] / 2


def test_the_steps_gradient_copies_share_the_memory_the_activations_free():
    """A stage's peak is the larger of its two phases: the forward and backward passes hold the activations, the
    optimizer step its fp32 copies of 16-bit gradients, and zero_grad frees those before the next forward."""
    def stage(precision, grad_reduce_in_bf16=False, micro=1):
        return load_spec({"model": {"preset": "llama3-8b"}, "parallel": {"tensor": 1, "pipeline": 1},
                          "precision": precision, "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1},
                          "optimizer": {"distributed": True, "grad_reduce_in_bf16": grad_reduce_in_bf16},
                          "batch": {"micro": micro, "global": 8 * micro},
                          "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8}]}})
    bf16_grads = estimate(stage("bf16", True)).memory_detail[0]
    copies = bf16_grads["optimizer"] / 4  # 4 of the 16 bytes an updated element holds
    assert bf16_grads["step_only"] == pytest.approx(copies)
    weights_to_optimizer = bf16_grads["weights"] + bf16_grads["gradients"] + bf16_grads["optimizer"]
    assert bf16_grads["activations"] > copies  # full recompute at micro-batch 1 still keeps more
    assert bf16_grads["total"] == pytest.approx(weights_to_optimizer - copies + bf16_grads["activations"])
    # fp32 gradients are the optimizer's own: nothing to free, the activations come on top of all the state
    fp32_grads = estimate(stage("bf16")).memory_detail[0]
    assert fp32_grads["step_only"] == 0
    assert fp32_grads["total"] == pytest.approx(
        sum(fp32_grads[k] for k in ("weights", "gradients", "optimizer", "activations")))
    # with fewer activations than copies, the step is the peak
    from labkit.estimate.memory import StageMemory
    assert StageMemory(weights=1, gradients=1, optimizer=4, activations=0.5, in_flight=1, step_only=1).total == 6


def test_an_evaluation_runs_beside_the_steps_copies():
    """Megatron-LM's evaluate (and the driver's) runs after an optimizer step, before the next zero_grad: its forward
    is held beside the step's copies."""
    def stage(eval_interval):
        return estimate(load_spec({"model": {"preset": "gpt2-xl"}, "precision": "fp16",
                                   "train": {"eval_interval": eval_interval, "eval_iters": 1},
                                   "batch": {"micro": 1, "global": 8},
                                   "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 1}]}}
                                  )).memory_detail[0]
    quiet, evaluating = stage(None), stage(100)
    assert quiet["evaluation"] == 0 < evaluating["evaluation"]
    assert evaluating["total"] == pytest.approx(max(
        evaluating["weights"] + evaluating["gradients"] + evaluating["optimizer"] - evaluating["step_only"]
        + evaluating["activations"],
        evaluating["weights"] + evaluating["gradients"] + evaluating["optimizer"] + evaluating["evaluation"]))


def test_the_planners_layer_caps_hold_at_the_peak_of_either_phase():
    """The planner caps each stage's layers from the memory of one and two layers: per phase, since the peak, the
    larger of two straight lines, bends where the other phase takes over."""
    from labkit.estimate.calibration import default_calibration
    from labkit.estimate.estimator import MEMORY_MARGIN, flash_attention
    from labkit.plan.search import _Links, _memory_caps

    spec = load_spec({"model": {"preset": "llama3-8b"}, "precision": "fp16", "parallel": {"pipeline": 2},
                      "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1},
                      "batch": {"micro": 1, "global": 16},
                      "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 2}]}})
    shape = Shape.of(spec.model)
    flash = flash_attention(spec.kernels.attention_backend, ["H100-SXM"])
    caps = _memory_caps(spec, shape, _Links.of(spec, default_calibration()), flash)
    limit = (1 - MEMORY_MARGIN) * 80
    for i, cap in enumerate(caps):
        def peak(layers):
            partition = [layers if j == i else 1 for j in range(2)]
            return memory_per_stage(shape, partition, num_micro_batches=16, precision="fp16", recompute="full",
                                    flash_attention=flash)[i].total
        assert 0 < cap < shape.num_layers
        assert peak(cap) <= limit < peak(cap + 1), (i, cap)

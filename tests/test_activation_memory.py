"""Activation memory as megatron-core's layers really keep it: the bytes one TransformerLayer saves for its backward
pass, counted on the CPU with `torch.autograd.graph.saved_tensors_hooks`, against labkit's per-layer formula
(labkit.estimate.memory.activation_bytes_per_layer with `on_cpu=True`), within 2%; and the terms a GPU changes.

The layers are built as the driver builds them (labkit.megatron_args -> labkit.train.arguments ->
labkit.train.model.transformer_config, get_gpt_layer_local_spec, build_model) in a gloo world of `tensor` processes
with labkit.train.cpu_compat applied. Sequence parallelism needs a norm that takes a sequence shard, which the local
spec's torch norm refuses (megatron-core's WrappedTorchNorm asserts; the driver asks for Transformer Engine): there the
norms are torch's own LayerNorm/RMSNorm built directly, and every other module is the local spec's, with
`sequence_parallel` on. A saved tensor counts once per storage (views, and a tensor two operations save, share one),
parameters not at all, and only while the autograd graph still holds it when the forward pass ends. One layer's bytes
are a two-layer model's less a one-layer model's, so what all layers share (the rotary frequencies, the final norm)
drops out. benchmarks/bench_activation_memory.py prints the whole grid.
"""
from __future__ import annotations

import multiprocessing
import queue
import weakref
from dataclasses import dataclass, field

import pytest

from labkit.estimate.memory import activation_bytes_per_layer
from labkit.estimate.params import Shape
from labkit.net import free_port
from labkit.spec import load_spec

TOLERANCE = 0.02
MICRO_BATCH = 2
GPT = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128, "vocab_size": 512}
LLAMA = {**GPT, "num_query_groups": 4, "ffn_hidden_size": 640, "swiglu": True, "untie_embeddings": True,
         "normalization": "RMSNorm", "position_embedding_type": "rope", "rotary_base": 10000,
         "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0}
MODELS = {"gpt": GPT, "llama": LLAMA,
          "gpt-gqa": {**GPT, "num_query_groups": 2},  # grouped K/V without rotary positions
          "llama-mha": {**LLAMA, "num_query_groups": 8}}  # rotary positions without grouping


@dataclass(frozen=True)
class Case:
    """One measured layer configuration."""
    name: str
    """Row label: model, tensor size, sequence parallelism, recompute and precision."""
    model: dict = field(hash=False)
    """Model fields of the run spec (the measurement builds one and two layers of it)."""
    tensor: int = 1
    """Tensor-parallel size: the gloo world the layer is built in."""
    sequence_parallel: bool = False
    """Sequence parallelism (tensor > 1)."""
    recompute: str | None = None
    """None, "selective" or "full" (uniform, one layer per checkpoint)."""
    precision: str = "bf16"
    """bf16 or fp32."""
    modules: tuple[str, ...] = ()
    """With selective recompute, the modules recomputed (none: megatron-core's default, core_attn)."""

    def spec(self, layers: int | None = None):
        recompute = {"granularity": self.recompute, **({"method": "uniform"} if self.recompute == "full" else {}),
                     **({"modules": list(self.modules)} if self.modules else {})}
        return load_spec({
            "name": self.name, "model": {**self.model, **({"num_layers": layers} if layers else {})},
            "precision": self.precision, "data": {"mock": True}, "parallel": {"tensor": self.tensor},
            "batch": {"micro": MICRO_BATCH, "global": MICRO_BATCH},
            "recompute": recompute if self.recompute else "none",
            "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": self.tensor}]}})

    def estimate(self) -> float:
        return activation_bytes_per_layer(Shape.of(self.spec().model), MICRO_BATCH, self.tensor,
                                          self.sequence_parallel, self.recompute, self.precision, on_cpu=True,
                                          recompute_modules=self.modules or None)


def case(model: str, tensor: int = 1, sp: bool = False, recompute: str | None = None, precision: str = "bf16",
         modules: tuple[str, ...] = ()):
    mode = f"{recompute}:{'+'.join(modules)}" if modules else recompute or "none"
    name = f"{model} t{tensor}{' sp' if sp else ''} {mode} {precision}"
    return Case(name, MODELS[model], tensor, sp, recompute, precision, modules)


def grid() -> list[Case]:
    """GPT (LayerNorm, GELU, biases, dropout) and Llama (RMSNorm, SwiGLU, rotary, GQA, no dropout) layers over tensor
    1/2, sequence parallelism, recompute none/selective/full, bf16 and fp32; GQA without rotary and rotary without GQA
    at tensor 1 and 2."""
    cases = [case(model, tensor, sp, recompute, precision)
             for model in ("gpt", "llama")
             for tensor, sp in ((1, False), (2, False), (2, True))
             for recompute in (None, "selective", "full")
             for precision in ("bf16", "fp32")]
    cases += [case(model, tensor, recompute=recompute)
              for model in ("gpt-gqa", "llama-mha") for tensor in (1, 2) for recompute in (None, "selective")]
    # recompute by module: what the CPU's layers recompute (the MLP of a layer without biases)
    cases += [case("llama", tensor, recompute="selective", modules=modules, precision=precision)
              for tensor in (1, 2) for modules in (("mlp",), ("core_attn", "mlp")) for precision in ("bf16", "fp32")]
    return cases


class _Held:
    """A saved tensor as autograd holds it between the forward and the backward pass."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _norm_for_sequence_shards():
    """A norm megatron-core's TransformerLayer can build with sequence_parallel on: torch's LayerNorm or RMSNorm,
    which normalise each token alone and so take a sequence shard as they take a whole sequence."""
    import torch

    class SequenceShardNorm:
        def __new__(cls, config, hidden_size, eps=1e-5, **_):
            norm = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
            return norm(hidden_size, eps=eps, dtype=config.params_dtype)

    return SequenceShardNorm


def _saved_bytes(case: Case, layers: int, rank: int) -> int:
    """Bytes the decoder of a `layers`-layer model saves for backward on this rank, for one micro-batch."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from labkit.megatron.sizes import padded_vocab_size
    from labkit.megatron_args import megatron_args
    from labkit.train import model as driver_model
    from labkit.train.arguments import parse_args

    args = parse_args(megatron_args(case.spec(layers)), world_size=case.tensor, rank=rank, cuda=False)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, case.tensor)
    args.sequence_parallel = case.sequence_parallel
    config = driver_model.transformer_config(args)
    layer_spec = driver_model.layer_spec
    if case.sequence_parallel:
        norm = _norm_for_sequence_shards()
        local = get_gpt_layer_local_spec(normalization=args.normalization)
        local.submodules.input_layernorm = local.submodules.pre_mlp_layernorm = norm
        driver_model.layer_spec = lambda *_: TransformerBlockSubmodules(layer_specs=[local] * layers, layer_norm=norm)
    try:
        chunk = driver_model.build_model(args, config)[0]
    finally:
        driver_model.layer_spec = layer_spec
    gpt = chunk
    while hasattr(gpt, "module"):
        gpt = gpt.module
    parameters = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
    packed = []

    def pack(tensor):
        # autograd keeps what pack returns while the graph node that saved it lives (a node made and dropped at once,
        # as under the checkpoint's no_grad, frees it): a weak reference tells which the graph holds at the end
        held = _Held(tensor)
        packed.append(weakref.ref(held))
        return held

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor)
    gpt.decoder.register_forward_pre_hook(lambda *_: hooks.__enter__() and None)
    gpt.decoder.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length))
    loss = chunk(tokens, torch.arange(args.seq_length).expand_as(tokens), None, labels=tokens)
    storages = {}
    for ref in packed:
        held = ref()
        if held is not None and held.tensor.untyped_storage().data_ptr() not in parameters:
            storage = held.tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    loss.sum().backward()  # the backward pass (and its recomputation) runs as in training
    return sum(storages.values())


def _world(rank: int, cases: list[Case], port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from labkit.train import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state, tensor_parallel

    tensor = cases[0].tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=tensor, rank=rank)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    measured = {c.name: _saved_bytes(c, 2, rank) - _saved_bytes(c, 1, rank) for c in cases}
    if rank == 0:
        results.put(measured)
    dist.destroy_process_group()


def measure(cases: list[Case]) -> dict[str, int]:
    """Bytes one layer saves per micro-batch on tensor rank 0, by case name; one gloo world per tensor size."""
    context = multiprocessing.get_context("spawn")
    measured = {}
    for tensor in sorted({c.tensor for c in cases}):
        group = [c for c in cases if c.tensor == tensor]
        results, port = context.Queue(), free_port()
        workers = [context.Process(target=_world, args=(rank, group, port, results)) for rank in range(tensor)]
        for w in workers:
            w.start()
        while True:
            try:
                measured.update(results.get(timeout=5))
                break
            except queue.Empty:
                if any(w.exitcode not in (None, 0) for w in workers):
                    for w in workers:
                        w.kill()
                    raise RuntimeError(f"tensor {tensor}: a measuring process failed (its traceback is above)")
        for w in workers:
            w.join()
    return measured


# One of each kind: both models, tensor 1 and 2, sequence parallelism, every recompute mode, bf16 and fp32, GQA
# without rotary and rotary without GQA. The benchmark measures the whole grid.
SMALL_GRID = [case("gpt", 1, recompute=None, precision="bf16"), case("gpt", 2, True, "selective", "fp32"),
              case("gpt", 2, recompute="full"), case("llama", 1, recompute="selective"),
              case("llama", 2, precision="fp32"), case("llama", 2, True), case("gpt-gqa", 1),
              case("gpt-gqa", 1, recompute="selective"), case("gpt-gqa", 2, recompute="selective"),
              case("llama-mha", 1), case("llama", 1, recompute="selective", modules=("mlp",)),
              case("llama", 2, recompute="selective", modules=("core_attn", "mlp"), precision="fp32")]


@pytest.mark.slow
def test_megatron_core_layers_save_what_the_formula_counts():
    measured = measure(SMALL_GRID)
    for c in SMALL_GRID:
        assert c.estimate() == pytest.approx(measured[c.name], rel=TOLERANCE), c.name


def _gpu(shape, **kw):
    return activation_bytes_per_layer(shape, MICRO_BATCH, **kw)


def test_a_gpu_layer_with_megatron_lms_fused_kernels_is_korthikantis():
    """Korthikanti et al. Table 2: s b h (34 + 5 a s/h) at t = 1 and (10 + 24/t + 5as/(ht)) at t, 16-bit, plus the
    fp32 LayerNorm statistics Transformer Engine keeps (two norms, two per token: 16/h)."""
    shape = Shape.of(load_spec({"model": GPT}).model)
    s, b, h, a = 128, MICRO_BATCH, 256, 8
    for t in (1, 2):
        assert _gpu(shape, tensor=t) == pytest.approx(s * b * h * (10 + 16 / h + 24 / t + 5 * a * s / (h * t)))
        assert _gpu(shape, tensor=t, sequence_parallel=True) == \
            pytest.approx(s * b * h * (34 + 16 / h + 5 * a * s / h) / t)


def test_the_cpu_and_a_gpu_differ_in_the_kernels_they_run():
    """The same layer: the CPU's dropout keeps 2-byte noise where CUDA keeps a bool mask, and its softmax runs in fp32
    behind a causal mask per layer where Megatron's fused kernel keeps 16 bits."""
    shape = Shape.of(load_spec({"model": GPT}).model)
    s, b, h, a = 128, MICRO_BATCH, 256, 8
    masks = 2 * s * b * h * (2 - 1)
    stats = 2 * s * b * (2 * 2 - 2 * 4)  # LayerNorm statistics: bf16 on the CPU, fp32 from Transformer Engine
    scores = b * a * s * s * ((4 + 2 + 2) - (2 + 1 + 2)) + s * s
    assert _gpu(shape, on_cpu=True) - _gpu(shape) == pytest.approx(masks + stats + scores)


def test_flash_attention_keeps_the_grouped_qkv_and_a_log_sum_exp_instead_of_the_scores():
    shape = Shape.of(load_spec({"model": {**LLAMA, "seq_length": 4096}}).model)
    s, b, h, a, g = 4096, MICRO_BATCH, 256, 8, 4
    unfused, flash = _gpu(shape, precision="bf16"), _gpu(shape, flash_attention=True)
    # unfused: rotary Q, K and V repeated to every head (3h), the softmax output (16-bit: no dropout); flash: rotary Q
    # and K (h + hg/a), the QKV output V is a view of (h + 2hg/a), a log-sum-exp per head and token
    kept_unfused = s * b * (2 * 3 * h + 2 * a * s)
    kept_flash = s * b * (2 * (h + h * g / a) + 2 * (h + 2 * h * g / a) + 4 * a)
    assert unfused - flash == pytest.approx(kept_unfused - kept_flash)


def test_fp8_keeps_one_byte_copies_of_the_gemm_inputs():
    """Transformer Engine keeps FP8 copies of the QKV, projection, MLP-in and MLP-out inputs; fused attention's 16-bit
    output stays beside the projection's copy."""
    shape = Shape.of(load_spec({"model": LLAMA}).model)
    s, b, h, f = 128, MICRO_BATCH, 256, 640
    for t, sp in ((1, False), (4, True)):
        kw = dict(tensor=t, sequence_parallel=sp, flash_attention=True)
        bf16, fp8 = _gpu(shape, precision="bf16", **kw), _gpu(shape, precision="fp8", **kw)
        norm_outputs = 2 * s * b * h * (2 - 1) / (t if sp else 1)
        projection = s * b * h * ((2 - 1) - 2) / t
        mlp_out_input = s * b * f * (2 - 1) / t
        assert bf16 - fp8 == pytest.approx(norm_outputs + projection + mlp_out_input)
    assert _gpu(shape, precision="fp8", on_cpu=True) == _gpu(shape, precision="bf16", on_cpu=True)


def test_full_recompute_keeps_the_layer_input_and_selective_drops_only_the_core():
    shape = Shape.of(load_spec({"model": GPT}).model)
    s, b, h = 128, MICRO_BATCH, 256
    assert _gpu(shape, recompute="full", precision="fp32") == 4 * s * b * h
    assert _gpu(shape, tensor=2, sequence_parallel=True, recompute="full") == 2 * s * b * h / 2
    assert _gpu(shape, recompute="selective") == pytest.approx(s * b * h * (34 + 16 / h))

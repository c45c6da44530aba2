"""kernels.attention_backend sdpa: attention's core through torch.nn.functional.scaled_dot_product_attention in
megatron-core's layers (labkit/train/attention.py), checked against megatron-core's own DotProductAttention on the CPU:
the same outputs and gradients, the same dropout stream, the same losses over a tiny training run, and fewer saved
bytes. Which runs take it (labkit.megatron.rules.sdpa_attention) and how a spec renders it."""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from labkit.megatron import rules
from labkit.megatron.flags import FLAG, build_parser
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec

H100 = {"cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8}]}, "precision": "bf16",
        "batch": {"micro": 1, "global": 8}}
MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --mock-data --vocab-size 1023 " \
        "--lr 1e-3 --train-iters 2"


@pytest.fixture(scope="module")
def world():
    """One gloo process with megatron-core's parallel state and RNG tracker, on the CPU; all undone after."""
    from labkit.train import cpu_compat

    applied = not cpu_compat.is_applied() and cpu_compat.apply()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if applied:
        cpu_compat.remove()


def _pair(groups: int, dropout: float = 0.0, mask_type=None):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from labkit.train.attention import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                               attention_dropout=dropout, use_cpu_initialization=True, cuda_graph_scope=[])
    mask_type = mask_type or AttnMaskType.causal
    return (DotProductAttention(config, 1, mask_type, "self"), SDPAttention(config, 1, mask_type, "self"))


def _qkv(groups: int, s: int = 32, b: int = 2):
    import torch

    torch.manual_seed(0)
    return (torch.randn(s, b, 4, 16, requires_grad=True), torch.randn(s, b, groups, 16, requires_grad=True),
            torch.randn(s, b, groups, 16, requires_grad=True))


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_outputs_and_gradients_equal_dot_product_attentions(world, groups):
    """Causal, multi-head (4 groups), grouped (2) and multi-query (1): the layout [s, b, n, d] in, [s, b, n d] out."""
    import torch

    local, sdpa = _pair(groups)
    q, k, v = _qkv(groups)
    expected, got = local(q, k, v, None), sdpa(q, k, v, None)
    assert got.shape == expected.shape == (32, 2, 64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(expected.square().sum(), (q, k, v)),
                    torch.autograd.grad(got.square().sum(), (q, k, v))):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_a_given_mask_is_megatrons_true_means_masked(world):
    """megatron-core's boolean mask marks what may not be attended (attention_mask_func fills it with -10000); a
    padding layer given one attends to the rest."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    local, sdpa = _pair(4, mask_type=AttnMaskType.padding)
    q, k, v = _qkv(4)
    mask = torch.zeros(2, 1, 32, 32, dtype=torch.bool)
    mask[:, :, :, 20:] = True  # the last 12 keys are padding
    torch.testing.assert_close(sdpa(q, k, v, mask), local(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_dropout_draws_from_the_tensor_parallel_trackers_stream(world):
    """As DotProductAttention: the tracker's fork, so the default generator (hidden dropout's) is left where it was
    and the same tracker state gives the same dropout."""
    import torch
    from megatron.core import tensor_parallel

    _, sdpa = _pair(4, dropout=0.5)
    sdpa.train()
    q, k, v = _qkv(4)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states, default = tracker.get_states(), torch.get_rng_state()
    first = sdpa(q, k, v, None)
    assert torch.equal(torch.get_rng_state(), default)
    tracker.set_states(states)
    assert torch.equal(sdpa(q, k, v, None), first)
    sdpa.eval()
    local, _ = _pair(4)
    torch.testing.assert_close(sdpa(q, k, v, None), local(q, k, v, None), rtol=1e-5, atol=1e-5)


def _args(flags: str, cuda: bool, te: bool, driver: bool = True):
    args = build_parser().parse_args([*MODEL.split(), *flags.split()])
    return args, rules.Runtime(driver=driver, cuda=cuda, transformer_engine=te)


@pytest.mark.parametrize("flags, cuda, te, expected", [
    ("", True, False, True),                               # auto on GPUs without Transformer Engine
    ("", True, True, False),                               # Transformer Engine's flash or fused attention
    ("", False, False, False),                             # auto on CPUs: megatron-core's local attention
    ("--attention-backend local", True, False, False),     # asked for megatron-core's own
    ("--sdpa-attention", False, False, True),              # asked for, on CPUs
    ("--transformer-impl local", True, True, True),        # local layers on a machine with Transformer Engine
])
def test_which_runs_take_sdpa(flags, cuda, te, expected):
    args, runtime = _args(flags, cuda, te)
    assert rules.sdpa_attention(args, runtime) is expected
    assert rules.problems(args, 1, runtime) == []


def test_sdpa_is_the_drivers_and_chooses_the_kernel_alone():
    args, runtime = _args("--sdpa-attention --attention-backend flash", cuda=True, te=True)
    assert [(p.argument, "conflicts with --attention-backend flash" in p.message)
            for p in rules.problems(args, 1, runtime)] == [("sdpa_attention", True)]
    args, runtime = _args("--sdpa-attention", cuda=True, te=True, driver=False)
    assert [p.argument for p in rules.problems(args, 1, runtime)] == ["sdpa_attention"]
    assert not rules.sdpa_attention(*_args("", cuda=True, te=False, driver=False))  # Megatron-LM decides its own


def test_the_spec_renders_the_drivers_flag_and_megatron_lm_refuses_the_key():
    args = megatron_args(load_spec({**H100, "kernels": {"attention_backend": "sdpa"}}))
    assert FLAG.sdpa_attention.name in args and FLAG.attention_backend.name not in args
    cpu = megatron_args(load_spec({"kernels": {"attention_backend": "sdpa"}}))
    assert FLAG.sdpa_attention.name in cpu
    with pytest.raises(SpecError, match=r"kernels\.attention_backend: sdpa is labkit's driver's .* megatron-lm"):
        load_spec({**H100, "kernels": {"attention_backend": "sdpa"},
                   "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/megatron-lm"}})
    with pytest.raises(SpecError, match=r"kernels\.attention_backend: 'triton' is not one of .*local, sdpa"):
        load_spec({"kernels": {"attention_backend": "triton"}})
    with pytest.raises(SpecError, match=r"kernels\.attention_backend: conflicts with job\.extra_args\[0\] local"):
        load_spec({"kernels": {"attention_backend": "sdpa"}, "job": {"extra_args": ["--attention-backend", "local"]}})


def test_the_layer_specs_core_attention_is_replaced_in_dense_and_moe_layers(world):
    from labkit.train import model
    from labkit.train.arguments import finish
    from labkit.train.attention import SDPAttention

    dense = finish(build_parser().parse_args([*MODEL.split(), "--sdpa-attention"]), 1, 0, cuda=False)
    spec = model.layer_spec(dense)
    assert spec.submodules.self_attention.submodules.core_attention is SDPAttention
    plain = model.layer_spec(finish(build_parser().parse_args(MODEL.split()), 1, 0, cuda=False))
    assert plain.submodules.self_attention.submodules.core_attention is not SDPAttention
    moe = finish(build_parser().parse_args([*MODEL.split(), "--sdpa-attention", "--num-experts", "4",
                                            "--moe-layer-freq", "([0]+[1])"]), 1, 0, cuda=False)
    block = model.layer_spec(moe, model.transformer_config(moe))
    assert [layer.submodules.self_attention.submodules.core_attention for layer in block.layer_specs] \
        == [SDPAttention, SDPAttention]
    assert "torch scaled_dot_product_attention" in model.attention_line(dense)


# --- the tiny preset trained both ways ------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_trains_to_local_attentions_losses(train_in_parallel):
    """Three iterations of the tiny GPT, data-parallel 2 on gloo, fp32: sdpa's losses are local attention's to fp32
    rounding. Attention dropout is 0: the two kernels draw their dropout masks in different orders from the same
    stream."""
    def spec(backend):
        return load_spec({"model": {"preset": "tiny", "attention_dropout": 0.0}, "precision": "fp32",
                          "batch": {"micro": 2, "global": 8}, "train": {"iters": 3, "log_interval": 1},
                          "kernels": {"attention_backend": backend},
                          "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}})

    runs = train_in_parallel({"attention-local": spec("local"), "attention-sdpa": spec("sdpa")})

    def losses(name):
        return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", runs[name][1])]

    assert "attention core: torch scaled_dot_product_attention" in runs["attention-sdpa"][1]
    assert "attention core: megatron-core's DotProductAttention" in runs["attention-local"][1]
    assert len(losses("attention-local")) == 3
    assert losses("attention-sdpa") == pytest.approx(losses("attention-local"), rel=1e-5)


# --- the bytes a layer keeps for its backward -----------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionCase:
    """A test_activation_memory case (one layer's saved bytes on the CPU) with an attention backend."""
    base: object
    backend: str

    @property
    def name(self) -> str:
        return f"{self.base.name} {self.backend}"

    @property
    def tensor(self) -> int:
        return self.base.tensor

    @property
    def sequence_parallel(self) -> bool:
        return self.base.sequence_parallel

    def spec(self, layers: int | None = None):
        return self.base.spec(layers).replace(**{"kernels.attention_backend": self.backend})


def attention_cases():
    """GPT (MHA, dropout 0.1) and Llama (GQA, no dropout) layers, bf16 and fp32, without recompute."""
    from test_activation_memory import case

    return [AttentionCase(case(model, precision=precision), backend)
            for model in ("gpt", "llama") for precision in ("bf16", "fp32") for backend in ("local", "sdpa")]


@pytest.mark.slow
def test_sdpa_keeps_no_scores_where_it_drops_nothing():
    """A Llama layer (no dropout) in fp32: PyTorch's CPU flash kernel keeps its output and a log-sum-exp per head and
    token where megatron-core's local attention keeps the s x s softmax (4 bytes an element) and grouped K/V repeated
    to every head. With dropout the CPU falls back to the math kernel, which keeps the scores as well
    (benchmarks/bench_sdpa_memory.py prints both)."""
    from test_activation_memory import MICRO_BATCH, measure

    [local, sdpa] = [c for c in attention_cases() if c.base.name == "llama t1 none fp32"]
    measured = measure([local])
    measured.update(measure([sdpa]))  # megatron-core's models set the backend's NVTE_* variables once per process
    model = local.base.model
    scores = MICRO_BATCH * model["num_attention_heads"] * model["seq_length"] ** 2 * 4
    assert measured[local.name] - measured[sdpa.name] > scores / 2

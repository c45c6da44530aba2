"""The CPU compatibility layer against the pinned megatron-core: each CUDA-only call it answers, and that it is
needed (megatron fails without it), undone by `remove`, and left off when a GPU is present."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from labkit.train import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is for machines without CUDA")


@pytest.fixture(scope="module")
def process_group():
    """One gloo process and megatron's model-parallel groups (tensor and pipeline size 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    # An in-process store: nothing leaks into the environment that later training subprocesses inherit.
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def compat():
    assert cpu_compat.apply()
    yield
    cpu_compat.remove()


def test_megatron_needs_the_layer_without_cuda():
    from megatron.core.utils import GlobalMemoryBuffer

    cpu_compat.remove()
    with pytest.raises((RuntimeError, AssertionError)):
        GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "scratch")


def test_attention_scratch_buffer_lands_on_the_cpu(compat):
    from megatron.core.utils import GlobalMemoryBuffer

    buffer = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "scratch")
    assert buffer.device.type == "cpu" and buffer.shape == (2, 3)


def test_cuda_tensor_factories_in_megatron_modules_make_cpu_tensors(compat):
    schedules = sys.modules["megatron.core.pipeline_parallel.schedules"]
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.tensor([1.0], device="cuda:0").device.type == "cpu"
    assert schedules.torch.empty(3, device=torch.device("cuda")).device.type == "cpu"
    assert schedules.torch.cuda.current_device() == torch.device("cpu")
    assert schedules.torch.cuda.synchronize() is None
    # everything else is the real torch
    assert schedules.torch.matmul is torch.matmul and schedules.torch.Tensor is torch.Tensor


def test_optimizer_type_checks_see_cuda_names_and_conversions_still_work(compat):
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type(torch.float16).dtype == torch.float16
    t = torch.ones(2)
    assert t.cuda() is t


def test_remove_restores_torch_and_megatron():
    assert cpu_compat.apply()
    schedules = sys.modules["megatron.core.pipeline_parallel.schedules"]
    cpu_compat.remove()
    assert schedules.torch is torch
    assert torch.ones(1).type() == "torch.FloatTensor"
    assert not cpu_compat.is_applied()


def test_not_applied_when_a_gpu_is_present(monkeypatch):
    cpu_compat.remove()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply() is False
    assert not cpu_compat.is_applied()
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_tensor_parallel_rng_tracker_forks_the_cpu_generator(compat, process_group, caplog):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = tracker.get_states()
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING), tracker.fork():
        inside = torch.rand(4)
    after_fork = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), inside)  # the tracked stream replays
    torch.manual_seed(0)
    assert torch.equal(torch.rand(4), after_fork)  # and the default stream was put back around the fork
    assert not torch.equal(inside, after_fork)
    assert "CPU RNG state changed" not in caplog.text


def test_recomputation_replays_dropout_exactly(compat, process_group):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    weight = torch.randn(8, 8, requires_grad=True)

    def block(x):
        with tensor_parallel.get_cuda_rng_tracker().fork():
            x = torch.nn.functional.dropout(x @ weight, p=0.5, training=True)
        return torch.nn.functional.dropout(x, p=0.5, training=True).sum(dim=1)

    x = torch.randn(4, 8, requires_grad=True)
    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    cpu_state = torch.get_rng_state()
    plain = block(x)
    plain.sum().backward()
    grads = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None
    tensor_parallel.get_cuda_rng_tracker().set_states(states)
    torch.set_rng_state(cpu_state)
    recomputed = tensor_parallel.checkpoint(block, False, x)
    recomputed.sum().backward()
    assert torch.equal(plain, recomputed)
    assert torch.equal(weight.grad, grads[0]) and torch.equal(x.grad, grads[1])


def test_megatron_loads_its_fused_kernels_uncompiled_on_a_cpu_where_they_are_off():
    """The driver's start-up on a CPU: megatron-core's torch.compile'd bias fusions are off there
    (labkit.train.model.fusions), so they load as plain functions and TorchInductor (seconds of import) stays out."""
    import subprocess

    code = ("import sys, torch; from labkit.train import cpu_compat; cpu_compat.apply(); "
            "from megatron.core import jit; from megatron.core.fusions import fused_bias_geglu as g; "
            "print(torch.compile is not jit.jit_fuser, 'torch._inductor.compile_fx' in sys.modules, "
            "type(g.geglu_back).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "function"], out
    from types import SimpleNamespace

    from labkit.train.model import fusions
    args = SimpleNamespace(transformer_impl="local", swiglu=True, add_bias_linear=True, position_embedding_type="rope",
                           **dict.fromkeys(["bias_swiglu_fusion", "bias_gelu_fusion", "bias_dropout_fusion",
                                            "masked_softmax_fusion", "apply_rope_fusion",
                                            "gradient_accumulation_fusion"], True))
    assert not any(on for on, _ in fusions(args, cuda=False).values())

"""Run megatron-core 0.16.1 on a machine without CUDA: the small, isolated layer that makes that possible.

megatron-core hard-codes CUDA in a few places (the list is in docs and tests: `device="cuda"` tensor factories,
`torch.cuda.current_device()`, `torch.cuda.synchronize()`, the CUDA RNG state used by the tensor-parallel RNG tracker
and by activation recomputation, `Tensor.cuda()`, optimizer checks on `Tensor.type()` names, and in the
mixture-of-experts layer CUDA streams and events and the token counts the alltoall dispatcher copies to the host as
all_to_all's split sizes). This module answers those calls with their CPU equivalents, and only when
`torch.cuda.is_available()` is false.

How: every loaded `megatron.core` module that refers to the global name `torch` gets a `_TorchOnCPU` object in its
place. It forwards every attribute to the real `torch` (cached after the first look-up, so ordinary ops cost nothing
extra) except the few tensor factories and `torch.cuda` functions above. Two methods of `torch.Tensor` are patched
process-wide: `.cuda()` returns the tensor itself, and `.type()` without arguments reports the `torch.cuda.*` name
megatron's optimizer asserts on. While `apply` loads megatron-core, torch.compile returns what it is given, so the
fused kernels megatron-core compiles as it loads (all off on a CPU) skip TorchInductor's import. Because this touches
megatron-core internals, labkit pins megatron-core exactly and tests this layer against that version
(tests/test_train_cpu_compat.py).
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import types
import warnings

import torch
from torch.distributed import DeviceMesh

MEGATRON_MODULES = (
    "megatron.core.utils",
    "megatron.core.timers",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed.torch_fully_sharded_data_parallel",
    # distributed checkpointing (--ckpt-format torch_dist): the writer waits for device-to-host copies with
    # torch.cuda.synchronize() (filesystem_async.py), and the save's plan check and failure broadcast build their
    # flags on device="cuda" / torch.cuda.current_device() (state_dict_saver.py)
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    # mixture of experts: the router and experts place tensors with torch.cuda.current_device(), the load-balancing
    # tracker makes its sums on device="cuda", the alltoall dispatcher copies token counts on a CUDA stream
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.moe_layer",
)

_TO_HOST_USERS = ("megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.token_dispatcher")
"""Modules holding megatron-core's maybe_move_tensor_to_cpu under that name (the dispatcher imports it by name)."""
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor")
_CPU = torch.device("cpu")
_state: dict = {}


def _on_cpu(device):
    """Device arguments meaning a GPU ('cuda', 'cuda:0', torch.device('cuda'), an int index) -> the CPU."""
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _factory(fn):
    def on_cpu(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs a CUDA host allocator
        return fn(*args, **kwargs)
    on_cpu.__name__ = fn.__name__
    return on_cpu


def _no_op(*args, **kwargs):
    return None


class _HostEvent:
    """A CUDA event on the CPU: the work it marks is done when it is recorded (the CPU runs one op after another)."""

    def record(self, stream=None):
        return None

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream on the CPU: megatron-core's MoE layer copies token counts to the host on a side stream and
    waits for it with an event (MoEAlltoAllTokenDispatcher), and can run its shared experts on one
    (SharedExpertMLP). On the CPU everything runs in order on the one thread, so waiting is nothing."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event or _HostEvent()

    def synchronize(self):
        return None

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _HostStream()


def _cuda_namespace() -> types.SimpleNamespace:
    """What megatron calls under `torch.cuda`, answered for the CPU; anything else falls through to torch.cuda."""
    random = types.SimpleNamespace(get_rng_state=lambda device=None: torch.get_rng_state(),
                                   set_rng_state=lambda state, device=None: torch.set_rng_state(state))
    names = dict(
        current_device=lambda: _CPU,
        synchronize=_no_op,
        empty_cache=_no_op,
        get_rng_state=random.get_rng_state,
        set_rng_state=random.set_rng_state,
        manual_seed=lambda seed: torch.manual_seed(seed) and None,
        random=random,
        Stream=_HostStream,
        Event=_HostEvent,
        current_stream=lambda device=None: _CURRENT_STREAM,
        stream=lambda stream: contextlib.nullcontext(),
    )
    return _Fallthrough(torch.cuda, names)


class _Fallthrough:
    """An object that answers `overrides` first and every other attribute from `target` (cached on first use)."""

    def __init__(self, target, overrides: dict):
        self.__dict__.update(overrides)
        self._target = target

    def __getattr__(self, name):
        value = getattr(self._target, name)
        setattr(self, name, value)
        return value


class _TorchOnCPU(_Fallthrough):
    def __init__(self):
        super().__init__(torch, {name: _factory(getattr(torch, name)) for name in _FACTORIES})
        self.cuda = _cuda_namespace()


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        name = _state["type"](self)
        return name.replace("torch.", "torch.cuda.", 1) if not self.is_cuda and "cuda" not in name else name
    return _state["type"](self, dtype, non_blocking, **kwargs)


class _MeshOnCPU:
    """torch's DeviceMesh for megatron-core's FSDP2 wrapper, which builds its mesh with device type "cuda"
    (TorchFullyShardedDataParallel.__init__): the same mesh on the CPU, where FSDP2 shards over gloo."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        return DeviceMesh.from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _cpu_rng_get(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_rng_set(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's maybe_move_tensor_to_cpu (moe/moe_utils.py) for the CPU. On a GPU it copies the alltoall
    dispatcher's token counts to the host, as NumPy arrays where asked, and all_to_all_single takes those as its split
    sizes; it copies only CUDA tensors, so on the CPU the counts stayed tensors, which all_to_all_single refuses. Here
    they become the same NumPy arrays (copies, as the GPU's are)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().numpy().copy()
    return tensor


class _SameGeneratorFilter(logging.Filter):
    """On the CPU the tracker's "GPU" stream is the CPU generator itself, so megatron's check that forking left the
    CPU stream untouched always fires; the warning says nothing there."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


_RNG_FILTER = _SameGeneratorFilter()
EXPECTED_ON_CPU = (r".*Transformer Engine", r".*Apex is not installed", r".*custom_layers\.transformer_engine")
"""megatron-core's warnings that say nothing on a CPU, where its local layers and torch's optimizers are the point."""


def _uncompiled(model=None, **options):
    """torch.compile's signature, returning the function as it is."""
    return model if model is not None else (lambda f: f)


@contextlib.contextmanager
def _fusions_left_uncompiled():
    """While megatron-core loads: the functions it decorates with `jit_fuser` (megatron/core/jit.py takes
    `jit_fuser = torch.compile`: the fused bias kernels, and a few activations and norms) are compiled as their
    modules load, which imports TorchInductor, about 3 s of CPU in every process. On a CPU the driver turns the
    fusions off (labkit.train.model.fusions: they need Triton and a GPU), and what else runs computes the same
    uncompiled: they load as plain functions, and megatron.core.jit keeps the plain decorator until `remove`.
    megatron-core's own `disable_jit_fuser()` cannot do this: importing megatron.core.jit first imports the modules
    that use it. A process that had loaded megatron-core before keeps what it had."""
    if "megatron.core" in sys.modules:
        yield
        return
    compile_ = torch.compile
    torch.compile = _uncompiled
    try:
        yield
    finally:
        torch.compile = compile_


def needed() -> bool:
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return bool(_state)


def apply() -> bool:
    """Patch megatron-core for CPU execution when there is no GPU. Returns whether the layer is (now) active.

    Taught in labs 02, 03, 04, 07 and 10.
    """
    if _state:
        return True
    if not needed():
        return False
    with warnings.catch_warnings(), _fusions_left_uncompiled():
        # on a CPU megatron-core's local layers are the point: its notes that Transformer Engine and Apex are absent
        # (and that its Transformer Engine wrappers moved) say nothing there
        for pattern in EXPECTED_ON_CPU:
            warnings.filterwarnings("ignore", message=pattern)
        for name in MEGATRON_MODULES:
            importlib.import_module(name)
    proxy = _TorchOnCPU()
    replaced = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = proxy
            replaced[name] = module
    rng = sys.modules["megatron.core.tensor_parallel.random"]
    _state.update(modules=replaced, rng=(rng._get_cuda_rng_state, rng._set_cuda_rng_state),
                  cuda=torch.Tensor.cuda, type=torch.Tensor.type)
    rng._get_cuda_rng_state, rng._set_cuda_rng_state = _cpu_rng_get, _cpu_rng_set
    fsdp2 = sys.modules["megatron.core.distributed.torch_fully_sharded_data_parallel"]
    _state["mesh"] = fsdp2.DeviceMesh
    fsdp2.DeviceMesh = _MeshOnCPU
    _state["to_host"] = {}
    for name in _TO_HOST_USERS:
        module = sys.modules[name]
        _state["to_host"][name] = module.maybe_move_tensor_to_cpu
        module.maybe_move_tensor_to_cpu = _to_host
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.type = _tensor_type
    logging.getLogger(rng.__name__).addFilter(_RNG_FILTER)
    return True


def remove() -> None:
    """Undo `apply` (tests and the overhead benchmark use this)."""
    if not _state:
        return
    for module in _state["modules"].values():
        module.torch = torch
    rng = sys.modules["megatron.core.tensor_parallel.random"]
    rng._get_cuda_rng_state, rng._set_cuda_rng_state = _state["rng"]
    sys.modules["megatron.core.distributed.torch_fully_sharded_data_parallel"].DeviceMesh = _state["mesh"]
    for name, function in _state["to_host"].items():
        sys.modules[name].maybe_move_tensor_to_cpu = function
    torch.Tensor.cuda = _state["cuda"]
    torch.Tensor.type = _state["type"]
    jit = sys.modules["megatron.core.jit"]
    if jit.jit_fuser is _uncompiled:  # modules loaded from now on compile their kernels again
        jit.jit_fuser = torch.compile
    logging.getLogger(rng.__name__).removeFilter(_RNG_FILTER)
    _state.clear()

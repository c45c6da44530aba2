"""The driver's GPU path, checked on a CPU: what the flags become in megatron-core's TransformerConfig, process groups
and optimizer when CUDA (and, where it matters, Transformer Engine) is present, and that no flag is accepted and then
ignored. Runs that must train are in test_train_driver.py (overlapped parameter gather across a checkpoint)."""
import argparse
import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from labkit.spec import load_spec
from labkit.jobs.submission import submission_errors
from labkit.spec.checks import check_job
from labkit.megatron_args import megatron_args
from labkit.train import arguments, model, training
from labkit.train.arguments import ArgumentError, build_parser, finish

TRAIN = Path(__file__).resolve().parent.parent / "labkit" / "train"
MODEL = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64".split()
BASE = [*MODEL, "--mock-data", "--vocab-size", "1023", "--lr", "1e-3", "--train-iters", "2"]


def parsed(flags, world_size=1, cuda=False, te=False, monkeypatch=None) -> argparse.Namespace:
    if monkeypatch is not None:
        monkeypatch.setattr(arguments, "_te_importable", lambda: te)
    return finish(build_parser().parse_args([*BASE, *flags]), world_size=world_size, rank=0, cuda=cuda)


@pytest.fixture
def gpu_config(monkeypatch):
    """TransformerConfig as the driver builds it on a GPU machine (CUDA reported present; nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return lambda args: model.transformer_config(args)


def test_interleaved_two_stages_on_nccl_overlap_their_messages_instead_of_batching_them(gpu_config):
    """Two interleaved stages batch sends and receives in both directions between the same two ranks, which NCCL
    matches in posting order: activations and gradients swap. Megatron-LM overlaps them instead (batch_p2p_comm =
    not overlap_p2p_comm) and refuses batching with two stages."""
    args = parsed(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                   "--global-batch-size", "4"], world_size=2, cuda=True)
    assert args.distributed_backend == "nccl" and args.virtual_pipeline_model_parallel_size == 2
    config = gpu_config(args)
    assert config.overlap_p2p_comm and not config.batch_p2p_comm
    with pytest.raises(ArgumentError, match=r"^--no-overlap-p2p-communication: .*pipeline-model-parallel-size 2"):
        parsed(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                "--global-batch-size", "4", "--no-overlap-p2p-communication"], world_size=2, cuda=True)


def test_gloo_sends_and_receives_in_posting_order_without_freeing_what_it_sends():
    """gloo's asynchronous send reads its tensor when it runs, after an overlapped schedule has freed it."""
    args = parsed(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                   "--global-batch-size", "4"], world_size=2)
    config = model.transformer_config(args)
    assert args.distributed_backend == "gloo"
    assert not config.overlap_p2p_comm and not config.batch_p2p_comm and not config.deallocate_pipeline_outputs


def test_batched_messages_where_they_are_safe(gpu_config):
    plain = gpu_config(parsed(["--pipeline-model-parallel-size", "2"], world_size=2, cuda=True))
    assert plain.batch_p2p_comm and not plain.overlap_p2p_comm  # 1F1B: one direction per batch
    four = gpu_config(parsed(["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                              "--num-layers", "8", "--global-batch-size", "4", "--no-overlap-p2p-communication"],
                             world_size=4, cuda=True))
    assert four.batch_p2p_comm and not four.overlap_p2p_comm


@pytest.mark.parametrize("flags, named", [
    (["--context-parallel-size", "2"], "--context-parallel-size"),
    (["--tp-comm-overlap", "--sequence-parallel", "--tensor-model-parallel-size", "2"], "--tp-comm-overlap"),
])
@pytest.mark.parametrize("cuda, te", [(False, False), (True, True)])
def test_what_the_driver_does_not_set_up_is_refused_on_every_machine(flags, named, cuda, te, monkeypatch):
    """Context parallelism (batches sliced per context rank, losses reduced over them) and Transformer Engine's
    userbuffers are Megatron-LM's; the driver refuses them naming the flag rather than training something else."""
    with pytest.raises(ArgumentError, match=f"^{named}: labkit's driver does not"):
        parsed(flags, world_size=4, cuda=cuda, te=te, monkeypatch=monkeypatch)


def test_a_spec_for_the_driver_with_context_parallelism_is_refused_before_submission():
    spec = load_spec({"model": {"preset": "tiny"}, "parallel": {"context": 2}, "precision": "bf16",
                      "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 2}]}})
    assert any(e.startswith("parallel.context: labkit's driver") and "Megatron-LM's pretrain_gpt.py" in e
               for e in submission_errors(spec, "local"))
    assert not any(e.startswith("parallel.context") for e in check_job(spec))  # a valid plan, estimated as is
    megatron = spec.replace(**{"job.entrypoint": "megatron-lm", "job.megatron_lm": "/opt/Megatron-LM"})
    assert not any(e.startswith("parallel.context") for e in submission_errors(megatron, "local"))


def test_fp8_and_the_attention_backend_reach_megatron_core_with_transformer_engine(gpu_config, monkeypatch):
    args = parsed(["--bf16", "--fp8-format", "hybrid", "--attention-backend", "flash"], cuda=True, te=True,
                  monkeypatch=monkeypatch)
    assert args.transformer_impl == "transformer_engine"
    config = gpu_config(args)
    assert config.fp8 == "hybrid"
    assert config.attention_backend.name == "flash"


def test_the_timers_default_to_megatron_lms_level_and_the_spec_sets_it():
    assert build_parser().parse_args(BASE).timing_log_level == 0
    spec = load_spec({"model": {"preset": "tiny"}})
    assert "--timing-log-level" not in megatron_args(spec)
    flags = megatron_args(spec.replace(**{"train.timing_log_level": 2}))
    assert flags[flags.index("--timing-log-level") + 1] == "2"
    with pytest.raises(Exception, match=r"train.timing_log_level: 3 is not 0, 1 or 2"):
        spec.replace(**{"train.timing_log_level": 3})


def _fake_find_spec(present):
    real = importlib.util.find_spec
    return lambda name, *a, **k: object() if name in present else (None if name in (
        "triton", "scaled_masked_softmax_cuda", "fused_weight_gradient_mlp_cuda") else real(name, *a, **k))


def test_fused_kernels_are_on_where_their_kernel_exists(gpu_config, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec({"triton"}))
    args = parsed(["--bf16"], cuda=True)
    config = gpu_config(args)
    assert config.bias_activation_fusion and config.bias_dropout_fusion  # torch.compile with Triton
    assert not config.masked_softmax_fusion and not config.gradient_accumulation_fusion  # Apex or TE only
    line = model.fusions_line(args, cuda=True)
    assert "bias_dropout on" in line and "masked_softmax off (needs a GPU and the scaled_masked_softmax_cuda" in line
    no_bias = parsed(["--bf16", "--disable-bias-linear"], cuda=True)
    assert not gpu_config(no_bias).bias_activation_fusion  # GeLU without biases: Megatron-LM turns it off too
    assert not gpu_config(parsed(["--bf16", "--no-bias-dropout-fusion"], cuda=True)).bias_dropout_fusion
    assert "bias_dropout off (off by --no-bias-dropout-fusion)" in model.fusions_line(
        parsed(["--no-bias-dropout-fusion"], cuda=True), cuda=True)


def test_no_fusion_on_a_cpu(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec({"triton"}))
    assert not any(on for on, _ in model.fusions(parsed([]), cuda=False).values())


def test_pipeline_outputs_are_freed_once_sent(gpu_config):
    assert gpu_config(parsed(["--pipeline-model-parallel-size", "2"], world_size=2, cuda=True)) \
        .deallocate_pipeline_outputs


def test_process_groups_get_the_timeout_and_no_unused_gloo_copies(monkeypatch):
    calls = {}
    monkeypatch.setattr(training.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(training.dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(training.parallel_state, "initialize_model_parallel",
                        lambda **kw: calls.setdefault("groups", kw))
    monkeypatch.setattr(training.parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(training.tensor_parallel, "model_parallel_cuda_manual_seed", lambda seed: None)
    training.initialize(parsed(["--distributed-timeout-minutes", "3"], world_size=2))
    assert calls["init"]["timeout"].total_seconds() == 180
    assert calls["groups"]["create_gloo_process_groups"] is False


def test_a_failed_rank_exits_without_waiting_in_the_group_teardown(monkeypatch):
    from labkit.train import __main__ as entry
    from labkit.train import cpu_compat

    destroyed = []
    monkeypatch.setattr(cpu_compat, "apply", lambda: None)
    monkeypatch.setattr(training, "run", lambda args: (_ for _ in ()).throw(training.TrainingError("out of memory")))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: destroyed.append(True))
    assert entry.main(BASE) == 1 and destroyed == []
    monkeypatch.setattr(training, "run", lambda args: 0)
    assert entry.main(BASE) == 0 and destroyed == [True]


# Flags the driver reads only to derive others (finish() maps them), or that only its parser and log use.
DERIVED = {
    "group_query_attention": "num_query_groups", "num_layers_per_virtual_pipeline_stage":
    "virtual_pipeline_model_parallel_size", "recompute_activations": "recompute_granularity",
    "checkpoint_activations": "recompute_granularity", "activations_checkpoint_method": "recompute_method",
    "activations_checkpoint_num_layers": "recompute_num_layers", "lr_warmup_fraction": "lr_warmup_iters",
    "data_path": "data_prefixes", "bias_gelu_fusion": "bias_activation_fusion",
    "bias_swiglu_fusion": "bias_activation_fusion",
    "use_pytorch_profiler": None,  # Megatron-LM's choice between profilers; the driver's --profile is torch.profiler
    "zero_stage": None,  # Megatron-DeepSpeed's spelling of the stage ds_config.json sets; the parser checks they agree
    "help": None,
    # the driver saves the distributed optimizer fully reshardable whatever it is told (labkit/train/checkpoint.py)
    "dist_ckpt_optim_fully_reshardable": None,
}
REFUSED = {"tp_comm_overlap": ["--tp-comm-overlap"], "context_parallel_size": ["--context-parallel-size", "2"],
           "use_megatron_fsdp": ["--use-megatron-fsdp"],
           "data_parallel_sharding_strategy": ["--data-parallel-sharding-strategy", "optim"],
           "ckpt_format": ["--ckpt-format", "torch_dcp"], "cuda_graph_impl": ["--cuda-graph-impl", "local"],
           "cuda_graph_scope": ["--cuda-graph-scope", "attn"],
           "moe_pad_experts_for_cuda_graph_inference": ["--moe-pad-experts-for-cuda-graph-inference"],
           "overlap_moe_expert_parallel_comm": ["--overlap-moe-expert-parallel-comm"]}


def _attributes_read_outside_the_parser() -> set[str]:
    read = set()
    for path in TRAIN.glob("*.py"):
        if path.name == "arguments.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value).split(".")[-1] == "args":
                read.add(node.attr)  # args.name, self.args.name
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                read.add(node.value)  # getattr(args, "name") and tables keyed by the name
    return read


def test_every_flag_the_parser_accepts_is_used_or_refused(monkeypatch):
    """A flag the driver takes must change what it does: read beyond the parser, derived into one that is, or
    refused with an error naming it; never accepted and dropped."""
    read = _attributes_read_outside_the_parser()
    unused = []
    for action in build_parser()._actions:
        dest = action.dest
        if dest in read or dest in REFUSED:
            continue
        if dest in DERIVED and (DERIVED[dest] is None or DERIVED[dest] in read):
            continue
        unused.append(action.option_strings[0])
    assert unused == []
    for dest, flags in REFUSED.items():
        with pytest.raises(ArgumentError, match=re.escape(flags[0])):
            parsed([*flags, "--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=4, cuda=True,
                   te=True, monkeypatch=monkeypatch)


def test_the_flag_audit_sees_a_dropped_flag(monkeypatch):
    original = arguments.build_parser

    def with_an_unused_flag():
        parser = original()
        parser.add_argument("--never-read-anywhere", action="store_true")
        return parser

    monkeypatch.setattr(arguments, "build_parser", with_an_unused_flag)
    monkeypatch.setitem(globals(), "build_parser", with_an_unused_flag)
    with pytest.raises(AssertionError, match="--never-read-anywhere"):
        test_every_flag_the_parser_accepts_is_used_or_refused(monkeypatch)

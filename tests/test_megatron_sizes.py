"""Megatron's size rules (labkit.megatron.sizes), each checked against megatron-core's own objects where one holds the
rule, and against Megatron-LM's arithmetic where only Megatron-LM's training code does; then the estimator against
the model the driver builds, for every preset."""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import yaml

from labkit import diagrams
from labkit.estimate import Shape, estimate
from labkit.megatron import sizes
from labkit.megatron_args import megatron_args
from labkit.paths import data_file
from labkit.profiling import trace as tr
from labkit.spec import load_spec
from labkit.spec.layout import layout_of
from labkit.train.arguments import parse_args

PRESETS = list(yaml.safe_load(data_file("models.yaml").read_text())["models"])


def core_config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "use_cpu_initialization": True}
    if kw.get("pipeline_model_parallel_size", 1) > 1:
        base["pipeline_dtype"] = torch.float32
    return TransformerConfig(**{**base, **kw})


# --- the MLP width --------------------------------------------------------------------------------------------------

def test_ffn_default_is_megatron_lm_rule():
    # Megatron-LM's validate_args (megatron/training/arguments.py, core_v0.16.1) computes the SwiGLU default in floats
    for h in [*range(1, 20000), 4096, 5120, 8192, 12288, 16384, 53248]:
        assert sizes.ffn_hidden_size(h, True) == int((4 * h * 2 / 3) / 64) * 64, h
    assert sizes.ffn_hidden_size(64, True) == 128
    assert sizes.ffn_hidden_size(1600, True) == 4224
    assert sizes.ffn_hidden_size(4096, True) == 10880  # Llama 2 7B writes its own 11008
    assert sizes.ffn_hidden_size(4096, True, written=11008) == 11008
    assert sizes.ffn_hidden_size(4096, False, written=11008) == 11008


def test_ffn_default_without_swiglu_is_megatron_cores():
    for h in (64, 1600, 4096):
        assert core_config(hidden_size=h).ffn_hidden_size == sizes.ffn_hidden_size(h, False) == 4 * h


def test_spec_and_estimator_take_the_swiglu_default():
    spec = load_spec({"model": {"preset": "gpt2-xl", "swiglu": True}})
    assert spec.model.ffn_hidden_size is None
    assert spec.model.ffn_size == Shape.of(spec.model).ffn_size == 4224


# --- query groups and the vocabulary -------------------------------------------------------------------------------

def test_query_groups_default_is_megatron_cores():
    assert core_config(num_attention_heads=8, hidden_size=64).num_query_groups == sizes.query_groups(8) == 8
    assert core_config(num_attention_heads=8, hidden_size=64, num_query_groups=2).num_query_groups \
        == sizes.query_groups(8, 2) == 2


def test_vocabulary_is_padded_like_megatron_lm():
    # Megatron-LM's _vocab_size_with_padding: ceil(vocab / (divisible_by x tensor)) x that multiple
    for vocab in (1, 127, 128, 129, 730, 1024, 32000, 50257, 128256):
        for divisible_by in (1, 64, 128):
            for tensor in (1, 2, 3, 8):
                multiple = divisible_by * tensor
                assert sizes.padded_vocab_size(vocab, divisible_by, tensor) == math.ceil(vocab / multiple) * multiple
    assert sizes.padded_vocab_size(50257, 128, 1) == 50304
    assert sizes.padded_vocab_size(50257, 128, 8) == 51200
    with pytest.raises(sizes.SizeError, match="must be positive"):
        sizes.padded_vocab_size(50257, 0, 1)


# --- data-parallel size --------------------------------------------------------------------------------------------

def test_data_parallel_size_counts_context_ranks_out():
    assert sizes.data_parallel_size(16, tensor=2, context=2, pipeline=2) == 2
    assert sizes.data_parallel_size(64, tensor=4, pipeline=8) == 2
    assert sizes.data_parallel_size(1) == 1
    with pytest.raises(sizes.SizeError, match=r"world size 12 is not divisible by tensor 2 x context 2 x pipeline 2"):
        sizes.data_parallel_size(12, tensor=2, context=2, pipeline=2)


def _parallel_state_sizes(rank: int, world: int, store_path: str, out: str, splits) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store_path, world))
    found = []
    for t, c, p in splits:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=t, context_parallel_size=c,
                                                 pipeline_model_parallel_size=p)
        found.append(parallel_state.get_data_parallel_world_size())
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(found))


def test_data_parallel_size_is_megatron_cores(tmp_path):
    """megatron-core's initialize_model_parallel in a real gloo world of 4 processes sizes its data-parallel groups as
    sizes.data_parallel_size does, context ranks excluded."""
    import torch.multiprocessing as mp
    from megatron.core import parallel_state  # noqa: F401  imported once here, not in each forked rank (7 s of 9)

    world, splits = 4, [(1, 2, 1), (2, 1, 1), (1, 1, 2), (2, 2, 1), (1, 1, 1)]
    out = tmp_path / "sizes.json"
    # forked, not spawned: a spawned process would import labkit and megatron-core all over again
    mp.start_processes(_parallel_state_sizes, args=(world, str(tmp_path / "store"), str(out), splits), nprocs=world,
                       start_method="fork")
    assert json.loads(out.read_text()) == [sizes.data_parallel_size(world, t, c, p) for t, c, p in splits] \
        == [2, 2, 2, 1, 4]


def llama_with_context():
    """Llama 2 7B at tensor 2, pipeline 2, context 2 on 16 H100s (run by Megatron-LM: labkit's driver has no context
    parallelism)."""
    return load_spec({"model": {"preset": "llama2-7b"}, "parallel": {"tensor": 2, "pipeline": 2, "context": 2},
                      "batch": {"global": 16}, "precision": "bf16",
                      "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]},
                      "job": {"entrypoint": "megatron-lm", "megatron_lm": "/workspace/megatron-lm"}})


def test_driver_and_spec_derive_the_same_data_parallel_size():
    spec = load_spec({"model": {"preset": "tiny"}, "parallel": {"tensor": 2, "pipeline": 2, "data": 2}})
    args = parse_args([str(a) for a in megatron_args(spec)], world_size=8, rank=0, cuda=False)
    assert spec.data_parallel == layout_of(spec).data == args.data_parallel_size == 2
    spec = llama_with_context()
    assert spec.data_parallel == layout_of(spec).data == 2 and layout_of(spec).world_size == 16


def test_diagram_caption_counts_context_ranks():
    """The issue's example: the caption said 4 GPUs per stage (tensor x data), the layout places 8."""
    spec = llama_with_context()
    svg = diagrams.heterogeneous_pipeline_svg(spec)
    caption = next(ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text")).text
    assert layout_of(spec).per_stage == 8
    assert "8 GPU(s) per stage (TP 2 x CP 2 x DP 2)" in caption


def _trace(tmp_path, world: int, events) -> tr.Trace:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": world}}))
    return tr.load_trace(path)


def _op(name, ts, dur, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": 100, "ts": ts, "dur": dur, "args": args}


def test_trace_layout_counts_context_ranks(tmp_path):
    # a flat all-reduce on 4 ranks at tensor 2 x context 2 has no data-parallel group to be in: it is tensor-parallel
    t = _trace(tmp_path, 4, [_op("c10d::allreduce_", 0, 10, **{"Input Dims": [[[5000]]]})])
    assert tr.communication_calls(t, tensor=2)["group"].tolist() == ["dp"]
    assert tr.communication_calls(t, tensor=2, context=2)["group"].tolist() == ["tp"]
    with pytest.raises(ValueError, match="world size 4 is not divisible by tensor 3"):
        tr.communication_calls(t, tensor=3)


def test_trace_names_the_context_parallel_group_from_its_ranks(tmp_path):
    # rank 0 of tensor 2 x context 2 x data 2: its context group is ranks 0 and 2 (labkit.spec.layout's order)
    events = [_op("c10d::allreduce_", 0, 10, **{"Input Dims": [[[64, 2, 32]]]}),
              _op("record_param_comms", 1, 1, **{"Process Group Ranks": "[0, 2]"})]
    t = _trace(tmp_path, 8, events)
    assert tr.communication_calls(t, tensor=2, context=2)["group"].tolist() == ["cp"]
    # the same ranks form a data-parallel group at tensor 2 x data 2 x pipeline 2
    assert tr.communication_calls(t, tensor=2, pipeline=2)["group"].tolist() == ["dp"]


# --- layers per pipeline stage -------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers, pipeline, virtual", [(8, 2, 1), (8, 2, 2), (8, 2, 4), (12, 4, 3), (12, 3, 1)])
def test_layers_per_stage_are_megatron_cores(layers, pipeline, virtual):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = core_config(num_layers=layers, pipeline_model_parallel_size=pipeline,
                         virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None)
    for rank in range(pipeline):
        if virtual == 1:
            assert get_num_layers_to_build(config, pp_rank=rank) == sizes.layers_per_stage(layers, pipeline)
        for chunk in range(virtual):
            built = get_num_layers_to_build(config, vp_stage=chunk if virtual > 1 else None, pp_rank=rank)
            assert built == sizes.layers_per_virtual_stage(layers, pipeline, virtual)


def test_uneven_layers_are_refused():
    with pytest.raises(sizes.SizeError, match="10 layers do not split evenly over 4 pipeline stages"):
        sizes.layers_per_stage(10, 4)
    with pytest.raises(sizes.SizeError, match="the 4 layers of each pipeline stage .* into 3 virtual stages"):
        sizes.layers_per_virtual_stage(8, 2, 3)


# --- the estimate against the model the driver builds ---------------------------------------------------------------

@pytest.fixture(scope="module")
def driver():
    """Builds a spec's model exactly as the driver does (its arguments, tokenizer vocabulary, transformer_config and
    build_model), on the meta device so that 405B parameters cost nothing, in a gloo world of one process; returns
    the parameter count the driver logs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from labkit.train import cpu_compat, data
    from labkit.train import model as driver_model

    # as the driver starts on a machine without CUDA (MoE layers make CUDA streams as they are built)
    applied_here = not cpu_compat.is_applied() and cpu_compat.apply()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    parallel_state.initialize_model_parallel()
    wrap = driver_model.DistributedDataParallel

    def build(spec) -> int:
        args = parse_args([str(a) for a in megatron_args(spec)], world_size=1, rank=0, cuda=False)
        args.padded_vocab_size = sizes.padded_vocab_size(data.build_tokenizer(args).vocab_size,
                                                         args.make_vocab_size_divisible_by,
                                                         args.tensor_model_parallel_size)
        with torch.device("meta"):
            config = driver_model.transformer_config(args)
            driver_model.build_model(args, config)
        return args.num_parameters

    # DDP's gradient buffers would be real memory; the count is taken before the model is wrapped
    driver_model.DistributedDataParallel = lambda config, ddp_config, module, **kw: module
    try:
        yield build
    finally:
        driver_model.DistributedDataParallel = wrap
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        if applied_here:
            cpu_compat.remove()


CASES = [({"preset": name}) for name in PRESETS] + [
    {"preset": "tiny", "swiglu": True}, {"preset": "gpt2-xl", "swiglu": True},
    {"preset": "tiny", "qk_layernorm": True, "kv_channels": 32},  # a dense model with Qwen3's attention
    {"preset": "tiny", "num_experts": 4, "add_bias_linear": False, "moe_layer_freq": "([0]+[1]*1)",
     "moe_shared_expert_intermediate_size": 96},
    {"preset": "tiny", "num_experts": 4},  # biases: the router's too
]


@pytest.mark.parametrize("model", CASES, ids=lambda m: "-".join(f"{v}" if k == "preset" else k for k, v in m.items())
                         if isinstance(m, dict) else None)
def test_estimate_counts_the_model_the_driver_builds(driver, model):
    spec = load_spec({"model": model})
    est = estimate(spec)
    assert est.params_with_padding == driver(spec)
    # the unpadded count differs by the padded rows alone (twice with untied output weights)
    padded_rows = est.padded_vocab_size - spec.model.vocab_size
    copies = 2 if spec.model.untie_embeddings else 1
    assert est.params == est.params_with_padding - copies * padded_rows * spec.model.hidden_size


def test_tiny_swiglu_estimate_is_the_drivers_model(driver):
    """The issue's example: the tiny preset with swiglu and no ffn_hidden_size was estimated at 203,008 parameters
    (a 4h MLP) while the driver built 153,344 (Megatron-LM's 128-wide SwiGLU MLP)."""
    spec = load_spec({"model": {"preset": "tiny", "swiglu": True}})
    assert estimate(spec).params == estimate(spec).params_with_padding == driver(spec) == 153_344


# --- how many virtual stages split a model -------------------------------------------------------------------------

@pytest.mark.parametrize("layers, pipeline, counts", [
    (80, 8, [1, 2, 5, 10]),     # NVIDIA's Llama 3 70B: pipeline 8, 5 virtual stages
    (80, 4, [1, 2, 4, 5, 10, 20]),
    (126, 16, [1, 2, 4, 8]),    # Llama 3.1 405B: only with the embedding and the loss counted
    (24, 1, [1]),
])
def test_virtual_stage_counts_are_the_splits_megatron_accepts(layers, pipeline, counts):
    assert sizes.virtual_stage_counts(layers, pipeline) == counts
    for v in range(2, layers + 3):
        splits = []
        for accounted in (False, True):
            try:
                chunks = sizes.chunk_layers(layers, pipeline, v, account_for_embedding=accounted,
                                            account_for_loss=accounted)
                splits.append(sum(map(sum, chunks)) == layers)
            except sizes.SizeError:
                pass
        assert (v in counts) == (pipeline > 1 and any(splits)), v


# --- the rules that tie sizes together, worded for the spec and for the driver ------------------------------------

@pytest.mark.parametrize("heads, hidden, groups, tensor", [
    (12, 96, None, 5), (12, 100, None, 1), (12, 96, 5, 1), (12, 96, 6, 4), (16, 128, 8, 4), (8, 64, None, 2)])
def test_shape_rules_are_megatrons_and_both_callers_word_them(heads, hidden, groups, tensor):
    from labkit.megatron import rules
    from labkit.megatron.flags import ArgumentError, build_parser
    from labkit.spec import SpecError
    from labkit.spec.checks import SPEC_FIELDS
    from labkit.train.arguments import finish

    problems = rules.shape_problems(str, heads=heads, hidden=hidden, groups=groups, tensor=tensor)
    try:  # megatron-core refuses heads or query groups that do not split over the tensor ranks
        core_config(num_attention_heads=heads, hidden_size=hidden, num_query_groups=groups,
                    tensor_model_parallel_size=tensor)
        core_refuses = False
    except (ValueError, AssertionError):
        core_refuses = True
    assert core_refuses == any("tensor_model_parallel_size" in p.message for p in problems)
    # Megatron-LM's validate_args adds the rest: hidden size over heads, heads over query groups
    assert (hidden % heads != 0 or (groups is not None and heads % groups != 0)) == \
        any("tensor_model_parallel_size" not in p.message for p in problems)

    spec = {"model": {"preset": "tiny", "num_attention_heads": heads, "hidden_size": hidden,
                      "num_query_groups": groups}, "parallel": {"tensor": tensor},
            "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": tensor}]}}
    argv = ["--num-layers", "2", "--hidden-size", str(hidden), "--num-attention-heads", str(heads), "--seq-length",
            "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size",
            "64", "--tensor-model-parallel-size", str(tensor)]
    if groups is not None:
        argv += ["--group-query-attention", "--num-query-groups", str(groups)]
    if not problems:
        load_spec(spec)
        finish(build_parser().parse_args(argv), tensor, 0, False)
        return
    worded = rules.shape_problems(SPEC_FIELDS.get, heads=heads, hidden=hidden, groups=groups, tensor=tensor)
    with pytest.raises(SpecError) as spec_refused:
        load_spec(spec)
    assert f"{SPEC_FIELDS[worded[0].argument]}: {worded[0].message}" in spec_refused.value.errors
    with pytest.raises(ArgumentError) as driver_refused:
        finish(build_parser().parse_args(argv), tensor, 0, False)
    message = str(driver_refused.value)
    assert message.startswith("--" + problems[0].argument.replace("_", "-") + ": ")
    assert "--tensor-model-parallel-size" in message or "--num-attention-heads" in message


@pytest.mark.parametrize("case", ["sequence parallel on one tensor rank", "overlapped gather without the optimizer",
                                  "overlapped gather without the overlapped reduce"])
def test_paired_settings_are_refused_alike_by_the_spec_and_the_driver(case):
    from labkit.megatron.flags import ArgumentError, build_parser
    from labkit.spec import SpecError
    from labkit.train.arguments import finish

    spec = {"model": {"preset": "tiny"}, "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 2}]}}
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", "64"]
    if case.startswith("sequence"):
        spec["parallel"] = {"tensor": 1, "data": 2, "sequence_parallel": True}
        argv += ["--sequence-parallel"]
        field, flag = "parallel.sequence_parallel", "--sequence-parallel"
    elif case.endswith("optimizer"):
        spec["kernels"] = {"overlap_param_gather": True, "overlap_grad_reduce": True}
        spec["optimizer"] = {"distributed": False}
        argv += ["--overlap-param-gather", "--overlap-grad-reduce"]
        field, flag = "kernels.overlap_param_gather", "--overlap-param-gather"
    else:  # Megatron-LM's validate_args asserts both overlaps together
        spec["kernels"] = {"overlap_param_gather": True}
        spec["optimizer"] = {"distributed": True}
        argv += ["--overlap-param-gather", "--use-distributed-optimizer"]
        field, flag = "kernels.overlap_param_gather", "--overlap-param-gather"
    with pytest.raises(SpecError) as spec_refused:
        load_spec(spec)
    with pytest.raises(ArgumentError) as driver_refused:
        finish(build_parser().parse_args(argv), 2, 0, True)
    spec_error = next(e for e in spec_refused.value.errors if e.startswith(field + ": "))
    # one rule, two vocabularies: the same words once each caller's names are swapped in
    names = {"parallel.tensor": "--tensor-model-parallel-size", "optimizer.distributed": "--use-distributed-optimizer",
             "kernels.overlap_grad_reduce": "--overlap-grad-reduce"}
    for spec_name, flag_name in names.items():
        spec_error = spec_error.replace(spec_name, flag_name)
    assert spec_error.split(": ", 1)[1] == str(driver_refused.value).split(": ", 1)[1]
    assert str(driver_refused.value).startswith(flag + ": ")

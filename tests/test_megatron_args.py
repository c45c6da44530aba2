"""Golden files for spec -> Megatron-LM flags. Regenerate with LABKIT_UPDATE_GOLDEN=1 and review the diff."""
import os
import shlex
from pathlib import Path

import pytest
import yaml

from labkit.megatron_args import megatron_args, pipeline_layout
from labkit.spec import load_spec
from labkit.megatron.flags import flag_errors

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden" / "megatron_args"
LLAMA_TOKENIZER = ROOT / "labkit" / "data" / "tokenizer" / "llama" / "tokenizer.json"

CASES = {
    "gpt2-xl-hetero": (ROOT / "examples" / "gpt2-xl-hetero.yaml", {}, False),
    "gpt2-xl-hetero-legacy": (ROOT / "examples" / "gpt2-xl-hetero.yaml", {}, True),
    "tiny-cpu": (ROOT / "examples" / "tiny-cpu.yaml", {}, False),
    "workshop-fp16-selective": (ROOT / "examples" / "tiny-cpu.yaml",
                                {"model": {"preset": "gpt2-small"}, "precision": "fp16",
                                 "recompute": {"granularity": "selective"}, "cluster": "workshop-a100x2",
                                 "batch": {"micro": 4, "global": 16},
                                 "data": {"path": "/data/my-gpt2_text_document", "mock": False}}, False),
    "llama-gqa-interleaved": (ROOT / "examples" / "tiny-cpu.yaml",
                              {"model": {"preset": "llama2-7b", "num_query_groups": 8},
                               "parallel": {"tensor": 2, "pipeline": 4, "virtual_stages": 2, "sequence_parallel": True},
                               "precision": "bf16", "optimizer": {"distributed": True},
                               "batch": {"micro": 1, "global": 32},
                               "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]}}, False),
    # Llama 3.1 405B's interleaved pipeline: the embedding and loss counted as layers, then the same as a layout
    "llama3.1-405b-account-for": (ROOT / "examples" / "llama3.1-405b-interleaved.yaml", {}, False),
    "llama3.1-405b-layout": (ROOT / "examples" / "llama3.1-405b-interleaved.yaml",
                             {"parallel": {"tensor": 8, "pipeline": 16, "virtual_stages": 8, "sequence_parallel": True,
                                           "pipeline_layout": "E|(t|)*126,L"}}, False),
    "bf16-grad-reduce-distributed": (ROOT / "examples" / "tiny-cpu.yaml",
                                     {"precision": "bf16", "cluster": "workshop-a100x2",
                                      "optimizer": {"distributed": True, "grad_reduce_in_bf16": True}}, False),
    "tiny-llama-hf-tokenizer": (ROOT / "examples" / "tiny-cpu.yaml",
                                {"model": {"preset": "tiny-llama"},
                                 "data": {"path": "/data/corpus-llama_text_document", "mock": False, "tokenizer":
                                          {"type": "HuggingFaceTokenizer", "model": str(LLAMA_TOKENIZER)}}},
                                False),
}


def render(name: str) -> str:
    path, overrides, legacy = CASES[name]
    data = yaml.safe_load(path.read_text())
    data.update(overrides)
    args = megatron_args(load_spec(data), legacy=legacy)
    # One flag per line, values quoted, paths relative to the checkout so the golden file is portable.
    text = shlex.join(args).replace(str(ROOT) + "/", "")
    return text.replace(" --", " \\\n  --") + "\n"


@pytest.mark.parametrize("name", sorted(CASES))
def test_megatron_args_match_golden(name):
    golden = GOLDEN / f"{name}.txt"
    text = render(name)
    if os.environ.get("LABKIT_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_labkits_driver_accepts_every_rendered_flag(name):
    path, overrides, legacy = CASES[name]
    data = yaml.safe_load(path.read_text())
    data.update(overrides)
    assert flag_errors(megatron_args(load_spec(data), legacy=legacy)) == []


def test_fasop_partition_renders_as_megatron_core_layout():
    assert pipeline_layout([0, 11, 8, 8, 8, 8, 5, 0]) == "E|t*11|t*8|t*8|t*8|t*8|t*5|L"
    assert pipeline_layout([3, 2]) == "E,t*3|t*2,L"
    assert pipeline_layout([4]) == "E,t*4,L"


def test_layout_string_is_one_megatron_core_understands():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    layout = PipelineParallelLayerLayout(pipeline_layout([0, 11, 8, 8, 8, 8, 5, 0]), 8)
    # layout.layout[pp_rank] holds one list of layer types per virtual stage.
    decoders = [sum(layer.name == "decoder" for chunk in stage for layer in chunk) for stage in layout.layout]
    assert decoders == [0, 11, 8, 8, 8, 8, 5, 0]


def test_legacy_and_modern_recompute_spellings():
    legacy = render("gpt2-xl-hetero-legacy")
    modern = render("gpt2-xl-hetero")
    assert "--checkpoint-activations" in legacy and "--activations-checkpoint-method uniform" in legacy
    assert "--recompute-granularity full" in modern and "--recompute-method uniform" in modern
    assert "--recompute-granularity" not in legacy


def test_relative_data_files_render_as_read_here_and_absolute_ones_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_spec({"data": {"path": "runs/corpus_text_document", "vocab_file": "~/v.json"}})
    args = megatron_args(spec)
    assert args[args.index("--data-path") + 1] == str(tmp_path / "runs" / "corpus_text_document")
    assert args[args.index("--vocab-file") + 1] == str(Path.home() / "v.json")
    spec = load_spec({"data": {"path": "/data//a/../corpus_text_document"}})
    assert megatron_args(spec)[megatron_args(spec).index("--data-path") + 1] == "/data//a/../corpus_text_document"

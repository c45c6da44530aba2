"""The Llama family end to end on CPU: labkit's Llama-style tokenizer (rebuilt byte for byte), HuggingFace and
SentencePiece tokenizers in `labkit data prepare` and the driver, the spec's flags checked before anything runs, and
`tiny-llama` trained with tensor, pipeline (uneven and interleaved) and data parallelism, recomputation, bf16 and fp16,
each rank's parameters matching the estimate."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.data_prep import prepare
from labkit.estimate.params import rank_params
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec
from labkit.train.arguments import finish, build_parser
from labkit.megatron.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "labkit" / "data" / "corpus" / "corpus.jsonl"
LLAMA_TOKENIZER = ROOT / "labkit" / "data" / "tokenizer" / "llama" / "tokenizer.json"
TEXT = "Ada saw the fox by the river. Zürich, 日本!"
PARAMETERS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)")


def build_script():
    spec = importlib.util.spec_from_file_location("build_llama_tokenizer", ROOT / "data" / "build_llama_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_llama_tokenizer_rebuilds_byte_for_byte(tmp_path):
    rebuilt = build_script().build(out_dir=tmp_path)
    assert rebuilt.read_bytes() == LLAMA_TOKENIZER.read_bytes()


def test_the_llama_tokenizer_has_llamas_layout_and_falls_back_to_bytes():
    tokenizer = HuggingFaceTokenizer(LLAMA_TOKENIZER)
    vocab = json.loads(LLAMA_TOKENIZER.read_text())["model"]["vocab"]
    assert [vocab["<unk>"], vocab["<s>"], vocab["</s>"], vocab["<0x00>"], vocab["<0xFF>"]] == [0, 1, 2, 3, 258]
    assert tokenizer.eod == 2 and tokenizer.vocab_size == len(vocab)
    ids = tokenizer.tokenize(TEXT)
    assert ids[0] == 1  # <s> opens every document, as Llama's tokenizer does
    assert vocab["<0xC3>"] in ids  # ü is not in the corpus: its UTF-8 bytes stand in
    assert tokenizer.detokenize(ids) == TEXT


def test_a_sentencepiece_model_tokenizes_and_prepares_data(tmp_path):
    import sentencepiece

    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:300]]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=400, model_type="bpe", byte_fallback=True,
                                             num_threads=1, minloglevel=2)
    tokenizer = SentencePieceTokenizer(tmp_path / "sp.model")
    ids = tokenizer.tokenize(TEXT)
    # Megatron-LM's vocabulary: the 400 pieces (<unk> <s> </s> among them, no pad), then <CLS> <SEP> <EOD> <MASK> <PAD>.
    assert tokenizer.vocab_size == 405 and tokenizer.eod == 402
    assert ids[0] != 1 and max(ids) < 400
    assert tokenizer.detokenize(ids) == TEXT
    assert tokenizer.detokenize([*ids, tokenizer.eod]) == TEXT + " <EOD>"

    corpus = tmp_path / "few.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:20]))
    result = prepare(corpus, tmp_path / "sp-data", tokenizer_type="SentencePieceTokenizer",
                     tokenizer_model=tmp_path / "sp.model", progress=False)
    assert result["documents"] == 20
    assert result["tokens"] == sum(len(tokenizer.tokenize(t)) + 1 for t in texts[:20])


def test_data_prepare_writes_llama_tokens_that_read_back_as_the_text(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:5]]
    corpus = tmp_path / "five.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    result = prepare(corpus, tmp_path / "llama", tokenizer_type="HuggingFaceTokenizer",
                     tokenizer_model=LLAMA_TOKENIZER, progress=False)
    dataset = IndexedDataset(result["prefix"])
    tokenizer = HuggingFaceTokenizer(LLAMA_TOKENIZER)
    assert len(dataset) == 5
    for text, ids in zip(texts, (dataset[i].tolist() for i in range(5))):
        assert ids[0] == 1 and ids[-1] == tokenizer.eod
        assert tokenizer.detokenize(ids[:-1]) == text


def test_data_prepare_without_the_tokenizer_file_exits_2_naming_the_flag(tmp_path, capsys):
    from labkit.cli import main

    rc = main(["data", "prepare", str(CORPUS), "--output-prefix", str(tmp_path / "x"),
               "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "none.json"),
               "--quiet"])
    assert rc == 2 and "--tokenizer-model: no such file" in capsys.readouterr().err


def test_the_driver_reads_the_llama_flags_as_megatron_names_them():
    spec = load_spec({"model": {"preset": "tiny-llama"}})
    args = finish(build_parser().parse_args(megatron_args(spec)), world_size=1, rank=0, cuda=False)
    assert (args.normalization, args.position_embedding_type, args.rotary_base) == ("RMSNorm", "rope", 10000)
    assert args.add_bias_linear is False and args.swiglu and args.untie_embeddings_and_output_weights
    assert args.num_query_groups == 2


def test_validate_refuses_a_flag_the_driver_would_refuse_naming_it():
    with pytest.raises(SpecError) as error:
        load_spec({"model": {"preset": "tiny"}, "job": {"extra_args": ["--normalisation", "RMSNorm"]}})
    assert "job.extra_args: unrecognized arguments: --normalisation" in str(error.value)
    with pytest.raises(SpecError) as error:
        load_spec({"model": {"preset": "tiny"}, "job": {"extra_args": ["--position-embedding-type", "alibi"]}})
    assert "--position-embedding-type: invalid choice: 'alibi'" in str(error.value)
    spec = load_spec({"model": {"preset": "tiny"}, "job": {"extra_args": ["--normalization", "RMSNorm"]}})
    assert megatron_args(spec)[-2:] == ["--normalization", "RMSNorm"]


def test_a_relative_tokenizer_path_renders_as_the_file_validate_read(monkeypatch):
    monkeypatch.chdir(LLAMA_TOKENIZER.parent)
    spec = load_spec({"model": {"preset": "tiny-llama"}, "data": {
        "path": "corpus", "mock": False, "tokenizer": {"type": "HuggingFaceTokenizer", "model": "tokenizer.json"}}})
    args = megatron_args(spec)
    assert args[args.index("--tokenizer-model") + 1] == str(LLAMA_TOKENIZER)


@pytest.mark.parametrize("model", [None, "missing/tokenizer.json", "."])
def test_a_missing_or_unreadable_tokenizer_file_is_refused_naming_the_field(model):
    tokenizer = {"type": "HuggingFaceTokenizer", **({"model": model} if model else {})}
    with pytest.raises(SpecError) as error:
        load_spec({"model": {"preset": "tiny-llama"}, "data": {"tokenizer": tokenizer}})
    assert "data.tokenizer.model:" in str(error.value)


def test_validating_a_spec_imports_neither_torch_nor_megatron():
    code = ("import sys; from labkit.spec import load_spec; "
            "load_spec({'model': {'preset': 'tiny-llama'}, 'job': {'extra_args': ['--norm-epsilon', '1e-5']}}); "
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


LAYOUTS = {
    "tp2": {"parallel": {"tensor": 2}},
    "pp2": {"parallel": {"pipeline": 2}},
    "dp2": {},
    "pp2-uneven-bf16-recompute": {"parallel": {"pipeline": 2, "partition": [1, 3]}, "precision": "bf16",
                                  "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}},
    # A fixed loss scale: dynamic scaling skips the first steps, which then log no loss.
    "pp2-interleaved-fp16": {"parallel": {"pipeline": 2, "virtual_stages": 2}, "precision": "fp16",
                             "optimizer": {"loss_scale": 128.0}},
    # ZeRO stages 2 and 3: PyTorch FSDP2 through megatron-core on labkit's driver (tests/test_zero.py)
    "dp2-zero2": {"optimizer": {"zero_stage": 2}},
    "dp2-zero3": {"optimizer": {"zero_stage": 3}},
}


@pytest.fixture(scope="module")
def trained(train_in_parallel):
    """tiny-llama for 3 iterations with each layout, two gloo processes each, all started at once."""
    return train_in_parallel({name: load_spec({"model": {"preset": "tiny-llama"}, "precision": "fp32",
                                               "batch": {"micro": 2, "global": 8},
                                               "train": {"iters": 3, "log_interval": 1},
                                               "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]},
                                               **changes})
                              for name, changes in LAYOUTS.items()})


@pytest.mark.slow
def test_zero_stages_2_and_3_train_to_plain_data_parallelisms_losses(trained):
    """The same data and seed: sharding changes where the model state lives, not the arithmetic beyond fp32
    rounding (the reductions' order)."""
    def losses(name):
        return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", trained[name][1])]

    # the driver's arguments block, as Megatron-LM prints it
    assert re.search(r"use_torch_fsdp2 \.+ True", trained["dp2-zero3"][1])
    assert re.search(r"torch_fsdp2_reshard_after_forward \.+ False", trained["dp2-zero2"][1])
    for name in ("dp2-zero2", "dp2-zero3"):
        assert losses(name) == pytest.approx(losses("dp2"), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tiny_llama_trains_and_each_ranks_parameters_match_the_estimate(trained, name):
    spec, text = trained[name]
    logged = {(int(t), int(p)): int(n) for t, p, n in PARAMETERS.findall(text)}
    expected_ranks = {(t, p) for t in range(spec.parallel.tensor) for p in range(spec.parallel.pipeline)}
    assert set(logged) == expected_ranks
    assert logged == {(t, p): rank_params(spec, t, p) for t, p in expected_ranks}
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", text)]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)

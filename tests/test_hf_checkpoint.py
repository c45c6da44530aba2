"""`labkit checkpoint import-hf` / `export-hf`: tiny random transformers models (Llama with GQA and untied
embeddings, GPT-2 with tied ones), made here without the hub, into labkit's driver and back."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from labkit.checkpoint.hf import _fuse_qkv, _split_qkv  # noqa: E402
from labkit.spec import load_spec  # noqa: E402

LOGITS_TOLERANCE = 1e-5
"""Largest |HF logit - driver logit|: fp32 rounding of sums done in another order (the logits are about 1; 3e-7
measured)."""
LOSS_TOLERANCE = 1e-5
"""Largest |HF loss - the driver's first lm loss|, the driver printing 7 significant digits."""


def _llama(path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=192, vocab_size=1024,
                                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return path


def _gpt2(path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=1024,
                                     activation_function="gelu", bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def _spec_file(path: Path, preset: str, **model) -> Path:
    spec = {"name": "hf", "model": {"preset": preset, "hidden_dropout": 0.0, "attention_dropout": 0.0, **model},
            "data": {"mock": True}, "train": {"iters": 1, "log_interval": 1, "ckpt_format": "torch_dist"}}
    path.write_text(json.dumps(spec))
    return path


def _labkit(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", *map(str, argv)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """{family: (HF model directory, spec file, the checkpoint import-hf wrote)}, each imported once."""
    out = {}
    for family, make, preset in (("llama", _llama, "tiny-llama"), ("gpt2", _gpt2, "tiny")):
        root = tmp_path_factory.mktemp(f"hf-{family}")
        hf, spec = make(root / "hf"), _spec_file(root / "spec.json", preset)
        done = _labkit("checkpoint", "import-hf", hf, "--spec", spec, "-o", root / "ckpt")
        assert done.returncode == 0, done.stderr
        out[family] = (hf, spec, root / "ckpt")
    return out


def _layout_spec(preset: str, ckpt: Path, tensor: int, pipeline: int):
    return load_spec({"name": f"hf-t{tensor}p{pipeline}", "model": {"preset": preset, "hidden_dropout": 0.0,
                                                                     "attention_dropout": 0.0},
                      "parallel": {"tensor": tensor, "pipeline": pipeline}, "batch": {"micro": 2, "global": 2},
                      "data": {"mock": True},
                      "train": {"iters": 1, "log_interval": 1, "load": str(ckpt), "ckpt_format": "torch_dist"}})


def _logits_gap(tokens, hf_logits):
    """measure(args) for on_driver_ranks: the driver's model loaded with train.load (checkpoint.load), its logits for
    `tokens` through megatron-core's pipeline schedule (forward only), gathered over tensor ranks; the last stage's
    first tensor rank returns the largest difference from `hf_logits`."""
    def measure(args):
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from labkit.train import checkpoint
        from labkit.train.model import build_model, transformer_config
        from labkit.train.training import build_optimizer

        config = transformer_config(args)
        model = build_model(args, config)
        optimizer, scheduler = build_optimizer(args, model, config)
        assert checkpoint.load(args, model, optimizer, scheduler) == 0
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)

        def step(data_iterator, chunk):
            return chunk(tokens, positions, None), lambda output, non_loss_data=False: output

        with torch.no_grad():
            out = get_forward_backward_func()(forward_step_func=step, data_iterator=None, model=model,
                                              num_microbatches=1, seq_length=tokens.shape[1],
                                              micro_batch_size=tokens.shape[0], forward_only=True,
                                              collect_non_loss_data=True)
        if not parallel_state.is_pipeline_last_stage():
            return None
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(out[0])
        return (logits[..., :hf_logits.shape[-1]] - hf_logits).abs().max().item()
    return measure


def test_megatron_cores_fused_qkv_puts_each_groups_query_heads_before_its_key_and_value():
    d, heads, groups = 2, 4, 2
    q = torch.arange(heads * d).float().unsqueeze(1) + 100   # query rows 100..107
    k = torch.arange(groups * d).float().unsqueeze(1) + 200  # key rows 200..203
    v = torch.arange(groups * d).float().unsqueeze(1) + 300
    fused = _fuse_qkv(q, k, v, heads, groups).squeeze(1).tolist()
    assert fused == [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    assert all(torch.equal(a, b) for a, b in zip(_split_qkv(_fuse_qkv(q, k, v, heads, groups), heads, groups),
                                                 (q, k, v)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_import_then_export_gives_back_the_hf_model_bit_for_bit(tmp_path, imported, family):
    hf, spec, ckpt = imported[family]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "release"
    done = _labkit("checkpoint", "export-hf", ckpt, "--spec", spec, "-o", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    before = safetensors_torch.load_file(hf / "model.safetensors")
    after = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert [name for name in before if not torch.equal(before[name], after[name])] == []
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    original = transformers.AutoModelForCausalLM.from_pretrained(hf)
    tokens = torch.randint(0, 1024, (2, 16))
    assert torch.equal(reloaded(tokens).logits, original(tokens).logits)


def test_a_spec_that_does_not_match_the_hf_config_is_refused_naming_both_and_nothing_is_written(tmp_path):
    hf = _llama(tmp_path / "hf")
    spec = _spec_file(tmp_path / "spec.json", "tiny-llama", num_layers=2, rotary_base=500000)
    done = _labkit("checkpoint", "import-hf", hf, "--spec", spec, "-o", tmp_path / "ckpt")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[0] == "labkit checkpoint import-hf: 2 error(s)"
    assert re.search(r"^  - model\.num_layers: 2 in the spec, num_hidden_layers 4 in .*config\.json; set "
                     r"model\.num_layers: 4$", done.stderr, re.M), done.stderr
    assert "  - model.rotary_base: 500000 in the spec, rope_theta 10000 in " in done.stderr
    assert not (tmp_path / "ckpt").exists()
    tied = _spec_file(tmp_path / "tied.json", "tiny", num_layers=4, num_query_groups=2, ffn_hidden_size=192)
    done = _labkit("checkpoint", "import-hf", hf, "--spec", tied, "-o", tmp_path / "ckpt")
    assert done.returncode == 2
    assert "model.untie_embeddings: false in the spec, tie_word_embeddings false in " in done.stderr
    assert re.search(r"model\.normalization: \"LayerNorm\" in the spec; .*config\.json is a llama model, whose "
                     r"normalization is \"RMSNorm\"; set model\.normalization: \"RMSNorm\"$", done.stderr, re.M)
    assert not (tmp_path / "ckpt").exists()


def test_what_the_mappings_do_not_carry_is_refused_before_anything_is_written(tmp_path, capsys):
    """An untied GPT-2, a Llama with biases and an MoE spec: import and export name the field instead of leaving
    weights out of what they write (export refuses before it reads the checkpoint). The command runs in this process
    (a refusal starts no training): an error it did not catch would fail the test instead of returning 2."""
    from labkit.cli import main

    def refused(*argv) -> str:
        assert main(list(map(str, argv))) == 2
        return capsys.readouterr().err

    hf, ckpt = _gpt2(tmp_path / "hf"), tmp_path / "ckpt"
    untied = _spec_file(tmp_path / "untied.json", "tiny", untie_embeddings=True)
    assert "model.untie_embeddings: true in the spec" in refused("checkpoint", "import-hf", hf, "--spec", untied,
                                                                 "-o", tmp_path / "in")
    assert "model.untie_embeddings" in refused("checkpoint", "export-hf", ckpt, "--spec", untied,
                                               "-o", tmp_path / "out")
    biased = _spec_file(tmp_path / "biased.json", "tiny-llama", add_bias_linear=True)
    assert "model.add_bias_linear: true in the spec" in refused("checkpoint", "export-hf", ckpt, "--spec", biased,
                                                                "-o", tmp_path / "out")
    moe = _spec_file(tmp_path / "moe.json", "tiny-llama", num_experts=4)
    assert "model.num_experts" in refused("checkpoint", "export-hf", ckpt, "--spec", moe, "-o", tmp_path / "out")
    assert not (tmp_path / "in").exists() and not (tmp_path / "out").exists()


def test_an_existing_output_directory_is_never_overwritten(tmp_path):
    hf = _gpt2(tmp_path / "hf")
    spec = _spec_file(tmp_path / "spec.json", "tiny")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep").write_text("mine")
    for command in ("import-hf", "export-hf"):
        done = _labkit("checkpoint", command, hf if command == "import-hf" else tmp_path / "ckpt", "--spec", spec,
                       "-o", tmp_path / "ckpt")
        assert done.returncode == 2 and "exists and is not empty" in done.stderr, done.stderr
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["keep"]


def test_without_safetensors_the_command_names_the_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    from labkit.checkpoint import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name))
    spec = _spec_file(tmp_path / "spec.json", "tiny")
    args = type("Args", (), {"spec": str(spec), "source": str(tmp_path), "output": str(tmp_path / "o")})
    assert cli._convert(args, "import-hf") == 2
    assert capsys.readouterr().err == ("labkit checkpoint import-hf: labkit checkpoint import-hf needs safetensors, "
                                       "which the base install leaves out: pip install 'labkit[hf]'\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family, layouts", [("llama", [(1, 1), (2, 1), (1, 2)]), ("gpt2", [(2, 1), (1, 2)]),
                                             ("llama", [(2, 2)])])
def test_the_driver_loads_an_imported_model_under_each_layout_with_the_hf_models_logits(imported, family, layouts):
    """Llama (GQA, SwiGLU, rotary, untied) and GPT-2 (biases, learned positions, tied: the output layer on the last
    stage is the first stage's embedding) at tensor 1 and 2, pipeline 1 and 2."""
    from labkit.train.model_state import on_driver_ranks

    hf, _, ckpt = imported[family]
    preset = "tiny-llama" if family == "llama" else "tiny"
    tokens = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_logits = transformers.AutoModelForCausalLM.from_pretrained(hf)(tokens).logits
    gaps = {}
    for tensor, pipeline in layouts:
        ranks = on_driver_ranks([_layout_spec(preset, ckpt, tensor, pipeline)],
                                _logits_gap(tokens, hf_logits))[0]
        gaps[tensor, pipeline] = max(g for g in ranks if g is not None)
    print(family, "largest |logit difference| per (tensor, pipeline):", gaps)
    assert all(gap < LOGITS_TOLERANCE for gap in gaps.values()), gaps


@pytest.mark.slow
def test_an_imported_llama_trains_on_from_the_hf_models_loss(tmp_path, imported, train_in_parallel):
    """train.load at the imported checkpoint, two pipeline stages: the first iteration's lm loss (before its update) is
    the HF model's loss on the same global batch of the driver's mock data, and the run trains on."""
    from labkit.megatron_args import megatron_args
    from labkit.train import data
    from labkit.train.arguments import parse_args

    hf, spec_file, ckpt = imported["llama"]
    spec = load_spec({"name": "hf-train", "model": {"preset": "tiny-llama"}, "parallel": {"pipeline": 2},
                      "batch": {"micro": 2, "global": 4}, "data": {"mock": True}, "optimizer": {"lr": 1e-3},
                      "train": {"iters": 3, "log_interval": 1, "load": str(ckpt),
                                "save": str(tmp_path / "trained"), "ckpt_format": "torch_dist"}})
    args = parse_args([str(a) for a in megatron_args(spec)], world_size=2, rank=0, cuda=False)
    dataset = data.build_datasets(args, data.build_tokenizer(args))[0]
    batch = [dataset[i] for i in range(spec.batch.global_)]  # the first global batch, one data-parallel rank
    tokens, labels, mask = (torch.stack([s[key] for s in batch]) for key in ("tokens", "labels", "loss_mask"))

    def hf_loss(directory) -> float:
        with torch.no_grad():
            logits = transformers.AutoModelForCausalLM.from_pretrained(directory)(tokens).logits
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return (losses * mask.flatten()).sum().item() / mask.sum().item()

    before = hf_loss(hf)
    log = train_in_parallel({"hf-train": spec})["hf-train"][1]
    assert "loading release checkpoint (weights only)" in log
    driver = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", log)]
    print("HF loss", before, "driver's lm losses", driver)
    assert len(driver) == 3 and abs(driver[0] - before) < LOSS_TOLERANCE, (driver, before)
    assert driver[-1] < driver[0]
    # the trained run's checkpoint (iteration 3, two stages, with its optimizer) goes back to transformers
    done = _labkit("checkpoint", "export-hf", tmp_path / "trained", "--spec", spec_file, "-o",
                   tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert hf_loss(tmp_path / "out") < before
    wrong = _spec_file(tmp_path / "wrong.json", "tiny-llama", ffn_hidden_size=128)
    done = _labkit("checkpoint", "export-hf", tmp_path / "trained", "--spec", wrong, "-o", tmp_path / "wrong")
    assert done.returncode == 2 and not (tmp_path / "wrong").exists()
    assert re.search(r"model: .*iter_0000003 holds decoder\.layers\.mlp\.linear_fc2\.weight of shape \(4, 64, 192\), "
                     r"the spec's model \(4, 64, 128\); give the spec the model the checkpoint was trained with$",
                     done.stderr, re.M), done.stderr

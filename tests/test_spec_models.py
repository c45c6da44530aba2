"""The Llama family in the spec: Megatron-LM's model keys, their presets and checks, the parameters Megatron builds
and the activations a Llama layer keeps."""
import dataclasses
import json

import pytest
import yaml

from labkit.cli import main
from labkit.estimate import (Shape, estimate, memory_per_stage, model_flops, params_with_padding, rank_params,
                             total_params)
from labkit.estimate.memory import GIB, activation_bytes_per_layer
from labkit.paths import data_file
from labkit.spec import ModelSpec, RunSpec, SpecError, load_spec
from labkit.megatron.tokenizer import GPT2BPETokenizer, HuggingFaceTokenizer

# Published exact parameter counts (the model cards' safetensors totals).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
}
LLAMA_PRESETS = [*PUBLISHED, "tiny-llama"]


def errors_of(model: dict, **sections) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec({"model": model, **sections})
    return info.value.errors


@pytest.mark.parametrize("preset", PUBLISHED)
def test_each_preset_counts_its_published_parameters(preset):
    est = estimate(load_spec({"model": {"preset": preset}}))
    assert est.params == PUBLISHED[preset]
    # these vocabularies are multiples of 128: Megatron builds them unpadded at tensor size 1
    assert est.params_with_padding == PUBLISHED[preset]


def test_gpt2_small_counts_its_published_parameters_with_the_final_layer_norm():
    assert total_params(Shape.of(load_spec({"model": {"preset": "gpt2-small"}}).model)) == 124_439_808


def test_llama_presets_are_llama_shaped_and_gpt_presets_take_megatrons_defaults():
    for preset in LLAMA_PRESETS:
        m = load_spec({"model": {"preset": preset}}).model
        assert (m.normalization, m.position_embedding_type, m.add_bias_linear) == ("RMSNorm", "rope", False), preset
        assert (m.swiglu, m.untie_embeddings, m.hidden_dropout, m.attention_dropout) == (True, True, 0.0, 0.0)
    assert load_spec({"model": {"preset": "llama3-8b"}}).model.rotary_base == 500000
    m = load_spec({"model": {"preset": "gpt2-xl"}}).model
    assert (m.normalization, m.position_embedding_type, m.add_bias_linear) == ("LayerNorm", "learned_absolute", True)
    assert (m.rotary_base, m.make_vocab_size_divisible_by, m.hidden_dropout) == (None, 128, 0.1)


def test_rope_without_a_base_takes_megatrons_10000():
    assert load_spec({"model": {"preset": "tiny", "position_embedding_type": "rope"}}).model.rotary_base == 10000


def test_what_the_user_writes_wins_over_a_llama_preset():
    m = load_spec({"model": {"preset": "llama3-8b", "normalization": "LayerNorm", "add_bias_linear": True,
                             "make_vocab_size_divisible_by": 64, "hidden_dropout": 0.1}}).model
    assert (m.normalization, m.add_bias_linear, m.make_vocab_size_divisible_by, m.hidden_dropout) == (
        "LayerNorm", True, 64, 0.1)
    # turning rotary positions off drops the preset's base with them
    m = load_spec({"model": {"preset": "llama3-8b", "position_embedding_type": "learned_absolute"}}).model
    assert (m.position_embedding_type, m.rotary_base) == ("learned_absolute", None)
    assert load_spec({"model": {"preset": "llama2-7b", "rotary_base": 1000000}}).model.rotary_base == 1000000


def test_a_python_built_model_leaves_none_to_the_preset_and_its_own_values_win():
    m = load_spec(RunSpec(model=ModelSpec(preset="llama3-8b"))).model
    assert (m.normalization, m.add_bias_linear, m.rotary_base) == ("RMSNorm", False, 500000)
    m = load_spec(RunSpec(model=ModelSpec(preset="llama3-8b", add_bias_linear=True, normalization="LayerNorm"))).model
    assert (m.add_bias_linear, m.normalization) == (True, "LayerNorm")


def test_unknown_choices_name_the_field_and_the_choices():
    errors = errors_of({"preset": "tiny", "normalization": "rmsnorm", "position_embedding_type": "alibi"})
    assert any(e.startswith("model.normalization:") and "LayerNorm, RMSNorm" in e for e in errors)
    assert any(e.startswith("model.position_embedding_type:") and "learned_absolute, rope, none" in e
               for e in errors)
    errors = errors_of({"preset": "tiny"}, data={"tokenizer": {"type": "Llama3Tokenizer"}})
    assert any(e.startswith("data.tokenizer.type:") and "HuggingFaceTokenizer" in e for e in errors)


def test_rotary_base_without_rope_names_both_fields():
    errors = errors_of({"preset": "tiny", "rotary_base": 500000})
    assert any(e.startswith("model.rotary_base:") and "model.position_embedding_type" in e for e in errors)
    errors = errors_of({"preset": "llama3-8b", "position_embedding_type": "none", "rotary_base": 500000})
    assert any(e.startswith("model.rotary_base:") and "'none'" in e for e in errors)


@pytest.mark.parametrize("value", [0, -128])
def test_vocabulary_padding_unit_must_be_positive(value):
    assert any(e.startswith("model.make_vocab_size_divisible_by:")
               for e in errors_of({"preset": "tiny", "make_vocab_size_divisible_by": value}))


@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_dropout_is_a_probability(value):
    assert any(e.startswith("model.hidden_dropout:") for e in errors_of({"preset": "tiny", "hidden_dropout": value}))


def test_validate_exits_2_naming_an_unknown_normalization(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "tiny-llama", "normalization": "BatchNorm"}}))
    assert main(["validate", str(path)]) == 2
    out = capsys.readouterr()
    assert "model.normalization" in out.out + out.err and "RMSNorm" in out.out + out.err


def test_megatron_pads_the_vocabulary_to_the_unit_times_the_tensor_size():
    shape = Shape(num_layers=2, hidden=64, heads=4, seq_length=64, vocab=50257)
    assert [shape.padded_vocab(t) for t in (1, 2, 8)] == [50304, 50432, 51200]
    assert params_with_padding(shape, 8) - total_params(shape) == (51200 - 50257) * 64
    assert dataclasses.replace(shape, vocab_multiple=1).padded_vocab(1) == 50257


def test_estimate_json_carries_unpadded_and_padded_counts(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "gpt2-small"}, "parallel": {"tensor": 2},
                                    "cluster": {"nodes": [{"gpu": "A100-80GB", "gpus_per_node": 2}]}}))
    assert main(["estimate", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 124_439_808
    assert out["padded_vocab_size"] == 50432
    assert out["params_with_padding"] == 124_439_808 + (50432 - 50257) * 768
    assert main(["estimate", str(path)]) == 0
    assert "124,574,208 as Megatron builds it (vocabulary padded to 50,432)" in capsys.readouterr().out


def test_llama_layers_drop_biases_positions_and_norm_biases():
    base = dict(num_layers=1, hidden=64, heads=4, seq_length=64, vocab=1024, vocab_multiple=1)
    gpt, llama = Shape(**base), Shape(**base, norm="RMSNorm", positions="rope", bias=False)
    # per layer: QKV (192) and MLP-in (256) biases, projection and MLP-out biases (64 + 64), two norm biases (128);
    # the position table (64 x 64) and the final norm's bias (64)
    assert total_params(gpt) - total_params(llama) == 192 + 256 + 128 + 128 + 64 * 64 + 64
    gqa = Shape(**base, query_groups=2)
    assert total_params(Shape(**base)) - total_params(gqa) == 2 * 64 * 32 + 2 * 32  # K and V halve, with biases
    swiglu = Shape(**base, swiglu=True, ffn=100)
    assert total_params(swiglu) - total_params(Shape(**base, ffn=100)) == 64 * 100 + 100  # a second MLP-in matrix


# Counts megatron-core 0.16.1 logs for these layouts (its GPTModel built on CPU with labkit's layer spec).
@pytest.mark.parametrize("model, tensor, pipeline, logged", [
    ({"preset": "tiny-llama"}, 2, 2, [82176, 82240]),
    ({"preset": "tiny"}, 2, 2, [62048, 58080]),  # tied: the last stage holds a copy
    ({"preset": "tiny", "vocab_size": 1000}, 1, 2, [119616, 115648]),  # 1000 padded to 1024
])
def test_rank_params_equal_what_megatron_logs(model, tensor, pipeline, logged):
    spec = load_spec({"model": model, "parallel": {"tensor": tensor, "pipeline": pipeline}})
    assert [rank_params(spec, t, p) for p in range(pipeline) for t in range(tensor)] == [
        n for n in logged for _ in range(tensor)]


def test_rank_params_of_one_stage_is_the_model_as_built():
    spec = load_spec({"model": {"preset": "tiny-llama"}})
    assert rank_params(spec, 0, 0) == estimate(spec).params_with_padding == 328_256
    with pytest.raises(ValueError):
        rank_params(spec, 1, 0)


def test_swiglu_saves_its_2f_input_and_no_dropout_keeps_no_masks():
    s, h, a, f = 4096, 4096, 32, 11008
    base = dict(num_layers=32, hidden=h, heads=a, seq_length=s, vocab=32000, ffn=f)
    # Korthikanti et al. Table 2 for a GELU MLP with dropout: s b h (34 + 5 a s / h) at tensor size 1, plus what the
    # table leaves out: each LayerNorm's fp32 mean and inverse deviation per token (2 norms x 8 bytes x s b)
    layer_norms = 2 * 8 * s
    gelu = Shape(**{**base, "ffn": 4 * h})
    assert activation_bytes_per_layer(gelu, 1) == s * h * (34 + 5 * a * s / h) + layer_norms
    # SwiGLU: the 2f-wide MLP-in output and the f-wide product (6 f/h) instead of GELU's 4 f/h
    swiglu = Shape(**base, swiglu=True)
    assert activation_bytes_per_layer(swiglu, 1) == s * h * (10 + 8 + 6 * f / h + 5 * a * s / h) + layer_norms
    # dropout 0: no masks (2 s b h, a s^2 b) and attention over values reads the softmax output (2 a s^2 b); rotary
    # positions keep the rotated queries and keys (4 s b h / t); RMSNorm keeps one fp32 statistic per token (8 s b)
    llama = load_spec({"model": {"preset": "llama2-7b"}})
    split = 8 + 6 * f / h + 2 * a * s / h + 4
    rms_norms = 2 * 4 * s
    assert activation_bytes_per_layer(Shape.of(llama.model), 1) == s * h * (8 + split) + rms_norms
    assert activation_bytes_per_layer(Shape.of(llama.model), 1, tensor=4) == s * h * (8 + split / 4) + rms_norms


def test_the_first_stage_keeps_no_embedding_dropout_mask_without_dropout():
    spec = load_spec({"model": {"preset": "tiny-llama"}, "parallel": {"pipeline": 2}})
    shape = Shape.of(spec.model)
    with_dropout = dataclasses.replace(shape, hidden_dropout=0.1)
    first, dropped = (memory_per_stage(x, [2, 2], num_micro_batches=4)[0] for x in (shape, with_dropout))
    s, h = shape.seq_length, shape.hidden
    per_layer = activation_bytes_per_layer(with_dropout, 1) - activation_bytes_per_layer(shape, 1)
    assert per_layer == 2 * s * h
    # two micro-batches in flight on the first of two stages, two layers each, plus the embedding mask
    assert (dropped.activations - first.activations) * GIB == pytest.approx(2 * (2 * per_layer + s * h))


@pytest.mark.parametrize("preset", ["llama2-7b", "llama3-8b", "llama2-70b"])
def test_model_flops_are_six_per_token_per_matrix_weight_plus_attention(preset):
    # GQA's smaller K/V and SwiGLU's three MLP matrices: the FLOPs follow the weights the layers multiply by
    m = load_spec({"model": {"preset": preset}}).model
    shape, batch = Shape.of(m), 4
    tokens = batch * m.seq_length
    matrices = PUBLISHED[preset] - m.vocab_size * m.hidden_size - (2 * m.num_layers + 1) * m.hidden_size
    attention = 3 * m.num_layers * 2 * tokens * 2 * m.seq_length * m.hidden_size  # QK^T and x V, non-causal
    assert model_flops(shape, batch) == pytest.approx(6 * tokens * matrices + attention, rel=1e-12)


LLAMA_TOKENIZER = str(data_file("tokenizer", "llama", "tokenizer.json"))
LLAMA_DATA = {"path": "/data/corpus-llama_text_document",
              "tokenizer": {"type": "HuggingFaceTokenizer", "model": LLAMA_TOKENIZER}}


def test_with_a_dataset_the_vocabulary_is_the_tokenizers():
    tokens = HuggingFaceTokenizer(LLAMA_TOKENIZER).vocab_size
    spec = load_spec({"model": {"preset": "tiny-llama"}, "data": LLAMA_DATA})
    assert spec.data.mock is False and spec.model.vocab_size == tokens != 1024  # the preset's number gives way
    assert load_spec({"model": {"preset": "tiny"}, "data": {"path": "/data/x"}}).model.vocab_size == \
        GPT2BPETokenizer(data_file("tokenizer", "vocab.json"), data_file("tokenizer", "merges.txt")).vocab_size
    written = load_spec({"model": {"preset": "tiny-llama", "vocab_size": tokens}, "data": LLAMA_DATA})
    assert written.model.vocab_size == tokens
    assert load_spec({"model": {"preset": "tiny-llama"}}).model.vocab_size == 1024  # mock tokens: the model's own


def test_a_written_vocabulary_that_is_not_the_tokenizers_names_both_fields():
    errors = errors_of({"preset": "tiny-llama", "vocab_size": 1024}, data=LLAMA_DATA)
    assert any(e.startswith("model.vocab_size: 1024") and "data.tokenizer.model" in e for e in errors)
    errors = errors_of({"preset": "tiny", "vocab_size": 1024}, data={"path": "/data/x"})
    assert any(e.startswith("model.vocab_size: 1024") and "data.vocab_file" in e for e in errors)


def test_a_dataset_path_means_no_mock_tokens_and_both_at_once_is_refused():
    assert load_spec({"data": {"path": "/data/x"}}).data.mock is False
    assert load_spec({"data": {}}).data.mock is True
    errors = errors_of({"preset": "tiny"}, data={"path": "/data/x", "mock": True})
    assert any(e.startswith("data.mock: true") and "data.path" in e for e in errors)


def test_a_changed_copy_derives_what_the_spec_did_not_write():
    tiny = load_spec({"model": {"preset": "tiny", "num_layers": 4}})
    on_corpus = tiny.replace(data={"path": "/data/x"})  # the tokenizer's vocabulary, not the preset's 1024
    assert on_corpus.model.vocab_size == load_spec({"data": {"path": "/data/x"}}).model.vocab_size != 1024
    bigger = tiny.replace(**{"model.preset": "gpt2-small"})  # the new preset's sizes; the written layer count stays
    assert (bigger.model.num_layers, bigger.model.hidden_size, bigger.model.vocab_size) == (4, 768, 50257)
    assert load_spec(bigger).model.hidden_size == 768 and "num_layers" not in bigger.derived_model_keys

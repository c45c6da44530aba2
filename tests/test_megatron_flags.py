"""labkit.megatron.flags: one table of the Megatron-LM flags labkit writes and reads, checked against Megatron-LM's
flag list and megatron-core's own defaults; the driver's parser is that table and nothing else."""
import pytest
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

from labkit import catalog
from labkit.megatron.flags import FLAG, FLAGS, build_parser, flag_errors
from labkit.megatron_args import megatron_args
from labkit.spec import load_spec


def test_every_flag_is_one_of_megatron_lms_or_a_named_legacy_spelling():
    known = catalog.megatron_lm_flags()  # core_v0.16.1's add_megatron_arguments
    assert [f.name for f in FLAGS if f.name not in known] == [f.name for f in FLAGS if f.legacy or
                                                               f.megatron_deepspeed or f.driver_only]
    assert [f.name for f in FLAGS if f.megatron_deepspeed] == ["--deepspeed", "--deepspeed_config", "--zero-stage"]
    assert [f.name for f in FLAGS if f.driver_only] == ["--sdpa-attention"]
    assert [f.name for f in FLAGS if f.legacy] == ["--activations-checkpoint-method",
                                                   "--activations-checkpoint-num-layers"]


def test_the_table_has_each_flag_once_and_names_it_by_its_snake_case():
    assert len({f.name for f in FLAGS}) == len(FLAGS)
    assert str(FLAG.num_layers) == "--num-layers"
    assert FLAG.disable_bias_linear.dest == "add_bias_linear"  # a switch that turns a default off


def test_the_drivers_parser_is_the_table():
    parser = build_parser()
    options = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options == [f.name for f in FLAGS]
    defaults = parser.parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                                  "--seq-length", "8", "--lr", "1", "--train-iters", "1"])
    for flag in FLAGS:
        if flag.action is None and not flag.required:
            assert getattr(defaults, flag.dest or flag.key) == flag.default, flag.name
    assert defaults.add_bias_linear is True and defaults.overlap_p2p_comm is True  # store_false switches


# Flag -> (megatron-core config class, field): the defaults Megatron-LM's parser shares with megatron-core's configs.
SAME_DEFAULT = {
    "hidden_dropout": (TransformerConfig, "hidden_dropout"),
    "attention_dropout": (TransformerConfig, "attention_dropout"),
    "init_method_std": (TransformerConfig, "init_method_std"),
    "norm_epsilon": (TransformerConfig, "layernorm_epsilon"),
    "weight_decay": (OptimizerConfig, "weight_decay"),
    "adam_beta1": (OptimizerConfig, "adam_beta1"),
    "adam_beta2": (OptimizerConfig, "adam_beta2"),
    "adam_eps": (OptimizerConfig, "adam_eps"),
    "sgd_momentum": (OptimizerConfig, "sgd_momentum"),
    "clip_grad": (OptimizerConfig, "clip_grad"),
    "initial_loss_scale": (OptimizerConfig, "initial_loss_scale"),
    "min_loss_scale": (OptimizerConfig, "min_loss_scale"),
    "loss_scale_window": (OptimizerConfig, "loss_scale_window"),
    "hysteresis": (OptimizerConfig, "hysteresis"),
}


@pytest.mark.parametrize("key", SAME_DEFAULT)
def test_defaults_agree_with_megatron_core(key):
    config, field = SAME_DEFAULT[key]
    assert getattr(FLAG, key).default == config.__dataclass_fields__[field].default


def test_every_flag_a_spec_renders_is_in_the_table():
    spec = load_spec({"model": {"preset": "tiny-llama"}, "precision": "bf16", "optimizer": {"distributed": True},
                      "recompute": {"granularity": "selective"}, "train": {"timing_log_level": 1}})
    rendered = [a for a in megatron_args(spec) if a.startswith("--")]
    assert set(rendered) <= {f.name for f in FLAGS}
    assert flag_errors(megatron_args(spec)) == []
    assert flag_errors(["--no-such-flag"]) and flag_errors(["--timing-log-level", "3"])


def test_a_models_unset_choices_are_what_the_driver_parses_when_the_flag_is_left_out():
    """A spec that sets only the model's sizes gets the values the driver's parser holds for the flags left out, so
    the spec, the estimate and the run describe one model."""
    spec = load_spec({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                "vocab_size": 512}})
    parsed = build_parser().parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                        "--seq-length", "32", "--lr", "1e-4", "--train-iters", "1"])
    m = spec.model
    assert (m.swiglu, not m.untie_embeddings, m.normalization, m.position_embedding_type, m.add_bias_linear,
            m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout) == \
        (parsed.swiglu, not parsed.untie_embeddings_and_output_weights, parsed.normalization,
         parsed.position_embedding_type, parsed.add_bias_linear, parsed.make_vocab_size_divisible_by,
         parsed.hidden_dropout, parsed.attention_dropout)
    rope = load_spec({"model": {"preset": "tiny", "position_embedding_type": "rope"}})
    assert rope.model.rotary_base == parsed.rotary_base

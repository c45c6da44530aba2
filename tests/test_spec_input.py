"""Spec input: text fields keep the text the user wrote, and any file, however hostile, ends in exit 0 with a sane spec
or exit 2 naming a field, fast and with short messages."""
from __future__ import annotations

import time

import pytest

from labkit.cli import main
from labkit.jobs.render import render
from labkit.spec import SpecError, load_spec

HANG_S = 5.0
"""What counts as a hang: the issue's bound on any spec, however hostile."""
BASE = """\
name: {name}
model: {{preset: tiny}}
parallel: {{tensor: 1, pipeline: 1}}
batch: {{micro: 1, global: 8}}
"""


def spec_file(tmp_path, text: str, suffix: str = ".yaml"):
    path = tmp_path / f"spec{suffix}"
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return path


def errors_of(tmp_path, text, suffix=".yaml") -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(spec_file(tmp_path, text, suffix))
    return info.value.errors


def assert_names(errors: list[str], field: str, *words: str):
    matching = [e for e in errors if e.startswith(field + ":")]
    assert matching, f"no error names {field!r}: {errors}"
    for word in words:
        assert any(word in e for e in matching), f"{word!r} not in {matching}"


# --- YAML 1.2: text stays text -------------------------------------------------------------------------------------

TEXTS = ["2:00:00", "30:00", "0123", "010", "0x1F", "0o17", "1_000", "1.50", "1e3", "yes", "no", "on", "off", "Y",
         "NO", "+12", ".5", "2001-12-14", "<<"]


@pytest.mark.parametrize("text", TEXTS)
def test_every_text_field_keeps_the_text_as_written(tmp_path, text):
    # A mount is SRC:DST with paths: the text goes into its source where it makes one
    mount = f"/{text}:/data" if ":" not in text else "/data:/data"
    yaml_text = BASE.format(name=text) + f"""\
data: {{path: {text}, vocab_file: {text}}}
job:
  partition: {text}
  account: {text}
  env: {{VALUE: {text}}}
  extra_args: [--data-cache-path, {text}]
  container: {{image: {text}, mounts: [{mount}]}}
cluster: {{nodes: [{{gpu: cpu, count: 1, gpus_per_node: 1}}]}}
train: {{save: {text}}}
"""
    spec = load_spec(spec_file(tmp_path, yaml_text))
    job = spec.job
    assert spec.name == text
    assert (spec.data.path, spec.data.vocab_file, spec.train.save) == (text,) * 3
    assert (job.partition, job.account, job.env["VALUE"], job.extra_args, job.container.image, job.container.mounts) \
        == (text, text, text, ["--data-cache-path", text], text, [mount])


@pytest.mark.parametrize("key", ["0123", "0x1F", "1.50", "2:00:00"])
def test_a_key_is_named_as_written(tmp_path, key):
    assert_names(errors_of(tmp_path, BASE.format(name="k") + f"job: {{env: {{{key}: x}}}}\n"), f"job.env.{key}")


@pytest.mark.parametrize("limit", ["2:00:00", "30:00", "1-00:00", "0:30"])
def test_a_time_limit_renders_as_written(tmp_path, limit):
    spec = load_spec(spec_file(tmp_path, BASE.format(name="t") + f"job: {{time_limit: {limit}}}\n"))
    assert spec.job.time_limit == limit
    scripts = render(spec, "/runs/RUN/logs", layout="multinode", run_id="RUN").scripts.values()
    assert any(f"#SBATCH --time={limit}\n" in script for script in scripts)


def test_numbers_are_yaml_1_2_numbers(tmp_path):
    spec = load_spec(spec_file(tmp_path, BASE.format(name="n") + """\
optimizer: {lr: 1.5e-4, min_lr: 1e-5, weight_decay: 0, clip_grad: 1}
train: {iters: 0x10, log_interval: 0o4, seed: 0123}
"""))
    assert spec.optimizer.lr == 1.5e-4 and isinstance(spec.optimizer.lr, float)
    assert spec.optimizer.min_lr == 1e-5
    assert (spec.train.iters, spec.train.log_interval, spec.train.seed) == (16, 4, 123)
    assert type(spec.train.seed) is int and type(spec.optimizer.weight_decay) is float
    assert "!!python" not in spec.to_yaml() and load_spec(spec.to_dict()).train.seed == 123


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "Y"])
def test_a_switch_needs_true_or_false(tmp_path, word):
    errors = errors_of(tmp_path, BASE.format(name="b") + f"optimizer: {{distributed: {word}}}\n")
    assert_names(errors, "optimizer.distributed", "true or false", repr(word))


def test_a_switch_or_null_in_a_text_field_is_refused_not_converted(tmp_path):
    errors = errors_of(tmp_path, BASE.format(name="true") + "job: {env: {DEBUG: false, EMPTY: }}\n")
    assert_names(errors, "name", "text", '"true"')
    assert_names(errors, "job.env.DEBUG", "text")
    assert_names(errors, "job.env.EMPTY", "missing a value")


def test_json_specs_read_as_before(tmp_path):
    spec = load_spec(spec_file(tmp_path, '{"name": 123, "model": {"preset": "tiny"}, "optimizer": {"lr": "1e-4"}}',
                               ".json"))
    assert spec.name == "123" and spec.optimizer.lr == 1e-4


# --- never a traceback ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, field, words", [
    (b"name: caf\xe9\n", "spec", ["UTF-8"]),
    ("name: x\n".encode("utf-16"), "spec", ["UTF-8"]),
    (b"", "spec", ["empty"]),
    (b"# only a comment\n", "spec", ["empty"]),
    (b"false\n", "spec", ["mapping"]),
    (b"[]\n", "spec", ["mapping"]),
    (b"3\n", "spec", ["mapping"]),
    (b"- name: x\n", "spec", ["mapping"]),
    (b"name: " + b"[" * 400 + b"]" * 400 + b"\n", "spec", ["nested"]),
    (b"name: " + b"{a: " * 400 + b"1" + b"}" * 400 + b"\n", "spec", ["nested"]),
    (b"name: x\n" + b"# padding\n" * 30000, "spec", ["larger than"]),
])
def test_unreadable_files_are_spec_errors(tmp_path, content, field, words):
    assert_names(errors_of(tmp_path, content), field, *words)


def test_a_directory_is_a_spec_error(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(SpecError, match="spec: cannot read"):
        load_spec(tmp_path / "dir.yaml")


def test_deep_json_is_a_spec_error(tmp_path):
    assert_names(errors_of(tmp_path, '{"name": ' + "[" * 100000 + "]" * 100000 + "}", ".json"), "spec", "nested")


@pytest.mark.parametrize("key", ["batch.micro", "batch.global", "parallel.tensor", "parallel.pipeline",
                                 "parallel.virtual_stages", "train.iters", "optimizer.lr", "precision", "name",
                                 "model.num_layers"])
def test_an_empty_value_is_missing_a_value(tmp_path, key):
    section, leaf = key.split(".") if "." in key else (None, key)
    text = ("" if key == "name" else "name: x\n") + (f"{section}: {{{leaf}: }}\n" if section else f"{leaf}:\n")
    if section != "model":
        text += "model: {preset: tiny}\n"
    assert_names(errors_of(tmp_path, text), key, "missing")


def test_an_empty_node_count_is_missing_a_value(tmp_path):
    errors = errors_of(tmp_path, "cluster: {nodes: [{gpu: cpu, count: , gpus_per_node: 2}]}\n")
    assert_names(errors, "cluster.nodes[0].count", "missing a value")


def test_an_empty_list_item_or_env_value_is_missing_a_value(tmp_path):
    errors = errors_of(tmp_path, BASE.format(name="e") + "job:\n  container:\n    image: img\n    mounts:\n      -\n"
                       "  extra_args: [--a, ~]\n  env: {X: ~}\n")
    assert_names(errors, "job.container.mounts[0]", "missing a value")
    assert_names(errors, "job.extra_args[1]", "missing a value")
    assert_names(errors, "job.env.X", "missing a value")


def test_zero_data_parallel_is_named(tmp_path):
    text = BASE.format(name="z").replace("parallel: {tensor: 1, pipeline: 1}", "parallel: {data: 0}")
    assert_names(errors_of(tmp_path, text), "parallel.data", "positive")


# --- huge sizes and alias bombs fail fast with short output ---------------------------------------------------------

@pytest.mark.parametrize("text, field", [
    ("parallel: {pipeline: 100000000}\n", "parallel.pipeline"),
    ("parallel: {tensor: 1e9}\n", "parallel.tensor"),
    ("parallel: {data: 10000000000}\n", "parallel.data"),
    ("parallel: {virtual_stages: 100000000}\n", "parallel.virtual_stages"),
    ("parallel: {pipeline: 2048}\nmodel: {preset: tiny, num_layers: 2048}\n", "parallel.pipeline"),
    ("cluster: {nodes: [{gpu: cpu, count: 100000, gpus_per_node: 100000}]}\n", "cluster.nodes"),
    ("cluster: {nodes: [{gpu: cpu, count: 100000000, gpus_per_node: 1}]}\n", "cluster.nodes[0].count"),
    ("model: {preset: tiny, num_layers: 100000000}\nparallel: {pipeline: 100000000}\n", "parallel.pipeline"),
    ("train: {iters: " + "9" * 5000 + "}\n", "train.iters"),
])
def test_huge_sizes_are_refused_fast(tmp_path, text, field):
    start = time.perf_counter()
    errors = errors_of(tmp_path, "name: big\n" + text)
    assert time.perf_counter() - start < HANG_S
    assert_names(errors, field)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join('*' + chr(97 + i) for _ in range(9))}]\n" for i in range(8))


def test_the_largest_layout_resolves_without_a_hang(tmp_path, capsys):
    path = spec_file(tmp_path, "model: {preset: tiny, num_layers: 1024}\nparallel: {pipeline: 1024, data: 1024}\n"
                     "batch: {micro: 1, global: 1048576}\n")
    start = time.perf_counter()
    assert main(["validate", str(path)]) == 0
    assert time.perf_counter() - start < HANG_S
    assert "world_size: 1048576" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["name", "job.env.X", "unknown_key", "job.extra_args"])
def test_an_alias_bomb_is_refused_fast_and_briefly(tmp_path, capsys, where):
    value = "*i"
    text = {"name": f"name: {value}", "job.env.X": f"job: {{env: {{X: {value}}}}}", "unknown_key": f"oops: {value}",
            "job.extra_args": f"job: {{extra_args: {value}}}"}[where]
    path = spec_file(tmp_path, "x-anchors:\n" + "".join("  " + line + "\n" for line in BOMB.splitlines())
                     + text + "\n")
    start = time.perf_counter()
    assert main(["validate", str(path)]) == 2
    assert time.perf_counter() - start < HANG_S
    err = capsys.readouterr().err
    assert len(err) < 4000 and "alias" in err


def test_anchors_and_aliases_of_modest_size_still_work(tmp_path):
    spec = load_spec(spec_file(tmp_path, BASE.format(name="&n run")
                               + "job: {partition: *n, extra_args: [--data-cache-path, *n]}\n"))
    assert spec.job.partition == "run" and spec.job.extra_args == ["--data-cache-path", "run"]


@pytest.mark.parametrize("text, key", [
    ("name: a\nmodel: {preset: tiny}\nname: b\n", "name"),
    ("job: {env: {1: a, '1': b}}\n", "1"),
])
def test_a_key_given_twice_is_refused_not_dropped(tmp_path, text, key):
    assert_names(errors_of(tmp_path, text), "spec", f"the key {key!r} is given twice")


def test_a_merge_key_may_still_override(tmp_path):
    spec = load_spec(spec_file(tmp_path, "batch:\n  <<: {micro: 1, global: 8}\n  micro: 2\n"))
    assert (spec.batch.micro, spec.batch.global_) == (2, 8)


@pytest.mark.parametrize("text, field", [
    ('name: "' + "x" * 100000 + '\\0"\n', "name"),
    ("name: " + "x" * 100000 + "\x00\n", "spec"),
    ("job: {partition: '" + "y " * 50000 + "'}\n", "job.partition"),
    ("job:\n  env:\n    ? " + "Z" * 100000 + "-\n    : x\n", "job.env.ZZZ"),
    ("? " + "x" * 100000 + "\n: 1\n", "xxx"),
    ("name: [" + ", ".join(["abcdefgh"] * 5000) + "]\n", "name"),
    ("\n".join(f"k{i}: 1" for i in range(1000)) + "\n", "k0"),
])
def test_error_output_stays_small(tmp_path, capsys, text, field):
    path = spec_file(tmp_path, text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err) < 20000
    assert any(line.startswith("  - " + field) for line in err.splitlines())
    assert all(len(line) < 1000 for line in err.splitlines())


# --- nonsense is refused naming the field --------------------------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    ("lr: .nan", "optimizer.lr"), ("lr: .inf", "optimizer.lr"), ("lr: -.inf", "optimizer.lr"),
    ("min_lr: -1e-5", "optimizer.min_lr"), ("min_lr: 1.0", "optimizer.min_lr"),
    ("weight_decay: -0.1", "optimizer.weight_decay"), ("clip_grad: -1", "optimizer.clip_grad"),
    ("adam_beta1: 7", "optimizer.adam_beta1"), ("adam_beta1: -0.1", "optimizer.adam_beta1"),
    ("adam_beta2: 1.0", "optimizer.adam_beta2"),
    ("initial_loss_scale: .inf", "optimizer.initial_loss_scale"),
    ("initial_loss_scale: -4", "optimizer.initial_loss_scale"), ("loss_scale: 0", "optimizer.loss_scale"),
    ("loss_scale: .inf", "optimizer.loss_scale"),
    ("lr_warmup_fraction: 1.5", "optimizer.lr_warmup_fraction"),
    ("lr_warmup_fraction: -0.1", "optimizer.lr_warmup_fraction"),
])
def test_nonsense_optimizer_values_are_refused(tmp_path, change, field):
    assert_names(errors_of(tmp_path, BASE.format(name="o") + f"optimizer: {{{change}}}\n"), field)


@pytest.mark.parametrize("change, field", [
    ("eval_interval: 0", "train.eval_interval"), ("eval_iters: -1", "train.eval_iters"),
    ("save_interval: 0", "train.save_interval"),
])
def test_nonsense_train_values_are_refused(tmp_path, change, field):
    assert_names(errors_of(tmp_path, BASE.format(name="o") + f"train: {{{change}}}\n"), field)


def test_non_finite_link_speeds_are_refused(tmp_path):
    errors = errors_of(tmp_path, "cluster: {inter_node_gbps: .nan, nodes: [{gpu: cpu, intra_node_gbps: .inf}]}\n")
    assert_names(errors, "cluster.inter_node_gbps", "finite")
    assert_names(errors, "cluster.nodes[0].intra_node_gbps", "finite")


def test_sane_optimizer_edges_are_accepted(tmp_path):
    spec = load_spec(spec_file(tmp_path, BASE.format(name="ok") + """\
optimizer: {lr: 1e-4, min_lr: 1e-4, weight_decay: 0, clip_grad: 0, adam_beta1: 0, lr_warmup_fraction: 1}
train: {eval_interval: 5, eval_iters: 0}
"""))
    assert spec.optimizer.min_lr == spec.optimizer.lr and spec.train.eval_interval == 5


@pytest.mark.parametrize("train, field", [({"seed": "1e300"}, "train.seed"), ({"seed": -1}, "train.seed"),
                                          ({"seed": 2**31}, "train.seed"),
                                          ({"iters": 99999999999999999999}, "train.iters")])
def test_counts_and_seeds_out_of_range_are_refused_naming_the_field(tmp_path, train, field):
    key, value = next(iter(train.items()))
    assert_names(errors_of(tmp_path, BASE.format(name="big") + f"train: {{{key}: {value}}}\n"), field)

"""`labkit validate` on mutated specs: exit 0 with a sane resolved spec, or exit 2 naming a field; never a traceback, a
hang or a text the user wrote changed. benchmarks/bench_spec_fuzz.py runs the same contract on 10,000 mutations."""
from __future__ import annotations

import contextlib
import io
import json
import math
import re
import signal
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit.cli import main
from labkit.spec import SpecError, load_spec

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
HANG_S = 5
BASE = """\
name: fuzz-run
model: {preset: tiny}
parallel:
  tensor: 1
  pipeline: 1
  data: 2
  virtual_stages: 1
batch:
  micro: 1
  global: 8
precision: fp32
optimizer:
  lr: 1.5e-4
  min_lr: 1.0e-5
  weight_decay: 0.01
  adam_beta1: 0.9
  lr_warmup_fraction: 0.01
  distributed: false
train:
  iters: 20
  eval_interval: 10
  save: ckpt
data:
  split: 90,5,5
  path: corpus
cluster:
  nodes:
    - gpu: cpu
      count: 1
      gpus_per_node: 2
job:
  partition: debug
  time_limit: 30
  env:
    VALUE: x
  extra_args:
    - --data-cache-path
    - cache
  container:
    image: img
    mounts:
      - /a:/b
"""
# Each field's line in BASE (its exact prefix) and its kind.
FIELDS = {
    "name": ("name: ", str), "data.split": ("  split: ", str), "data.path": ("  path: ", str),
    "train.save": ("  save: ", str), "job.partition": ("  partition: ", str), "job.time_limit": ("  time_limit: ", str),
    "job.env.VALUE": ("    VALUE: ", str), "job.extra_args[1]": ("    - cache", str),
    "job.container.image": ("    image: ", str), "job.container.mounts[0]": ("      - /a:/b", str),
    "parallel.tensor": ("  tensor: ", int), "parallel.pipeline": ("  pipeline: ", int), "parallel.data": ("  data: ", int),
    "parallel.virtual_stages": ("  virtual_stages: ", int), "batch.micro": ("  micro: ", int),
    "batch.global": ("  global: ", int), "train.iters": ("  iters: ", int), "train.eval_interval": ("  eval_interval: ", int),
    "cluster.nodes[0].count": ("      count: ", int), "cluster.nodes[0].gpus_per_node": ("      gpus_per_node: ", int),
    "optimizer.lr": ("  lr: ", float), "optimizer.min_lr": ("  min_lr: ", float),
    "optimizer.weight_decay": ("  weight_decay: ", float), "optimizer.adam_beta1": ("  adam_beta1: ", float),
    "optimizer.lr_warmup_fraction": ("  lr_warmup_fraction: ", float), "optimizer.distributed": ("  distributed: ", bool),
}
# Plain scalars YAML 1.1 would have read as something else, numbers at and past the bounds, and YAML 1.2's own.
TOKENS = ["2:00:00", "30:00", "1:30", "0123", "010", "0x1F", "0o17", "0b101", "1_000", "1.50", "1e3", "1.5e-4", "+12",
          "-3", "0", ".5", "1.", "yes", "no", "on", "off", "y", "n", "Yes", "true", "false", "True", "null", "~", "",
          ".nan", ".inf", "-.inf", "1e999", "2001-12-14", "<<", "=", "1024", "1025", "1048576", "1048577", "100000000",
          "1e9", "10000000000", "9" * 5000, "0.0", "-0", "0.95", "1.0", "7", "inf", "NaN", "x" * 3000, "{}", "[]",
          "{a: 1}", "[x, y]", "*undefined", "&a x", "!!str 0123", "!!int 1.5", "!!float x", "!!bool yes",
          "!!binary aGk=", "!!timestamp 2001-12-14", "!!python/object:os.system x", "'quoted'", '"a\\x00b"',
          '"\\ud800"', "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"]
NULLS = {"null", "Null", "NULL", "~", ""}
BOOLS = {"true", "True", "TRUE", "false", "False", "FALSE"}
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                    r"|\.(?:nan|NaN|NAN))$")
PLAIN = re.compile(r"^(?!-$)[A-Za-z0-9+.=_/,-][A-Za-z0-9+.=_/:,-]*(?<!:)$")
"""Tokens that are plain YAML scalars: their text is exactly the value they write."""


def yaml12_number(token: str):
    """What the YAML 1.2 core schema reads a plain token as, when a number (written here independently of labkit)."""
    if _INT.match(token):
        t = token.lstrip("+")
        if len(t) > 300:  # beyond any size a field takes (and beyond what Python reads past 4300 digits)
            return math.inf
        return int(t[2:], 8) if t.startswith("0o") else int(t, 16 if t.startswith("0x") else 10)
    if _FLOAT.match(token):
        return float(token.lower().replace(".inf", "inf").replace(".nan", "nan"))
    return None


def fits(kind, token: str) -> bool:
    """Whether a plain token is a value of the field's kind (a consistency check may still refuse it)."""
    number = yaml12_number(token)
    if kind is str:
        return token not in BOOLS and token not in NULLS
    if kind is bool:
        return token in BOOLS
    if kind is int:
        return number is not None and math.isfinite(number) and float(number).is_integer()
    return number is not None and math.isfinite(number)


def with_value(field: str, token: str) -> str:
    prefix, _ = FIELDS[field]
    lines = BASE.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    head = prefix if ": " in prefix else prefix[:prefix.index("- ") + 2]
    lines[i] = head + token
    return "\n".join(lines) + "\n"


def resolved(spec: dict, field: str):
    node = spec
    for part in re.findall(r"[^.\[\]]+", field):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def validate(path) -> tuple[int, dict | None, str]:
    """`labkit validate --json` in this process: exit status, the resolved spec printed, and stderr. A traceback
    (an exception out of main) or a hang fails the test."""
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S * 4)
    start = time.process_time()  # CPU time: a busy machine slows the run but does not make it hang
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["validate", str(path), "--json"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.process_time() - start < HANG_S, f"hang: {path.read_bytes()[:300]!r}"
    return rc, json.loads(out.getvalue()) if rc == 0 else None, error_lines(rc, out.getvalue()) + err.getvalue()


def error_lines(rc: int, out: str) -> str:
    """The errors `validate --json` printed as JSON on stdout, as the '  - field: ...' lines it prints without --json."""
    printed = json.loads(out) if rc == 2 and out.strip() else {}
    errors = printed.get("errors", [])
    return f"{printed.get('spec')}: {len(errors)} error(s)\n" + "".join(f"  - {e}\n" for e in errors) if errors else ""


def check_outcome(rc: int, printed: dict | None, err: str):
    """Exit 0 with a sane resolved spec, or exit 2 with every error naming a field, in small output."""
    assert rc in (0, 2), err
    assert len(err) < 100_000
    if rc == 2:
        errors = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
        assert errors and all(re.match(r"^[^\s:][^:]*:", e) for e in errors), err
        return
    summary = printed["resolved"]
    assert 1 <= summary["world_size"] <= 2 ** 20
    assert summary["tensor"] * summary["pipeline"] * summary["data"] == summary["world_size"]
    optimizer = printed["spec"]["optimizer"]
    assert 0 < optimizer["lr"] < math.inf and 0 <= optimizer["min_lr"] <= optimizer["lr"]


def assert_round_trip(path):
    """The spec a run records (RunSpec.to_yaml) reads back as the same spec: no text turns into a number."""
    spec = load_spec(path)
    again = path.with_name("again.yaml")
    again.write_text(spec.to_yaml())
    assert load_spec(again).to_dict() == spec.to_dict()


@FUZZ
@given(st.sampled_from(sorted(FIELDS)), st.sampled_from(TOKENS))
def test_a_value_in_a_field_is_kept_or_refused_naming_the_field(tmp_path_factory, field, token):
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(with_value(field, token))
    rc, printed, err = validate(path)
    check_outcome(rc, printed, err)
    kind = FIELDS[field][1]
    plain = PLAIN.match(token) is not None
    if rc == 2:
        if plain and token not in NULLS and not fits(kind, token):  # the wrong kind is refused by the field's name
            assert f"\n  - {field}:" in err, err
        return
    assert_round_trip(path)
    value = resolved(printed["spec"], field)
    if not plain or token in NULLS:
        return
    if kind is str:
        assert token not in BOOLS, f"{field}: a switch taken as text"
        assert value == token, f"{field}: wrote {token!r}, resolved {value!r}"
    elif kind is bool:
        assert token in BOOLS and value == (token.lower() == "true")
    else:
        expected = yaml12_number(token)
        assert expected is not None, f"{field}: text {token!r} taken as the number {value!r}"
        assert value == (float(expected) if kind is float else expected), f"{field}: wrote {token!r}, got {value!r}"


@FUZZ
@given(st.sampled_from(sorted(FIELDS)), st.text(max_size=30))
def test_any_quoted_text_in_a_text_field_is_kept_exactly(tmp_path_factory, field, text):
    if FIELDS[field][1] is not str:
        return
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(with_value(field, json.dumps(text)))  # a JSON string is a YAML double-quoted scalar
    rc, printed, err = validate(path)
    check_outcome(rc, printed, err)
    if rc == 0:
        assert resolved(printed["spec"], field) == text
        assert_round_trip(path)


@FUZZ
@given(st.integers(0, len(BASE)), st.binary(max_size=40), st.integers(0, 40))
def test_bytes_spliced_into_a_spec_never_crash(tmp_path_factory, at, data, cut):
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    base = BASE.encode()
    path.write_bytes(base[:at] + data + base[at + cut:])
    check_outcome(*validate(path))


@pytest.mark.parametrize("content", [b"", b"false", b"[]", b"3", b"\xff\xfe", b"---\n---\n", b"%YAML 1.1\n---\nx: 1",
                                     b"? [a]\n: 1", b"{a: 1, a: 2}", b"&a [*a]"])
def test_whole_file_oddities_exit_2(tmp_path, content):
    path = tmp_path / "spec.yaml"
    path.write_bytes(content)
    rc, _, err = validate(path)
    assert rc == 2 and err
    check_outcome(rc, None, err)


# --- the classes of issue-style input the fuzzing found last: each refused naming its field, or kept as written -----

def test_null_in_a_model_field_keeps_the_presets_value():
    spec = load_spec({"model": {"preset": "tiny-llama", "swiglu": None, "normalization": None, "num_layers": None,
                                "rotary_base": None}})
    assert (spec.model.swiglu, spec.model.normalization, spec.model.num_layers, spec.model.rotary_base) \
        == (True, "RMSNorm", 4, 10000)
    assert "swiglu" in spec.derived_model_keys  # not written: a new preset brings its own
    assert spec.replace(**{"model.preset": "tiny"}).model.swiglu is False
    # With a dataset the vocabulary is the tokenizer's, as when the key is left out.
    data = {"path": "corpus"}
    assert load_spec({"model": {"preset": "gpt2-small", "vocab_size": None}, "data": data}).model.vocab_size \
        == load_spec({"model": {"preset": "gpt2-small"}, "data": data}).model.vocab_size


@pytest.mark.parametrize("data, fix", [({"mock": False}, "give data.path"),
                                       ({"mock": False, "path": ""}, "remove data.mock")])
def test_mock_false_without_a_dataset_is_refused(data, fix):
    with pytest.raises(SpecError) as info:
        load_spec({"model": {"preset": "tiny"}, "data": data})
    assert any(e.startswith("data.mock:") and fix in e for e in info.value.errors), info.value.errors


@pytest.mark.parametrize("text, shown", [("[a, b]", "['a', 'b']"), ("{a: 1}", "{'a': 1}"), ("1e3", "'1e3'"),
                                         ("true", "'true'")])
def test_a_preset_that_is_no_name_is_one_error_naming_the_field(tmp_path, text, shown):
    path = tmp_path / "spec.yaml"
    path.write_text(f"name: x\nmodel: {{preset: {text}}}\n")
    rc, _, err = validate(path)
    errors = [line for line in err.splitlines() if line.startswith("  - ")]
    assert rc == 2 and len(errors) == 1 and errors[0].startswith("  - model.preset: unknown preset"), err
    assert shown in errors[0] and "known: tiny" in errors[0]


@pytest.mark.parametrize("field", ["data.tokenizer.model", "train.save", "train.load", "data.vocab_file",
                                   "data.split", "name", "job.env.VALUE"])
def test_a_nul_byte_in_text_is_refused_never_cut(tmp_path, field):
    data = {"model": {"preset": "tiny"}, "data": {"path": "corpus", "tokenizer": {"type": "HuggingFaceTokenizer",
                                                                                   "model": "tok"}}}
    node, *parents, leaf = data, *field.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = "a\0b"
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    rc, _, err = validate(path)
    assert rc == 2 and f"\n  - {field}: contains a NUL byte" in err, err


@pytest.mark.parametrize("change, field", [({"optimizer": {"lr": 65}}, "optimizer.lr"),
                                           ({"optimizer": {"lr": 1e300}}, "optimizer.lr"),
                                           ({"data": {"path": "corpus", "split": "abc"}}, "data.split"),
                                           ({"data": {"path": "corpus", "split": "0,0,0"}}, "data.split"),
                                           ({"train": {"iters": 5, "log_interval": 10}}, "train.log_interval")])
def test_nonsense_values_are_refused_naming_the_field_and_the_fix(change, field):
    with pytest.raises(SpecError) as info:
        load_spec({"model": {"preset": "tiny"}, **change})
    (error,) = [e for e in info.value.errors if e.startswith(f"{field}:")]
    assert re.search(r"; (write|set) ", error), error


def test_a_world_the_sizes_cannot_split_says_what_to_change():
    with pytest.raises(SpecError) as info:
        load_spec({"model": {"preset": "tiny"}, "parallel": {"tensor": 2, "data": 3},
                   "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 3}]}})
    (error,) = [e for e in info.value.errors if e.startswith("parallel.data:")]
    assert "?" not in error and "give cluster.nodes 6 GPUs" in error

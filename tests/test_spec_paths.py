"""Paths and names in a run spec: what reaches a remote shell never reads as an option, a container image is a file or a
registry reference by its form, mounts are pyxis's SRC:DST[:FLAGS], and no path or name holds a line break; each
refusal names its field and the fix."""
from __future__ import annotations

import json
import os
import shlex
import stat
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.jobs.remote import RemoteError, SshRunner
from labkit.jobs.render import render
from labkit.spec import SpecError, load_spec

BASE = {"name": "paths", "model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8},
        "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 1}]}}


def spec_with(**sections) -> dict:
    data = json.loads(json.dumps(BASE))
    for dotted, value in sections.items():
        node, *parents, leaf = data, *dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return data


def errors_of(data: dict) -> list[str]:
    with pytest.raises(SpecError) as refused:
        load_spec(data)
    return refused.value.errors


def test_a_remote_dir_that_starts_with_a_dash_is_refused_naming_the_field_and_the_fix():
    [error] = errors_of(spec_with(**{"cluster.login": "alice@login", "cluster.remote_dir": "-rf"}))
    assert error.startswith("cluster.remote_dir: '-rf' starts with '-'") and "write ./-rf" in error, error
    load_spec(spec_with(**{"cluster.login": "alice@login", "cluster.remote_dir": "./-rf"}))  # the fix it names
    with pytest.raises(ValueError, match="cluster.remote_dir"):
        SshRunner("alice@login", "--help")


def test_paths_sent_to_the_login_node_are_never_read_as_options(tmp_path, monkeypatch):
    # A stand-in for ssh that runs the command here (in `home`), as the login node's shell would.
    home = tmp_path / "home"
    home.mkdir()
    fake = tmp_path / "ssh"
    fake.write_text(f'#!/bin/bash\nprintf "%s\\n" "${{@: -1}}" >>{tmp_path}/commands\ncd {home} && '
                    'exec bash -c "${@: -1}"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("LABKIT_SSH_COMMAND", str(fake))
    runner = SshRunner("alice@login", "./-runs")
    assert runner.root() == str(home / "-runs") and (home / "-runs").is_dir()
    assert runner.place(tmp_path / "run1") == f"{home}/-runs/run1" and (home / "-runs" / "run1" / "logs").is_dir()
    commands = (tmp_path / "commands").read_text()
    assert "mkdir -p -- ./-runs && cd -- ./-runs" in commands and f"mkdir -p -- {home}/-runs/run1/logs" in commands
    runner._root = "-rf"  # however a path came to start with '-', no command receives it
    with pytest.raises(RemoteError, match="cluster.remote_dir: '-rf/run2' starts with '-'"):
        runner.place(tmp_path / "run2")
    with pytest.raises(RemoteError, match="starts with '-'"):
        runner.read_text("-n")


@pytest.mark.parametrize("image", ["megatron.sqsh", "images/megatron.SIF", "./megatron.sqsh", "~/no-such.sqsh"])
def test_an_image_file_is_known_by_its_form_and_a_missing_one_is_reported(tmp_path, monkeypatch, image):
    monkeypatch.chdir(tmp_path)
    container = {"image": image, "runtime": "apptainer" if image.lower().endswith(".sif") else "pyxis"}
    [error] = errors_of(spec_with(**{"job.container": container}))
    assert error.startswith(f"job.container.image: '{image}' does not exist on this machine"), error
    Path(tmp_path / "images").mkdir()
    if not image.startswith("~"):
        (tmp_path / image).write_bytes(b"hsqs")
        spec = load_spec(spec_with(**{"job.container": container}))
        assert spec.job.container.image == image  # as written
        script = render(spec, tmp_path / "logs").scripts["job.sbatch"]
        absolute = shlex.quote(os.path.abspath(tmp_path / image))
        # absolute, as pyxis reads a file (and Apptainer runs it from any directory)
        assert (f"--container-image={absolute}" if container["runtime"] == "pyxis" else f" {absolute} \\\n") in script


@pytest.mark.parametrize("image", ["nvcr.io#nvidia/pytorch:25.04-py3", "nvcr.io/nvidia/pytorch:24.05-py3", "img",
                                   "ubuntu"])
def test_a_registry_image_is_not_looked_for(image):
    spec = load_spec(spec_with(**{"job.container": {"image": image}}))
    assert f"--container-image={shlex.quote(image)}" in render(spec, "/runs/R/logs").scripts["job.sbatch"]


@pytest.mark.parametrize("mount, wrong", [
    ("0", "gives no container path"), ("/fsx", "gives no container path"), ("fsx:/fsx", "the source 'fsx'"),
    ("/fsx:fsx", "the container path 'fsx'"), ("/a:/b:ro:x", "3 colons"), ("/a:/b:ro,rw", "without commas"),
    ("/a:/b:r o", "the flags 'r o'"), ("/a\n:/b", "on one line"), ("", "on one line"), ("2:00:00", "the source '2'"),
])
def test_a_mount_is_src_dst_flags(mount, wrong):
    errors = errors_of(spec_with(**{"job.container": {"image": "img", "mounts": [mount]}}))
    assert errors and all(e.startswith("job.container.mounts[0]: ") for e in errors), errors
    assert any(wrong in e for e in errors) and any("/fsx:/fsx" in e or "e.g. ro" in e for e in errors), errors


@pytest.mark.parametrize("mount", ["/fsx:/fsx", "/data:/data:ro", "/a:/b:ro+rprivate", "./cache:/cache",
                                   "tmpfs:/scratch", "/x:/y:x-create=file"])
def test_a_good_mount_is_kept_as_written(mount):
    spec = load_spec(spec_with(**{"job.container": {"image": "img", "mounts": [mount]}}))
    assert spec.job.container.mounts == [mount]
    assert f"--container-mounts={mount}," in render(spec, "/runs/R/logs").scripts["job.sbatch"].replace("'", "")


FIELDS = ["name", "data.path", "data.vocab_file", "data.merge_file", "data.tokenizer.model", "train.save",
          "train.load", "train.tensorboard_dir", "train.wandb.project", "train.wandb.exp_name", "train.wandb.save_dir"]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("breaker", ["\n", "\r", "\t"])
def test_a_line_break_in_a_path_or_name_is_refused_naming_its_field(tmp_path, field, breaker):
    value = f"runs{breaker}x"
    data = spec_with(**{field: value})
    if field.startswith("data."):
        data["data"].setdefault("path", "corpus")
    if field == "data.tokenizer.model":
        data["data"]["tokenizer"]["type"] = "SentencePieceTokenizer"
    if field.startswith("train.wandb."):
        data["train"]["wandb"].setdefault("project", "labkit")
    if field == "train.load":
        data["train"]["save"] = "ckpt"
    errors = errors_of(data)
    mine = [e for e in errors if e.startswith(f"{field}: ")]
    assert mine and f"write {field} on one line" in mine[0], errors
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(data))
    assert main(["validate", str(spec)]) == 2  # the command line says the same, without a traceback


def test_every_error_is_one_line_even_where_a_parser_quotes_the_users_line_break(tmp_path, capsys):
    """The driver's parser names an unknown flag as written; the error list stays one line per error."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_with(**{"job.extra_args": ["--no-such-flag\nrm -rf /"]})))
    assert main(["validate", str(spec)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("1 error(s)") and len(lines) == 2, lines
    assert lines[1].startswith("  - job.extra_args: ") and "--no-such-flag\\nrm -rf /" in lines[1]


def test_a_spec_with_plain_paths_and_names_is_accepted_as_written():
    data = spec_with(**{"train.save": "ckpt dir/é", "train.tensorboard_dir": "tb", "name": "a name, with 'quotes'",
                        "train.wandb": {"project": "labkit", "exp_name": "run #1", "save_dir": "/w"}})
    spec = load_spec(data)
    assert (spec.name, spec.train.save, spec.train.wandb.exp_name) == ("a name, with 'quotes'", "ckpt dir/é", "run #1")
    assert os.sep == "/"

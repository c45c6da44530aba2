"""Experiment tracking: train.tensorboard_dir and train.wandb rendered as Megatron-LM's flags and honoured by the
driver (W&B offline, read back from its run file), and a finished run's logs exported into MLflow's file store."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import catalog, cli
from labkit.logs import parse_log
from labkit.megatron.flags import flag_errors
from labkit.megatron_args import megatron_args, spec_flags
from labkit.jobs.submission import submission_errors
from labkit.spec import SpecError, load_spec
from labkit.train.arguments import parse_args

FIXTURE_LOG = Path(__file__).parent / "fixtures" / "logs" / "03-mlm2025-gpt2-fp16-autodl.log"
TINY = {"name": "tracked", "model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 4},
        "train": {"iters": 2, "log_interval": 1, "eval_interval": 2, "eval_iters": 1}}


def _spec(**train):
    return load_spec({**TINY, "train": {**TINY["train"], **train}})


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# ------------------------------------------------------------------------------------------------- the spec's flags

def test_wandb_renders_megatron_lm_flags_with_a_tensorboard_directory_beside_it():
    args = megatron_args(_spec(wandb={"project": "labkit"}))
    # Megatron-LM sends losses to W&B only inside its TensorBoard branch: W&B alone would get no loss.
    assert _value(args, "--tensorboard-dir") == "tensorboard" and "--log-timers-to-tensorboard" in args
    assert (_value(args, "--wandb-project"), _value(args, "--wandb-exp-name"), _value(args, "--wandb-save-dir")) == (
        "labkit", "tracked", "wandb")
    assert flag_errors(args) == []
    assert {"--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--tensorboard-dir"} <= catalog.megatron_lm_flags()


def test_tracking_fields_are_named_for_their_flags_and_the_save_directory_holds_wandb_by_default():
    spec = _spec(save="ckpt", tensorboard_dir="/fsx/tb", wandb={"project": "p", "exp_name": "e"})
    rendered = spec_flags(spec)
    args = [str(a) for a in rendered.args]
    assert _value(args, "--tensorboard-dir") == "/fsx/tb" and _value(args, "--wandb-save-dir") == "ckpt/wandb"
    assert rendered.fields["--tensorboard-dir"] == "train.tensorboard_dir"
    assert rendered.fields["--wandb-exp-name"] == "train.wandb.exp_name"
    tensorboard_only = megatron_args(_spec(tensorboard_dir="tb"))
    assert _value(tensorboard_only, "--tensorboard-dir") == "tb" and "--wandb-project" not in tensorboard_only
    assert not any("tensorboard" in a or "wandb" in a for a in megatron_args(_spec()))


def test_wandb_without_a_project_is_refused_naming_the_field():
    with pytest.raises(SpecError) as error:
        _spec(wandb={"exp_name": "e"})
    assert any(e.startswith("train.wandb.project: the W&B project is needed") for e in error.value.errors)


def test_wandb_missing_here_names_the_field_and_the_pip_command(monkeypatch, capsys):
    spec = _spec(wandb={"project": "p"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert "train.wandb needs wandb, which the base install leaves out: pip install 'labkit[tracking]'" in submission_errors(
        spec, "local")
    assert not any("wandb" in e for e in submission_errors(spec, "multinode"))  # the cluster's environment is its own
    with pytest.raises(SystemExit):
        parse_args(megatron_args(spec), world_size=1, rank=0, cuda=False)
    assert "--wandb-project needs wandb, which the base install leaves out: pip install 'labkit[tracking]'" in \
        capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (labkit[tracking])")
def test_the_driver_follows_megatron_lm_for_the_wandb_directory(capsys):
    args = [*megatron_args(_spec(wandb={"project": "p"})), "--wandb-save-dir", ""]
    with pytest.raises(SystemExit):
        parse_args(args, world_size=1, rank=0, cuda=False)
    assert "--wandb-project: W&B keeps its files under --save's wandb/" in capsys.readouterr().err
    parsed = parse_args([*args, "--save", "ckpt"], world_size=1, rank=0, cuda=False)
    assert parsed.wandb_save_dir == os.path.join("ckpt", "wandb")  # Megatron-LM's _set_wandb_writer default


# ------------------------------------------------------------------------------------------ W&B offline, end to end

def wandb_records(path: Path):
    """The records of a W&B run file (run-*.wandb), read with wandb's own protobuf: after a 7-byte header (':W&B',
    magic, version) it is LevelDB's log format, 32 KiB blocks of chunks (CRC32C, little-endian length, type
    1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield Record.FromString(pending)
            pending = b""


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    pytest.importorskip("wandb")
    spec = _spec(timing_log_level=1, wandb={"project": "labkit-test"})
    run_dir = tmp_path_factory.mktemp("wandb-run")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1")
    with open(run_dir / "train.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "labkit.train", *megatron_args(spec)], cwd=run_dir, env=env,
                              stdout=log, stderr=subprocess.STDOUT, timeout=300)
    assert done.returncode == 0, (run_dir / "train.log").read_text()[-3000:]
    return run_dir


@pytest.mark.slow
def test_an_offline_wandb_run_holds_the_scalars_the_log_prints(wandb_run):
    [run_file] = (wandb_run / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    def items(entries) -> dict:
        return {entry.key or "/".join(entry.nested_key): json.loads(entry.value_json) for entry in entries}

    history, run = {}, None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            scalars = items(record.history.item)
            history.setdefault(scalars.pop("_step"), {}).update(scalars)
        elif kind == "run":
            run = record.run
    assert (run.project, run.display_name) == ("labkit-test", "tracked")
    config = items(run.config.update)  # the driver's arguments, as Megatron-LM gives W&B vars(args)
    assert config["train_iters"] == 2 and config["wandb_project"] == "labkit-test"
    log = parse_log(wandb_run / "train.log")
    assert sorted(history) == [1, 2]
    for row in log.iterations.itertuples():
        scalars = history[row.iteration]
        assert {"lm loss", "learning-rate", "grad-norm", "iteration-time", "loss-scale", "batch-size",
                "samples vs steps", "throughput", "forward-backward-time", "optimizer-time"} <= set(scalars)
        assert scalars["lm loss"] == pytest.approx(row.lm_loss, rel=1e-5)  # the log prints six digits
        assert scalars["grad-norm"] == pytest.approx(row.grad_norm, abs=1e-3)
        assert scalars["iteration-time"] * 1000 == pytest.approx(row.elapsed_ms, abs=0.1)
        assert scalars["samples vs steps"] == row.consumed_samples
    valid = log.validation[log.validation.split == "valid"].iloc[0]
    assert history[2]["lm loss validation"] == pytest.approx(valid.lm_loss, rel=1e-5)
    assert list((wandb_run / "tensorboard").glob("events.out.tfevents.*"))


# -------------------------------------------------------------------------------------------------- MLflow export

@pytest.mark.slow
def test_a_megatron_lm_log_exports_to_mlflow_parameters_and_per_iteration_metrics(tmp_path, capsys):
    pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    assert cli.main(["logs", "export", "--mlflow", str(store), "--experiment", "gpt2", str(FIXTURE_LOG)]) == 0
    run_id = capsys.readouterr().out.split()[2]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    run = client.get_run(run_id)
    log = parse_log(FIXTURE_LOG)
    assert run.info.status == "FINISHED" and run.info.run_name == FIXTURE_LOG.stem
    assert client.get_experiment(run.info.experiment_id).name == "gpt2"
    assert len(run.data.params) == len(log.arguments) == 463
    assert run.data.params["hidden_size"] == "768" and run.data.params["fp16"] == "True"
    losses = log.iterations.dropna(subset=["lm_loss"])
    history = client.get_metric_history(run_id, "lm_loss")
    assert [(m.step, m.value) for m in history] == list(zip(losses.iteration, losses.lm_loss))
    assert len(client.get_metric_history(run_id, "elapsed_ms")) == len(log.iterations) == 26
    first = log.iterations.timestamp.iloc[0].to_pydatetime().timestamp() * 1000
    assert client.get_metric_history(run_id, "elapsed_ms")[0].timestamp == first
    validation = client.get_metric_history(run_id, "lm loss validation")
    assert [(m.step, m.value) for m in validation] == list(zip(log.validation.iteration, log.validation.lm_loss))
    assert len(validation) == 5


@pytest.mark.slow
def test_the_drivers_run_directory_exports_to_mlflow_with_the_losses_it_logged(wandb_run, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from labkit.logs.export import export_mlflow

    run_id = export_mlflow(wandb_run, tmp_path / "mlruns")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.info.run_name == wandb_run.name and run.data.params["wandb_project"] == "labkit-test"
    log = parse_log(wandb_run)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "lm_loss")] == list(
        zip(log.iterations.iteration, log.iterations.lm_loss))
    # Validated at iteration 2, then the validation set again at the end of training: one key for both.
    assert [m.step for m in client.get_metric_history(run_id, "lm loss validation")] == [2, 2]
    assert [m.step for m in client.get_metric_history(run_id, "lm loss test")] == [2]


def test_mlflow_gets_the_validation_loss_under_the_one_name_tensorboard_and_wandb_give_it():
    from labkit.logs.export import METRICS, metric_rows
    from labkit.train.profiling import TensorBoard

    # The driver's log: validation at iterations 10 and 20, then the validation and test sets once more at the end.
    log = parse_log(FIXTURE_LOG.with_name("labkit-driver-dp2.log"))
    assert list(log.validation.split) == ["valid", "valid", "validation", "test"]
    rows = metric_rows(log)
    assert {key for key, *_ in rows} - set(METRICS) == {"lm loss validation", "lm loss validation ppl", "lm loss test",
                                                        "lm loss test ppl"}
    assert [(step, value) for key, value, step, _ in rows if key == "lm loss validation"] == [
        (10, 6.010339), (20, 5.76655), (20, 5.762235)]
    assert [(step, value) for key, value, step, _ in rows if key == "lm loss test"] == [(20, 5.726602)]

    class Writer:
        def __init__(self):
            self.tags = []

        def add_scalar(self, tag, value, step):
            self.tags.append(tag)

    board = TensorBoard(argparse.Namespace(tensorboard_dir=None, log_validation_ppl_to_tensorboard=True), True)
    board.writer = Writer()
    board.validation(20, 80, {"lm loss": 5.76655})
    assert {"lm loss validation", "lm loss validation ppl"} <= set(board.writer.tags)


def test_a_log_from_before_2023_exports_its_end_of_training_losses_at_the_last_iteration():
    from labkit.logs.export import metric_rows

    log = parse_log(FIXTURE_LOG.with_name("01-v1-deepspeedexamples-gpt2-mp2.log"))
    assert list(log.validation.split) == ["val", "test"]  # "at the end of training for val data": no iteration
    last = int(log.iterations.iteration.max())
    assert [(key, step) for key, _, step, _ in metric_rows(log) if key.startswith("lm loss ")] == [
        ("lm loss validation", last), ("lm loss validation ppl", last), ("lm loss test", last),
        ("lm loss test ppl", last)]


def test_an_export_without_iterations_is_refused(tmp_path, capsys):
    pytest.importorskip("mlflow")
    empty = tmp_path / "empty.log"
    empty.write_text("nothing trained here\n")
    assert cli.main(["logs", "export", "--mlflow", str(tmp_path / "mlruns"), str(empty)]) == 2
    assert "no logged iteration to export" in capsys.readouterr().err

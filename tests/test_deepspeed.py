"""optimizer.zero_backend deepspeed: the ds_config.json a Megatron-DeepSpeed launch reads (its numbers against the spec,
and DeepSpeed's own parser where deepspeed imports), the flags and checks that name the field, and labkit's driver
training a tiny GPT with DeepSpeed's ZeRO engine at stages 1-3 to the losses of plain data parallelism."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.deepspeed_config import FILE_NAME, ds_config, ds_config_text
from labkit.jobs.render import render
from labkit.megatron.flags import FLAG, ArgumentError, build_parser
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec
from labkit.jobs.submission import submission_errors
from labkit.train.arguments import finish

ROOT = Path(__file__).resolve().parent.parent

TINY = {"model": {"preset": "tiny"}, "precision": "fp32", "batch": {"micro": 2, "global": 8},
        "train": {"iters": 3, "log_interval": 1}, "data": {"mock": True},
        "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}}


def labkit_env(**extra) -> dict[str, str]:
    """The environment for a labkit subprocess: one with deepspeed installed beside it may see labkit only as this
    checkout (PYTHONPATH), whatever its working directory."""
    return dict(os.environ, **extra, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get(
        "PYTHONPATH")])]))


GPUS = {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 2}]}
"""Two GPUs: where DeepSpeed runs fp16 (its CPU accelerator does not)."""


def deepspeed_spec(stage: int = 2, **changes):
    return load_spec({**TINY, "optimizer": {"zero_stage": stage, "zero_backend": "deepspeed"}, **changes})


# ---------------------------------------------------------------------------------------------------------------------
# The config, without deepspeed

def test_the_configs_batch_sizes_stage_and_clipping_follow_the_spec():
    spec = load_spec({**TINY, "batch": {"micro": 2, "global": 32}, "optimizer": {
        "zero_stage": 3, "zero_backend": "deepspeed", "clip_grad": 0.5}, "kernels": {"overlap_grad_reduce": True},
        "cluster": {"nodes": [{"gpu": "cpu", "count": 2, "gpus_per_node": 2}]}})
    config = ds_config(spec)
    assert spec.data_parallel == 4
    # DeepSpeed's _batch_assertion: train_batch_size = micro x accumulation x data-parallel size
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (32, 2, 4)
    assert config["zero_optimization"] == {"stage": 3, "reduce_scatter": True, "overlap_comm": True,
                                           "contiguous_gradients": True}
    assert config["gradient_clipping"] == 0.5
    assert config["fp16"] == {"enabled": False} and config["bf16"] == {"enabled": False}
    assert config["steps_per_print"] is None and config["wall_clock_breakdown"] is False
    assert "optimizer" not in config and "scheduler" not in config  # the Megatron flags' (the driver builds them)


def test_fp16_scales_the_loss_dynamically_from_the_specs_initial_scale_or_keeps_a_fixed_one():
    dynamic = ds_config(deepspeed_spec(precision="fp16", cluster=GPUS))["fp16"]
    assert dynamic == {"enabled": True, "loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1.0}
    fixed = ds_config(deepspeed_spec(precision="fp16", cluster=GPUS, optimizer={
        "zero_stage": 1, "zero_backend": "deepspeed", "loss_scale": 128.0}))["fp16"]
    assert fixed["loss_scale"] == 128.0
    bf16 = ds_config(deepspeed_spec(precision="bf16"))
    assert bf16["bf16"] == {"enabled": True} and bf16["fp16"] == {"enabled": False}
    with pytest.raises(SpecError, match=r"optimizer\.initial_loss_scale: 1000 is no power of 2"):
        deepspeed_spec(precision="fp16", cluster=GPUS, optimizer={"zero_stage": 1, "zero_backend": "deepspeed",
                                                                  "initial_loss_scale": 1000.0})


def test_the_flags_are_megatron_deepspeeds_and_replace_the_distributed_optimizer():
    args = megatron_args(deepspeed_spec(1))
    at = args.index(str(FLAG.deepspeed))
    assert args[at:at + 5] == [str(FLAG.deepspeed), str(FLAG.deepspeed_config), FILE_NAME, str(FLAG.zero_stage), "1"]
    assert str(FLAG.use_distributed_optimizer) not in args and str(FLAG.use_torch_fsdp2) not in args
    assert str(FLAG.deepspeed) not in megatron_args(load_spec({**TINY, "optimizer": {"zero_stage": 1}}))


def test_the_rendered_job_holds_ds_config_json_and_its_script_writes_it_where_the_driver_reads_it(tmp_path):
    spec = deepspeed_spec(3)
    rendered = render(spec, tmp_path / "logs", layout="local", run_id="RUN", torchrun="torchrun")
    assert list(rendered.scripts) == ["run.sh", FILE_NAME]
    text = rendered.scripts[FILE_NAME]
    assert text == ds_config_text(spec) and json.loads(text) == ds_config(spec)
    script = rendered.scripts["run.sh"]
    assert f"--deepspeed_config {tmp_path / FILE_NAME}" in script and "--zero-stage 3" in script
    # the script's own copy: run the line that writes it
    (line,) = [line for line in script.splitlines(keepends=True) if line.startswith("printf '%s' ")]
    start = script.index(line)
    writer = script[start:script.index("\n", script.index(f">{tmp_path / FILE_NAME}", start))]
    subprocess.run(["bash", "-c", writer], check=True)
    assert (tmp_path / FILE_NAME).read_text() == text


def test_dry_run_shows_the_config(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**TINY, "optimizer": {"zero_stage": 2, "zero_backend": "deepspeed"}}))
    out = subprocess.run([sys.executable, "-m", "labkit", "run", str(path), "--dry-run", "--backend", "local"],
                         capture_output=True, text=True, cwd=tmp_path, env=labkit_env())
    assert out.returncode == 0, out.stderr
    assert "# ===== ds_config.json =====" in out.stdout and '"stage": 2' in out.stdout


ENGINE = "DeepSpeed's ZeRO engine (optimizer.zero_backend)"


@pytest.mark.parametrize("changes, message", [
    ({"job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/Megatron-LM"}},
     "optimizer.zero_backend: deepspeed (zero_stage 2) needs DeepSpeed's engine, which Megatron-LM's pretrain_gpt.py"),
    ({"parallel": {"tensor": 2}, "cluster": GPUS}, f"parallel.tensor: {ENGINE} takes one whole GPT per rank"),
    ({"precision": "fp16"}, f"precision: {ENGINE} does not run fp16 on CPUs"),
    ({"optimizer": {"zero_stage": 1, "zero_backend": "deepspeed", "name": "sgd"}},
     f"optimizer.name: {ENGINE} steps Adam-family optimizers"),
    ({"train": {"iters": 3, "log_interval": 1, "save": "/tmp/ckpt"}}, f"train.save: {ENGINE} saves and loads"),
])
def test_what_the_engine_cannot_run_is_refused_naming_the_field(changes, message):
    """On GPUs a plan is judged as Megatron-LM runs it (DeepSpeed's limits on labkit's driver show at submission); on
    CPUs, where only labkit's driver runs, when the spec is read."""
    try:
        errors = submission_errors(deepspeed_spec(2, **changes), "local")
    except SpecError as refused:
        errors = refused.errors
    assert any(e.startswith(message) for e in errors), errors


def test_labkits_driver_runs_every_stage_and_k8s_is_refused():
    for stage in range(4):
        assert submission_errors(deepspeed_spec(stage), "local") == []
    assert any("k8s backend" in e for e in submission_errors(deepspeed_spec(1), "k8s"))


def driver_args(tmp_path, stage=2, *extra, config_changes=None):
    spec = deepspeed_spec(stage)
    config = {**ds_config(spec), **(config_changes or {})}
    (tmp_path / FILE_NAME).write_text(json.dumps(config))
    argv = [*megatron_args(spec, ds_config=tmp_path / FILE_NAME), *extra]
    return build_parser().parse_args(argv)


def test_the_driver_takes_the_rendered_flags_and_refuses_a_config_that_disagrees(tmp_path, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # as if deepspeed were installed
    parsed = finish(driver_args(tmp_path, 3), world_size=2, rank=0, cuda=False)
    assert parsed.deepspeed and parsed.zero_stage == 3 and not parsed.use_distributed_optimizer
    with pytest.raises(ArgumentError, match=r"--deepspeed_config: train_batch_size is 16 in .*--global-batch-size"):
        finish(driver_args(tmp_path, 3, config_changes={"train_batch_size": 16}), world_size=2, rank=0, cuda=False)
    with pytest.raises(ArgumentError, match=r"--deepspeed_config: zero_optimization.stage is 1 .*--zero-stage"):
        finish(driver_args(tmp_path, 3, config_changes={"zero_optimization": {"stage": 1}}), world_size=2, rank=0,
               cuda=False)
    with pytest.raises(ArgumentError, match=r"--tensor-model-parallel-size: DeepSpeed's ZeRO engine \(--deepspeed\) "
                                            "takes one whole GPT per rank"):
        finish(driver_args(tmp_path, 1, "--tensor-model-parallel-size", "2"), world_size=2, rank=0, cuda=False)
    with pytest.raises(ArgumentError, match=r"--fp16: DeepSpeed's ZeRO engine \(--deepspeed\) does not run fp16 on CPUs"):
        finish(driver_args(tmp_path, 1, "--fp16"), world_size=2, rank=0, cuda=False)
    with pytest.raises(ArgumentError, match=r"--save: .*leave out --save and --load"):
        finish(driver_args(tmp_path, 1, "--save", str(tmp_path)), world_size=2, rank=0, cuda=False)
    argv = [a for a in megatron_args(deepspeed_spec(1)) if a != str(FLAG.deepspeed)]
    with pytest.raises(ArgumentError, match=r"--deepspeed_config: needs --deepspeed"):
        finish(build_parser().parse_args(argv), world_size=2, rank=0, cuda=False)


def test_without_deepspeed_the_driver_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ArgumentError, match=r"--deepspeed: needs the deepspeed package.*pip install 'labkit\[deepspeed\]'"):
        finish(driver_args(tmp_path, 1), world_size=2, rank=0, cuda=False)


def test_the_driver_imports_deepspeed_only_under_the_flag():
    """labkit.train runs without the deepspeed package: only deepspeed_engine imports it, and only training.py's run
    imports that, inside its --deepspeed branch."""
    train = ROOT / "labkit" / "train"
    for path in train.glob("*.py"):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top for a in n.names} | {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        if path.name != "deepspeed_engine.py":
            assert not {n for n in names if "deepspeed" in n}, path.name


# ---------------------------------------------------------------------------------------------------------------------
# DeepSpeed's own parser and engine

class DataParallelOnly:
    """The one thing DeepSpeedConfig asks a model-parallel unit (mpu): the data-parallel size it checks the batch
    sizes against, as Megatron-DeepSpeed passes megatron's mpu."""

    def __init__(self, size: int):
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


@pytest.fixture
def deepspeed_comm():
    """deepspeed.comm over a one-process gloo group (DeepSpeedConfig reads the rank through it)."""
    deepspeed = pytest.importorskip("deepspeed")
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    yield deepspeed
    dist.destroy_process_group()


@pytest.mark.parametrize("changes", [{}, {"precision": "fp16", "cluster": GPUS},
                                     {"precision": "bf16", "batch": {"micro": 1, "global": 16}}])
def test_deepspeeds_parser_reads_the_rendered_config(deepspeed_comm, tmp_path, changes):
    from deepspeed.runtime.config import DeepSpeedConfig

    for stage in range(4):
        spec = deepspeed_spec(stage, **changes)
        path = tmp_path / FILE_NAME
        path.write_text(ds_config_text(spec))  # the rendered job's file (see the test above)
        parsed = DeepSpeedConfig(str(path), mpu=DataParallelOnly(spec.data_parallel))
        assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu,
                parsed.gradient_accumulation_steps) == (spec.batch.global_, spec.batch.micro,
                                                        spec.batch.global_ // (spec.batch.micro * 2))
        assert parsed.zero_optimization_stage == stage and parsed.gradient_clipping == spec.optimizer.clip_grad
        assert (parsed.float16_config.enabled, parsed.bfloat16_config.enabled) == (
            spec.precision == "fp16", spec.precision == "bf16")
        if spec.precision == "fp16":
            assert parsed.float16_config.initial_scale_power == 32 and parsed.float16_config.loss_scale == 0
        assert parsed.steps_per_print is None and not parsed.wall_clock_breakdown


def _launch(runs: dict, tmp_path) -> dict:
    """Start labkit's driver under torchrun with two gloo processes for each spec, all at once: {name: log text}."""
    from labkit.net import free_port

    procs = {}
    for name, spec in runs.items():
        directory = tmp_path / name
        directory.mkdir()
        (directory / FILE_NAME).write_text(ds_config_text(spec))
        log = open(directory / "train.log", "w")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
               "-m", "labkit.train", *map(str, megatron_args(spec, ds_config=directory / FILE_NAME))]
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=directory,
                                        env=labkit_env(OMP_NUM_THREADS="1")), log)
    texts = {}
    for name, (proc, log) in procs.items():
        proc.wait(timeout=900)
        log.close()
        texts[name] = (tmp_path / name / "train.log").read_text()
        assert proc.returncode == 0, texts[name][-4000:]
    return texts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny GPT, 3 iterations of 2 micro-batches per rank, data-parallel 2: DeepSpeed at stages 1-3 and
    megatron-core's plain data parallelism (stage 0), started together."""
    pytest.importorskip("deepspeed")
    runs = {f"deepspeed-{stage}": deepspeed_spec(stage) for stage in (1, 2, 3)}
    runs["megatron-0"] = load_spec(TINY)
    return _launch(runs, tmp_path_factory.mktemp("deepspeed"))


def losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", text)]


@pytest.mark.slow
def test_deepspeed_stages_1_to_3_train_to_plain_data_parallelisms_losses(trained):
    """Same data, seed and optimizer: ZeRO moves the model state, not the arithmetic beyond fp32 rounding."""
    plain = losses(trained["megatron-0"])
    assert len(plain) == 3 and all(0 < x < 10 for x in plain)
    for stage in (1, 2, 3):
        text = trained[f"deepspeed-{stage}"]
        assert f"DeepSpeed ZeRO stage {stage} engine" in text
        assert re.search(r"zero_stage \.+ " + str(stage), text)  # the arguments block, as Megatron prints it
        assert losses(text) == pytest.approx(plain, rel=1e-5)


@pytest.mark.slow
def test_deepspeed_runs_log_megatrons_lines(trained):
    """labkit's log parser reads a DeepSpeed run as any other: iteration lines, the layout, the arguments."""
    from labkit.logs.parse import parse_text

    for name, text in trained.items():
        parsed = parse_text(text)
        assert parsed.iterations["iteration"].tolist() == [1, 2, 3], name
        assert parsed.iterations["lm_loss"].tolist() == pytest.approx(losses(text))
        assert parsed.parallel["data"] == 2 and parsed.parallel["num_micro_batches"] == 2
        assert parsed.arguments.get("deepspeed") == (name != "megatron-0")

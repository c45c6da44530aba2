"""Job scripts rendered from the spec: golden files, and hostile strings that must not run as commands."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from labkit import catalog
from labkit.jobs.render import gres_type, node_groups, render, render_array, time_limit_seconds
from labkit.jobs.submission import submission_errors
from labkit.spec import check_job
from labkit.megatron_args import megatron_args
from labkit.spec import ContainerSpec, SpecError, load_spec, with_changes

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden" / "jobs"
FAKE_TORCHRUN = Path(__file__).resolve().parent / "fake_torchrun.sh"
UPDATE = os.environ.get("LABKIT_UPDATE_GOLDEN") == "1"


def two_node_spec(**changes):
    spec = {"name": "tiny-2nodes", "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
            "batch": {"micro": 2, "global": 8}, "train": {"iters": 10, "log_interval": 5}, "data": {"mock": True},
            "cluster": {"nodes": [{"gpu": "A10", "count": 2, "gpus_per_node": 1}]}}
    return load_spec(with_changes(spec, **changes))


def full_options_spec():
    return two_node_spec(job={"partition": "debug", "account": "lab", "time_limit": "0:30:00", "cpus_per_task": 2,
                              "exclusive": True, "env": {"NCCL_DEBUG": "INFO"}, "master_port": 6787,
                              "container": {"image": "nvcr.io#nvidia/pytorch:24.01-py3", "mounts": ["/data:/data"]}})


GOLDEN_CASES = {
    "multinode.sbatch": lambda: render(full_options_spec(), "/runs/RUN/logs", run_id="RUN", torchrun="torchrun"),
    "enroot.sbatch": lambda: render(two_node_spec(job={"container": {"image": "/images/megatron.sqsh",
                                                                     "runtime": "enroot"},
                                                       "cluster_paths": ["/images"]}),
                                    "/runs/RUN/logs", run_id="RUN"),
    # Apptainer in each task; Slurm's own srun --container with an OCI bundle (tests/test_containers.py)
    "apptainer.sbatch": lambda: render(two_node_spec(job={
        "container": {"image": "/images/megatron.sif", "runtime": "apptainer", "mounts": ["/data:/data:ro"]},
        "env": {"NCCL_DEBUG": "INFO"}, "cluster_paths": ["/images"]}), "/runs/RUN/logs", run_id="RUN"),
    "slurm-container.sbatch": lambda: render(two_node_spec(job={
        "container": {"image": "/images/megatron-bundle", "runtime": "slurm"}, "cluster_paths": ["/images"]}),
        "/runs/RUN/logs", run_id="RUN"),
    "hetjob.sbatch": lambda: render(load_spec(ROOT / "examples/gpt2-xl-hetero.yaml"), "/runs/RUN/logs",
                                    run_id="RUN", torchrun="torchrun"),
    "pair": lambda: render(load_spec(ROOT / "examples/gpt2-xl-hetero.yaml"), "/runs/RUN/logs", layout="pair",
                           run_id="RUN", torchrun="torchrun"),
    "array.sbatch": lambda: render_array([two_node_spec(), two_node_spec(name="fp16", precision="fp16")],
                                         ["/runs/A/logs", "/runs/B/logs"], run_ids=["A", "B"], torchrun="torchrun"),
    "local-run.sh": lambda: render(load_spec(ROOT / "examples/tiny-cpu.yaml"), "/runs/RUN/logs", layout="local",
                                   run_id="RUN", torchrun="torchrun"),
    "production.sbatch": lambda: render(production_spec(), "/runs/RUN/logs", run_id="RUN", torchrun="torchrun"),
    "megatron-lm.sbatch": lambda: render(two_node_spec(job={
        "entrypoint": "megatron-lm", "megatron_lm": "/workspace/megatron-lm",
        "container": {"image": "nvcr.io#nvidia/pytorch:25.04-py3"}}), "/runs/RUN/logs", run_id="RUN"),
    "requeue.sbatch": lambda: render(requeue_spec(), "/runs/RUN/logs", run_id="RUN", torchrun="torchrun"),
    # DeepSpeed's ZeRO on labkit's driver: the script writes the ds_config.json it passes (tests/test_deepspeed.py)
    "deepspeed": lambda: render(two_node_spec(optimizer={"zero_stage": 2, "zero_backend": "deepspeed"}),
                                "/runs/RUN/logs", run_id="RUN", torchrun="torchrun"),
}


def requeue_spec(**job):
    """A preemptible hetjob on whole nodes of a catalog cluster that knows its A10 nodes' CPUs (not its A100 node's),
    with tensor parallelism."""
    return two_node_spec(job={"requeue": True, "time_limit": "2:00:00", "exclusive": True, **job},
                         cluster="a100-a10-hetero",
                         parallel={"tensor": 2, "pipeline": 2}, batch={"micro": 1, "global": 16},
                         train={"iters": 1000, "save": "/scratch/ckpt", "save_interval": 200})



@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_rendered_scripts_match_golden_files(case):
    rendered = GOLDEN_CASES[case]()
    for name, text in rendered.scripts.items():
        path = GOLDEN / (f"{case}.{name}" if len(rendered.scripts) > 1 else case)
        if UPDATE:
            path.write_text(text)
        assert text == path.read_text(), f"{path.name} changed; review the diff, then LABKIT_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("name", sorted(p for p in GOLDEN.iterdir() if p.suffix != ".json"), ids=lambda p: p.name)
def test_golden_scripts_are_valid_bash(name):
    assert subprocess.run(["bash", "-n", str(name)], capture_output=True).returncode == 0


def test_gres_types_and_node_groups():
    assert [gres_type(g) for g in ("A100-40GB", "a10", "H100-SXM5-80GB", "cpu", "RTX3090")] == \
        ["a100", "a10", "h100", None, "rtx3090"]
    groups = node_groups(load_spec(ROOT / "examples/gpt2-xl-hetero.yaml"))
    assert [(g.nodes, g.gres, g.first_rank) for g in groups] == [(1, "gpu:a100:4", 0), (7, "gpu:a10:4", 1)]


def test_time_limits_in_slurm_formats():
    assert [time_limit_seconds(t) for t in ("1", "1:30", "2:00:00", "1-0", "1-2:03", "1-0:0:5", "UNLIMITED")] == \
        [60, 90, 7200, 86400, 93780, 86405, None]


@pytest.mark.parametrize("job, field", [
    ({"time_limit": "ten minutes"}, "job.time_limit"),
    ({"partition": "debug\n#SBATCH --uid=0"}, "job.partition"),
    ({"account": "lab'; rm -rf ~"}, "job.account"),
    ({"env": {"BAD NAME": "1"}}, "job.env.BAD NAME"),
    ({"container": {"image": "img", "mounts": ["/a:/a,/etc:/etc"]}}, "job.container.mounts[0]"),
    ({"container": {"image": "img", "runtime": "docker"}}, "job.container.runtime"),
    ({"master_port": 70000}, "job.master_port"),
])
def test_job_options_that_cannot_be_written_safely_are_rejected_naming_the_field(job, field):
    with pytest.raises(SpecError) as refused:  # validate refuses what run would
        two_node_spec(job=job)
    assert any(e.startswith(field + ":") for e in refused.value.errors), refused.value.errors
    spec = two_node_spec()  # a spec changed after it was checked is checked again when rendered
    for key, value in job.items():
        setattr(spec.job, key, ContainerSpec(**value) if key == "container" else value)
    errors = check_job(spec)
    assert any(e.startswith(field + ":") for e in errors), errors
    with pytest.raises(SpecError):
        render(spec, "/runs/RUN/logs")


def test_layouts_need_matching_node_groups():
    with pytest.raises(SpecError, match="cluster.nodes: a master/slave pair"):
        render(load_spec(ROOT / "examples/tiny-cpu.yaml"), "/r", layout="pair")
    with pytest.raises(SpecError, match="runs dir"):
        render(two_node_spec(), "/runs/a\nb/logs")


# --- injection: run the rendered script with stand-ins for srun, scontrol, enroot and torchrun ---------------------
STUBS = {
    "srun": """#!/bin/bash
printf '%s\\0' "$@" >"$STUB_LOG/srun.argv"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
export SLURM_PROCID=0 SLURMD_NODENAME=n1
exec "$@"
""",
    "scontrol": "#!/bin/bash\necho n1\n",
    "apptainer": """#!/bin/bash
printf '%s\\0' "$@" >"$STUB_LOG/apptainer.argv"
[ "$1" = exec ] || exit 2
shift
while [ $# -gt 0 ]; do case $1 in --nv) shift ;; --bind) shift 2 ;; *) shift; break ;; esac; done
exec "$@"
""",
    "enroot": """#!/bin/bash
printf '%s\\0' "$@" >>"$STUB_LOG/enroot.argv"
[ "$1" = start ] || exit 0
shift
while [ $# -gt 0 ]; do case $1 in --rw) shift ;; --mount|--env) shift 2 ;; *) shift; break ;; esac; done
exec "$@"
""",
}


def hostile(marker: Path) -> str:
    return f"x'y\"z $(touch {marker}) `touch {marker}`; touch {marker} && touch {marker}\ntouch {marker} # \\"


def run_script(script_text: str, tmp_path: Path) -> Path:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(script_text)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(stubs), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "n1", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return stubs


def nul_list(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def node_env(log_dir: Path) -> dict[str, str]:
    pairs = nul_list(log_dir / "42" / "n1.env0")
    return dict(p.split("=", 1) for p in pairs)


@pytest.mark.parametrize("field", ["name", "data.path", "env", "extra_args", "container.image", "container.mounts",
                                   "enroot.image", "apptainer.image", "apptainer.env", "log_dir"])
def test_hostile_strings_reach_their_target_verbatim_and_never_run(field, tmp_path):
    marker = tmp_path / "INJECTED"
    payload = hostile(marker)
    log_dir = tmp_path / "logs"
    job: dict = {}
    spec_changes: dict = {}
    if field == "name":
        payload = payload.replace("\n", " ")  # a name with a line break is refused outright
        spec_changes["name"] = payload
    elif field == "data.path":
        payload = f"/{payload}".replace("\n", " ")  # relative paths render absolute; a line break is refused
        spec_changes["data"] = {"mock": False, "path": payload}
    elif field == "env":
        job["env"] = {"NCCL_DEBUG": payload}
    elif field == "extra_args":
        job["extra_args"] = ["--data-cache-path", payload]
    elif field == "container.image":
        payload = payload.replace("\n", " ")  # an image name with a line break is refused outright
        job["container"] = {"image": payload}
    elif field == "container.mounts":
        mount = "/" + payload.replace(",", "").replace(":", "")  # SRC:DST: a path, then where it goes
        job["container"] = {"image": "img", "mounts": [mount.replace("\n", " ") + ":/data"]}
    elif field == "enroot.image":
        payload = f"{tmp_path}/{payload}.sqsh".replace("\n", " ")  # the file must exist here: make it
        Path(payload).parent.mkdir(parents=True)
        Path(payload).touch()
        job["container"] = {"image": payload, "runtime": "enroot"}
    elif field == "apptainer.image":
        payload = f"{tmp_path}/{payload}.sif".replace("\n", " ")  # the file must exist here: make it
        Path(payload).parent.mkdir(parents=True)
        Path(payload).touch()
        job["container"] = {"image": payload, "runtime": "apptainer"}
    elif field == "apptainer.env":
        job["container"] = {"image": "docker://nvcr.io/nvidia/pytorch:25.04-py3", "runtime": "apptainer"}
        job["env"] = {"NCCL_DEBUG": payload}
    elif field == "log_dir":
        log_dir = tmp_path / "a b'c$(touch INJECTED)`touch INJECTED`;touch INJECTED" / "logs"
    spec = two_node_spec(job=job, **spec_changes)
    stubs = run_script(render(spec, log_dir, torchrun=str(FAKE_TORCHRUN)).scripts["job.sbatch"], tmp_path)
    assert not marker.exists() and not list(tmp_path.rglob("INJECTED"))
    argv = nul_list(log_dir / "42" / "n1.argv")
    srun = nul_list(stubs / "srun.argv")
    if field == "name":
        assert node_env(log_dir)["RUN_NAME"] == payload
    elif field == "data.path":
        assert argv[argv.index("--data-path") + 1] == payload
    elif field == "env":
        assert node_env(log_dir)["NCCL_DEBUG"] == payload
    elif field == "extra_args":
        assert argv[-2:] == ["--data-cache-path", payload]
    elif field == "container.image":
        assert f"--container-image={payload}" in srun
    elif field == "container.mounts":
        assert f"--container-mounts={mount.replace(chr(10), ' ')}:/data,{log_dir}:{log_dir}" in srun
    elif field == "enroot.image":
        assert payload in nul_list(stubs / "enroot.argv")
    elif field == "apptainer.image":
        assert payload in nul_list(stubs / "apptainer.argv")
    elif field == "apptainer.env":  # set over the image's own variables
        assert node_env(log_dir)["APPTAINERENV_NCCL_DEBUG"] == payload
    elif field == "log_dir":
        assert (log_dir / "42" / "n1.out").exists()


def test_hostile_name_stays_on_its_line(tmp_path):
    marker = tmp_path / "INJECTED"
    name = hostile(marker).replace("\n", " ")  # (a line break is refused outright)
    lines = render(two_node_spec(name=name), tmp_path / "logs").scripts["job.sbatch"].splitlines()
    job_name = [line for line in lines if line.startswith("#SBATCH --job-name=")]
    assert len(job_name) == 1 and re.fullmatch(r"#SBATCH --job-name=[A-Za-z0-9._+-]+", job_name[0])
    assert lines[1].startswith("# labkit run: x'y\"z $(touch") and lines[2].startswith("# 2 node(s) x 1 process(es)")


def production_spec():
    """Every scheduler option a cluster admin sets, on a two-group cluster whose A100 sizes share one gres type."""
    return two_node_spec(
        job={"exclusive": True, "mem": "0", "gpus_per_node_flag": "gpus-per-node", "rendezvous": "c10d",
             "sbatch": ["--qos=high", "--reservation=training"], "env_preset": "aws-efa",
             "env": {"NCCL_DEBUG": "INFO"}},
        batch={"micro": 2, "global": 32},
        cluster={"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 8, "constraint": "a100-80gb"},
                           {"gpu": "A100-40GB", "count": 1, "gpus_per_node": 8, "gres": "gpu:a100_40g:8"}]})


def test_production_options_reach_the_script():
    script = render(production_spec(), "/runs/RUN/logs", run_id="RUN").scripts["job.sbatch"]
    lines = script.splitlines()
    assert "#SBATCH --qos=high" in lines and "#SBATCH --reservation=training" in lines
    assert "#SBATCH --gpus-per-node=a100:8" in lines and "#SBATCH --constraint=a100-80gb" in lines
    assert "#SBATCH --gres=gpu:a100_40g:8" in lines and lines.count("#SBATCH --mem=0") == 2
    assert "export FI_PROVIDER=efa" in lines and "export NCCL_DEBUG=INFO" in lines  # job.env over the preset
    assert "NCCL_DEBUG=WARN" not in script
    assert '--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in script


@pytest.mark.parametrize("job, named", [
    ({"sbatch": ["qos=high"]}, "job.sbatch[0]"), ({"sbatch": ["--qos=high\n#SBATCH --x"]}, "job.sbatch[0]"),
    ({"mem": "lots"}, "job.mem"), ({"gpus_per_node_flag": "gpus"}, "job.gpus_per_node_flag"),
    ({"rendezvous": "etcd"}, "job.rendezvous"), ({"env_preset": "slingshot"}, "job.env_preset"),
    ({"entrypoint": "megatron-lm"}, "job.megatron_lm"), ({"entrypoint": "nemo"}, "job.entrypoint"),
    ({"entrypoint": "megatron-lm", "megatron_lm": "/m", "extra_args": ["--no-such-flag"]}, "job.extra_args[0]"),
])
def test_bad_scheduler_options_are_refused_naming_the_item(job, named):
    with pytest.raises(SpecError) as info:
        two_node_spec(job=job)
    assert any(e.startswith(named + ":") for e in info.value.errors), info.value.errors


def test_a_megatron_lm_job_runs_pretrain_gpt_with_the_drivers_flags():
    spec = two_node_spec(job={"entrypoint": "megatron-lm", "megatron_lm": "/workspace/megatron-lm",
                              "extra_args": ["--use-flash-attn"]})  # a Megatron-LM flag labkit's driver lacks
    script = render(spec, "/runs/RUN/logs", run_id="RUN").scripts["job.sbatch"]
    assert '/workspace/megatron-lm/pretrain_gpt.py "$@"' in script and "-m labkit.train" not in script
    assert "    --use-flash-attn" in script


def test_every_flag_labkit_renders_is_one_megatron_lm_defines():
    """labkit/data/megatron_lm_flags.txt: the parser's flags at the pinned Megatron-LM release. Every example, every
    preset and a spec with today's options render only those."""
    known = catalog.megatron_lm_flags()
    specs = [load_spec(path) for path in sorted((ROOT / "examples").glob("*.yaml"))]
    specs += [load_spec({"model": {"preset": name}, "precision": "bf16"}) for name in catalog.models()]
    specs.append(load_spec({
        "model": {"preset": "llama3-8b"}, "precision": "fp8", "optimizer": {"distributed": True},
        "parallel": {"tensor": 2, "context": 2, "sequence_parallel": True, "pipeline": 2, "virtual_stages": 2},
        "recompute": {"granularity": "selective"}, "batch": {"micro": 1, "global": 64},
        "kernels": {"attention_backend": "fused", "overlap_grad_reduce": True, "overlap_param_gather": True,
                    "tp_comm_overlap": True},
        "data": {"path": "/data/x", "tokenizer": {"type": "NullTokenizer"}},
        "train": {"save": "/ckpt", "save_interval": 100, "eval_interval": 50, "eval_iters": 2},
        "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]}}))
    rendered = {arg for spec in specs for arg in megatron_args(spec) if arg.startswith("--")}
    assert len(rendered) > 40 and rendered <= known, sorted(rendered - known)


def test_requeue_renders_the_signal_the_trap_and_a_resumable_driver():
    script = render(requeue_spec(), "/runs/RUN/logs", run_id="RUN").scripts["job.sbatch"]
    lines = script.splitlines()
    assert {"#SBATCH --requeue", "#SBATCH --signal=B:USR1@120", "#SBATCH --open-mode=append"} <= set(lines)
    # The warning goes on to the steps; the job is requeued only once they ended (in wait_steps), never in the trap.
    [warning] = re.findall(r"\ntrap '(.*?)' USR1\n", script, re.S)
    assert 'scancel --signal=USR1 "$SLURM_JOB_ID"' in warning and "requeue" not in warning
    wait_steps = script[script.index("wait_steps() {"):]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in wait_steps[:wait_steps.index("\n}\n")]
    assert "trap '' USR1" in script  # the node's shell and torchrun ignore it
    args = megatron_args(requeue_spec())
    assert args[args.index("--save") + 1] == args[args.index("--load") + 1] == "/scratch/ckpt"
    assert "--exit-signal-handler" in args and args[args.index("--exit-signal") + 1] == "SIGUSR1"
    # Later attempts log into their own directory.
    assert 'logs="$logs/attempt-$SLURM_RESTART_COUNT"' in script


def test_requeue_false_asks_slurm_never_to_requeue_and_none_leaves_the_cluster_default():
    never = render(two_node_spec(job={"requeue": False}), "/runs/RUN/logs").scripts["job.sbatch"].splitlines()
    assert "#SBATCH --no-requeue" in never and "#SBATCH --open-mode=append" not in never
    default = render(two_node_spec(), "/runs/RUN/logs").scripts["job.sbatch"]
    assert not re.search(r"--(no-)?requeue|--signal|scontrol requeue|--exit-signal-handler", default)


@pytest.mark.parametrize("changes, named", [
    ({"job.requeue": True}, "train.save"),
    ({"job.requeue": True, "train.save": "/c", "train.load": "/other"}, "train.load"),
    ({"job.requeue": True, "train.save": "/c", "job.time_limit": "1"}, "job.requeue_signal_s"),
    ({"job.requeue": True, "train.save": "/c", "job.requeue_signal_s": 0}, "job.requeue_signal_s"),
])
def test_requeue_without_what_it_needs_names_the_field(changes, named):
    with pytest.raises(SpecError) as error:
        two_node_spec(**changes)
    assert str(error.value).count(named) >= 1


def test_a_pair_cannot_be_requeued():
    spec = requeue_spec()
    assert any(e.startswith("job.requeue:") and "pair" in e for e in submission_errors(spec, "pair"))
    assert not submission_errors(spec, "hetjob")


def test_cpus_per_task_defaults_to_the_nodes_cpus_per_group_and_the_job_setting_wins():
    script = render(requeue_spec(), "/runs/RUN/logs").scripts["job.sbatch"]
    assert script.count("#SBATCH --cpus-per-task=96") == 1  # the A10 nodes (g5.24xlarge); the A100 node is unknown
    assert "--het-group=1 --nodes=7 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=96" in script
    assert "--het-group=0 --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 \\" in script
    assert render(requeue_spec(cpus_per_task=8), "/runs/RUN/logs").scripts["job.sbatch"].count(
        "#SBATCH --cpus-per-task=8") == 2


def test_tensor_parallel_jobs_get_one_cuda_connection_unless_the_spec_says_otherwise():
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in render(requeue_spec(), "/r").scripts["job.sbatch"]
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in render(two_node_spec(), "/r").scripts["job.sbatch"]
    mine = render(requeue_spec(env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"}), "/r").scripts["job.sbatch"]
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=8\n" in mine


def wait_steps_function() -> str:
    """The job scripts' wait_steps, as a multi-node job renders it."""
    script = render(two_node_spec(), "/runs/R/logs").scripts["job.sbatch"]
    return re.search(r"^wait_steps\(\) \{\n.*?^\}\n", script, re.S | re.M).group(0)


@pytest.mark.parametrize("steps, status", [
    ("(sleep 0.2) & a=$!; (sleep 0.2) & b=$!; sleep 1", 0),  # both ended before the call
    ("(sleep 0.2; exit 4) & a=$!; (sleep 0.2) & b=$!; sleep 1", 4),
    ("(exit 3) & a=$!; sleep 600 & b=$!", 3),  # the failing step stops the one still running
])
def test_wait_steps_gives_each_steps_own_status(steps, status):
    done = subprocess.run(["bash", "-c", f"{wait_steps_function()}\n{steps}\nwait_steps $a $b; echo $?"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == [str(status)], done.stderr

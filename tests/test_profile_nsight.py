"""The profile section: Nsight Systems and Nsight Compute over chosen ranks. The spec's checks, the flags it renders
(Megatron-LM's --profile range), the job scripts for Slurm, local and Kubernetes (golden files; the local script run
with stand-ins for torchrun, nsys, ncu and Python), and the driver's capture range and NVTX ranges."""
from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from labkit.jobs.k8s import render_manifest
from labkit.jobs.render import render
from labkit.jobs.render_profile import rank_shell
from labkit.megatron.flags import FLAG
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec, with_changes

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
UPDATE = os.environ.get("LABKIT_UPDATE_GOLDEN") == "1"


def gpu_spec(**changes):
    """The tiny GPT on 2 nodes x 2 H100; rank 0 and 2 under nsys over iterations 3-4, rank 1 under ncu."""
    spec = {"name": "tiny-nsight", "model": {"preset": "tiny"}, "precision": "bf16",
            "batch": {"micro": 1, "global": 4}, "train": {"iters": 6, "log_interval": 2}, "data": {"mock": True},
            "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 2, "cpus_per_node": 16}]},
            "profile": {"nsys": {"ranks": [0, 2], "start_step": 2, "end_step": 4, "trace": ["cuda", "nvtx", "osrt"],
                                 "extra_args": ["--cuda-memory-usage=true"]},
                        "ncu": {"ranks": [1], "kernel_regex": "gemm|flash", "launch_count": 3,
                                "sections": ["SpeedOfLight"]}}}
    return load_spec(with_changes(spec, **changes))


def k8s_spec(**changes):
    return gpu_spec(**{"job.container": {"image": "nvcr.io#nvidia/pytorch:25.04-py3", "mounts": ["/fsx:/fsx"]},
                       "profile.output_dir": "/fsx/profiles/tiny-nsight", "job.k8s.kind": "PyTorchJob", **changes})


GOLDEN_CASES = {
    "jobs/nsight.sbatch": lambda: render(gpu_spec(**{"job.container": {"image": "nvcr.io#nvidia/pytorch:25.04-py3"}}),
                                         "/runs/RUN/logs", run_id="RUN", torchrun="torchrun").scripts["job.sbatch"],
    "jobs/nsight-local-run.sh": lambda: render(gpu_spec(), "/runs/RUN/logs", layout="local", run_id="RUN",
                                               torchrun="torchrun").scripts["run.sh"],
    "jobs/nsight-megatron-lm.sbatch": lambda: render(gpu_spec(**{"job.entrypoint": "megatron-lm",
                                                                 "job.megatron_lm": "/workspace/megatron-lm",
                                                                 "job.exclusive": True, "profile.ncu": None}),
                                                     "/runs/RUN/logs", run_id="RUN",
                                                     torchrun="torchrun").scripts["job.sbatch"],
    "k8s/pytorchjob-nsight.yaml": lambda: render_manifest(k8s_spec()),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_rendered_jobs_match_golden_files(case):
    text, path = GOLDEN_CASES[case](), GOLDEN / case
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} changed; review the diff, then LABKIT_UPDATE_GOLDEN=1"
    if path.suffix != ".yaml":
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_the_pytorchjob_validates_and_writes_its_reports_under_a_mount():
    from test_jobs_k8s import schema_errors

    manifest = yaml.safe_load(render_manifest(k8s_spec()))
    assert schema_errors(manifest) == []
    command = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    start = command.index("--no-python")
    assert command[start:start + 3] == ["--no-python", "bash", "-c"]
    assert command[start + 4:] == ["labkit-profile", "/fsx/profiles/tiny-nsight", "python", "-u", "-m", "labkit.train"]
    assert "$$RANK" in command[start + 3]  # Kubernetes substitutes $(NAME) and turns $$ into $
    with pytest.raises(SpecError, match=r"profile\.output_dir: a pod's files end with it"):
        render_manifest(k8s_spec(**{"profile.output_dir": None}))
    with pytest.raises(SpecError, match=r"profile\.output_dir: '/scratch/p' is not under any job\.container\.mounts"):
        render_manifest(k8s_spec(**{"profile.output_dir": "/scratch/p"}))


def test_the_flags_are_megatron_lms_profile_range_on_both_entrypoints():
    for spec in (gpu_spec(), gpu_spec(**{"job.entrypoint": "megatron-lm", "job.megatron_lm": "/m", "profile.ncu": None,
                                          "profile.nsys.ranks": [0, 1, 2]})):
        args = megatron_args(spec)
        i = args.index(FLAG.profile.name)
        assert FLAG.use_pytorch_profiler.name not in args
        ranks = [0, 1, 2]
        assert args[i:i + 6 + len(ranks)] == [FLAG.profile.name, FLAG.profile_step_start.name, "2",
                                              FLAG.profile_step_end.name, "4", FLAG.profile_ranks.name,
                                              *map(str, ranks)]
    alone = megatron_args(gpu_spec(**{"profile.nsys": None, "train.iters": 12}))
    assert alone[alone.index(FLAG.profile_step_start.name) + 1:][:3] == ["10", FLAG.profile_step_end.name, "12"]


@pytest.mark.parametrize("changes, message", [
    ({"cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 4}]}},
     r"profile\.nsys: Nsight records CUDA GPUs, and cluster\.nodes\[0\]\.gpu is cpu"),
    ({"profile.nsys.ranks": [0, 4]}, r"profile\.nsys\.ranks: \[4\] outside the world of 4 processes"),
    ({"profile.nsys.ranks": []}, r"profile\.nsys\.ranks: empty"),
    ({"profile.ncu.ranks": [1, 2]}, r"profile\.ncu\.ranks: \[2\] also in profile\.nsys\.ranks"),
    ({"profile.nsys.end_step": 2}, r"profile\.nsys\.start_step: 2 with end_step 2"),
    ({"profile.nsys.end_step": 7}, r"profile\.nsys\.end_step: .* after iteration 7, past train\.iters 6"),
    ({"profile.nsys": None}, r"profile\.ncu: .*Megatron-LM's default steps 10 to 12\), past train\.iters 6"),
    ({"profile.nsys.extra_args": ["--output=/tmp/x"]}, r"profile\.nsys\.extra_args\[0\]: .*repeats --output"),
    ({"profile.nsys.trace": ["cuda,nvtx"]}, r"profile\.nsys\.trace\[0\]: 'cuda,nvtx' is not an nsys --trace value"),
    ({"profile.ncu.launch_count": 0}, r"profile\.ncu\.launch_count: must be at least 1"),
    ({"profile.ncu.sections": ["Speed Of Light"]}, r"profile\.ncu\.sections\[0\]: .* is not an ncu section"),
    ({"profile.output_dir": "reports"}, r"profile\.output_dir: 'reports' is not an absolute path"),
    ({"profile": {}}, r"profile: names neither nsys nor ncu"),
    ({"job.extra_args": ["--use-pytorch-profiler"]}, r"job\.extra_args: --use-pytorch-profiler turns the capture"),
    ({"job.extra_args": ["--profile"]}, r"job\.extra_args\[0\]: '--profile' repeats the --profile that profile\.nsys"),
])
def test_what_cannot_be_captured_is_refused_naming_the_key(changes, message):
    with pytest.raises(SpecError, match=message):
        gpu_spec(**changes)


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_the_local_script_starts_exactly_the_chosen_ranks_under_their_tool(tmp_path):
    """run.sh with stand-ins: torchrun starts each node's two workers with RANK set, as torch.distributed.run does
    with --no-python; nsys and ncu log their arguments and run the program; python logs its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torchrun = _executable(bin_dir / "torchrun", """#!/bin/bash
while [ "$1" != --no-python ]; do
    case $1 in --nproc_per_node) nproc=$2 ;; --node_rank) node=$2 ;; esac; shift
done
shift
for ((local_rank = 0; local_rank < nproc; local_rank++)); do RANK=$((node * nproc + local_rank)) "$@" || exit; done
""")
    for tool in ("nsys", "ncu"):
        _executable(bin_dir / tool, f"""#!/bin/bash
echo "$RANK {tool} $*" >>"{tmp_path}/calls"
while [ "$1" != -o ]; do shift; done
mkdir -p "$(dirname "$2")" && touch "$2"; shift 2
exec "$@"
""")
    _executable(bin_dir / "python", f'#!/bin/bash\necho "$RANK python $*" >>"{tmp_path}/calls"\n')
    logs = tmp_path / "run" / "logs"
    script = render(gpu_spec(), logs, layout="local", run_id="RUN", torchrun=str(torchrun)).scripts["run.sh"]
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    # run.sh ends by signalling its whole process group: a session of its own, as the local backend starts it
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr + "".join(p.read_text() for p in logs.rglob("*.err"))
    calls = sorted((tmp_path / "calls").read_text().splitlines())
    train = " -u -m labkit.train " + " ".join(megatron_args(gpu_spec()))
    assert [c.split(" ")[:2] for c in calls] == [["0", "nsys"], ["0", "python"], ["1", "ncu"], ["1", "python"],
                                                 ["2", "nsys"], ["2", "python"], ["3", "python"]]
    assert all(c.endswith(train) for c in calls if " python " in c)
    nsys = next(c for c in calls if c.startswith("0 nsys"))
    assert ("profile --capture-range=cudaProfilerApi --capture-range-end=stop --trace=cuda,nvtx,osrt --export=sqlite "
            f"--force-overwrite=true --cuda-memory-usage=true -o {logs}/nsys/rank0 ") in nsys
    ncu = next(c for c in calls if c.startswith("1 ncu"))
    assert (f"--profile-from-start off --launch-count 3 --force-overwrite --kernel-name regex:gemm|flash "
            f"--section SpeedOfLight -o {logs}/ncu/rank1 ") in ncu
    assert sorted(p.name for p in logs.glob("*/rank*")) == ["rank0", "rank1", "rank2"]


def test_a_node_without_the_tool_stops_naming_the_key(tmp_path):
    done = subprocess.run(["bash", "-c", rank_shell(gpu_spec().profile), "labkit-profile", str(tmp_path), "true"],
                          env={"PATH": "/usr/bin:/bin", "RANK": "1"}, capture_output=True, text=True)
    assert done.returncode == 1
    assert re.match(r"labkit: profile\.ncu: rank 1 found no ncu on \S+; install NVIDIA Nsight", done.stderr)
    other = subprocess.run(["bash", "-c", rank_shell(gpu_spec().profile), "labkit-profile", str(tmp_path), "true"],
                           env={"PATH": "/usr/bin:/bin", "RANK": "3"}, capture_output=True, text=True)
    assert other.returncode == 0  # a rank outside the profile runs as it is


# --- the driver -----------------------------------------------------------------------------------------------------

class _Calls(list):
    def record(self, name):
        return lambda *args, **kwargs: self.append((name, *args))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's profiler, NVTX and synchronize as a list of calls, CUDA reported present, rank 0."""
    import torch
    import torch.distributed as dist

    calls = _Calls()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", calls.record("synchronize"))
    monkeypatch.setattr(torch.cuda.profiler, "start", calls.record("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", calls.record("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", calls.record("push"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", calls.record("pop"))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    return calls


def _driver_args(extra: str = ""):
    from labkit.train.arguments import build_parser

    return build_parser().parse_args(("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                                      "--mock-data --vocab-size 1023 --lr 1e-3 --train-iters 6 --profile "
                                      "--profile-step-start 2 --profile-step-end 4 " + extra).split())


def test_the_driver_opens_the_cuda_range_around_whole_steps_and_names_them(fake_cuda):
    from labkit.train.profiling import StepProfiler

    args = _driver_args()
    profiler = StepProfiler(args)
    for step in range(args.train_iters):
        profiler.before_step(step)
        fake_cuda.append(("train", step + 1))
        args.iteration = step + 1
        profiler.after_step(step + 1)
    profiler.finish()
    assert fake_cuda == [("train", 1), ("train", 2), ("synchronize",), ("start",), ("push", "iteration 3"),
                         ("train", 3), ("pop",), ("push", "iteration 4"), ("train", 4), ("pop",), ("synchronize",),
                         ("stop",), ("train", 5), ("train", 6)]


def test_other_ranks_and_the_pytorch_profiler_open_no_cuda_range(fake_cuda, monkeypatch):
    import torch.distributed as dist

    from labkit.train.profiling import StepProfiler

    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert not StepProfiler(_driver_args()).cuda_range
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    assert not StepProfiler(_driver_args("--use-pytorch-profiler")).cuda_range


def test_forward_backward_and_optimizer_steps_are_nvtx_ranges(fake_cuda):
    from megatron.core.timers import Timers

    from labkit.train.profiling import nvtx_timers

    timers = nvtx_timers(Timers)(0, "minmax")
    for name, level in (("forward-compute", 2), ("backward-compute", 2), ("optimizer", 1), ("interval-time", 0)):
        timers(name, log_level=level).start()
        timers(name).stop()
    ranges = [call for call in fake_cuda if call[0] in ("push", "pop")]  # megatron's timers synchronize too
    assert ranges == [("push", "forward"), ("pop",), ("push", "backward"), ("pop",), ("push", "optimizer"), ("pop",)]

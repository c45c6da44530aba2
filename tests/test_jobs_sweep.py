"""Sweeps: variants of one spec submitted together on the local backend, with tests/fake_torchrun.sh standing in for
torchrun (it prints Megatron-format iteration lines and records its arguments); profiling flags checked as text."""
from __future__ import annotations

from pathlib import Path

import pytest

from labkit.jobs import LocalBackend, State
from labkit.jobs.sweep import NO_DROPOUT, PROFILE_DIR, Sweep, SweepFailed, profiled, share_cores, with_flags
from labkit.spec import load_spec

FAKE_TORCHRUN = str(Path(__file__).resolve().parent / "fake_torchrun.sh")


def tiny(**changes):
    spec = load_spec({"name": "tiny", "model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8},
                      "train": {"iters": 10, "log_interval": 5}, "cluster": "laptop"})
    return spec.replace(**changes) if changes else spec


def recorded_env(job) -> dict[str, str]:
    (env,) = job.log_dir.glob("*.env0")
    return dict(entry.split("=", 1) for entry in env.read_bytes().decode().split("\0") if "=" in entry)


def recorded_args(job) -> list[str]:
    (argv,) = job.log_dir.glob("*.argv")
    return argv.read_bytes().decode().split("\0")[:-1]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    backend = LocalBackend(runs_dir=tmp_path_factory.mktemp("runs"), torchrun=FAKE_TORCHRUN)
    base = tiny()
    sweep = Sweep.submit(backend, {"fp32": base, "bf16": profiled(base.replace(precision="bf16"), 4, 5, ranks=(0, 1)),
                                   "plain": with_flags(base, *NO_DROPOUT)}, prefix="lab")
    sweep.wait(timeout=120)
    return sweep


def test_every_variant_runs_under_its_prefixed_name_and_is_read_back(sweep):
    assert list(sweep.jobs) == ["fp32", "bf16", "plain"]
    assert [spec.name for spec in sweep.specs.values()] == ["lab-fp32", "lab-bf16", "lab-plain"]
    assert {job.state for job in sweep.jobs.values()} == {State.COMPLETED}
    assert sweep.specs["bf16"].precision == "bf16"
    assert list(sweep.logs) == ["fp32", "bf16", "plain"]
    assert sweep.logs["fp32"].iterations["iteration"].tolist() == [5, 10]
    assert all(path.name.startswith(sweep.jobs[name].record.run_id) for name, path in sweep.run_dirs.items())


def test_local_runs_share_the_cores_as_openmp_threads(sweep):
    # three runs of two processes on this host: one thread each (fewer cores than processes still gives one)
    assert {recorded_env(job)["OMP_NUM_THREADS"] for job in sweep.jobs.values()} == {"1"}


def test_core_shares_and_a_spec_that_sets_its_own_threads():
    one_process = tiny(cluster={"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 1}]})
    shared = share_cores({"a": one_process, "b": one_process, "c": tiny()}, cores=16)
    assert [s.job.env["OMP_NUM_THREADS"] for s in shared.values()] == ["4", "4", "4"]  # 16 cores, 4 processes
    own = one_process.replace(**{"job.env": {"OMP_NUM_THREADS": "3", "X": "y"}})
    assert share_cores({"a": own, "b": one_process}, cores=2)["a"].job.env == {"OMP_NUM_THREADS": "3", "X": "y"}
    assert share_cores({"a": one_process}, cores=2)["a"].job.env == {"OMP_NUM_THREADS": "2"}


def test_a_cluster_backend_leaves_the_threads_to_the_job():
    class Recorder:
        name = "slurm"
        submitted = []

        def submit(self, spec):
            self.submitted.append(spec)
            return spec

    backend = Recorder()
    Sweep.submit(backend, {"a": tiny()})
    assert "OMP_NUM_THREADS" not in backend.submitted[0].job.env


def test_profiled_passes_zero_based_steps_ranks_and_the_run_local_tensorboard_dir(sweep):
    args = recorded_args(sweep.jobs["bf16"])
    tail = args[args.index("--profile"):]
    assert tail == ["--profile", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "5",
                    "--profile-ranks", "0", "1", "--tensorboard-dir", PROFILE_DIR, "--log-timers-to-tensorboard",
                    "--log-memory-to-tensorboard"]
    assert "--bf16" in args


def test_with_flags_appends_to_what_the_spec_already_passes(sweep):
    args = recorded_args(sweep.jobs["plain"])
    assert args[-4:] == list(NO_DROPOUT)
    spec = with_flags(with_flags(tiny(), "--norm-epsilon", 1e-6), "--use-pytorch-profiler")
    assert spec.job.extra_args == ["--norm-epsilon", "1e-06", "--use-pytorch-profiler"]


def test_traces_of_a_run_that_was_not_profiled_say_how_to_profile_it(sweep):
    with pytest.raises(ValueError, match="was not profiled: submit labkit.jobs.sweep.profiled"):
        sweep.traces("fp32")
    with pytest.raises(KeyError, match="fp64"):
        sweep.traces("fp64")
    with pytest.raises(FileNotFoundError, match="no profiler trace"):  # the stand-in torchrun writes none
        sweep.traces("bf16")


@pytest.mark.parametrize("first, last, ranks, message", [
    (0, 2, (0,), r"1 <= first <= last <= train.iters \(10\)"),
    (5, 4, (0,), "first <= last"),
    (9, 11, (0,), "train.iters"),
    (1, 2, (2,), r"ranks from 0 to 1 \(the spec's world size is 2\)"),
    (1, 2, (), "choose ranks"),
])
def test_profiled_refuses_iterations_or_ranks_the_run_does_not_have(first, last, ranks, message):
    with pytest.raises(ValueError, match=message):
        profiled(tiny(), first, last, ranks=ranks)


def test_a_failed_variant_is_named_with_its_cause(tmp_path):
    backend = LocalBackend(runs_dir=tmp_path, torchrun=FAKE_TORCHRUN)
    sweep = Sweep.submit(backend, {"ok": tiny(), "broken": tiny(**{"job.env": {"FAKE_EXIT": "3"}})})
    with pytest.raises(SweepFailed) as failure:
        sweep.wait(timeout=120)
    assert list(failure.value.causes) == ["broken"]
    assert "exit code 3" in failure.value.causes["broken"]
    states = sweep.wait(raise_on_failure=False)
    assert states == {"ok": State.COMPLETED, "broken": State.FAILED}


def test_an_empty_sweep_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        Sweep.submit(LocalBackend(runs_dir=tmp_path), {})

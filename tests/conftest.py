"""Suite-wide fixtures. Tests marked `slurm` run against a real local Slurm (labkit/data/local_slurm/), started once per
session."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from labkit.jobs.local_slurm import SCRIPTS as SLURM_LOCAL

SLURM_TOOLS = ("sbatch", "squeue", "scontrol", "slurmctld", "slurmd", "munged")
ACCOUNTING_TOOLS = ("slurmdbd", "mariadbd", "mariadb-install-db")


@dataclass
class LocalSlurm:
    runtime_dir: Path
    conf: Path  # what SLURM_CONF points at
    accounting: bool  # slurmdbd runs: sacct answers for finished jobs

    @property
    def jobcomp(self) -> Path:
        return self.runtime_dir / "log" / "jobcomp.txt"


def why_slurm_cannot_be_installed() -> str | None:
    """The reason to skip Slurm tests on this host, or None when Slurm is installed or can be."""
    if all(shutil.which(tool) for tool in SLURM_TOOLS):
        return None
    if os.geteuid() != 0:
        return ("Slurm is not installed and installing it needs root: run `sudo make slurm-up` once "
                "(Debian packages slurmctld slurmd slurm-client munge), or run the suite as root")
    if not shutil.which("apt-get"):
        return ("Slurm is not installed and this host has no apt-get to install it: install slurmctld, slurmd, "
                "slurm-client and munge with your package manager")
    return None


def accounting_setting() -> str:
    """LABKIT_SLURM_ACCOUNTING for the suite's cluster: on (slurmdbd on MariaDB, as on production clusters) where it
    is installed or can be, unless the environment says otherwise."""
    if "LABKIT_SLURM_ACCOUNTING" in os.environ:
        return os.environ["LABKIT_SLURM_ACCOUNTING"]
    installable = os.geteuid() == 0 and shutil.which("apt-get")
    return "1" if installable or all(shutil.which(tool) for tool in ACCOUNTING_TOOLS) else "0"


def _daemon_alive(pid_file: Path) -> bool:
    try:
        return Path(f"/proc/{int(pid_file.read_text().strip())}").exists()
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="session")
def local_slurm():
    """Install (when missing, as root), start and share the local Slurm; SLURM_CONF points at it for the session.

    Sessions may share one cluster: each registers itself under users/, and the cluster is stopped at the end only by
    the session that started it, once no other session is still using it.
    """
    reason = why_slurm_cannot_be_installed()
    if reason:
        pytest.skip(reason)
    runtime_dir = Path(os.environ.get("LABKIT_SLURM_DIR", "/tmp/labkit-slurm"))
    was_running = _daemon_alive(runtime_dir / "run" / "slurmctld.pid")
    accounting = accounting_setting()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LABKIT_SLURM_ACCOUNTING", accounting)  # a later start.sh must not change the cluster's setup
        started = subprocess.run(["bash", str(SLURM_LOCAL / "start.sh")], capture_output=True, text=True)
        if started.returncode != 0:
            pytest.fail(f"local_slurm/start.sh failed (exit {started.returncode}):\n{started.stdout}{started.stderr}")
        users = runtime_dir / "users"
        users.mkdir(exist_ok=True)
        me = users / str(os.getpid())
        me.touch()
        cluster = LocalSlurm(runtime_dir=runtime_dir, conf=runtime_dir / "etc" / "slurm.conf",
                             accounting=accounting == "1")
        patch.setenv("SLURM_CONF", str(cluster.conf))
        yield cluster
    me.unlink(missing_ok=True)
    others = [u for u in users.iterdir() if u.name.isdigit() and Path(f"/proc/{u.name}").exists()]
    if not was_running and not others:
        subprocess.run(["bash", str(SLURM_LOCAL / "stop.sh")], capture_output=True, text=True)


@pytest.fixture(autouse=True)
def _slurm_for_marked_tests(request):
    if request.node.get_closest_marker("slurm"):
        request.getfixturevalue("local_slurm")


# megatron-core's language models write their attention backend into these variables as they are built, and assert
# that a later model in the same process (or a training run it starts, which inherits them) asks for the same one.
TRANSFORMER_ENGINE_ATTENTION_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@pytest.fixture(autouse=True)
def _attention_backend_variables_restored():
    """A test that builds a megatron-core model in the test process leaves the NVTE_* variables as they were."""
    before = {name: os.environ.get(name) for name in TRANSFORMER_ENGINE_ATTENTION_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True, scope="session")
def _scratch_user_directory(tmp_path_factory):
    """What labkit writes to the user's directory (measured profiles) goes to a scratch one during the suite."""
    patch = pytest.MonkeyPatch()
    patch.setenv("LABKIT_HOME", str(tmp_path_factory.mktemp("labkit-home")))
    yield
    patch.undo()


@pytest.fixture(autouse=True, scope="session")
def _messages_in_english():
    """The suite reads labkit's messages in English whatever language the caller's shell chose (LABKIT_LANG); a
    test of the Korean ones sets it itself."""
    patch = pytest.MonkeyPatch()
    patch.delenv("LABKIT_LANG", raising=False)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def train_in_parallel(tmp_path_factory):
    """train(specs) starts labkit's driver on each run spec ({name: spec}) under torchrun with two gloo processes, all
    at once (they share the cores), then waits for every one: {name: (spec, log text)}; a run that fails fails the
    test with its log."""
    return lambda specs: _train_in_parallel(specs, tmp_path_factory)


def _train_in_parallel(specs: dict, tmp_path_factory, processes: int = 2) -> dict:
    import sys

    from labkit.megatron_args import megatron_args
    from labkit.net import free_port

    runs = {}
    for name, spec in specs.items():
        directory = tmp_path_factory.mktemp(name)
        with open(directory / "train.log", "w") as log:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
                   f"--master-port={free_port()}", "-m", "labkit.train", *map(str, megatron_args(spec))]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=directory,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
        runs[name] = (spec, proc, directory / "train.log")
    results = {}
    for name, (spec, proc, log) in runs.items():
        proc.wait(timeout=600)
        text = log.read_text()
        assert proc.returncode == 0, text[-4000:]
        results[name] = (spec, text)
    return results


def pytest_addoption(parser):
    parser.addoption("--lab-edition", choices=("en", "ko", "all"), default="en",
                     help="the labs' edition that runs under nbval (tests/test_notebooks.py): en (the default: the "
                          "Korean edition's code is held identical to it), ko, or all")

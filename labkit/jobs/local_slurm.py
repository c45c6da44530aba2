"""labkit's local Slurm: a real Slurm (slurmctld, one slurmd per emulated node, munge, and slurmdbd when
LABKIT_SLURM_ACCOUNTING=1) on this host, with typed fake GPUs, for the labs and the tests.

Its scripts are package data (labkit/data/local_slurm/: start.sh, stop.sh, and common.sh with the settings), so a
wheel install starts the same cluster as a checkout: `labkit slurm up | down | status`, which `make slurm-up` and
`make slurm-down` call. The scripts stay shell because they drive daemons, apt and /etc the way an administrator
would; this module only finds and runs them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from labkit.paths import data_file

SCRIPTS = data_file("local_slurm")
"""start.sh, stop.sh and common.sh (whose header lists the LABKIT_SLURM_* settings)."""


def runtime_dir() -> Path:
    """Where the running cluster keeps its config, state and logs (LABKIT_SLURM_DIR, as common.sh reads it)."""
    return Path(os.environ.get("LABKIT_SLURM_DIR") or "/tmp/labkit-slurm")


def up() -> int:
    """Start the cluster (installing Slurm with apt on first use, as start.sh says); its exit status."""
    return subprocess.call(["bash", str(SCRIPTS / "start.sh")])


def down() -> int:
    """Stop the daemons start.sh started; a no-op when none runs."""
    return subprocess.call(["bash", str(SCRIPTS / "stop.sh")])


def status() -> int:
    """Print the nodes as `sinfo` sees them with the cluster's config: 0 when its controller answers, 3 when no local
    Slurm was started here, sinfo's status otherwise."""
    conf = runtime_dir() / "etc" / "slurm.conf"
    if not conf.exists() or shutil.which("sinfo") is None:
        print(f"no local Slurm in {runtime_dir()}: `labkit slurm up` starts one")
        return 3
    print(f"SLURM_CONF={conf}")
    return subprocess.call(["sinfo", "-N", "-o", "%N %T %G %c %m"], env={**os.environ, "SLURM_CONF": str(conf)})


def register(sub) -> None:
    p = sub.add_parser("slurm", help="start, stop or show labkit's local Slurm (typed fake GPUs on this host)")
    p.add_argument("action", choices=("up", "down", "status"),
                   help="up: start it (LABKIT_SLURM_* settings, see labkit/data/local_slurm/common.sh); down: stop "
                        "it; status: its nodes as sinfo sees them (exit 3 when none was started)")
    p.set_defaults(func=lambda args: {"up": up, "down": down, "status": status}[args.action]())

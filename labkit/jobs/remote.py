"""Where the Slurm backend runs Slurm's commands: on this host (LocalRunner) or on a cluster's login node over ssh
(SshRunner, from `cluster.login` and `cluster.remote_dir`).

One Slurm backend serves both: a runner runs a command (sbatch, squeue, sacct, scontrol, scancel) and reads a file
where Slurm is, places a run's directory there, sends it the rendered scripts, job.json and the files the run reads
(dataset, tokenizer, a container image file; not those under job.cluster_paths, which are there already), and brings
its logs back into the local run directory, so that `labkit status`, `labkit logs` and the widgets read them as they
read a local job's. Over ssh, everything goes through OpenSSH's own client (`ssh`, and `rsync -e ssh`, or `scp` where
either side lacks rsync) with the user's ~/.ssh/config and agent: labkit never holds a password or key. ssh runs
with BatchMode, so a login that would prompt fails with ssh's reason instead of hanging; LABKIT_SSH_COMMAND replaces
`ssh` and its options (as GIT_SSH_COMMAND does for git), e.g. `ssh -F ~/.ssh/cluster_config`. Connection sharing is
ssh's own ControlMaster/ControlPersist, set in the user's config.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from labkit.megatron.flags import DEFAULT_MERGES, DEFAULT_VOCAB
from labkit.spec import RunSpec
from labkit.spec.checks import login_errors, remote_option_error
from labkit.spec.files import container_image_file

REMOTE_DIR = "labkit-runs"
"""Where run directories go on the login node when cluster.remote_dir is not given (under the user's home)."""

TIMEOUT_S = 120
"""The longest one ssh command or transfer may take (sbatch on a busy controller, a large log)."""


class LocalRunner:
    """Slurm's commands on this host; the run directory is where Slurm reads it."""
    login: str | None = None

    def run(self, args: list[str], cwd: str | Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a command (`env`: variables added to this process's environment); FileNotFoundError when the
        command is not installed."""
        return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=cwd,
                              env={**os.environ, **env} if env else None)

    def read_text(self, path: str) -> str | None:
        """A file of the Slurm host (the job completion log); None when it cannot be read."""
        try:
            return Path(path).read_text(errors="replace")
        except OSError:
            return None

    def place(self, run_dir: Path) -> str:
        """The run directory as the job sees it."""
        return str(run_dir)

    def send(self, run_dir: Path, names: list[str]) -> None:
        """Make these files of the run directory visible to the job (here they already are)."""

    def send_inputs(self, spec: RunSpec) -> RunSpec:
        """The spec as the job reads it where Slurm runs (here: as it is)."""
        return spec

    def fetch_logs(self, run_dirs: list[Path]) -> None:
        """Bring the jobs' logs into each run_dir/logs (here they are written there)."""

    def job_info(self, run_dir: Path) -> dict:
        """What job.json records of where the job runs."""
        return {}


class RemoteError(RuntimeError):
    """The login node could not be reached, or refused a command or a transfer; the message says which, with ssh's
    own words."""


def _remote_path(path, field: str) -> str:
    """A path for a command of the login node's shell, quoted; refused (naming `field` and the fix) when it starts with
    '-', which the command would read as an option. The commands also get `--` before it."""
    path = str(path)
    if path.startswith("-") and field.startswith("cluster."):
        raise RemoteError(remote_option_error(field, path))
    if path.startswith("-"):
        raise RemoteError(f"{field} {path!r} starts with '-', which a command on the login node would read as an "
                          "option; it must be an absolute path")
    return shlex.quote(path)


class SshRunner:
    """Slurm's commands on a login node, over ssh. Run directories live under remote_dir there (one per run, named as
    the local one); the job's logs are copied back after each look at its state."""

    def __init__(self, login: str, remote_dir: str | None = None):
        errors = login_errors(login, remote_dir)
        if errors:
            raise ValueError("; ".join(errors))
        self.login = login
        self.remote_dir = remote_dir or REMOTE_DIR
        # remote_dir as an absolute path on the login node (job scripts name absolute paths), once known
        self._root: str | None = self.remote_dir if self.remote_dir.startswith("/") else None
        self._rsync: bool | None = None  # whether both sides have rsync, once asked

    def __repr__(self) -> str:
        return f"SshRunner({self.login}:{self.remote_dir})"

    @staticmethod
    def ssh_command() -> list[str]:
        """`ssh` and its options: $LABKIT_SSH_COMMAND, or plain ssh (the user's config and agent apply either way).
        BatchMode: never prompt (labkit holds no credentials); a dead host is given up on after 15 s."""
        return [*shlex.split(os.environ.get("LABKIT_SSH_COMMAND", "ssh")), "-o", "BatchMode=yes",
                "-o", "ConnectTimeout=15"]

    def _ssh(self, command: str) -> subprocess.CompletedProcess:
        """One shell command on the login node. ssh exits 255 for its own failures (the host is unreachable, the
        login refused): RemoteError with ssh's reason; any other status is the command's."""
        try:
            done = subprocess.run([*self.ssh_command(), self.login, command], capture_output=True, text=True,
                                  timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise RemoteError("cluster.login: this host has no ssh client; install OpenSSH's client (openssh-client) "
                              "to submit to a login node") from None
        except subprocess.TimeoutExpired:
            raise RemoteError(f"cluster.login: {self.login} did not answer within {TIMEOUT_S} s") from None
        if done.returncode == 255:
            raise RemoteError(self._unreachable(done.stderr))
        return done

    def _unreachable(self, stderr: str) -> str:
        return (f"cluster.login: cannot run commands on {self.login} over ssh: "
                f"{stderr.strip() or 'ssh exited with status 255'}; check that `ssh {self.login} true` works without "
                "a password prompt (a key in your ssh agent or ~/.ssh/config)")

    def run(self, args: list[str], cwd: str | Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A command on the login node, in `cwd` there, with `env` added to the login's environment; a command the
        login node lacks raises FileNotFoundError, as it would here."""
        words = [shlex.quote(str(a)) for a in args]
        if env:
            words = ["env", *(shlex.quote(f"{k}={v}") for k, v in env.items()), *words]
        command = " ".join(words)
        if cwd is not None:
            command = f"cd -- {_remote_path(cwd, 'cluster.remote_dir')} && {command}"
        # 127 is the remote shell's "command not found"; ask whether that was the command itself.
        done = self._ssh(f"command -v {shlex.quote(str(args[0]))} >/dev/null || exit 127; {command}")
        if done.returncode == 127 and not done.stdout:
            raise FileNotFoundError(args[0])
        return done

    def read_text(self, path: str) -> str | None:
        done = self._ssh(f"cat -- {_remote_path(path, 'the file to read')}")
        return done.stdout if done.returncode == 0 else None

    def root(self) -> str:
        """remote_dir as an absolute path on the login node (a relative one is made there and asked for)."""
        if self._root is None:
            quoted = _remote_path(self.remote_dir, "cluster.remote_dir")
            done = self._ssh(f"mkdir -p -- {quoted} && cd -- {quoted} && pwd -P")
            if done.returncode != 0:
                raise RemoteError(f"cluster.remote_dir: cannot make {self.remote_dir} on {self.login}: "
                                  f"{done.stderr.strip()}")
            self._root = done.stdout.strip().splitlines()[-1]
        return self._root

    def remote_run_dir(self, run_dir: Path) -> str:
        return f"{self.root()}/{run_dir.name}"

    def place(self, run_dir: Path) -> str:
        """Make the run's directory (and its logs/) on the login node; its absolute path there."""
        where = self.remote_run_dir(run_dir)
        done = self._ssh(f"mkdir -p -- {_remote_path(where, 'cluster.remote_dir')}/logs")
        if done.returncode != 0:
            raise RemoteError(f"cluster.remote_dir: cannot make {where} on {self.login}: {done.stderr.strip()}")
        return where

    def send(self, run_dir: Path, names: list[str]) -> None:
        """Copy these files of the local run directory into the run's directory on the login node."""
        self._copy([str(run_dir / name) for name in names], f"{self.login}:{self.remote_run_dir(run_dir)}/")

    def send_inputs(self, spec: RunSpec) -> RunSpec:
        """Copy the files the run reads to remote_dir/inputs/ on the login node (rsync sends only what changed since
        an earlier run sent them: each local directory has one directory there, named by a hash of its path), and
        return the spec with those paths in their place, for rendering its job; the run record keeps the spec as
        written. Paths under job.cluster_paths are the cluster's own and stay as they are."""
        sent: dict[str, list[str]] = {}  # directory on the login node -> the local files and directories it gets

        def there(path: str | os.PathLike | None, suffixes: tuple[str, ...] = ("",)) -> str | None:
            """Where `path` (with each suffix, for a dataset prefix) goes; None where nothing is sent."""
            if not path or spec.job.on_cluster_only(str(path)):
                return None
            local = Path(os.path.abspath(os.path.expanduser(str(path))))  # as megatron_args resolves it
            if not any(Path(f"{local}{suffix}").exists() for suffix in suffixes):
                return None  # not a file here (a HuggingFace hub name): the job reads it as written
            directory = f"{self.root()}/inputs/{hashlib.sha1(str(local.parent).encode()).hexdigest()[:12]}"
            sent.setdefault(directory, []).extend(f"{local}{suffix}" for suffix in suffixes)
            return f"{directory}/{local.name}"

        data, tokenizer = spec.data, spec.data.tokenizer
        changes = {}
        if data.path and not data.mock:
            changes["path"] = there(data.path, (".bin", ".idx"))
        if tokenizer is None or tokenizer.type == "GPT2BPETokenizer":
            changes["vocab_file"] = there(data.vocab_file or DEFAULT_VOCAB)
            changes["merge_file"] = there(data.merge_file or DEFAULT_MERGES)
        elif tokenizer.model:
            model = there(tokenizer.model)  # a file, or a HuggingFace tokenizer's directory
            if model:
                changes["tokenizer"] = dataclasses.replace(tokenizer, model=model)
        job = spec.job
        image = there(container_image_file(spec))
        if image:
            job = dataclasses.replace(job, container=dataclasses.replace(job.container, image=image))
        if not sent:
            return spec
        # The copies exist on the cluster only: nothing here looks for them, and the job script does before it starts.
        job = dataclasses.replace(job, cluster_paths=[*job.cluster_paths, f"{self.root()}/inputs"])
        done = self._ssh("mkdir -p -- " + " ".join(_remote_path(d, "cluster.remote_dir") for d in sent))
        if done.returncode != 0:
            raise RemoteError(f"cluster.remote_dir: cannot make {self.root()}/inputs on {self.login}: "
                              f"{done.stderr.strip()}")
        for directory, files in sent.items():
            self._copy(files, f"{self.login}:{directory}/")
        data = dataclasses.replace(data, **{k: v for k, v in changes.items() if v is not None})
        return dataclasses.replace(spec, data=data, job=job)

    def fetch_logs(self, run_dirs: list[Path]) -> None:
        """Copy the runs' logs from the login node into each run_dir/logs: with rsync, one transfer for all the runs
        of one runs directory (a sweep's), of what changed only; with scp, one per run."""
        if not self.rsync():
            for run_dir in run_dirs:
                self._copy([f"{self.login}:{self.remote_run_dir(run_dir)}/logs"], f"{run_dir}/")
            return
        runs: dict[Path, list[str]] = {}  # local runs directory -> its runs
        for run_dir in run_dirs:
            runs.setdefault(run_dir.parent, []).append(run_dir.name)
        for root, names in runs.items():
            # remote_dir holds each run under its local name: take their logs/ and nothing else.
            only = [f"--include=/{name}/" for name in names] + [f"--include=/{name}/logs/***" for name in names]
            self._copy([f"{self.login}:{self.root()}/"], f"{root}/", [*only, "--exclude=*", "--omit-dir-times"])

    def rsync(self) -> bool:
        """Whether this host and the login node both have rsync (asked once)."""
        if self._rsync is None:
            self._rsync = bool(shutil.which("rsync")) and self._ssh("command -v rsync").returncode == 0
        return self._rsync

    def _copy(self, sources: list[str], target: str, rsync_options: list[str] | None = None) -> None:
        """rsync over ssh where both sides have it (it sends only what changed), else scp; file times are kept, so
        that rsync skips a log that has not grown."""
        ssh = self.ssh_command()
        if self.rsync():
            command = ["rsync", "-rtp", *(rsync_options or []), "-e", " ".join(shlex.quote(w) for w in ssh), "--",
                       *sources, target]
        else:  # scp takes the ssh program with -S and shares ssh's -F, -i and -o options
            command = ["scp", "-r", "-p", "-q", "-S", ssh[0], *ssh[1:], "--", *sources, target]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RemoteError(f"cluster.login: copying to or from {self.login} took over {TIMEOUT_S} s") from None
        if done.returncode == 255:
            raise RemoteError(self._unreachable(done.stderr))
        if done.returncode != 0:
            raise RemoteError(f"cluster.login: {command[0]} {' '.join(sources)} -> {target} failed: "
                              f"{done.stderr.strip() or f'exit status {done.returncode}'}")

    def job_info(self, run_dir: Path) -> dict:
        return {"login": self.login, "remote_dir": self.root()}

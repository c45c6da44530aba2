"""Submission over ssh (cluster.login): a real OpenSSH server on the loopback address in front of the local Slurm.

The server runs from a throwaway configuration under the test's temporary directory, with its own host key and a
user key made for the test; the client reaches it through LABKIT_SSH_COMMAND (`ssh -F CONFIG`), as a user would
through ~/.ssh/config. The login node's run directories (cluster.remote_dir) and the local runs directory are
different directories, so that everything the job reads is sent and every log read here was brought back. The job
is a stand-in for torchrun (tests/fake_torchrun.sh, as in the scheduling tests of test_jobs_slurm.py) that logs
Megatron-format iterations: what is tested is the way there and back, which training on a shared machine would slow.
"""
from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.jobs import SlurmBackend, State, job_of
from labkit.jobs.record import RunRecord, load_run
from labkit.jobs.remote import SshRunner
from labkit.jobs.slurm import LoginError
from labkit.megatron.flags import DEFAULT_MERGES, DEFAULT_VOCAB
from labkit.net import free_port
from labkit.paths import shipped_corpus
from labkit.spec import SpecError, load_spec, validate

SSHD = "/usr/sbin/sshd"
FAKE_TORCHRUN = str(Path(__file__).resolve().parent / "fake_torchrun.sh")


def why_sshd_cannot_be_had() -> str | None:
    """Install OpenSSH's server when it is missing (as root, with apt-get, as the local Slurm is installed); the
    reason to skip otherwise."""
    if Path(SSHD).exists() and shutil.which("ssh-keygen") and shutil.which("ssh"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return ("no OpenSSH server to submit through: install openssh-server (it is installed by the suite only as "
                "root, with apt-get)")
    installed = subprocess.run("apt-get install -y -qq --no-install-recommends openssh-server openssh-client rsync "
                               "|| (apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                               "openssh-server openssh-client rsync)", shell=True, capture_output=True, text=True)
    if installed.returncode != 0 or not Path(SSHD).exists():
        return f"no OpenSSH server to submit through: apt-get could not install openssh-server: " \
               f"{installed.stderr.strip()[-300:]}"
    return None


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


@pytest.fixture(scope="module")
def login_node(local_slurm, tmp_path_factory):
    """user@127.0.0.1 served by sshd on a free loopback port in front of the local Slurm; yields the login."""
    reason = why_sshd_cannot_be_had()
    if reason:
        pytest.skip(reason)
    home = tmp_path_factory.mktemp("sshd")
    host_key, user_key = _keygen(home / "host_key"), _keygen(home / "user_key")
    (home / "authorized_keys").write_text(user_key + "\n")
    port = free_port()
    # The login node's own settings: its Slurm (the suite's), and nothing that asks for a password.
    (home / "sshd_config").write_text(f"""\
ListenAddress 127.0.0.1
Port {port}
HostKey {home}/host_key
PidFile {home}/sshd.pid
AuthorizedKeysFile {home}/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
Subsystem sftp internal-sftp
SetEnv SLURM_CONF={local_slurm.conf}
""")
    # The user's side: what ~/.ssh/config and known_hosts would hold, with one shared connection for labkit's many
    # short commands (ssh's ControlMaster, as users set it for a cluster).
    (home / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key}\n")
    (home / "ssh_config").write_text(f"""\
Host 127.0.0.1
    Port {port}
    IdentityFile {home}/user_key
    IdentitiesOnly yes
    UserKnownHostsFile {home}/known_hosts
    StrictHostKeyChecking yes
    LogLevel ERROR
    ControlMaster auto
    ControlPath {home}/%C
    ControlPersist 60
""")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory (root only)
    with open(home / "sshd.log", "w") as log:
        server = subprocess.Popen([SSHD, "-D", "-e", "-f", str(home / "sshd_config")], stdout=log, stderr=log)
    login = f"{getpass.getuser()}@127.0.0.1"
    ssh = ["ssh", "-F", str(home / "ssh_config"), "-o", "BatchMode=yes"]
    try:
        for _ in range(50):
            if subprocess.run([*ssh, login, "true"], capture_output=True).returncode == 0:
                break
            if server.poll() is not None:
                pytest.skip(f"sshd did not start: {(home / 'sshd.log').read_text()[-500:]}")
            time.sleep(0.2)
        else:
            pytest.fail(f"no ssh login to {login} after 10 s: {(home / 'sshd.log').read_text()[-1000:]}")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("LABKIT_SSH_COMMAND", f"ssh -F {home / 'ssh_config'}")
            yield login
    finally:
        subprocess.run([*ssh, "-O", "exit", "127.0.0.1"], capture_output=True)  # the shared connection, if any
        server.terminate()
        server.wait(timeout=10)


def tiny(login: str | None = None, env: dict | None = None, data: dict | None = None, **cluster) -> dict:
    return {"name": "tiny-remote", "model": {"preset": "tiny"}, "parallel": {"tensor": 1, "pipeline": 1},
            "batch": {"micro": 2, "global": 4}, "train": {"iters": 4, "log_interval": 2},
            "data": data or {"mock": True},
            "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 1}], "login": login, **cluster},
            "job": {"master_port": free_port(), "env": env or {}}}


@pytest.mark.slurm
@pytest.mark.slow
def test_a_tiny_job_runs_through_ssh_and_its_status_and_logs_come_back(login_node, tmp_path, capsys):
    runs, remote = tmp_path / "runs", tmp_path / "login-node"
    spec = load_spec(tiny(login_node, env={"FAKE_ITERATION_S": "1"}, data=shipped_corpus(), remote_dir=str(remote)))
    job = SlurmBackend(runs_dir=runs, torchrun=FAKE_TORCHRUN).submit(spec)
    info = json.loads((job.record.path / "job.json").read_text())
    assert (info["login"], info["remote_dir"]) == (login_node, str(remote))
    there = remote / job.record.run_id
    assert sorted(p.name for p in there.iterdir()) == ["job.json", "job.sbatch", "logs", "spec.yaml"]
    assert f"LOGDIR={there / 'logs'}" in (job.record.path / "job.sbatch").read_text()
    assert (job.record.path / "spec.yaml").read_text() == (there / "spec.yaml").read_text() == spec.to_yaml()

    # Followed as `labkit status` follows it from another process: a new backend, which reads job.json.
    follower = job_of(load_run(job.record.run_id, runs), SlurmBackend(runs_dir=runs))
    running = None
    deadline = time.monotonic() + 40
    while not follower.status().state.finished and time.monotonic() < deadline:
        running = running or (follower.tail(5) if follower.status(refresh=False).state == State.RUNNING else None)
        follower.wait(progress=False, timeout=0.5, poll_s=0.5)
    seen = [e["state"] for e in follower.record.events() if "state" in e]
    assert seen[-1] == "COMPLETED", (seen, follower.cause(), follower.tail(20))
    assert "RUNNING" in seen
    # While it ran, its logs were already here (each poll brings them back).
    assert running and any(files.get("out") for files in running.values()), running

    # The logs were written on the login node and brought back into the local run directory.
    (node,) = follower.node_logs()
    local_out = follower.log_dir / f"{node}.out"
    assert local_out.read_text() == (there / "logs" / job.job_id / f"{node}.out").read_text()
    # The job read the dataset and tokenizer sent to the login node, not this host's files.
    args = (follower.log_dir / f"{node}.argv").read_text().split("\0")
    for flag, local in (("--data-path", spec.data.path + ".bin"), ("--vocab-file", DEFAULT_VOCAB),
                        ("--merge-file", DEFAULT_MERGES)):
        sent = Path(args[args.index(flag) + 1] + (".bin" if flag == "--data-path" else ""))
        assert sent.is_relative_to(remote / "inputs") and sent.read_bytes() == Path(local).read_bytes()
    assert list(follower.result().iterations["iteration"]) == [2, 4]  # fake_torchrun's lines, parsed
    assert follower.record.metrics()["iterations"][-1]["iteration"] == 4

    assert main(["status", job.record.run_id, "--runs-dir", str(runs), "--json", "--lines", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "COMPLETED"
    assert main(["logs", "parse", str(local_out), "--json"]) == 0
    assert [row["iteration"] for row in json.loads(capsys.readouterr().out)["iterations"]] == [2, 4]
    print(f"\nremote job {job.job_id}: states {seen}; {node}.out read back "
          f"({len(local_out.read_text().splitlines())} lines), last: {local_out.read_text().splitlines()[-1]!r}")


@pytest.mark.slurm
@pytest.mark.slow
def test_labkit_cancel_stops_a_job_on_the_login_node(login_node, tmp_path, capsys):
    runs = tmp_path / "runs"
    spec = load_spec(tiny(login_node, env={"FAKE_ITERATION_S": "60"}, remote_dir=str(tmp_path / "login-node")))
    job = SlurmBackend(runs_dir=runs, torchrun=FAKE_TORCHRUN).submit(spec)
    deadline = time.monotonic() + 30
    while job.status().state != State.RUNNING and time.monotonic() < deadline:
        job.wait(progress=False, timeout=0.5, poll_s=0.5)
    assert main(["cancel", job.record.run_id, "--runs-dir", str(runs)]) == 0, capsys.readouterr().err
    assert job.wait(progress=False, timeout=30, poll_s=0.5) == State.CANCELLED
    assert load_run(job.record.run_id, runs).last_status()["state"] == "CANCELLED"


@pytest.mark.slurm
@pytest.mark.parametrize("rsync", [True, False], ids=["rsync", "scp"])
def test_files_go_there_and_logs_come_back_with_rsync_or_scp(login_node, tmp_path, monkeypatch, rsync):
    if not rsync:  # this host without rsync: scp carries them
        which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda name: None if name == "rsync" else which(name))
    runner = SshRunner(login_node, str(tmp_path / "login-node"))
    run_dir = tmp_path / "runs" / "20260101-000000-tiny"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "job.sbatch").write_text("#!/bin/bash\n")
    other = tmp_path / "runs" / "20260101-000000-tiny-2"  # a second run of a sweep: fetched with the first
    other.mkdir()
    there, elsewhere = Path(runner.place(run_dir)), Path(runner.place(other))
    (elsewhere / "logs" / "8.out").write_text("iteration 3\n")
    runner.send(run_dir, ["job.sbatch"])
    assert (there / "job.sbatch").read_text() == "#!/bin/bash\n"
    for text in ("iteration 1\n", "iteration 1\niteration 2\n"):  # a log that grows between two looks
        (there / "logs" / "7").mkdir(exist_ok=True)
        (there / "logs" / "7" / "n1.out").write_text(text)
        runner.fetch_logs([run_dir, other])
        assert (run_dir / "logs" / "7" / "n1.out").read_text() == text
    assert (other / "logs" / "8.out").read_text() == "iteration 3\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["job.sbatch", "logs"]  # logs only came back
    assert runner.rsync() is rsync


def test_an_unreachable_login_node_is_a_clear_error_and_a_failed_run(tmp_path, monkeypatch, capsys):
    closed = free_port()  # nothing listens there
    monkeypatch.setenv("LABKIT_SSH_COMMAND", f"ssh -p {closed} -o StrictHostKeyChecking=no "
                                             "-o UserKnownHostsFile=/dev/null")
    backend = SlurmBackend(runs_dir=tmp_path)
    with pytest.raises(LoginError, match=r"^cluster\.login: cannot run commands on alice@127\.0\.0\.1 over ssh: "
                                         r".*Connection refused.*ssh alice@127\.0\.0\.1 true"):
        backend.submit(load_spec(tiny("alice@127.0.0.1", remote_dir="/srv/runs")))
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    last = load_run(run).last_status()
    assert last["state"] == "FAILED" and last["cause"].startswith("not sent: cluster.login: cannot run commands")
    # `labkit run` takes the Slurm backend for a spec with a login, and says what ssh said, without a traceback.
    spec = tmp_path / "spec.yaml"
    spec.write_text(load_spec(tiny("alice@127.0.0.1")).to_yaml())
    assert main(["run", str(spec), "--runs-dir", str(tmp_path / "cli-runs")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cluster.login: cannot run commands on alice@127.0.0.1 over ssh:") and "Traceback" not in err


def test_a_login_node_that_stops_answering_leaves_the_recorded_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_SSH_COMMAND", f"ssh -p {free_port()} -o StrictHostKeyChecking=no "
                                             "-o UserKnownHostsFile=/dev/null")
    record = RunRecord.create(load_spec(tiny("alice@127.0.0.1")), tmp_path)
    record.attach("slurm", "multinode", ["7"], login="alice@127.0.0.1", remote_dir="/srv/runs")
    record.set_status("RUNNING")
    job = job_of(record)
    assert job.backend.runner_of(job).login == "alice@127.0.0.1"
    assert job.backend.poll([job]) == {}
    assert main(["status", record.run_id, "--runs-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "RUNNING"


def test_login_fields_are_checked_naming_the_field(capsys, tmp_path):
    with pytest.raises(SpecError) as bad:
        validate(load_spec(tiny("-oProxyCommand=x host")))
    assert any(e.startswith("cluster.login: '-oProxyCommand=x host' is not user@host") for e in bad.value.errors)
    with pytest.raises(SpecError) as bad:
        validate(load_spec(tiny(None, remote_dir="../runs x")))
    assert {e.split(":")[0] for e in bad.value.errors if e.startswith("cluster.")} == {"cluster.remote_dir"}
    assert len([e for e in bad.value.errors if e.startswith("cluster.remote_dir")]) == 2
    assert not [e for e in validate(load_spec(tiny("alice@login.cluster.org", remote_dir="runs/labkit")),
                                    raise_errors=False) if e.startswith("cluster.")]
    spec = tmp_path / "spec.yaml"
    spec.write_text(load_spec(tiny("alice@login.cluster.org")).to_yaml())
    assert main(["run", str(spec), "--backend", "local", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "cluster.login: the local backend runs the job on this host" in capsys.readouterr().err

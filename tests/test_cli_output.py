"""What the command line writes for a program or a file rather than a person: JSON from run, runs, cancel and validate;
no progress bar where the output is not a terminal; colour by termcolor's rules (NO_COLOR, FORCE_COLOR, TERM=dumb);
and a shell completion script that completes what the parser accepts."""
import contextlib
import fcntl
import functools
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
import termcolor

from labkit import cli, completion, jobs
from labkit.jobs import LocalBackend

FAKE_TORCHRUN = str(Path(__file__).resolve().parent / "fake_torchrun.sh")
SPEC = {"name": "tiny", "model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8},
        "train": {"iters": 10, "log_interval": 5}, "data": {"mock": True}}


@contextlib.contextmanager
def terminal(monkeypatch):
    """sys.stdout and sys.stderr on a pseudo-terminal 120 columns wide for the block; yields a list that holds
    everything written to it once the block ends."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    chunks, written = [], []

    def drain():  # read as it is written: a full terminal buffer would block the writer
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal was closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    out = open(follower, "w", buffering=1, closefd=False)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", out)
    try:
        yield written
    finally:
        out.flush()
        monkeypatch.undo()
        os.close(follower)
        reader.join(timeout=10)
        os.close(leader)
        written.append(b"".join(chunks).decode())


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps(SPEC))
    return path


@pytest.fixture
def fake_local(monkeypatch):
    monkeypatch.setitem(jobs.BACKENDS, "local", functools.partial(LocalBackend, torchrun=FAKE_TORCHRUN))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """The runs directory of one run that completed."""
    runs = tmp_path_factory.mktemp("finished") / "runs"
    job = LocalBackend(runs_dir=runs, torchrun=FAKE_TORCHRUN).submit(jobs_spec())
    assert job.wait(progress=False, timeout=60, poll_s=0.05).name == "COMPLETED"
    return runs


def jobs_spec():
    from labkit.spec import load_spec

    return load_spec(SPEC)


def test_run_wait_into_a_file_writes_no_progress_bar(spec_file, fake_local, capsys, tmp_path):
    assert cli.main(["run", str(spec_file), "--backend", "local", "--runs-dir", str(tmp_path), "--wait"]) == 0
    out = capsys.readouterr()  # neither stream is a terminal here, as with `labkit run --wait > file 2>&1`
    lines = out.out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("run ") and lines[1].endswith(": COMPLETED"), out
    assert out.err == ""


def test_run_wait_on_a_terminal_draws_the_bar(spec_file, fake_local, monkeypatch, tmp_path):
    with terminal(monkeypatch) as written:
        code = cli.main(["run", str(spec_file), "--backend", "local", "--runs-dir", str(tmp_path), "--wait"])
    assert code == 0 and "10/10 [" in written[0] and written[0].rstrip().endswith(": COMPLETED"), written


@pytest.mark.parametrize("env, tty, coloured", [
    ({"TERM": "xterm"}, True, True),
    ({"TERM": "dumb"}, True, False),
    ({"TERM": "xterm", "NO_COLOR": "1"}, True, False),
    ({"FORCE_COLOR": "1"}, False, True),
    ({"FORCE_COLOR": "1", "NO_COLOR": "1"}, False, False),
    ({}, False, False),
])
def test_status_colour_follows_termcolor_rules(finished_run, monkeypatch, capsys, env, tty, coloured):
    for name in ("NO_COLOR", "FORCE_COLOR", "ANSI_COLORS_DISABLED", "TERM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    decided = getattr(termcolor, "can_colorize", None)
    if hasattr(decided, "cache_clear"):  # termcolor 3 reads the environment once per process: this one reads it anew
        decided.cache_clear()
    if tty:
        with terminal(monkeypatch) as written:
            code = cli.main(["status", "--runs-dir", str(finished_run)])
        out = written[0]
    else:
        code, out = cli.main(["status", "--runs-dir", str(finished_run)]), capsys.readouterr().out
    assert code == 0 and "state: " in out, out
    assert ("\x1b[" in out) == coloured


def test_run_runs_and_cancel_print_json(tmp_path, spec_file, fake_local, capsys, monkeypatch):
    runs = str(tmp_path / "runs")
    assert cli.main(["run", str(spec_file), "--backend", "local", "--dry-run", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["scripts"]) == ["run.sh"]

    monkeypatch.setenv("FAKE_ITERATION_S", "30")  # still running when cancelled
    assert cli.main(["run", str(spec_file), "--backend", "local", "--runs-dir", runs, "--json"]) == 0
    submitted = json.loads(capsys.readouterr().out)
    assert set(submitted) == {"run_id", "backend", "job_ids", "path"} and submitted["backend"] == "local"
    assert Path(submitted["path"]).is_dir()

    assert cli.main(["cancel", submitted["run_id"], "--runs-dir", runs, "--json"]) == 0
    cancelled = json.loads(capsys.readouterr().out)
    assert cancelled == {**{k: submitted[k] for k in ("run_id", "backend", "job_ids")}, "cancelled": True,
                         "state": "CANCELLED"}

    assert cli.main(["runs", "--runs-dir", runs, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["run_id"] == submitted["run_id"] and row["state"] == "CANCELLED"
    assert cli.main(["runs", "--runs-dir", str(tmp_path / "none"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_run_wait_json_says_how_it_ended(tmp_path, spec_file, fake_local, capsys):
    assert cli.main(["run", str(spec_file), "--backend", "local", "--runs-dir", str(tmp_path), "--wait", "--json"]) == 0
    out = capsys.readouterr()
    ended = json.loads(out.out)
    assert ended["state"] == "COMPLETED" and ended["cause"] is None and out.err == ""


@pytest.mark.parametrize("command", ["validate", "run"])
def test_spec_errors_print_as_json(tmp_path, capsys, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodel: {preset: nope}\n")
    assert cli.main([command, str(bad), "--json"]) == 2
    out = capsys.readouterr()
    printed = json.loads(out.out)
    assert printed["spec"] == str(bad) and printed["errors"][0].startswith("model.preset: unknown preset 'nope'")
    assert out.err == ""


def complete(shell: str, *lines: str) -> list[list[str]]:
    """What the completion script offers after each command line (its last word being completed; '' for none yet),
    all asked in one run of `shell`."""
    script = completion.script(cli.build_parser(), shell)
    calls = "".join(f"COMP_WORDS=({line}); " + 'COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); COMPREPLY=(); _labkit; '
                    'echo "${COMPREPLY[*]}"\n' for line in lines)
    if shell == "zsh":  # bashcompinit runs a bash completion function under sh emulation
        program = ["zsh", "-f", "-c", f"autoload -U +X compinit && compinit -u -D\n{script}\n"
                                      f"asked() {{\nemulate -L sh\n{calls}}}\nasked"]
    else:
        program = ["bash", "--norc", "-c", f"{script}\n{calls}"]
    out = subprocess.run(program, capture_output=True, text=True, check=True).stdout
    return [line.split() for line in out.splitlines()]


def test_bash_completion_completes_commands_options_and_choices():
    assert complete("bash", "labkit ru", "labkit run --ba", "labkit run spec.yaml --backend ''", "labkit logs parse --j",
                    "labkit run ''", "labkit completion ''") == [
        ["run", "runs"], ["--backend"], ["local", "slurm", "k8s"], ["--json"],
        [],  # a spec file: left to the shell's file names
        ["bash", "zsh", "-h", "--help"]]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed here")
def test_zsh_completion_reads_the_same_script():
    # zsh filters the candidates by what is typed itself; the script picks them by the command typed so far.
    backend, logs = complete("zsh", "labkit run spec.yaml --backend ''", "labkit logs ''")
    assert backend == ["local", "slurm", "k8s"] and "parse" in logs

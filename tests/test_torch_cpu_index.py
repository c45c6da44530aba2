"""tests/torch_cpu_index.sh, which `make` asks where to install PyTorch from: PyTorch's CPU index on a Linux machine
without an NVIDIA GPU when the index answers, else nothing (pip's own choice), also when the index is unreachable or
never answers."""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from labkit.net import free_port

SCRIPT = Path(__file__).resolve().parent / "torch_cpu_index.sh"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the script acts on Linux only")
no_driver = pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"), reason="this machine has an NVIDIA driver")


def run(tmp_path: Path, index: str, gpu: bool = False) -> subprocess.CompletedProcess:
    """The script with only uname and timeout on PATH (and a fake nvidia-smi with `gpu`), asking `index`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("uname", "timeout"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": str(bin_dir), "LABKIT_TORCH_CPU_INDEX": index, "HOME": str(tmp_path)}
    return subprocess.run([shutil.which("bash"), str(SCRIPT), sys.executable], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def index(tmp_path):
    """A local package index whose torch/ page answers."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@no_driver
def test_without_a_gpu_an_answering_index_gives_the_cpu_wheel_and_one_line_says_so(tmp_path, index):
    done = run(tmp_path, index)
    assert done.returncode == 0
    assert done.stdout == f"--index-url {index}\n"
    assert done.stderr == f"no NVIDIA GPU here: installing PyTorch's CPU wheel from {index}\n"


def test_with_nvidia_smi_pip_chooses_as_before(tmp_path, index):
    done = run(tmp_path, index, gpu=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@no_driver
def test_an_unreachable_index_falls_back_silently(tmp_path):
    done = run(tmp_path, f"http://127.0.0.1:{free_port()}")  # a port nothing listens on
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@no_driver
def test_an_index_that_never_answers_falls_back_silently(tmp_path):
    with socket.create_server(("127.0.0.1", 0), backlog=1) as sock:  # accepts connections and never answers one
        done = run(tmp_path, f"http://127.0.0.1:{sock.getsockname()[1]}")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")

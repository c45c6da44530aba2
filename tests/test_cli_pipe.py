"""A reader that leaves early (`labkit validate X | head -1`, `| true`) ends labkit quietly: no BrokenPipeError
traceback, the exit status Python's docs give for SIGPIPE (1)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_reader_that_left_ends_labkit_quietly():
    # One command stands for all: labkit.cli.main handles the broken pipe for every subcommand.
    process = subprocess.Popen([sys.executable, "-m", "labkit", "validate", "examples/tiny-cpu.yaml"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # as `| true` does: nobody reads what labkit prints
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err

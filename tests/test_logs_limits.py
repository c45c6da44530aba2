"""The parser under hostile input: non-finite numbers still give valid JSON, and parse time grows linearly with
input of shapes that once made it quadratic."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import pytest

from labkit.cli import main
from labkit.logs import parse, parse_log, parse_text


@pytest.mark.parametrize("value", ["inf", "-inf", "Infinity", "1e999", "nan"])
def test_non_finite_values_are_json_null(tmp_path, capsys, value):
    log = tmp_path / "train.log"
    log.write_text(f" iteration        1/       2 | elapsed time per iteration (ms): {value} | lm loss: {value} |\n"
                   f" iteration        2/       2 | elapsed time per iteration (ms): 10.0 | lm loss: {value} |\n")
    assert main(["logs", "parse", "--json", str(log)]) == 0
    out = json.loads(capsys.readouterr().out)  # strict JSON: no Infinity or NaN tokens
    assert [row["lm_loss"] for row in out["iterations"]] == [None, None]
    assert out["iterations"][0]["elapsed_ms"] is None and out["iterations"][1]["elapsed_ms"] == 10.0
    assert out["summary"]["last_lm_loss"] is None


# Each shape, given a size, once took time (and memory) quadratic in it.
SHAPES = {
    "spliced interval records on one line": lambda n: b" iteration 1/ 2 |" * n + b"\n",
    "a record followed by a line of '|'": lambda n: b" iteration 1/ 2 |" + b"|" * (17 * n) + b"\n",
    "one line of 'Error '": lambda n: b"Error " * (3 * n) + b"\n",
    "one line of tail headers": lambda n: b"==> " * (4 * n) + b"\n",
    "one line of OSC escapes": lambda n: b"\x1b]" * (8 * n) + b"\n",
    "timer headers on one line": lambda n: b"max time across ranks (ms):" * n + b"\n",
    "a memory line with many fields": lambda n: b"memory (MB) |" + b" a: 1 |" * (2 * n) + b"\n",
    "argument headers, one per line": lambda n: b"---- arguments ----\n" * (n // 10),
    "a world-size line running on in letters": lambda n: b"using world size: 1, data-parallel size: 1" + b"Tb" * n + b"\n",
}


def _cpu_seconds(data: bytes) -> float:
    start = time.process_time()  # CPU time: other processes' load barely moves it
    parse_text(data)
    return time.process_time() - start


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_parse_time_is_linear_in_line_length(shape):
    make = SHAPES[shape]
    small_input, large_input = make(10_000), make(40_000)
    small = large = float("inf")
    for _ in range(3):  # interleaved, best of three
        small = min(small, _cpu_seconds(small_input))
        large = min(large, _cpu_seconds(large_input))
    # Four times the input: linear work makes the ratio 4, quadratic 16. Testing at 8 leaves room for timer noise on
    # inputs that parse in a few milliseconds (with a floor), where a 2x step and a bound of 3 did not.
    assert large < 8 * max(small, 0.005), (shape, small, large)


def test_spliced_line_is_one_partial_line_with_bounded_text():
    parsed = parse_text(b" iteration 1/ 2 |" * 5000 + b"\n iteration 2/ 2 | lm loss: 1.5 |\n")
    assert parsed.iterations["iteration"].tolist() == [2]
    assert parsed.partial_lines["line"].tolist() == [1]
    assert len(parsed.partial_lines["text"].iloc[0]) <= 1000


FIXTURES = Path(__file__).parent / "fixtures" / "logs"


@pytest.mark.parametrize("name", ["03-mlm2025-gpt2-fp16-autodl.log", "05-megads-2026-pdsh-2node-tp4dp2.log",
                                  "labkit-driver-dp2.log", "02-bert-vega-srun.log", "08-bionemo2-nemo-esm2-srun.log",
                                  "01-v1-deepspeedexamples-gpt2-mp2.log"])
def test_a_large_log_read_in_pieces_parses_as_read_whole(monkeypatch, name):
    """Logs over _PIECE_BYTES are parsed a piece at a time (memory follows the piece): with pieces of 1 KB, every
    table, line number and set-up value is the same as from the whole file."""
    whole = parse_log(FIXTURES / name)
    monkeypatch.setattr(parse, "_PIECE_BYTES", 1024)
    assert len(list(parse._pieces(FIXTURES / name))) >= 3
    pieces = parse_log(FIXTURES / name)
    for table in ("iterations", "memory", "timers", "validation", "events", "partial_lines"):
        pd.testing.assert_frame_equal(getattr(pieces, table), getattr(whole, table), check_dtype=False, obj=table)
    assert (pieces.arguments, pieces.parallel, pieces.formats) == (whole.arguments, whole.parallel, whole.formats)


def test_pieces_keep_the_tail_header_and_the_iteration_their_lines_come_under(monkeypatch, tmp_path):
    lines = []
    for node in ("n060", "n063"):
        lines.append(f"==> ../logs/{node}.out <==")
        for i in range(1, 40):
            lines += [f" iteration {i:8d}/      40 | elapsed time per iteration (ms): {100 + i}.0 | lm loss: 5.0 |",
                      "(min, max) time across ranks (ms):", f"    forward-backward ...: ({i}.0, {i + 1}.0)"]
    log = tmp_path / "tail.txt"
    log.write_text("\n".join(lines) + "\n")
    whole = parse_log(log)
    monkeypatch.setattr(parse, "_PIECE_BYTES", 512)
    assert len(list(parse._pieces(log))) > 10
    pieces = parse_log(log)
    assert set(whole.timers["node"]) == {"n060", "n063"} and len(whole.timers) == 78
    pd.testing.assert_frame_equal(pieces.timers, whole.timers)
    pd.testing.assert_frame_equal(pieces.iterations, whole.iterations)

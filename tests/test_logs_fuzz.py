"""The parser never raises, whatever bytes it is given, and cutting or interleaving a log never invents numbers."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit.logs import parse_text
from labkit.logs.parse import checkpoint_events

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
LOGS = {p.name: p.read_bytes() for p in sorted(FIXTURES.glob("0*.log"))}
FULL = {name: parse_text(data) for name, data in LOGS.items()}
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_LOGS = settings(FUZZ, max_examples=25)
FUZZ_WEAVE = settings(FUZZ, max_examples=10)

# Fragments that steer random input into the parser's code paths.
PIECES = st.sampled_from([
    b" iteration ", b"/", b" | ", b"|", b"lm loss: ", b"elapsed time per iteration (ms): ", b"1.5E+00", b"nan",
    b"(min, max) time across ranks (ms):\n", b"    forward-compute ....: (1.0, 2.0)\n", b"times across ranks (ms):\n",
    b"  forward:\n", b"     rank  3: 1.0\n", b"max time across ranks (ms):\n", b"memory (MB) | allocated: 1 |",
    b"[Rank 2] (after 5 iterations) ", b"------------------------ arguments ------------------------\n",
    b"  num_layers ............ 2\n", b"-------------------- end of arguments ---------------------\n",
    b"arguments:\n", b"using world size: 4, data-parallel size: x", b"Training epoch 0, ", b"3: ", b"host: ",
    b"[default1]:", b"[2025-01-01 00:00:00] ", b"\x1b[31m", b"\r", b"\n", b"==> n1.out <==\n", b"=", b"Error",
    b"validation loss at iteration 5 | lm loss value: 2 |", b"time (ms) | fwd: 1 |", b"\xff\xfe", b"\x00",
    b"Using topology: {ProcessCoord(pipe=9, data=0, model=0): 0}", b"\niteration 3 : 1.5 s\n", b"( , )",
])


def comparable(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=["line"]).reset_index(drop=True)


@FUZZ
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_never_raise(data):
    parsed = parse_text(data)
    parsed.summary()
    parsed.to_json()


@FUZZ
@given(st.lists(st.one_of(PIECES, st.binary(max_size=20)), max_size=60))
def test_log_shaped_garbage_never_raises(pieces):
    parsed = parse_text(b"".join(pieces))
    parsed.summary()
    parsed.to_json()


@FUZZ_LOGS
@given(st.sampled_from(sorted(LOGS)), st.floats(0.0, 1.0))
def test_truncation_keeps_only_complete_rows(name, fraction):
    data = LOGS[name]
    cut = parse_text(data[:int(len(data) * fraction)])
    full = FULL[name].iterations.set_index("iteration")
    got = cut.iterations.set_index("iteration")
    # every row read from the cut log is the full log's row, value for value
    assert set(got.index) <= set(full.index)
    got = got.reindex(columns=full.columns)  # a column only later lines print is all missing in the cut log
    pd.testing.assert_frame_equal(got.drop(columns=["line"]), full.loc[got.index].drop(columns=["line"]),
                                  check_dtype=False, check_index_type=False)


@FUZZ_WEAVE
@given(st.sampled_from(sorted(LOGS)), st.lists(st.integers(0, 3), min_size=1, max_size=50))
def test_interleaving_another_ranks_noise_changes_nothing(name, gaps):
    """Lines of a second rank (another prefix, no records) woven in anywhere leave the tables as they were."""
    lines = LOGS[name].split(b"\n")
    noise = [b"7: NCCL INFO Channel 00/0 : 7[7] -> 0[0] via P2P/IPC", b"7: > building train dataset ..."]
    woven = []
    for k, line in enumerate(lines):
        woven.extend(noise[: gaps[k % len(gaps)] % 3])
        woven.append(line)
    mixed = parse_text(b"\n".join(woven))
    full = FULL[name]
    pd.testing.assert_frame_equal(comparable(mixed.iterations), comparable(full.iterations), check_dtype=False)
    pd.testing.assert_frame_equal(comparable(mixed.memory), comparable(full.memory), check_dtype=False)
    assert mixed.arguments == full.arguments and mixed.parallel == full.parallel


@FUZZ_LOGS
@given(st.sampled_from(sorted(LOGS)), st.integers(0, 10**9), st.binary(min_size=1, max_size=40))
def test_bytes_spliced_into_a_log_never_raise(name, where, junk):
    data = LOGS[name]
    k = where % (len(data) + 1)
    parse_text(data[:k] + junk + data[k:]).summary()


INTERVAL = (b" [2025-01-01 00:00:00] iteration %s/      10 | consumed samples: 8 | elapsed time per iteration (ms): "
            b"100.0 | lm loss: 1.0E+01 |\n")
ARGUMENTS = (b"------------------------ arguments ------------------------\n  seq_length ............ %s\n"
             b"  num_layers ............ 2\n-------------------- end of arguments ---------------------\n")


@pytest.mark.parametrize("log", [
    INTERVAL % b"4611686018427387904",  # 2**62: beyond what the int64 columns hold
    INTERVAL % (b"9" * 500), INTERVAL % (b"9" * 5000), b"[Rank " + b"9" * 900 + b"] " + INTERVAL % b"1",
    b"9" * 600 + b": " + INTERVAL % b"1", ARGUMENTS % b"inf", ARGUMENTS % (b"9" * 5001), ARGUMENTS % (b"9" * 400),
    b"\n******************* job info 1 *******************\nNODE: n1\nDP_SIZE: " + b"9" * 5001 + b"\n",
    b"virtual stages per pipeline stage: " + b"9" * 5001 + b"\n",
    b"successfully saved checkpoint from iteration " + b"9" * 5001 + b"\n",
    ARGUMENTS.replace(b"num_layers ............ 2", b"global_batch_size ............ 8") % (b"9" * 50)
    + b"".join(INTERVAL % str(i).encode() for i in range(1, 5)),  # a throughput of that many tokens per sample
])
def test_numbers_beyond_any_count_are_not_read_as_one(log):
    parsed = parse_text(log)
    parsed.summary()
    parsed.to_json()
    assert parsed.iterations.empty or parsed.iterations["iteration"].max() < 2**62
    assert checkpoint_events(log.decode())["saved"] is None or checkpoint_events(log.decode())["saved"] < 2**62


def test_an_iteration_at_the_largest_count_is_still_read():
    parsed = parse_text(INTERVAL % b"100000000000000000")  # 18 digits (a float64 holds 10**17 exactly)
    assert parsed.iterations["iteration"].tolist() == [10**17]


@pytest.mark.parametrize("line", [
    INTERVAL % b"9223372036854775808",  # 2**63: beyond int64
    INTERVAL % b"4611686018427387904", INTERVAL % (b"9" * 500),
    b" iteration        1/" + b"9" * 30 + b" | elapsed time per iteration (ms): 100.0 | lm loss: 1.0E+01 |\n",
    b"\niteration " + b"9" * 25 + b" : 1.5 s\n",  # FASOP's summary
    b"validation loss at iteration " + b"9" * 40 + b" | lm loss value: 2.0E+00 |\n",
    b"[Rank 0] (after " + b"9" * 40 + b" iterations) memory (MB) | allocated: 1 | max allocated: 2 |\n",
])
def test_an_iteration_beyond_int64_is_reported_not_dropped(line):
    log = INTERVAL % b"5" + line + INTERVAL % b"10"
    parsed = parse_text(log)
    assert parsed.iterations["iteration"].tolist() == [5, 10]  # the damaged line is no row, and no other is lost
    assert parsed.validation.empty and parsed.memory.empty
    (reported,) = parsed.partial_lines["line"].tolist()
    assert reported == (3 if line.startswith(b"\n") else 2), parsed.partial_lines  # its own line, named
    assert parsed.summary()["partial_lines"] == 1

"""`labkit validate` on 10,000 seeded spec mutations (goal: 0 tracebacks, 0 silent changes, 0 hangs over 5 s).

    .venv/bin/python benchmarks/bench_spec_fuzz.py [--n 10000] [--seed 0]

Failures print with the end of the spec that caused them (--show N of each kind). Each mutation takes the spec of tests/test_spec_fuzz.py and does one of: put a hostile value in a field (YAML 1.1
look-alikes, numbers at and past the bounds, NaN, tags, aliases, long and deep values, random text), delete, repeat,
swap or re-indent lines, splice random bytes, or replace the whole file (empty, scalars, lists, BOMs, bombs). It runs
`labkit validate --json` in this process and counts:

  traceback      an exception out of labkit.cli.main
  silent change  exit 0 with a field's value other than the text written (or a YAML 1.2 number other than its value)
  unnamed        exit 2 without every error naming a field, or a value of the wrong kind refused without its field
  hang           a run over 5 s
  big output     stderr over 100 KB
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import random
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_spec_fuzz import BASE, BOOLS, FIELDS, NULLS, PLAIN, TOKENS, fits, resolved, with_value, yaml12_number  # noqa: E402

from labkit.cli import main  # noqa: E402

HANG_S = 5.0
KILL_S = 30
WHOLE_FILES = [
    b"", b"false", b"[]", b"3", b"null", b"~", b"'text'", b"- a\n- b\n", b"\xff\xfe" + "name: x\n".encode("utf-16-le"),
    b"\xef\xbb\xbfname: bom\n", b"name: caf\xe9\n", b"---\n---\n", b"name: " + b"[" * 400 + b"]" * 400,
    b"name: " + b"{a: " * 400 + b"1" + b"}" * 400, b"&a [*a]", b"? [a]\n: 1\n", b"{a: 1, a: 2}",
    b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join('*' + chr(97 + i) for _ in range(9))}]\n".encode() for i in range(8))
    + b"name: *i\n",
    b"parallel: {pipeline: 100000000}\n", b"parallel: {tensor: 1e9}\n", b"parallel: {data: 10000000000}\n",
]


def random_token(rng: random.Random) -> str:
    """A value for a field: one of the hostile tokens, or a random number-, time- or text-like one."""
    kind = rng.randrange(6)
    if kind < 3:
        return rng.choice(TOKENS)
    if kind == 3:  # digits and separators, as a time limit or a version might be written
        return "".join(rng.choice("0123456789:.-+_eExo") for _ in range(rng.randint(1, 10)))
    if kind == 4:  # a number of any size
        return rng.choice(["", "-", "+"]) + str(rng.choice([rng.randint(0, 10), rng.randint(0, 2 ** 64),
                                                              rng.random() * 10.0 ** rng.randint(-10, 300)]))
    text = "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0, 0x2FFF)])) for _ in range(rng.randint(0, 12)))
    return json.dumps(text)  # any text, written as a double-quoted scalar


def mutate(rng: random.Random) -> tuple[bytes, tuple[str, str] | None]:
    """A mutated spec, and the (field, token) it set when it set one value."""
    lines = BASE.splitlines()
    op = rng.randrange(10)
    if op < 5:
        field = rng.choice(sorted(FIELDS))
        token = random_token(rng)
        return with_value(field, token).encode(), (field, token)
    if op == 5:
        del lines[rng.randrange(len(lines))]
    elif op == 6:
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
    elif op == 7:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == 8:
        i = rng.randrange(len(lines))
        lines[i] = lines[i][2:] if rng.random() < 0.5 else "  " + lines[i]
    else:
        if rng.random() < 0.3:
            return rng.choice(WHOLE_FILES), None
        data = BASE.encode()
        at = rng.randrange(len(data))
        noise = bytes(rng.randrange(256) for _ in range(rng.randint(1, 20)))
        return data[:at] + noise + data[at + rng.randint(0, 20):], None
    return ("\n".join(lines) + "\n").encode(), None


def silent_change(printed: dict, field: str, token: str) -> str | None:
    """What went wrong when a plain token was accepted as something other than what it writes."""
    if not PLAIN.match(token) or token in NULLS:
        return None
    kind, value = FIELDS[field][1], resolved(printed["spec"], field)
    if kind is str:
        return None if value == token and token not in BOOLS else f"{field}: wrote {token!r}, got {value!r}"
    if kind is bool:
        return None if token in BOOLS and value == (token.lower() == "true") else f"{field}: {token!r} -> {value!r}"
    expected = yaml12_number(token)
    if expected is not None and kind is float:
        expected = float(expected)  # a float field holds a float, whatever the digits written
    return None if expected is not None and value == expected else f"{field}: wrote {token!r}, got {value!r}"


def _alarm(signum, frame):
    raise TimeoutError


def run_one(path: Path, data: bytes, target) -> tuple[str, str]:
    """(outcome, detail) of validating one mutated spec."""
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    signal.alarm(KILL_S)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["validate", str(path), "--json"])
    except TimeoutError:
        return "hang", f"over {KILL_S} s"
    except BaseException:  # noqa: BLE001 - anything out of main is the traceback this counts
        return "traceback", traceback.format_exc(limit=-3)
    finally:
        signal.alarm(0)
    seconds, err = time.perf_counter() - start, err.getvalue()
    if seconds > HANG_S:
        return "hang", f"{seconds:.1f} s"
    if len(err) > 100_000:
        return "big output", f"{len(err)} bytes"
    if rc not in (0, 2):
        return "traceback", f"exit {rc}: {err[:300]}"
    if rc == 2:
        errors = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
        if not errors or any(":" not in e or e[0].isspace() for e in errors):
            return "unnamed", err[:300]
        if target and PLAIN.match(target[1]) and target[1] not in NULLS \
                and not fits(FIELDS[target[0]][1], target[1]) \
                and f"\n  - {target[0]}:" not in err:
            return "unnamed", f"{target}: {err[:300]}"
        return "exit 2", ""
    if target:
        problem = silent_change(json.loads(out.getvalue()), *target)
        if problem:
            return "silent change", problem
    return "exit 0", ""


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=1, help="failures of each kind to print")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    signal.signal(signal.SIGALRM, _alarm)
    counts, examples, slowest = collections.Counter(), collections.defaultdict(list), 0.0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.yaml"
        for _ in range(args.n):
            data, target = mutate(rng)
            t0 = time.perf_counter()
            outcome, detail = run_one(path, data, target)
            slowest = max(slowest, time.perf_counter() - t0)
            counts[outcome] += 1
            examples[outcome].append((data[-300:], detail))
    print(f"{args.n} seeded mutations (seed {args.seed}) in {time.perf_counter() - start:.0f} s; "
          f"slowest {slowest * 1000:.0f} ms")
    for outcome in ("exit 0", "exit 2", "traceback", "silent change", "unnamed", "hang", "big output"):
        print(f"  {outcome:14s} {counts[outcome]}")
    for outcome in ("traceback", "silent change", "unnamed", "hang", "big output"):
        for data, detail in examples[outcome][:args.show]:
            print(f"\n{outcome}: ...{data!r}\n{detail}")


if __name__ == "__main__":
    main_bench()

"""`labkit validate` on 10,000 seeded spec mutations (goal: 0 tracebacks, 0 silent changes, 0 hangs over 5 s).

    .venv/bin/python benchmarks/bench_spec_fuzz.py [--n 10000] [--seed 0] [--pipes 10] [--interrupted 0.05]

Failures print with the end of the spec that caused them (--show N of each kind). Each mutation takes the spec of
tests/test_spec_fuzz.py and does one of: put a hostile value in a field (YAML 1.1 look-alikes, numbers at and past the
bounds, NaN, tags, aliases, long and deep values, random text), delete, repeat, swap or re-indent lines, splice random
bytes, replace the whole file (empty, scalars, lists, BOMs, bombs), or write one of the classes found by the last
attacks (CLASSES: null in a model field, data.mock false without a path, a preset that is no name, a NUL byte in text,
a learning rate, split or log interval that means nothing, a world the sizes cannot split; and of paths and names:
a cluster.remote_dir that starts with '-' and one that is plain, an image file (.sqsh, .sif, a path) that is not there
and a registry image, a mount that is not SRC:DST[:FLAGS] and one that is, a line break or other control character
in a path or name such as train.tensorboard_dir, train.wandb.* or train.save). It runs `labkit validate --json` in
this process and counts:

  traceback          an exception out of labkit.cli.main
  silent change      exit 0 with a field's value other than the text written (or a YAML 1.2 number other than its
                     value), a quoted text changed, a null model field not the preset's value, data.mock false
                     taken as mock data, or a remote directory, image or mount accepted as other than written
  nonsense accepted  exit 0 for a value no run means (a NUL byte, a learning rate above 1, a split of no numbers, a
                     log interval above the iterations, a remote directory read as an option, a missing image file,
                     a mount that is not SRC:DST, a line break in a path or name)
  good value refused exit 2 for a plain remote directory, a registry image or a good mount
  unnamed            exit 2 without every error naming a field, a value of the wrong kind or nonsense refused without
                     its field, or an error that quotes "?" or a number other than as written
  hang               a run over 5 s of CPU time (or 30 s of wall time)
  big output         stderr over 100 KB
  unclean interrupt  Ctrl-C (a share --interrupted of the runs, each a KeyboardInterrupt raised as a random one of
                     its first 50,000 Python calls starts, as SIGINT's handler raises it) not ending in exit 130 with
                     the one line `labkit validate: interrupted` on stderr

Then --pipes mutated specs go through `labkit validate` in a new process whose reader has left (as `| true`): any
traceback on stderr is counted as one.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import io
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_spec_fuzz import (BASE, BOOLS, FIELDS, NULLS, PLAIN, TOKENS, error_lines, fits, resolved,  # noqa: E402
                            with_value, yaml12_number)

from labkit import catalog  # noqa: E402
from labkit.spec import load_spec, yaml12  # noqa: E402

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


def issue_case(rng: random.Random) -> tuple[bytes, dict]:
    """One spec of the classes the last attacks found, with what must become of it and its class (`class`)."""
    kind = rng.choice(CLASSES)
    data, expect = _issue_case(kind, rng)
    return data, {**expect, "class": kind}


def _issue_case(kind: str, rng: random.Random) -> tuple[bytes, dict]:
    """A spec of class `kind`, and what must become of it: {"keep": field, "as": text} (exit 0 with the field's value
    in the spec `text`, which leaves the key out), {"accept": field, "value": text} (exit 0 with the field exactly the
    text written), or {"refuse": field, "silent": bool} (exit 2 naming the field; exit 0 is a silent change when
    silent, else nonsense accepted), with "not": text an error must not hold."""
    if kind == "null in a model field":
        preset = rng.choice(["tiny-llama", "llama2-7b", "gpt2-small", "mistral-7b"])
        values = {k: v for k, v in catalog.models()[preset].items() if k != "source"}
        field = rng.choice(sorted(values))
        null = rng.choice(["null", "~"])
        unset = BASE.replace("model: {preset: tiny}", f"model: {{preset: {preset}}}")
        unset = unset.replace("  data: 2\n", "")  # a preset's heads and layers need not split as tiny's do
        text = unset.replace(f"{{preset: {preset}}}", f"{{preset: {preset}, {field}: {null}}}")
        return text.encode(), {"keep": f"model.{field}", "as": unset}
    if kind == "data.mock false without a path":
        return BASE.replace("  path: corpus\n", "  mock: false\n").encode(), {"refuse": "data.mock", "silent": True}
    if kind == "a preset that is no name":
        token = rng.choice(["[a, b]", "{a: 1}", "1e3", "12", "true", "[[]]", "{}", "-.inf", "0x1F"])
        return BASE.replace("{preset: tiny}", f"{{preset: {token}}}").encode(), \
            {"refuse": "model.preset", "silent": False, "not": "1000.0" if token == "1e3" else "Traceback"}
    if kind == "a NUL byte in text":
        field = rng.choice(sorted(f for f, (_, k) in FIELDS.items() if k is str))
        text = "".join(rng.choice("abc/._-") for _ in range(rng.randint(0, 6)))
        at = rng.randint(0, len(text))
        return with_value(field, json.dumps(text[:at] + "\0" + text[at:])).encode(), {"refuse": field, "silent": False}
    if kind == "a learning rate that means nothing":
        token = rng.choice(["65", "1e300", "2", "1.5e2", "10", "1e9"])
        return with_value("optimizer.lr", token).encode(), {"refuse": "optimizer.lr", "silent": False}
    if kind == "a split that means nothing":
        token = rng.choice(["abc", "0,0,0", "a,b,c", "90;5;5", "1,2,3,4", "-1,5,5", "x" * rng.randint(1, 9)])
        return with_value("data.split", token).encode(), {"refuse": "data.split", "silent": False}
    if kind == "a log interval above the iterations":
        iters = rng.randint(1, 50)
        text = BASE.replace("  iters: 20\n", f"  iters: {iters}\n  log_interval: {iters + rng.randint(1, 100)}\n")
        return text.encode(), {"refuse": "train.log_interval", "silent": False}
    if kind in PATH_CLASSES:
        return path_case(kind, rng)
    tensor = rng.choice([2, 4, 8])  # a world the sizes cannot split
    gpus = rng.choice([g for g in range(1, 16) if g % tensor])
    text = BASE.replace("  tensor: 1\n", f"  tensor: {tensor}\n")
    text = text.replace("gpus_per_node: 2", f"gpus_per_node: {gpus}")
    return text.encode(), {"refuse": "parallel.data", "silent": False, "not": "?"}


def _inserted(after: str, line: str) -> str:
    """BASE with `line` added under its section `after` (e.g. "train:")."""
    return BASE.replace(f"\n{after}\n", f"\n{after}\n{line}\n", 1)


# Paths and names: what reaches a remote shell, container images by their form, mounts, line breaks.
OPTION_LIKE_DIRS = ["-rf", "--help", "-", "-x/runs", "-oProxyCommand=touch x"]
PLAIN_DIRS = ["./-runs", "labkit-runs", "/scratch/-x", "runs/2026"]
MISSING_IMAGES = ["megatron.sqsh", "images/x.sif", "a.SQSH", "./m.sqsh", "/nonexistent/m.sqsh", "~/no-such.sif"]
REGISTRY_IMAGES = ["nvcr.io#nvidia/pytorch:25.04-py3", "ubuntu:22.04", "nvcr.io/nvidia/pytorch:24.05-py3", "img.sqsh2"]
BAD_MOUNTS = ["0", "/fsx", "fsx:/fsx", "/a:b", "/a:/b:ro:x", "0:0", "data", "/a:/b:r o", "~/x:/x"]
GOOD_MOUNTS = ["/fsx:/fsx", "/data:/data:ro", "/a:/b:ro+rprivate", "./cache:/cache", "tmpfs:/scratch"]
ONE_LINE_FIELDS = ["name", "data.path", "data.vocab_file", "train.save", "train.load", "train.tensorboard_dir",
                   "train.wandb.project", "train.wandb.exp_name", "train.wandb.save_dir"]


def path_case(kind: str, rng: random.Random) -> tuple[bytes, dict]:
    """One spec of the path and name classes, and what must become of it (see issue_case; {"accept": field, "value":
    text}: exit 0 with the field's value exactly the text written)."""
    if kind in ("a remote directory that starts with -", "a remote directory kept as written"):
        bad = kind.endswith("-")
        token = rng.choice(OPTION_LIKE_DIRS if bad else PLAIN_DIRS)
        text = _inserted("cluster:", f"  login: alice@login.cluster.org\n  remote_dir: {json.dumps(token)}")
        return text.encode(), ({"refuse": "cluster.remote_dir", "silent": False} if bad
                               else {"accept": "cluster.remote_dir", "value": token})
    if kind == "an image file that is not there":
        token = rng.choice(MISSING_IMAGES)
        return with_value("job.container.image", json.dumps(token)).encode(), \
            {"refuse": "job.container.image", "silent": False}
    if kind == "a registry image kept as written":
        token = rng.choice(REGISTRY_IMAGES)
        return with_value("job.container.image", json.dumps(token)).encode(), \
            {"accept": "job.container.image", "value": token}
    if kind == "a mount that is not SRC:DST":
        token = rng.choice(BAD_MOUNTS)
        plain = rng.random() < 0.5 and PLAIN.match(token)  # as written plain (0 is then a YAML number) or quoted
        written = token if plain else json.dumps(token)
        return with_value("job.container.mounts[0]", written).encode(), \
            {"refuse": "job.container.mounts[0]", "silent": False}
    if kind == "a mount kept as written":
        token = rng.choice(GOOD_MOUNTS)
        return with_value("job.container.mounts[0]", token).encode(), \
            {"accept": "job.container.mounts[0]", "value": token}
    field = rng.choice(ONE_LINE_FIELDS)  # a line break (or another control character) in a path or name
    value = "".join(rng.choice("abc/._- ") for _ in range(rng.randint(0, 6)))
    at = rng.randint(0, len(value))
    value = value[:at] + rng.choice(["\n", "\r", "\r\n", "\t", "\x1b", "\n\n"]) + value[at:]
    quoted = json.dumps(value)
    if field in FIELDS:
        text = with_value(field, quoted)
    elif field.startswith("train.wandb."):
        key = field.rsplit(".", 1)[1]
        values = {"project": "labkit", key: value}
        text = _inserted("train:", "  wandb: {" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in values.items()) + "}")
    else:
        section, key = field.split(".")
        text = _inserted(f"{section}:", f"  {key}: {quoted}")
    return text.encode(), {"refuse": field, "silent": False}


PATH_CLASSES = ["a remote directory that starts with -", "a remote directory kept as written",
                "an image file that is not there", "a registry image kept as written", "a mount that is not SRC:DST",
                "a mount kept as written", "a line break in a path or name"]
CLASSES = ["null in a model field", "data.mock false without a path", "a preset that is no name", "a NUL byte in text",
           "a learning rate that means nothing", "a split that means nothing", "a log interval above the iterations",
           "a world the sizes cannot split", *PATH_CLASSES]


def mutate(rng: random.Random) -> tuple[bytes, tuple[str, str] | dict | None]:
    """A mutated spec, and the (field, token) it set when it set one value, or what an issue case expects."""
    lines = BASE.splitlines()
    op = rng.randrange(12)
    if op >= 10:
        return issue_case(rng)
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


def issue_outcome(rc: int, printed: dict | None, err: str, expect: dict) -> tuple[str, str]:
    """What became of an issue case (see issue_case)."""
    if "keep" in expect:  # null: the value of the spec that leaves the key out
        field = expect["keep"]
        value = resolved(load_spec(yaml12.load(expect["as"])).to_dict(), field)
        got = resolved(printed["spec"], field) if rc == 0 else None
        return ("exit 0", "") if rc == 0 and got == value else ("silent change", f"{field}: unset {value!r}, "
                                                                                 f"got {got!r} (exit {rc}) {err[:200]}")
    if "accept" in expect:  # a good value: exit 0, the field exactly as written
        field = expect["accept"]
        if rc != 0:
            return "good value refused", f"{field} {expect['value']!r}: {err[:300]}"
        got = resolved(printed["spec"], field)
        return ("exit 0", "") if got == expect["value"] else ("silent change", f"{field}: wrote "
                                                                               f"{expect['value']!r}, got {got!r}")
    if rc == 0:
        return ("silent change" if expect["silent"] else "nonsense accepted"), f"{expect['refuse']} accepted"
    if f"\n  - {expect['refuse']}:" not in err or expect.get("not", "Traceback") in err:
        return "unnamed", f"{expect}: {err[:300]}"
    return "exit 2", ""


class Interrupt:
    """Ctrl-C as the `after`-th Python call starts: KeyboardInterrupt raised there, as SIGINT's handler raises it
    between two steps of the program (a trace function that raises stops tracing, and the call gets the exception).
    A generator's frame is passed over for the next call: one that the garbage collector closes would report any
    exception as ignored and drop it, as CPython does with every exception there."""

    def __init__(self, after: int):
        self.after, self.calls, self.fired = after, 0, False

    def __call__(self, frame, event, arg):
        self.calls += 1
        if self.calls >= self.after and not self.fired and not frame.f_code.co_flags & GENERATOR_FRAMES:
            self.fired = True
            raise KeyboardInterrupt


GENERATOR_FRAMES = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def run_one(path: Path, data: bytes, target, interrupt: Interrupt | None = None) -> tuple[str, str]:
    """(outcome, detail) of validating one mutated spec (with `interrupt`, Ctrl-C in the middle of it)."""
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    signal.alarm(KILL_S)
    start = time.process_time()  # CPU time, as tests/test_spec_fuzz.py: a busy machine slows a run without hanging it
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            sys.settrace(interrupt)
            try:
                rc = main(["validate", str(path), "--json"])
            finally:
                sys.settrace(None)
    except TimeoutError:
        return "hang", f"over {KILL_S} s"
    except BaseException:  # noqa: BLE001 - anything out of main is the traceback this counts
        return "traceback", traceback.format_exc(limit=-3)
    finally:
        signal.alarm(0)
    if interrupt is not None and interrupt.fired:
        lines = err.getvalue().splitlines()
        if rc == 130 and lines == ["labkit validate: interrupted"]:
            return "interrupted", ""
        return "unclean interrupt", f"exit {rc} at call {interrupt.after}: {err.getvalue()[-300:]!r}"
    seconds, err = time.process_time() - start, error_lines(rc, out.getvalue()) + err.getvalue()
    if seconds > HANG_S:
        return "hang", f"{seconds:.1f} s"
    if len(err) > 100_000:
        return "big output", f"{len(err)} bytes"
    if rc not in (0, 2):
        return "traceback", f"exit {rc}: {err[:300]}"
    if isinstance(target, dict):
        return issue_outcome(rc, json.loads(out.getvalue()) if rc == 0 else None, err, target)
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
        printed = json.loads(out.getvalue())
        problem = silent_change(printed, *target)
        if target[1].startswith('"') and FIELDS[target[0]][1] is str:  # a quoted text is kept exactly
            written = json.loads(target[1])
            if resolved(printed["spec"], target[0]) != written:
                problem = f"{target[0]}: wrote {written!r}, got {resolved(printed['spec'], target[0])!r}"
            elif "\0" in written:
                return "nonsense accepted", f"{target[0]}: a NUL byte"
        if problem:
            return "silent change", problem
    return "exit 0", ""


def run_piped(path: Path, data: bytes) -> tuple[str, str]:
    """`labkit validate` in a new process whose reader has left: a traceback on stderr is one."""
    path.write_bytes(data)
    process = subprocess.Popen([sys.executable, "-m", "labkit", "validate", str(path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    err = process.stderr.read().decode(errors="replace")
    process.wait()
    return ("traceback", err[-300:]) if "Traceback" in err else (f"exit {process.returncode}", "")


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=1, help="failures of each kind to print")
    parser.add_argument("--pipes", type=int, default=10, help="mutated specs validated with the reader gone")
    parser.add_argument("--interrupted", type=float, default=0.05, help="the share of runs that get a Ctrl-C")
    args = parser.parse_args()
    rng, interrupts = random.Random(args.seed), random.Random(args.seed + 1)
    signal.signal(signal.SIGALRM, _alarm)
    counts, examples, slowest = collections.Counter(), collections.defaultdict(list), 0.0
    issues, pipes = collections.Counter(), collections.Counter()
    by_class = collections.defaultdict(collections.Counter)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.yaml"
        for _ in range(args.n):
            data, target = mutate(rng)
            interrupt = Interrupt(interrupts.randint(1, 50_000)) if interrupts.random() < args.interrupted else None
            t0 = time.perf_counter()
            outcome, detail = run_one(path, data, target, interrupt)
            if interrupt is not None and not interrupt.fired:
                counts["ended before its Ctrl-C"] += 1
            slowest = max(slowest, time.perf_counter() - t0)
            counts[outcome] += 1
            examples[outcome].append((data[-300:], detail))
            if isinstance(target, dict) and outcome != "interrupted":
                issues[outcome in ("exit 0", "exit 2")] += 1
                by_class[target.get("class")][outcome in ("exit 0", "exit 2")] += 1
        for _ in range(args.pipes):
            outcome, detail = run_piped(path, mutate(rng)[0])
            pipes[outcome != "traceback"] += 1
            if outcome == "traceback":
                counts[outcome] += 1
                examples[outcome].append((b"(stdout closed)", detail))
    print(f"{args.n} seeded mutations (seed {args.seed}) in {time.perf_counter() - start:.0f} s; "
          f"slowest {slowest * 1000:.0f} ms; {sum(issues.values())} of them of the last attack's classes "
          f"({issues[True]} as they should be); {args.pipes} with the reader gone ({pipes[True]} quiet)")
    kinds = ("traceback", "silent change", "nonsense accepted", "good value refused", "unnamed", "hang", "big output",
             "unclean interrupt")
    for outcome in ("exit 0", "exit 2") + kinds:
        print(f"  {outcome:18s} {counts[outcome]}")
    print(f"  Ctrl-C'd {counts['interrupted'] + counts['unclean interrupt']} mid-run ({counts['interrupted']} exit 130 "
          f"with one line), {counts['ended before its Ctrl-C']} ended before theirs")
    print("  of the path and name classes:")
    for kind in PATH_CLASSES:
        print(f"    {kind:40s} {sum(by_class[kind].values()):5d} ({by_class[kind][True]} as they should be)")
    for outcome in kinds:
        for data, detail in examples[outcome][:args.show]:
            print(f"\n{outcome}: ...{data!r}\n{detail}")


if __name__ == "__main__":
    main_bench()

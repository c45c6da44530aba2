"""`labkit logs parse` on 10,000 seeded mutations of real logs (goal: 0 crashes, 0 hangs over 5 s, 0 invented rows,
0 lines dropped unseen, 0 unclean interrupts).

    .venv/bin/python benchmarks/bench_log_fuzz.py [--n 10000] [--seed 0] [--pipes 5] [--interrupted 0.03]
                                                  [--big-interrupts 6]

Each mutation takes one of the logs in tests/fixtures/logs and does one of: cut it anywhere, delete, repeat or swap
lines, splice random bytes or log-shaped fragments (interval, timer, memory, argument and tail-header pieces, colour
codes, carriage returns, NULs, invalid UTF-8) at random places, blow one line up to a megabyte, or write a number
beyond any count where the log has one (an iteration of 2**62 or of hundreds of digits, `inf` or thousands of digits
as an argument, a size in the job info, a rank in a prefix). It parses the result in this process, builds the
summary and the JSON (as `labkit logs parse --json` does) and counts:

  crash          an exception out of parse_text, summary or to_json (a traceback)
  hang           a parse over 5 s of CPU time (its own and a forked scanner's)
  invented row   after a cut or a deletion (which only take text away), an iteration row whose values the whole
                 log does not have; or an iteration number no int64 column holds
  dropped unseen an interval line whose iteration number (or count) is beyond int64 that is neither a row nor among
                 the partial lines, or a summary that reports no partial line for it
  unclean interrupt  Ctrl-C (a share --interrupted of the parses, each a KeyboardInterrupt raised as a random one of
                 its first 30,000 Python calls starts, as SIGINT's handler raises it) that the parse does not pass on,
                 or that leaves a forked scanner behind

Then --pipes mutated logs go through `labkit logs parse` in a new process whose reader has left (as `| head`): a
traceback on stderr counts as a crash. Then --big-interrupts parses of a 23 MB log (large enough that the event scan
runs in a forked process) are interrupted: half in this process at a random call, half as `labkit logs parse` in a new
process that gets a real SIGINT (to its process group, as a terminal's Ctrl-C) at a random moment; each must end in
exit 130 with one line on stderr (or the KeyboardInterrupt passed on), no traceback, and no process left behind.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import math
import multiprocessing
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.logs import parse_text  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "logs"
FRAGMENTS = [
    b" iteration ", b"/", b" | ", b"|", b"lm loss: ", b"elapsed time per iteration (ms): ", b"1.5E+00", b"nan", b"inf",
    b"1e999", b"(min, max) time across ranks (ms):\n", b"    forward-compute ....: (1.0, 2.0)\n",
    b"times across ranks (ms):\n", b"max time across ranks (ms):\n", b"memory (MB) | allocated: 1 |",
    b"[Rank 2] (after 5 iterations) ", b"------------------------ arguments ------------------------\n",
    b"  num_layers ............ 2\n", b"-------------------- end of arguments ---------------------\n",
    b"using world size: 4, data-parallel size: x", b"Training epoch 0, ", b"3: ", b"[default1]:",
    b"[2025-01-01 00:00:00] ", b"\x1b[31m", b"\r", b"\n", b"==> n1.out <==\n", b"Error", b"Traceback",
    b"validation loss at iteration 5 | lm loss value: 2 |", b"\xff\xfe", b"\x00", b"\niteration 3 : 1.5 s\n",
]
KEY = ["iteration", "lm_loss", "elapsed_ms"]


HUGE = [str(2**62).encode(), str(2**63).encode(), b"9" * 19, b"9" * 500, b"9" * 5001, b"inf", b"1e999", b"-9" * 30]
BEYOND = [  # where a log holds a count: each with a number no count reaches
    lambda n: b" iteration %s/      10 | elapsed time per iteration (ms): 100.0 | lm loss: 1.0E+01 |\n" % n,
    lambda n: b" iteration        1/%s | elapsed time per iteration (ms): 100.0 | lm loss: 1.0E+01 |\n" % n,
    lambda n: b"------------------------ arguments ------------------------\n  seq_length ............ %s\n"
              b"  micro_batch_size ............ %s\n"
              b"-------------------- end of arguments ---------------------\n" % (n, n),
    lambda n: b"\n******************* job info 1 *******************\nNODE: n1\nDP_SIZE: %s\nTP_SIZE: %s\n" % (n, n),
    lambda n: b"[Rank %s] (after 5 iterations) memory (MB) | allocated: %s |\n" % (n, n),
    lambda n: b"%s: iteration        1/      10 | lm loss: 1.0E+01 |\n" % n,
    lambda n: b"using world size: %s, data-parallel size: %s, tensor-model-parallel size: 1\n" % (n, n),
    lambda n: b"setting number of micro-batches to constant %s\nvirtual stages per pipeline stage: %s\n" % (n, n),
    lambda n: b"successfully saved checkpoint from iteration %s to ckpt\n" % n,
]


_INTERVAL = re.compile(rb"iteration[ =]+(\d+) */ *(\d+) *\|")


def beyond_int64(digits: bytes) -> bool:
    return len(digits) > 19 or (len(digits) == 19 and int(digits) >= 2**63)


def dropped_unseen(data: bytes, parsed) -> list[int]:
    """The line numbers of interval lines with an iteration number (or count) beyond int64 that the parse neither
    read as a row nor reported among its partial lines (or whose summary reports no partial line)."""
    lines = {data.count(b"\n", 0, m.start()) + 1 for m in _INTERVAL.finditer(data)
             if beyond_int64(m.group(1)) or beyond_int64(m.group(2))}
    if not lines:
        return []
    if not parsed.summary()["partial_lines"]:
        return sorted(lines)
    return sorted(lines - set(parsed.partial_lines["line"]))


class Interrupt:
    """Ctrl-C as the `after`-th Python call of this process starts: KeyboardInterrupt raised there, as SIGINT's
    handler raises it between two steps of the program (a process forked meanwhile is left alone: SIGINT's handler
    does not run there either). A generator's frame is passed over for the next call: one that the garbage collector
    closes would report any exception as ignored and drop it, as CPython does with every exception there."""

    def __init__(self, after: int):
        self.after, self.calls, self.pid, self.fired = after, 0, os.getpid(), False

    def __call__(self, frame, event, arg):
        if os.getpid() != self.pid:
            sys.settrace(None)
            return None
        self.calls += 1
        if self.calls >= self.after and not self.fired and not frame.f_code.co_flags & GENERATOR_FRAMES:
            self.fired = True
            raise KeyboardInterrupt
        return None


GENERATOR_FRAMES = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def parse_interrupted(data: bytes, interrupt: Interrupt) -> str:
    """Parse, summarise and serialise `data` with Ctrl-C at `interrupt`: "interrupted", "ended first", or what went
    wrong (the KeyboardInterrupt swallowed, a forked scanner left running)."""
    sys.settrace(interrupt)
    try:
        parsed = parse_text(data)
        parsed.summary()
        parsed.to_json()
        outcome = "swallowed" if interrupt.fired else "ended first"
    except KeyboardInterrupt:
        outcome = "interrupted"
    finally:
        sys.settrace(None)
    left = multiprocessing.active_children()
    for child in left:
        child.kill()
        child.join()
    return f"left {len(left)} scanner(s)" if left else outcome


def sigint_logs_parse(path: Path, delay_s: float) -> str:
    """`labkit logs parse PATH` in a new process, SIGINT to its process group `delay_s` after it has started:
    "interrupted", "ended first", or what went wrong."""
    launch = "import sys; from labkit.cli import main; print('ready', flush=True); sys.exit(main())"
    process = subprocess.Popen([sys.executable, "-c", launch, "logs", "parse", str(path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    process.stdout.readline()  # imported: from here on the command handles Ctrl-C
    time.sleep(delay_s)
    try:
        os.killpg(process.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    out, err = process.communicate(timeout=120)
    err = err.decode(errors="replace")
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True).stdout.split()
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    if left:
        return f"left {len(left)} process(es)"
    if process.returncode == 0 and not err:
        return "ended first"
    if process.returncode != 130 or err.splitlines() != ["labkit logs: interrupted"]:
        return f"exit {process.returncode}: {err[-300:]!r}"
    return "interrupted"


def mutate(data: bytes, rng: random.Random) -> tuple[bytes, bool]:
    """A mutated log, and whether the mutation only took text away (so every row read must be one of the log's)."""
    lines = data.split(b"\n")
    kind = rng.randrange(8)
    mutate.kind = kind
    if kind == 0:
        return data[:rng.randrange(len(data) + 1)], True
    if kind == 1:
        drop = set(rng.sample(range(len(lines)), k=rng.randrange(1, max(2, len(lines) // 10))))
        return b"\n".join(line for i, line in enumerate(lines) if i not in drop), True
    if kind == 2:
        i = rng.randrange(len(lines))
        lines[i:i] = [lines[i]] * rng.randrange(1, 50)
    elif kind == 3:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == 4:
        for _ in range(rng.randrange(1, 20)):
            at = rng.randrange(len(data) + 1)
            data = data[:at] + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) + data[at:]
        return data, False
    elif kind == 5:
        for _ in range(rng.randrange(1, 30)):
            at = rng.randrange(len(data) + 1)
            data = data[:at] + rng.choice(FRAGMENTS) * rng.randrange(1, 5) + data[at:]
        return data, False
    elif kind == 6:
        for _ in range(rng.randrange(1, 4)):  # a number beyond any count, in a line of the log or one of its kind
            i = rng.randrange(len(lines))
            digits = list(re.finditer(rb"\d+", lines[i]))
            if digits and rng.random() < 0.5:
                m = rng.choice(digits)
                lines[i] = lines[i][:m.start()] + rng.choice(HUGE) + lines[i][m.end():]
            else:
                lines.insert(i, rng.choice(BEYOND)(rng.choice(HUGE)))
    else:
        i = rng.randrange(len(lines))
        lines[i] = lines[i] + rng.choice(FRAGMENTS) * rng.randrange(1000, 60_000)
    return b"\n".join(lines), False


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the parser's event scan may run in a forked child)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def rows(parsed) -> set[tuple]:
    df = parsed.iterations
    if df.empty:
        return set()
    df = df.reindex(columns=KEY)
    return {tuple(None if v != v else v for v in row) for row in df.astype(object).itertuples(index=False)}


def invented(got: set[tuple], whole: set[tuple]) -> bool:
    """A row with a value no row of the whole log has for that iteration (a value missing, as when the interval
    line was cut away and a summary line still gives the time, is not invented; 1.3739 s and 1373.9 ms are the same)."""
    def same(g, w) -> bool:
        return g is None or g == w or (w is not None and math.isclose(g, w, rel_tol=1e-9))
    return any(not any(all(same(g, w) for g, w in zip(row, full)) for full in whole) for row in got)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, help="write each failing mutated log into this directory")
    ap.add_argument("--pipes", type=int, default=5, help="mutated logs parsed by a new process with the reader gone")
    ap.add_argument("--interrupted", type=float, default=0.03, help="the share of parses that get a Ctrl-C")
    ap.add_argument("--big-interrupts", type=int, default=6, help="Ctrl-Cs in the parse of a 23 MB log")
    args = ap.parse_args(argv)
    rng, interrupts = random.Random(args.seed), random.Random(args.seed + 1)
    logs = {p.name: p.read_bytes() for p in sorted(FIXTURES.iterdir()) if p.is_file() and p.suffix != ".md"}
    whole = {name: rows(parse_text(data)) for name, data in logs.items()}
    counts = {"crash": 0, "hang": 0, "invented row": 0, "dropped unseen": 0, "unclean interrupt": 0}
    beyond, interrupted, ended_first = 0, 0, 0
    slowest, start = 0.0, time.perf_counter()
    def keep(number: int, kind: str, name: str, data: bytes) -> None:
        print(f"  mutation {number} ({kind}, kind {mutate.kind}) of {name}", file=sys.stderr)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / f"{number}-{kind.replace(' ', '-')}-{name}").write_bytes(data)

    for number in range(args.n):
        name = rng.choice(sorted(logs))
        data, only_removed = mutate(logs[name], rng)
        if interrupts.random() < args.interrupted:
            outcome = parse_interrupted(data, Interrupt(interrupts.randint(1, 30_000)))
            interrupted += outcome == "interrupted"
            ended_first += outcome == "ended first"
            if outcome not in ("interrupted", "ended first"):
                counts["unclean interrupt"] += 1
                keep(number, f"unclean interrupt ({outcome})", name, data)
            continue
        began, began_cpu = time.perf_counter(), cpu_seconds()
        try:
            parsed = parse_text(data)
            parsed.summary()
            parsed.to_json()
        except Exception:
            counts["crash"] += 1
            keep(number, "crash", name, data)
            if counts["crash"] <= 3:
                traceback.print_exc()
            continue
        slowest = max(slowest, time.perf_counter() - began)
        if cpu_seconds() - began_cpu > 5:  # CPU time: a busy machine slows a parse but does not make it hang
            counts["hang"] += 1
            keep(number, "hang", name, data)
        beyond += mutate.kind == 6
        found = parsed.iterations["iteration"] if "iteration" in parsed.iterations else []
        if len(found) and found.max() >= 2**62:
            counts["invented row"] += 1
            keep(number, "invented row", name, data)
        elif only_removed and invented(rows(parsed), whole[name]):
            counts["invented row"] += 1
            keep(number, "invented row", name, data)
        lost = dropped_unseen(data, parsed)
        if lost:
            counts["dropped unseen"] += 1
            keep(number, f"dropped unseen (lines {lost[:5]})", name, data)
    quiet = 0
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(args.pipes):
            name = rng.choice(sorted(logs))
            path = Path(tmp) / name
            path.write_bytes(mutate(logs[name], rng)[0])
            process = subprocess.Popen([sys.executable, "-m", "labkit", "logs", "parse", str(path)], cwd=ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            process.stdout.close()  # the reader has left
            err = process.stderr.read().decode(errors="replace")
            process.wait()
            if "Traceback" in err:
                counts["crash"] += 1
                print(f"  piped {number} of {name}: {err[-300:]}", file=sys.stderr)
            else:
                quiet += 1
        big = Path(tmp) / "big.log"
        big.write_bytes(logs["03-mlm2025-gpt2-fp16-autodl.log"] * 400)
        big_outcomes = collections.Counter()
        for number in range(args.big_interrupts):
            if number % 2 == 0:
                outcome = parse_interrupted(big.read_bytes(), Interrupt(interrupts.randint(1, 240_000)))
            else:
                outcome = sigint_logs_parse(big, interrupts.uniform(0.0, 1.5))
            big_outcomes[outcome] += 1
            if outcome not in ("interrupted", "ended first"):
                counts["unclean interrupt"] += 1
                print(f"  Ctrl-C {number} in the parse of a 23 MB log: {outcome}", file=sys.stderr)
    print(f"{args.n} seeded log mutations (seed {args.seed}) of {len(logs)} logs in "
          f"{time.perf_counter() - start:.0f} s; slowest parse {slowest * 1000:.0f} ms; {beyond} with numbers beyond "
          f"any count; {args.pipes} parsed with the reader gone ({quiet} quiet); Ctrl-C in {interrupted} parses "
          f"({ended_first} more ended first) and in {args.big_interrupts} parses of a 23 MB log "
          f"({big_outcomes['interrupted']} interrupted, {big_outcomes['ended first']} ended first)")
    for kind, count in counts.items():
        print(f"  {kind:<14} {count}")
    return 1 if any(counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

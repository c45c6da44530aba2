"""Megatron-family training logs into pandas DataFrames.

`parse_log(paths)` reads one log, the per-node files of one job (`JOBID/NODE.out`), or a run/job directory, and
returns a `ParsedLog`. It understands, in any mix:

- Megatron-LM interval lines of every era: 2020's colon-less `lm loss 5.0E+00 |`, the `key: value |` style,
  `[YYYY-MM-DD HH:MM:SS]` prefixes, `throughput per GPU (TFLOP/s/GPU)`, `consumed tokens`, `skipped samples`;
- Megatron-DeepSpeed (`TFLOPs:`, elapsed time in seconds, `key=value` forks) and NeMo 2
  (`Training epoch E, iteration i/n`);
- launcher prefixes: `srun -l` labels (`3: `), pdsh hosts (`host: `), torchrun `[default3]:`, torch `[rank3]:`,
  quoted `> ` lines, logger prefixes; ANSI colour codes; carriage-return progress lines; `tail`'s `==> file <==`
  headers;
- memory reports, timers (one-line `time (ms) |` and the `(min, max)`, `max` and per-rank `times across ranks`
  blocks), the arguments block, parallel sizes, validation losses, and errors/warnings with their line numbers.

Conventions. Iteration numbers are kept as printed, NeMo's 0-based `iteration 28/99` included (its `epoch` is kept
beside it). Times are milliseconds. One row per iteration even when several ranks print it: rows of one iteration are
merged, the first value printed wins; when a stream prints an iteration again after a higher one (a restart from a
checkpoint) the later print wins. A line cut off mid-record (a truncated file, a line broken by another rank's output)
is ignored and reported in `partial_lines`, and so is a line whose iteration number is longer than any count (over 18
digits, beyond what the int64 columns hold): damage is never read as a row, nor dropped unseen (the summary counts
the partial lines). Bytes that are not UTF-8 are replaced, never fatal.

The scan works on bytes with one C-level regex pass per record kind, so Python code runs only for lines that carry
data; that is what keeps large multi-rank logs fast (see benchmarks/bench_log_parse.py). On a large log the
event-word passes run in a forked child on a second CPU meanwhile (`_start_event_scan`).
"""
from __future__ import annotations

import ast
import bisect
import contextlib
import functools
import gc
import itertools
import multiprocessing
import os
import re
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from labkit.logs import job_info
from labkit.megatron import sizes

# ---------------------------------------------------------------------------------------------------------------------
# Record patterns. Each starts with a literal so the regex engine can skip ahead quickly. A count is at most 18 digits
# (\d{1,18}(?!\d)): below 2**62, which the int64 columns hold; a longer number is damage, not an iteration or a size.

# An iteration number is read whatever its length, and one longer than a count (a damaged line) is reported among the
# partial lines instead of becoming a row: never dropped unseen.
_ITERATION = re.compile(rb"iteration[ =]+(\d+) */ *(\d+) *\|")
_GET_RESULT_TIME = re.compile(rb"\niteration (\d+) : ([\d.]+) s(?=\n)")  # FASOP's get_result.sh summary
_MAX_COUNT_DIGITS = 18
_MEMORY = re.compile(rb"memory \(MB\) *\|([^\n]*)")
_TIMER_LINE = re.compile(rb"time \(ms\) *\|([^\n]*)")
_TIMER_BLOCK = re.compile(rb"across ranks \(ms\):")
_ARGS_NEW = re.compile(rb" arguments -{4}")
_ARGS_OLD = re.compile(rb"\narguments:[ \t]*(?=\n)")
_WORLD = re.compile(rb"using world size[^\n]*")
_MICRO_BATCHES = re.compile(rb"micro-?batches to constant (\d{1,18}(?!\d))")
_PARAMS = re.compile(rb"number of parameters on (?:\(tensor, pipeline\) )?model parallel rank "
                     rb"(?:\((\d{1,18}(?!\d)), *(\d{1,18}(?!\d))\)|(\d{1,18}(?!\d))): *(\d{1,18}(?!\d))")
_VIRTUAL = re.compile(rb"virtual stages per pipeline stage: *(\w+)")
_TOPOLOGY = re.compile(rb"Using topology: \{[^\n]*")
_PARAMS_DTYPE = re.compile(rb"using (torch\.\w+) for parameters")
_PADDED_VOCAB = re.compile(rb"padded vocab \(size: (\d{1,18}(?!\d))\) with (\d{1,18}(?!\d)) dummy tokens "
                           rb"\(new size: (\d{1,18}(?!\d))\)")
_VALIDATION = re.compile(rb"validation loss at (?:iteration +(\d+)(?: on (\w+) set)?"
                         rb"|the end of training for (\w+) data)"
                         rb" *\|([^\n]*)")
_TAIL_HEADER = re.compile(rb"^==> ([^\n]*) <==[ \t]*$", re.M)  # tail prints each header on a line of its own
_JOB_INFO = re.compile(rb"\n(" + "|".join(job_info.PARALLEL).encode() + rb"): ([\w-]+)(?=\n)")
# Words that make a line an event (Slurm's `CANCELLED` and time-limit lines carry `error:`). One literal scan per
# word: an alternation starting with common letters is several times slower.
_ERROR_WORDS = (b"Traceback", b"Error", b"ERROR", b"error:", b"out of memory", b"Killed", b"Segmentation fault",
                b"NaN")
_WARNING_WORDS = (b"Warning", b"WARNING")
_EVENT_SCANS = [re.compile(re.escape(word)) for word in _ERROR_WORDS + _WARNING_WORDS]
_ERROR = re.compile(b"|".join(re.escape(word) for word in _ERROR_WORDS))
_ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\n\x1b]*\x07")

_STAMP = re.compile(rb"\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)[^\]\n]*\]")
_LAUNCHER_PREFIX = re.compile(rb" *\d+: |\[[A-Za-z_]+\d+\]:|[\w.-]+: ")  # srun -l, torchrun, pdsh
_NEMO_PREFIX = re.compile(rb"Training epoch (\d{1,18}(?!\d)), *$")
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")
_PREFIX_TOKEN = re.compile(r"\s*(?:\[([^\]]*)\]:?|([^\s:\[\]]+):(?=\s|\[|$)|(\S+))")
_BRACKET_RANK = re.compile(r"(?:Rank |rank)(\d{1,18}(?!\d))$")
_BRACKET_ROLE = re.compile(r"([A-Za-z_]+)(\d{1,18}(?!\d))$")
_HOST = re.compile(r"[A-Za-z0-9][\w.-]*$")
_AFTER_ITERS = re.compile(rb"after (\d+) iterations")
_ARG_ENTRY = re.compile(rb"\s*([A-Za-z_][A-Za-z0-9_]*) \.* ?(.*?)\s*$")
_ARG_ENTRY_INDENTED = re.compile(rb"\s+([A-Za-z_][A-Za-z0-9_]*) \.* ?(.*?)\s*$")
_TIMER_MAX = re.compile(rb"\s+(\S.*?) \.*: ([-+.\deEnaif]+)\s*$")
_TIMER_ALL_NAME = re.compile(rb"  (\S.*?):\s*$")
_TIMER_ALL_RANK = re.compile(rb"\s+rank +(\d{1,18}(?!\d)): ([-+.\deEnaif]+)\s*$")
# bounded: a long run of letters is linear
_SIZE = re.compile(rb"(?<![A-Za-z-])([A-Za-z-]{1,80})[ -]sizes?: *(\d{1,18}(?!\d))")
_COORD = re.compile(rb"ProcessCoord\(pipe=(\d{1,18}(?!\d)), data=(\d{1,18}(?!\d)), model=(\d{1,18}(?!\d))\)")
_NOT_ALNUM = re.compile(rb"[^a-z0-9]")

# Bounds that keep the work per line linear whatever a line holds (a log of one 500 KB line, megabytes of '|'):
# a record's fields are read from at most _MAX_RECORD bytes (Megatron's longest interval line is about 2 KB), a
# launcher prefix from the _MAX_PREFIX bytes before its record, and a reported line keeps its first _MAX_TEXT bytes.
_MAX_RECORD = 1 << 16
_MAX_PREFIX = 1 << 10
_MAX_TEXT = 1000

# Interval-line fields: normalised key (lower case, alphanumerics only) -> (column, scale to the column's unit).
_FIELDS = {
    b"consumedsamples": ("consumed_samples", 1.0),
    b"consumedtokens": ("consumed_tokens", 1.0),
    b"skippedsamples": ("skipped_samples", 1.0),
    b"elapsedtimeperiterationms": ("elapsed_ms", 1.0),
    b"elapsedtimeperiterations": ("elapsed_ms", 1000.0),
    b"trainsteptimingins": ("elapsed_ms", 1000.0),
    b"throughputpergputflopsgpu": ("tflops_per_gpu", 1.0),
    b"tflops": ("tflops_per_gpu", 1.0),
    b"learningrate": ("lr", 1.0),
    b"lr": ("lr", 1.0),
    b"globalbatchsize": ("global_batch_size", 1.0),
    b"lmloss": ("lm_loss", 1.0),
    b"reducedtrainloss": ("lm_loss", 1.0),
    b"lossscale": ("loss_scale", 1.0),
    b"gradnorm": ("grad_norm", 1.0),
    b"numzeros": ("num_zeros", 1.0),
    b"paramsnorm": ("params_norm", 1.0),
    b"numberofskippediterations": ("skipped", 1.0),
    b"numberofnaniterations": ("nan", 1.0),
    b"samplespersecond": ("samples_per_s", 1.0),
    b"tokenspergpupersecondtgs": ("tokens_per_gpu_per_s", 1.0),
    b"actualseqlen": ("seq_length", 1.0),
    b"globalstep": ("global_step", 1.0),  # NeMo's 0-based step, as printed
}
_MEMORY_FIELDS = {
    b"allocated": "allocated_mb", b"maxallocated": "max_allocated_mb",
    b"reserved": "reserved_mb", b"maxreserved": "max_reserved_mb",
    b"cached": "reserved_mb", b"maxcached": "max_reserved_mb",
}

ITERATION_COLUMNS = [
    "iteration", "train_iters", "epoch", "consumed_samples", "consumed_tokens", "skipped_samples", "elapsed_ms",
    "tflops_per_gpu", "samples_per_s", "tokens_per_gpu_per_s", "lr", "global_batch_size", "lm_loss", "loss_scale",
    "grad_norm", "num_zeros", "params_norm", "skipped", "nan", "seq_length", "timestamp",
    "source", "node", "task", "rank", "local_rank", "line",
]
_INT_COLUMNS = ("iteration", "train_iters", "epoch", "consumed_samples", "consumed_tokens", "skipped_samples",
                "global_batch_size", "skipped", "nan", "seq_length", "global_step", "task", "rank", "local_rank", "line")
_ORIGIN = ["source", "node", "task", "rank", "local_rank", "line"]
MEMORY_COLUMNS = ["iteration", "allocated_mb", "max_allocated_mb", "reserved_mb", "max_reserved_mb", *_ORIGIN]
TIMER_COLUMNS = ["iteration", "phase", "ms", "min_ms", "max_ms", "style", *_ORIGIN]
VALIDATION_COLUMNS = ["iteration", "split", "lm_loss", "lm_ppl", "source", "line"]
EVENT_COLUMNS = ["level", "message", *_ORIGIN]


@dataclass
class ParsedLog:
    """Everything read from one run's logs. DataFrames have the columns listed in this module's *_COLUMNS."""
    iterations: pd.DataFrame
    memory: pd.DataFrame
    timers: pd.DataFrame
    validation: pd.DataFrame
    events: pd.DataFrame
    partial_lines: pd.DataFrame
    arguments: dict = field(default_factory=dict)
    parallel: dict = field(default_factory=dict)
    sources: list = field(default_factory=list)
    formats: list = field(default_factory=list)
    restarts: int = 0

    def summary(self) -> dict:
        """Headline figures a person checks first; derived speed figures come from labkit.logs.derive."""
        from labkit.logs.derive import summarize
        return summarize(self)

    def to_json(self) -> dict:
        """The `labkit logs parse --json` object: tables as lists of rows, missing values as null."""
        return {
            "iterations": records(self.iterations),
            "memory": records(self.memory),
            "timers": records(self.timers),
            "validation": records(self.validation),
            "arguments": jsonable(self.arguments),
            "parallel": jsonable(self.parallel),
            "events": records(self.events),
            "partial_lines": records(self.partial_lines),
            "summary": jsonable(self.summary()),
        }


_CHECKPOINT_SAVED = re.compile(r"successfully saved checkpoint from iteration +(\d{1,18}(?!\d))")
_CHECKPOINT_LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d{1,18}(?!\d))")
_STOPPED_ON_SIGNAL = re.compile(r"exiting program after receiving (\S+?)\.")


def checkpoint_events(text: str) -> dict[str, int | str | None]:
    """What a Megatron log says of checkpoints: the iteration it resumed from (`loaded`), the last it saved
    (`saved`), and the signal it stopped on (`stopped_on`, with --exit-signal-handler); None for what it does not
    say."""
    def last(pattern: re.Pattern):
        found = pattern.findall(text)
        return found[-1] if found else None
    loaded, saved = last(_CHECKPOINT_LOADED), last(_CHECKPOINT_SAVED)
    return {"loaded": int(loaded) if loaded else None, "saved": int(saved) if saved else None,
            "stopped_on": last(_STOPPED_ON_SIGNAL)}


def records(df: pd.DataFrame) -> list[dict]:
    """DataFrame rows as JSON-ready dicts: NaN/NA become None, numpy scalars plain Python, timestamps ISO strings."""
    out = []
    columns = list(df.columns)
    for row in df.itertuples(index=False, name=None):
        out.append({c: _scalar(v) for c, v in zip(columns, row)})
    return out


def _scalar(v):
    if v is None or v is pd.NA or v is pd.NaT:
        return None
    if isinstance(v, (float, np.floating)):
        return None if not np.isfinite(v) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (pd.Timestamp,)):
        return v.isoformat()
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def jsonable(obj):
    """Nested dicts and lists made JSON-ready as `records` makes rows: NaN and infinities become None."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return _scalar(obj)


# ---------------------------------------------------------------------------------------------------------------------
# Entry points

def parse_log(paths, per_node: bool | None = None) -> ParsedLog:
    """Parse a log file, several files of one job (e.g. per-node `NODE.out`), or a run/job directory.

    A directory contributes every `*.out`, `*.err` and `*.log` file beneath it. With `per_node` (by default, when more
    than one file is read), each file's stem names the node its lines came from (unless a line's own launcher prefix
    names a host), except Slurm's `slurm-JOBID.out`.
    """
    files = _expand(paths)
    per_node = len(files) > 1 if per_node is None else per_node
    with _no_cyclic_gc():
        parts = []
        for path in files:
            node, last_iteration, tail_file, setup = _node_of(path) if per_node else None, None, None, True
            for data, first_line in _pieces(path):
                part = _scan(data, source=str(path), node=node, first_line=first_line,
                             last_iteration=last_iteration, setup=setup, tail_file=tail_file)
                last_iteration = part["last_iteration"] if part["last_iteration"] is not None else last_iteration
                tail_file = part["tail_file"]
                setup = setup and last_iteration is None
                parts.append(part)
                del data  # before the next piece is read
        return _combine(parts, sources=[str(p) for p in files])


_PIECE_BYTES = 64 << 20
"""A file larger than this is parsed a piece at a time, so memory follows the piece, not the file (a 1 GB log)."""


def _pieces(path: Path, size: int | None = None):
    """(bytes, number of its first line) for consecutive pieces of the file, each cut just before a line holding an
    interval line, so that the timer and memory lines printed after an iteration stay in its piece (else at a line
    break, with the last iteration handed on). A file of at most `size` bytes is one piece."""
    size = size or _PIECE_BYTES
    first_line, carry, pieces = 1, b"", 0
    with open(path, "rb") as f:
        while True:
            block = f.read(size)
            if not block:
                if carry or not pieces:
                    yield carry, first_line
                return
            data = carry + block if carry else block
            del carry, block
            cut = _cut(data, at_any_line=len(data) >= max(4 * size, 1 << 20)) if len(data) >= size else 0
            if cut <= 0:
                carry = data
                continue
            yield data[:cut], first_line
            pieces += 1
            first_line += data.count(b"\n", 0, cut)
            carry = data[cut:]
            del data


def _cut(data: bytes, at_any_line: bool) -> int:
    """Where to end a piece: the start of the last line holding an interval line; else, `at_any_line`, just past the
    last line break (0: no cut). Set-up lines come before the first interval line, so they stay in one piece unless
    they alone fill several."""
    found = data.rfind(b"iteration")
    while found >= 0:
        line = data.rfind(b"\n", 0, found) + 1
        end = data.find(b"\n", found)
        if line > 0 and _ITERATION.search(data, line, len(data) if end < 0 else end):
            return line
        found = data.rfind(b"iteration", 0, line)
    return data.rfind(b"\n") + 1 if at_any_line else 0


@contextlib.contextmanager
def _no_cyclic_gc():
    """The scan makes millions of small tuples and lists and no reference cycles; Python's cycle collector would
    re-walk them over and over (15% of the time on a 200 MB log)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _node_of(path: Path) -> str | None:
    """The node a per-node log belongs to (`n060.out` -> n060); Slurm's batch output `slurm-JOBID.out` has none."""
    return None if re.fullmatch(r"slurm-[\d_]+", path.stem) else path.stem


def parse_text(text: str | bytes, source: str = "<text>", node: str | None = None) -> ParsedLog:
    """Parse log text already in memory (tests, notebooks, a pasted excerpt)."""
    data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else bytes(text)
    with _no_cyclic_gc():
        return _combine([_scan(data, source=source, node=node)], sources=[source])


def _expand(paths) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            # A W&B directory in the run (train.wandb) holds W&B's copy of the console and its own debug logs, not
            # more of the job's output: reading them would count every line twice.
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".out", ".err", ".log")
                           and "wandb" not in f.relative_to(p).parts[:-1])
            if not found:
                raise FileNotFoundError(f"{p}: no *.out, *.err or *.log files in this directory")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such log file or directory")
    if not files:
        raise FileNotFoundError("no log files given")
    return files


# ---------------------------------------------------------------------------------------------------------------------
# One file

class _Columns:
    """Sparse column builder: rows are appended, each with only the fields its line printed."""

    def __init__(self):
        self.n = 0
        self.raw: dict[tuple[str, float], tuple[list, list]] = {}  # (column, scale) -> (row indices, raw bytes)
        self.obj: dict[str, list] = {}  # columns holding Python objects, one entry per row
        # Lines of one format share their keys: (raw keys) -> (column specs, row indices, value lists).
        self.layouts: dict[tuple, tuple[list, list, list]] = {}

    def add_fields(self, keys: tuple, values: list, spec_of) -> None:
        """A row's fields as raw keys and values; each layout's columns are found once, by spec_of(key)."""
        layout = self.layouts.get(keys)
        if layout is None:
            layout = self.layouts[keys] = ([spec_of(k) for k in keys], [], [])
        layout[1].append(self.n)
        layout[2].append(values)

    def add_raw(self, column: str, value: bytes, scale: float = 1.0):
        entry = self.raw.get((column, scale))
        if entry is None:
            entry = self.raw[(column, scale)] = ([], [])
        entry[0].append(self.n)
        entry[1].append(value)

    def frame(self, columns: list[str]) -> pd.DataFrame:
        data = dict(self.obj)
        for (name, scale), (rows, values) in self.raw.items():
            if name not in data:
                data[name] = np.full(self.n, np.nan)
            data[name][np.asarray(rows, dtype=np.int64)] = _floats(values) * scale
        for specs, rows, values in self.layouts.values():
            by_field = list(zip(*values))
            index = np.asarray(rows, dtype=np.int64)
            for spec, field_values in zip(specs, by_field):
                if spec is not None:
                    name, scale = spec
                    if name not in data:
                        data[name] = np.full(self.n, np.nan)
                    data[name][index] = _floats(field_values) * scale
        return _frame(data, self.n, columns)


def _floats(values) -> np.ndarray:
    try:
        return np.fromiter(map(float, values), dtype=np.float64, count=len(values))
    except ValueError:
        return np.array([_float(v) for v in values], dtype=np.float64)


def _number(v: bytes) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def _float(v: bytes) -> float:
    try:
        return float(v)
    except ValueError:
        return float("nan")


_TEXT_COLUMNS = {"source", "node", "phase", "style", "split", "level", "message", "text"}


def _frame(data: dict, n: int, columns: list[str]) -> pd.DataFrame:
    """One DataFrame from column lists: documented columns first (absent ones missing), extras after, integers Int64.

    `data` is consumed, each column dropped as soon as it is converted, and the frame keeps the converted arrays without
    copying them into blocks: a 1 GB log has millions of timer rows, and every copy of them counts.
    """
    out = {}
    for c in columns + sorted(c for c in data if c not in columns):
        values = data.pop(c, None)
        if values is None:
            values = [None] * n if c in _TEXT_COLUMNS else np.full(n, np.nan)
        if c in _INT_COLUMNS:
            values = _ints(values)
        elif c == "timestamp":
            values = pd.to_datetime(pd.Series(values, dtype=object), errors="coerce", format="mixed") \
                if any(v is not None for v in values) else pd.Series([pd.NaT] * n, dtype="datetime64[ns]")
        out[c] = values
    return pd.DataFrame(out, index=pd.RangeIndex(n), copy=False)


def _ints(values) -> pd.arrays.IntegerArray:
    arr = np.asarray(values, dtype=float) if not isinstance(values, pd.api.extensions.ExtensionArray) \
        else values.to_numpy(dtype=float, na_value=np.nan)
    missing = ~np.isfinite(arr) | (np.abs(arr) >= 2.0**62)
    return pd.arrays.IntegerArray(np.where(missing, 0, np.round(arr)).astype(np.int64), missing)


_WINDOW = 1 << 24
"""Bytes looked at in one step where a whole-file pass would need scratch memory the size of the file."""


def _newline_offsets(buf: bytes) -> np.ndarray:
    """Offsets of every line break, found one window at a time: one mask over a 1 GB log would take another GB."""
    view = np.frombuffer(buf, dtype=np.uint8)
    found = [np.flatnonzero(view[at:at + _WINDOW] == 10) + at for at in range(0, len(view), _WINDOW)]
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


class _Scan:
    """State while scanning one file. Positions are byte offsets into `buf`, which are the file's own."""

    def __init__(self, data: bytes, source: str, node: str | None, first_line: int = 1, tail_file: str | None = None):
        self.source = source
        self.file_node = node
        self.first_line = first_line
        # Complete lines only: bytes after the last newline are a line still being written (or a cut-off file).
        end = data.rfind(b"\n") + 1
        tail = data[end:]
        self.partial: list[tuple[int, str]] = []
        if tail.strip():
            self.partial.append((data.count(b"\n") + first_line, _text(tail)))
        body = data if end == len(data) else data[:end]  # large logs are not copied when nothing needs changing
        self.newlines = _newline_offsets(body)
        if b"\x1b" in body:
            # Blank out colour codes byte for byte, so offsets (and line numbers) stay those of the file.
            body = _ANSI.sub(lambda m: b" " * len(m.group()), body)
        if b"\r" in body:
            # A carriage return starts a new line on a terminal (progress bars); parse each piece as its own line.
            body = body.replace(b"\r", b"\n")
        self.buf = body
        # Line breaks of the buffer (carriage returns included), so that finding a position's line is a binary search.
        self.breaks = _newline_offsets(body) if b"\r" in data else self.newlines
        # `tail` headers (==> n060.out <==) name the file the lines below them came from; `tail_file`: the one the
        # previous piece ended in.
        self.headers = [(-1, tail_file)] if tail_file else []
        self.headers += [(m.start(), Path(_text(m.group(1)).strip()).stem) for m in _TAIL_HEADER.finditer(self.buf)]
        self.header_pos = [p for p, _ in self.headers]
        self.prefix_cache: dict[bytes, tuple] = {}
        self.formats: set[str] = set()

    # Positions and lines -------------------------------------------------------------------------------------------
    def line_no(self, pos: int) -> int:
        """1-based line number in the file of buffer offset `pos`."""
        return int(np.searchsorted(self.newlines, pos, side="left")) + self.first_line

    def line_nos(self, positions: list[int]) -> np.ndarray:
        return np.searchsorted(self.newlines, np.asarray(positions, dtype=np.int64), side="left") + self.first_line

    # A line break is looked for nearby first (most lines are short), else found by binary search, so that the cost
    # of finding a line does not grow with its length.
    def line_start(self, pos: int) -> int:
        near = self.buf.rfind(b"\n", max(0, pos - _MAX_PREFIX), pos)
        if near >= 0 or pos <= _MAX_PREFIX:
            return near + 1
        i = int(np.searchsorted(self.breaks, pos, side="left"))
        return int(self.breaks[i - 1]) + 1 if i else 0

    def line_end(self, pos: int) -> int:
        near = self.buf.find(b"\n", pos, pos + _MAX_PREFIX)
        if near >= 0:
            return near
        i = int(np.searchsorted(self.breaks, pos, side="left"))
        return int(self.breaks[i]) if i < len(self.breaks) else len(self.buf)

    def line_text(self, start: int) -> str:
        """The line starting at `start`, as reported (its first _MAX_TEXT bytes)."""
        return _text(self.buf[start:min(self.line_end(start), start + _MAX_TEXT)])

    def origin(self, prefix: bytes, pos: int) -> tuple:
        """(node, task, rank, local_rank, timestamp) for a record whose line starts with `prefix`."""
        stamp = None
        if b"[" in prefix and (m := _STAMP.search(prefix)):
            # Timestamps differ on every line; keep them out of the cache key.
            stamp = m.group(1).decode("ascii")
            prefix = prefix[:m.start()] + prefix[m.end():]
        info = self.prefix_cache.get(prefix)
        if info is None:
            info = _prefix_info(_text(prefix))
            if len(self.prefix_cache) < 100_000:
                self.prefix_cache[prefix] = info
        node, task, rank, local_rank, stamp_in_prefix = info
        stamp = stamp or stamp_in_prefix
        if node is None:
            node = self.header_node(pos) or self.file_node
        return node, task, rank, local_rank, stamp

    def header_node(self, pos: int) -> str | None:
        if not self.headers:
            return None
        i = bisect.bisect_right(self.header_pos, pos) - 1
        return self.headers[i][1] if i >= 0 else None


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _prefix_info(prefix: str) -> tuple:
    """Read launcher and logger prefixes: srun labels, pdsh hosts, torchrun roles, [Rank N], timestamps."""
    node = task = rank = local_rank = stamp = None
    for bracket, label, _other in _PREFIX_TOKEN.findall(prefix):
        if bracket:
            if m := _BRACKET_RANK.search(bracket):
                rank = int(m.group(1))
            elif m := _TIMESTAMP.search(bracket):
                stamp = m.group(0)
            elif m := _BRACKET_ROLE.fullmatch(bracket):
                local_rank = int(m.group(2))
        elif label:
            if label.isdigit() and len(label) <= 18:  # a longer number is damage (see the record patterns)
                task = int(label)
            elif _HOST.match(label) and stamp is None:
                node = label
    return node, task, rank, local_rank, stamp


def _scan(data: bytes, source: str, node: str | None, first_line: int = 1, last_iteration: int | None = None,
          setup: bool = True, tail_file: str | None = None) -> dict:
    """One file, or one piece of it: `first_line` numbers its first line; `last_iteration` and `tail_file` are the
    iteration and the `tail` header the pieces before it ended in (the lines at its start belong to them); `setup` says
    whether to read set-up lines (arguments, parallel sizes), which only the pieces before training starts hold."""
    s = _Scan(data, source, node, first_line, tail_file)
    event_hits = _start_event_scan(s.buf)
    try:
        iterations, iteration_pos, partial = _iterations(s)
        if last_iteration is not None:
            iteration_pos.insert(0, (-1, last_iteration))
        tables = {
            "iterations": iterations,
            "memory": _memory(s, iteration_pos, partial),
            "timers": _timers(s, iteration_pos),
            "validation": _validation(s, partial),
            "events": _events(s, event_hits()),
        }
    except BaseException:  # Ctrl-C (or a failure): a forked scanner stops with the parse, not later on its own
        event_hits(stop=True)
        raise
    partial.extend(s.partial)
    tables["partial_lines"] = _frame(
        {"source": [source] * len(partial), "line": [p[0] for p in partial], "text": [p[1] for p in partial]},
        len(partial), ["source", "line", "text"])
    # Set-up lines (arguments, sizes, parameters) come before training starts; later ones (a restart) repeat them.
    setup_end = iteration_pos[0][0] + _SETUP_MARGIN if iteration_pos else len(s.buf)
    arguments = _arguments(s, setup_end) if setup else {}
    parallel = _parallel(s, setup_end) if setup else {}
    return {"tables": tables, "arguments": arguments, "parallel": parallel, "formats": s.formats,
            "last_iteration": iteration_pos[-1][1] if iteration_pos else None,
            "tail_file": s.headers[-1][1] if s.headers else None}


_SETUP_MARGIN = 1 << 20  # bytes after the first interval line where other ranks' set-up lines may still appear


def _iterations(s: _Scan):
    cols = _Columns()
    iteration, train_iters, epoch, stamps, nodes, tasks, ranks, local_ranks, lines = ([] for _ in range(9))
    positions, partial = [], []
    buf = s.buf
    start = line_end = cut_line = -1
    for current, following in itertools.pairwise(itertools.chain(_ITERATION.finditer(buf), [None])):
        if current.start() > line_end:
            start, line_end = s.line_start(current.start()), s.line_end(current.start())
        # Another rank's interval line starting inside this one cuts this record off; that one is read next.
        spliced = following is not None and following.start() < line_end
        if not spliced and line_end - current.end() <= _MAX_RECORD:
            rest = buf[current.end():line_end]
            # Rank 0's memory report after the first iteration ("[Rank 0] (after 1 iterations) memory (MB) | ...")
            # can land on the line the last rank prints the iteration on, before its line break: the record ends
            # at the '|' before it (the memory line is read on its own).
            glued = rest.find(b"|[Rank ")
            if glued >= 0:
                rest = rest[:glued + 1]
            prefix = buf[max(start, current.start() - _MAX_PREFIX):current.start()]
            nemo = _NEMO_PREFIX.search(prefix) if b"Training epoch" in prefix else None
        if spliced or line_end - current.end() > _MAX_RECORD or (nemo is None and not rest.rstrip().endswith(b"|")):
            # Megatron's interval line always ends with '|': this one was cut off or broken by another rank's output.
            if start != cut_line:
                partial.append((s.line_no(start), s.line_text(start)))
                cut_line = start
            continue
        if _beyond_a_count(current.group(1), current.group(2)):
            # An iteration number no int64 column holds is damage: the line is reported, not read.
            if start != cut_line:
                partial.append((s.line_no(start), s.line_text(start)))
                cut_line = start
            continue
        it, n = int(current.group(1)), int(current.group(2))
        if nemo is not None:
            # NeMo counts from 0 (`iteration 28/99`); the numbers are kept as printed, with the epoch beside them.
            epoch.append(int(nemo.group(1)))
            prefix = prefix[:nemo.start()]
            s.formats.add("nemo")
        else:
            epoch.append(None)
        if rest.count(b":") == rest.count(b"|"):
            # The common case, `key: value |` throughout: keys and values alternate.
            parts = rest.replace(b":", b"|").split(b"|")
            cols.add_fields(tuple(parts[0:-1:2]), parts[1::2], _field)
        else:
            fields = [f.partition(b":") for f in rest.split(b"|")]
            if all(sep or not key.strip() for key, sep, _ in fields):
                cols.add_fields(tuple(f[0] for f in fields), [f[2] for f in fields], _field)
            else:
                _odd_fields(s, cols, rest)
        node, task, rank, local_rank, stamp = s.origin(prefix, start)
        iteration.append(it)
        train_iters.append(n)
        stamps.append(stamp)
        nodes.append(node)
        tasks.append(task)
        ranks.append(rank)
        local_ranks.append(local_rank)
        lines.append(start)
        positions.append((start, it))
        cols.n += 1
    for m in _GET_RESULT_TIME.finditer(buf):
        if _beyond_a_count(m.group(1)):
            partial.append((s.line_no(m.start() + 1), s.line_text(m.start() + 1)))
            continue
        cols.add_raw("elapsed_ms", m.group(2), 1000.0)
        iteration.append(int(m.group(1)))
        train_iters.append(None)
        epoch.append(None)
        stamps.append(None)
        nodes.append(s.file_node)
        tasks.append(None)
        ranks.append(None)
        local_ranks.append(None)
        lines.append(m.start() + 1)
        cols.n += 1
    if iteration:
        s.formats.add("megatron")
    cols.obj.update(iteration=iteration, train_iters=train_iters, epoch=epoch, timestamp=stamps,
                    source=[s.source] * cols.n, node=nodes, task=tasks, rank=ranks, local_rank=local_ranks,
                    line=s.line_nos(lines))
    return cols.frame(ITERATION_COLUMNS), positions, partial


def _beyond_a_count(*numbers: bytes) -> bool:
    """Whether a number printed as an iteration is longer than any count (what the int64 columns hold)."""
    return any(len(n) > _MAX_COUNT_DIGITS for n in numbers)


def _odd_fields(s: _Scan, cols: _Columns, rest: bytes) -> None:
    """Fields of the `key=value` forks and of 2020's colon-less lines, one by one."""
    for f in rest.split(b"|"):
        key, sep, value = f.partition(b":")
        if not sep:
            key, sep, value = f.partition(b"=")
            if not sep:
                # 2020 style, no colon: the value is the last word ("lm loss 5.023855E+00").
                parts = f.rsplit(None, 1)
                if len(parts) != 2:
                    continue
                key, value = parts
                s.formats.add("megatron-lm-2020")
            else:
                s.formats.add("key=value")
        spec = _field(key)
        if spec is not None:
            cols.add_raw(spec[0], value, spec[1])


_field_cache: dict[bytes, tuple | None] = {}


def _field(key: bytes):
    """Column and scale for a raw interval-line key, e.g. b' lm loss' -> ('lm_loss', 1.0); None to ignore it."""
    if key in _field_cache:
        return _field_cache[key]
    norm = _NOT_ALNUM.sub(b"", key.lower())
    spec = _FIELDS.get(norm)
    if spec is None and norm.endswith(b"loss") and len(norm) > 4:
        # Other losses a model prints (BERT's `sop loss`, MoE and MTP losses) keep their own column.
        spec = (_snake(key), 1.0)
    if len(_field_cache) < 10_000:
        _field_cache[key] = spec
    return spec


def _snake(key: bytes) -> str:
    return re.sub(r"[^a-z0-9]+", "_", _text(key).strip().lower()).strip("_")


def _last_iteration(positions: list[tuple[int, int]], pos: int):
    """The iteration of the last interval line printed before `pos` (None before the first)."""
    i = bisect.bisect_left(positions, (pos, -1)) - 1
    return positions[i][1] if i >= 0 else None


def _memory(s: _Scan, iteration_pos, partial: list) -> pd.DataFrame:
    cols = _Columns()
    its, origin, notes = [], [], {}
    buf = s.buf
    for m in _MEMORY.finditer(buf):
        start = s.line_start(m.start())
        head = buf[max(start, m.start() - _MAX_PREFIX):m.start()]
        rest = m.group(1)
        if len(rest) > _MAX_RECORD:
            partial.append((s.line_no(start), s.line_text(start)))
            continue
        parts = rest.replace(b":", b"|").split(b"|")
        keys, values = tuple(parts[0::2]), parts[1::2]
        after = _AFTER_ITERS.search(head)
        if rest.count(b":") != rest.count(b"|") + 1 or not all(v.strip() for v in values) \
                or (after and _beyond_a_count(after.group(1))):
            # A field without its value: the line was cut off; or an iteration no count reaches (damage, and not the
            # last iteration's either).
            partial.append((s.line_no(start), s.line_text(start)))
            continue
        cols.add_fields(keys, values, _memory_field)
        for j in _other_memory_fields(keys):
            # Beyond Megatron's four figures: another number, or a note such as labkit's CPU runs'
            # `measured as: cpu process resident memory`.
            if _number(values[j]):
                cols.add_raw(_snake(keys[j]) + "_mb", values[j])
            else:
                notes.setdefault(_snake(keys[j]), {})[cols.n] = _text(values[j]).strip()
        its.append(int(after.group(1)) if after else _last_iteration(iteration_pos, start))
        # The launcher prefix and `[Rank N]` come before "(after N iterations)", which changes every report.
        cut = head.find(b"after ")
        if cut > 0 and head[cut - 1:cut] == b"(":
            cut -= 1
        node, task, rank, local_rank, _ = s.origin(head[:cut] if cut >= 0 else head, start)
        origin.append((node, task, rank, local_rank, start))
        cols.n += 1
    for name, by_row in notes.items():
        cols.obj[name] = [by_row.get(i) for i in range(cols.n)]
    _set_origin(cols, s.source, origin)
    cols.obj["line"] = s.line_nos(cols.obj["line"])
    cols.obj["iteration"] = its
    return cols.frame(MEMORY_COLUMNS)


@functools.lru_cache(maxsize=1024)
def _memory_field(key: bytes):
    """Megatron's four memory figures (`cached` in 2020) -> (column, scale); None for anything else."""
    column = _MEMORY_FIELDS.get(_NOT_ALNUM.sub(b"", key.lower()))
    return (column, 1.0) if column else None


@functools.lru_cache(maxsize=1024)
def _other_memory_fields(keys: tuple) -> list[int]:
    return [j for j, key in enumerate(keys) if _memory_field(key) is None and key.strip()]


def _set_origin(cols: _Columns, source: str, origin: list[tuple]):
    cols.obj["source"] = [source] * cols.n
    for i, name in enumerate(("node", "task", "rank", "local_rank", "line")):
        cols.obj[name] = [o[i] for o in origin]


def _timers(s: _Scan, iteration_pos) -> pd.DataFrame:
    # (iteration, phase, ms, min_ms, max_ms, style, node, task, rank, local_rank, offset); times as raw bytes
    rows: list[tuple] = []
    buf = s.buf
    for m in _TIMER_LINE.finditer(buf):
        start = s.line_start(m.start())
        if len(m.group(1)) > _MAX_RECORD:
            continue
        prefix = buf[max(start, m.start() - _MAX_PREFIX):m.start()]
        node, task, rank, local_rank, _ = s.origin(prefix, start)
        it = _last_iteration(iteration_pos, start)
        if rank is not None and b"[Rank" in prefix:
            # DeepSpeed's engine prints its step timers before Megatron prints that step's interval line.
            it = (it or 0) + 1
        for f in m.group(1).split(b"|"):
            key, sep, value = f.partition(b":")
            if sep:
                rows.append((it, _text(key).strip(), value, b"nan", b"nan", "line", node, task, rank, local_rank,
                             start))
    minmax_headers: dict[bytes, list[tuple]] = {}
    header_line = -1
    for m in _TIMER_BLOCK.finditer(buf):
        start = s.line_start(m.start())
        if start == header_line:  # a block has one header line
            continue
        header_line = start
        header = buf[max(start, m.start() - _MAX_PREFIX):m.end()]
        if b"(min, max)" in header:
            style, cut = "minmax", header.find(b"(min, max)")
        elif b"times across" in header:
            style, cut = "all", header.find(b"times across")
        elif b"max time" in header:
            style, cut = "max", header.find(b"max time")
        else:
            continue
        prefix = header[:cut]
        origin = s.origin(prefix, start)
        it = _last_iteration(iteration_pos, start)
        if style == "minmax":
            minmax_headers.setdefault(prefix.rstrip(), []).append((start, it, origin))
        else:
            _timer_block_rest(s, s.line_end(m.end()), prefix, style, it, origin, rows)
    pieces = [_timer_columns(rows)]
    pieces += [_minmax_entries(s, prefix, blocks) for prefix, blocks in minmax_headers.items()]
    pieces = [piece for piece in pieces if len(piece["phase"])] or pieces[:1]
    data = {name: np.concatenate([piece[name] for piece in pieces]) if len(pieces) > 1 else pieces[0][name]
            for name in _TIMER_FIELDS}
    del pieces
    n = len(data["phase"])
    data["line"] = s.line_nos(data["line"])
    data["source"] = np.full(n, s.source, dtype=object)
    in_order = bool(np.all(np.diff(data["line"]) >= 0))
    timers = _frame(data, n, TIMER_COLUMNS)
    return timers if in_order else timers.sort_values("line", kind="stable", ignore_index=True)


_TIMER_FIELDS = ["iteration", "phase", "ms", "min_ms", "max_ms", "style", "node", "task", "rank", "local_rank", "line"]
_TIMER_DTYPES = {"iteration": float, "task": float, "rank": float, "local_rank": float, "line": np.int64,
                 "phase": object, "style": object, "node": object}


def _timer_columns(rows: list[tuple]) -> dict[str, np.ndarray]:
    """Timer rows (fields in _TIMER_FIELDS order, times as raw bytes) as column arrays."""
    columns = {}
    for i, name in enumerate(_TIMER_FIELDS):
        values = [r[i] for r in rows]
        columns[name] = _floats(values) if name.endswith("ms") else np.asarray(values, dtype=_TIMER_DTYPES[name])
    return columns


def _minmax_entries(s: _Scan, prefix: bytes, blocks: list[tuple]) -> dict[str, np.ndarray]:
    """Entries `    name ......: (min, max)` of the `(min, max) time across ranks` blocks of one launcher prefix.

    One scan reads the prefix's headers and entries in order; an entry belongs to the header before it, so blocks of
    several ranks interleaved line by line are told apart. Each entry's `line` is its header's.
    """
    pattern, buf = _minmax_pattern(prefix), s.buf
    codes: dict[bytes, int] = {}  # raw timer name -> its index in `codes`
    owners, name_codes, lows, highs = [], [], [], []
    block, last = 0, len(blocks) - 1
    start, end = s.line_end(blocks[0][0]), min(len(buf), blocks[-1][0] + _MAX_BLOCK_BYTES)
    # A window at a time, each turned into arrays at once: millions of entries held as bytes would take more memory
    # than the log. A window ends just past a line break, and the next starts on it, as every match starts with one.
    while start < end:
        cut = buf.find(b"\n", min(start + _WINDOW, end))
        stop = end if cut < 0 or cut >= end else cut + 1
        owner, code, lo, hi = [], [], [], []
        for header, raw, low, high in pattern.findall(buf, start, stop):
            if header:
                block = min(block + 1, last)
            else:
                owner.append(block)
                code.append(codes.setdefault(raw, len(codes)))
                lo.append(low)
                hi.append(high)
        owners.append(np.asarray(owner, dtype=np.int64))
        name_codes.append(np.asarray(code, dtype=np.int64))
        lows.append(_floats(lo))
        highs.append(_floats(hi))
        start = stop - 1 if stop < end else end
    owner = np.concatenate(owners)
    names = np.asarray([_text(raw).strip() for raw in codes], dtype=object)
    high = np.concatenate(highs)
    columns = {"phase": names[np.concatenate(name_codes)], "ms": high, "min_ms": np.concatenate(lows),
               "max_ms": high, "style": np.full(len(owner), "minmax", dtype=object)}
    per_block = {"iteration": [b[1] for b in blocks], "line": [b[0] for b in blocks],
                 **{name: [b[2][i] for b in blocks] for i, name in enumerate(("node", "task", "rank", "local_rank"))}}
    for name, values in per_block.items():
        columns[name] = np.asarray(values, dtype=_TIMER_DTYPES[name])[owner]
    return columns


_MAX_BLOCK_BYTES = 1 << 18


@functools.lru_cache(maxsize=256)
def _minmax_pattern(prefix: bytes) -> re.Pattern:
    """The `(min, max)` headers and timer entry lines of one launcher prefix, in one regex (header in group 1)."""
    head = re.escape(prefix) + rb" *" if prefix else rb""
    return re.compile(rb"\n" + head + rb"(?:(\(min, max\) time across ranks \(ms\):)|"
                      rb" {4}(\S+) \.*: \(([^,()\n]+), *([^,()\n]+)\)[ \t]*(?=\n))")


def _timer_block_rest(s: _Scan, pos: int, prefix: bytes, style: str, it, origin, rows: list) -> None:
    """`max` and per-rank (`times across ranks`) timer blocks line by line, skipping other ranks' lines in between."""
    node, task, rank, local_rank, _ = origin
    phase = None
    for start, body in _block_lines(s, pos, prefix):
        if style == "max" and (e := _TIMER_MAX.match(body)):
            rows.append((it, _text(e.group(1)), e.group(2), b"nan", e.group(2), style, node, task, rank, local_rank,
                         start))
        elif style == "all" and (e := _TIMER_ALL_RANK.match(body)) and phase is not None:
            rows.append((it, phase, e.group(2), b"nan", b"nan", style, node, task, int(e.group(1)), local_rank,
                         start))
        elif style == "all" and (e := _TIMER_ALL_NAME.match(body)):
            phase = _text(e.group(1))
        else:
            return


def _block_lines(s: _Scan, pos: int, prefix: bytes, max_foreign: int = 64):
    """Yield (offset, text after `prefix`) for the lines after a block header that carry the same prefix.

    Lines from other ranks (another prefix) interleaved into the block are skipped, up to `max_foreign` in a row.
    """
    buf = s.buf
    pos = s.line_end(pos) + 1
    foreign = 0
    while pos < len(buf):
        end = s.line_end(pos)
        line = buf[pos:min(end, pos + _MAX_RECORD + 1)]
        if len(line) <= _MAX_RECORD and line.startswith(prefix) and (prefix or not _LAUNCHER_PREFIX.match(line)):
            foreign = 0
            yield pos, line[len(prefix):]
        else:
            foreign += 1
            if foreign > max_foreign:
                return
        pos = end + 1


def _validation(s: _Scan, partial: list) -> pd.DataFrame:
    cols = _Columns()
    its, splits, lines = [], [], []
    for m in _VALIDATION.finditer(s.buf):
        if len(m.group(4)) > _MAX_RECORD or (m.group(1) and _beyond_a_count(m.group(1))):
            # Too long to be a record, or at an iteration no count reaches: reported, not read.
            start = s.line_start(m.start())
            partial.append((s.line_no(start), s.line_text(start)))
            continue
        for f in m.group(4).split(b"|"):
            key, sep, value = f.partition(b":")
            if not sep or not value.strip():
                continue
            name = _snake(key).replace("_value", "")
            name = {"lm_loss_ppl": "lm_ppl"}.get(name, name.replace("_loss_ppl", "_ppl"))
            cols.add_raw(name, value)
        # During training: "at iteration N"; at its end: "at iteration N on test set" or, before 2023,
        # "at the end of training for test data".
        its.append(int(m.group(1)) if m.group(1) else None)
        end_split = m.group(2) or m.group(3)
        splits.append(_text(end_split) if end_split else "valid")
        lines.append(s.line_start(m.start()))
        cols.n += 1
    cols.obj.update(iteration=its, split=splits, line=s.line_nos(lines), source=[s.source] * cols.n)
    return cols.frame(VALIDATION_COLUMNS)


def _event_hits(buf: bytes) -> list[int]:
    """Offsets of the event words, in order."""
    return sorted(m.start() for pattern in _EVENT_SCANS for m in pattern.finditer(buf))


# A log this large has its event-word scans (a fifth of the parse) run in a forked process while the rest is parsed.
_BACKGROUND_SCAN_BYTES = 16 << 20


def _start_event_scan(buf: bytes):
    """Start finding the event words; returns a function that gives their offsets when they are needed.

    The scans need only the bytes, so on a Linux machine with a spare CPU a forked child runs them (it shares the
    buffer without copying it and sends back a list of offsets). Forking is skipped in a process with other threads
    (a Jupyter kernel, say), where a child could inherit a lock some thread holds; there the scans run in line.
    """
    if len(buf) < _BACKGROUND_SCAN_BYTES or not _can_fork_a_scanner():
        hits = _event_hits(buf)
        return lambda stop=False: hits
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_event_hits, args=(buf, send), daemon=True)
    try:
        child.start()
    except OSError:  # no process to be had (a memory or process limit): scan here
        receive.close()
        send.close()
        hits = _event_hits(buf)
        return lambda stop=False: hits
    send.close()

    def collect(stop: bool = False) -> list[int]:
        """The offsets; with `stop` (the parse was interrupted), none, and the child is stopped unheard."""
        try:
            if stop:
                child.kill()
                return []
            return receive.recv()
        except EOFError:  # the child died without an answer: scan here instead
            return _event_hits(buf)
        finally:
            receive.close()
            child.join()
    return collect


def _can_fork_a_scanner() -> bool:
    spare_cpu = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) > 1
    return spare_cpu and threading.active_count() == 1


def _send_event_hits(buf: bytes, send) -> None:
    # Ctrl-C reaches the whole process group: the parent stops the parse (the command line reports it in one line)
    # and this daemon child goes with it, without a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    send.send(_event_hits(buf))
    send.close()


def _events(s: _Scan, hits: list[int]) -> pd.DataFrame:
    rows = []
    buf = s.buf
    end = -1
    for hit in hits:
        if hit < end:  # one event per line
            continue
        start, end = s.line_start(hit), s.line_end(hit)
        line = buf[start:end]
        level = "error" if _ERROR.search(line) else "warning"
        node, task, rank, local_rank, _ = s.origin(line[max(0, hit - start - _MAX_PREFIX):max(0, hit - start)], start)
        rows.append((level, _text(line[:_MAX_TEXT].strip())[:500], node, task, rank, local_rank, start))
    names = ["level", "message", "node", "task", "rank", "local_rank", "line"]
    data = {name: [r[i] for r in rows] for i, name in enumerate(names)}
    data["line"] = s.line_nos(data["line"])
    data["source"] = [s.source] * len(rows)
    return _frame(data, len(rows), EVENT_COLUMNS)


def _arguments(s: _Scan, end: int) -> dict:
    args: dict = {}
    buf = s.buf
    read_to = -1  # lines up to here belong to a block already read: a header among them starts nothing new
    for m in _ARGS_NEW.finditer(buf, 0, end):
        if m.start() < read_to:
            continue
        start = s.line_start(m.start())
        header = buf[start:s.line_end(start)]
        if b"end of arguments" in header:
            continue
        prefix = header[:header.find(b"-")]
        read_to = m.end()
        for n, (pos, body) in enumerate(_block_lines(s, m.end(), prefix)):
            read_to = pos
            if b"end of arguments" in body or _ARGS_NEW.search(body) or n > 5000:
                break  # a block ends at its end line, or where another block starts
            if e := _ARG_ENTRY.match(body):
                args.setdefault(_text(e.group(1)), _arg_value(_text(e.group(2))))
    if m := _PADDED_VOCAB.search(buf, 0, end):
        # Megatron pads the vocabulary after printing its arguments; FLOP counts use the padded size.
        args.setdefault("padded_vocab_size", int(m.group(3)))
    if m := _PARAMS_DTYPE.search(buf, 0, end):
        args.setdefault("params_dtype", _text(m.group(1)))
    old_headers = [m.end() for m in _ARGS_OLD.finditer(buf, 0, end)]
    if buf.startswith(b"arguments:"):
        old_headers.insert(0, 0)
    for header_end in old_headers:
        for _, body in _block_lines(s, header_end, b""):
            e = _ARG_ENTRY_INDENTED.match(body)
            if not e:
                break
            args.setdefault(_text(e.group(1)), _arg_value(_text(e.group(2))))
    return args


def _arg_value(text: str):
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        # An integer beyond int64 is no argument Megatron prints (a damaged line): kept as the text it is.
        return value if kind is float or abs(value) < 2**63 else text
    if text[:1] in "[({" and len(text) < 10_000:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    return text


def _parallel(s: _Scan, end: int) -> dict:
    out: dict = {}
    buf = s.buf
    for m in _WORLD.finditer(buf, 0, end):
        for name, value in _SIZE.findall(m.group(0)):
            key = _size_key(_text(name))
            if key:
                out.setdefault(key, int(value))
    for m in _TOPOLOGY.finditer(buf, 0, end):
        coords = _COORD.findall(m.group(0))
        if coords:
            pipe, data, model = (max(int(c[i]) for c in coords) + 1 for i in range(3))
            out.setdefault("pipeline", pipe)
            out.setdefault("data", data)
            out.setdefault("tensor", model)
            out.setdefault("world_size", len(coords))
    for m in _MICRO_BATCHES.finditer(buf, 0, end):
        out.setdefault("num_micro_batches", int(m.group(1)))
    for m in _VIRTUAL.finditer(buf, 0, end):
        value = _text(m.group(1))
        out.setdefault("virtual_stages", int(value) if value.isdigit() and len(value) <= 18 else None)
    params = {}
    for m in _PARAMS.finditer(buf, 0, end):
        t, p = (int(m.group(1)), int(m.group(2))) if m.group(1) else (int(m.group(3)), 0)
        params.setdefault(f"{t},{p}", int(m.group(4)))
    if params:
        out["parameters_per_rank"] = params
    for m in _JOB_INFO.finditer(buf, 0, end) if buf.find(b"_SIZE: ", 0, end) >= 0 else ():
        value = _text(m.group(2))
        count = value.isdigit() and len(value) <= 18  # a longer number is damage (see the record patterns)
        out.setdefault(job_info.PARALLEL[_text(m.group(1))], int(value) if count else value)
    return out


def _size_key(name: str) -> str | None:
    name = name.lower()
    if "encoder" in name or "sequence" in name:
        return None
    for suffix, key in (("world", "world_size"), ("data-parallel", "data"), ("tensor-model-parallel", "tensor"),
                        ("pipeline-model-parallel", "pipeline"), ("context-parallel", "context"),
                        ("expert-model-parallel", "expert"), ("model-parallel", "tensor")):
        if name.endswith(suffix):
            return key
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Several files into one ParsedLog

def _combine(parts: list[dict], sources: list[str]) -> ParsedLog:
    def cat(name):
        frames = [p["tables"][name] for p in parts]
        frames = [f for f in frames if len(f)] or frames[:1]
        return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]

    iterations, restarts = _one_row_per_iteration(cat("iterations"))
    arguments: dict = {}
    parallel: dict = {}
    formats: set = set()
    for p in parts:
        for k, v in p["arguments"].items():
            arguments.setdefault(k, v)
        for k, v in p["parallel"].items():
            parallel.setdefault(k, v)
        formats |= p["formats"]
    _fill_parallel(parallel, arguments)
    return ParsedLog(iterations=iterations, memory=cat("memory"), timers=cat("timers"),
                     validation=cat("validation"), events=cat("events"), partial_lines=cat("partial_lines"),
                     arguments=arguments, parallel=parallel, sources=sources, formats=sorted(formats),
                     restarts=restarts)


_ATTEMPT_DIR = re.compile(r"attempt-(\d{1,9})")


def _attempt_of(source: str) -> int:
    """A requeued job's later attempts log into JOBID/attempt-N/ beside the first one's files (labkit.jobs.record):
    N for a file there, 0 for any other."""
    found = _ATTEMPT_DIR.fullmatch(Path(source).parent.name)
    return int(found.group(1)) if found else 0


def _one_row_per_iteration(df: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Merge the rows several ranks print for one iteration; after a restart keep the re-run's rows. Restarts: each
    later attempt of a requeued job read (it may resume just after the iteration its predecessor saved, so its
    iterations need not go back), and each time a stream goes back to an iteration it already passed."""
    if df.empty:
        return df, 0
    codes, sources = pd.factorize(df["source"])
    attempt = np.array([_attempt_of(str(source)) for source in sources] + [0])[codes]  # (code -1: no source)
    later_attempts = len(set(attempt[attempt > 0].tolist()))
    it = df["iteration"].to_numpy(dtype=float, na_value=np.nan)
    if np.all(np.diff(it) > 0):
        return df, later_attempts
    stream = df.groupby(["source", "node", "task", "rank", "local_rank"], dropna=False, sort=False).ngroup()
    order = np.arange(len(df))
    # A stream that goes back to an iteration it already passed was restarted (e.g. resumed from a checkpoint).
    keys = stream.to_numpy()
    previous = pd.Series(it).groupby(keys).shift().to_numpy()
    back = pd.Series((it <= previous).astype(int))
    # A later attempt's rows win over an earlier one's, as a stream's rows after it went back win over those before.
    segment = back.groupby(keys).cumsum().to_numpy() + attempt * (len(df) + 1)
    restarts = int(back.sum()) + later_attempts
    work = df.assign(_segment=segment, _order=order)
    work = work.sort_values(["iteration", "_segment", "_order"], ascending=[True, False, True], kind="stable")
    if work["iteration"].duplicated().any():
        merged = work.groupby("iteration", sort=True, dropna=True).first().reset_index()
        merged = _frame({c: merged[c].to_numpy() if c not in _INT_COLUMNS else merged[c].array
                         for c in df.columns}, len(merged), ITERATION_COLUMNS)
    else:
        merged = work[df.columns].reset_index(drop=True)
    return merged, restarts


def _fill_parallel(parallel: dict, args: dict) -> None:
    """Complete parallel sizes from the arguments block and from each other."""
    from_args = {"world_size": "world_size", "data": "data_parallel_size", "tensor": "tensor_model_parallel_size",
                 "pipeline": "pipeline_model_parallel_size", "context": "context_parallel_size",
                 "expert": "expert_model_parallel_size", "virtual_stages": "virtual_pipeline_model_parallel_size"}
    for key, arg in from_args.items():
        if parallel.get(key) is None and isinstance(args.get(arg), int):
            parallel[key] = args[arg]
    if "tensor" not in parallel and isinstance(args.get("model_parallel_size"), int):
        parallel["tensor"] = args["model_parallel_size"]
    world, t, p, c = (parallel.get(k) for k in ("world_size", "tensor", "pipeline", "context"))
    if world and t and parallel.get("data") is None:
        with contextlib.suppress(sizes.SizeError):  # sizes that do not divide the world leave the data size unknown
            parallel["data"] = sizes.data_parallel_size(world, t, c or 1, p or 1)
    if world and t:
        parallel.setdefault("pipeline", 1)
    gbs, mbs, d = args.get("global_batch_size"), args.get("micro_batch_size"), parallel.get("data")
    if "num_micro_batches" not in parallel and isinstance(gbs, int) and isinstance(mbs, int) and d:
        parallel["num_micro_batches"] = gbs // (mbs * d)


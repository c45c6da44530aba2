"""Run records: one directory per submission under runs/, and an SQLite index of them.

runs/<run-id>/
  spec.yaml       the resolved run spec (written once, before submission)
  job.sbatch ...  the rendered script(s) (written once)
  job.json        backend, layout, scheduler job ids, submission time (written once, after submission)
  events.jsonl    every state change, and how each attempt of a requeued job ended, appended
  status.json     the latest state and its cause (a convenience copy of the last event)
  metrics.json    the parsed iteration table, once the job has ended
  logs/           slurm-JOBID.out and JOBID/NODE.out|err|gpu (a requeued job's later attempts: JOBID/attempt-N/)
runs/index.sqlite one row per run, for `labkit runs`

Append-only: a new run never reuses a directory, and a record is readable at every point of its life (an interrupted
run keeps its spec, script and logs; its last event says how far it got). A run directory is put together under a
hidden draft name (.STEM.HOST-PID-START-THREAD.draft) and renamed into place holding its spec and CREATED event, so
that no run is ever seen half made; a draft whose creator died is removed by the next run created on its host. Every
file is written whole and synced (the file, then its directory) before the next step, and events.jsonl is the truth:
status.json and the index are copies of it that a reader can do without, and the index can be rebuilt from the run
directories (a damaged one too). A record only stores what it is given (a spec, scripts, states, causes, metrics);
labkit.jobs.job decides what to store.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import os
import shutil
import socket
import re
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path

from labkit.paths import runs_dir
from labkit.spec import RunSpec, load_spec

UNFINISHED_STATES = frozenset({"CREATED", "SUBMITTED", "PENDING", "RUNNING"})
"""Recorded states a run can still leave: the dashboard refreshes such runs and `labkit runs` polls their jobs."""
STATUS_KEYS = ("state", "exit_code", "reason", "cause")
"""What a state change's event (and status.json) holds besides its time."""


def _now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "run"


class RecordError(RuntimeError):
    """A run record could not be written or read (a read-only or full runs directory); the message names where."""
    damaged = False
    """True when the index is damaged (not an SQLite file, or a malformed one), rather than unwritable."""


def unwritable(exc: BaseException) -> bool:
    """Whether `exc` says the run records could not be written (a full disk, a read-only runs directory), which a
    reader can do without: it then reads the records as they are and records nothing."""
    return isinstance(exc, RecordError) and not exc.damaged


@contextmanager
def _storing(where: Path):
    """Turn a failure to write under `where` (EROFS, ENOSPC, EACCES, a locked or unwritable index) into RecordError."""
    try:
        yield
    except (OSError, sqlite3.Error) as exc:
        if isinstance(exc, FileExistsError):
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RecordError(f"cannot write the run records in {where}: {reason}") from exc


def _sync_dir(path: Path) -> None:
    """Make a new or renamed entry of `path` durable (its own fsync covers only a file's contents)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp(path: Path) -> Path:
    """A temporary name beside `path`, this writer's own (pollers in several processes and threads write at once)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")


def _write_synced(path: Path, data: bytes, flags: int) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


class RunRecord:
    def __init__(self, path: Path, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        """A view of a record this process cannot write (a read-only runs directory): the states it is told stay in
        memory, nothing is written."""

    # --- creation ------------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, spec: RunSpec, root: str | os.PathLike | None = None) -> "RunRecord":
        """A new run directory holding the spec and a CREATED event, then its index row. The directory is made under
        a draft name and renamed into place whole, so that every run directory holds a readable spec and its
        creation, whatever stops labkit meanwhile (a kill, a full disk); a draft that could not be completed is
        removed again."""
        root = runs_dir(root)
        with _storing(root):
            root.mkdir(parents=True, exist_ok=True)
        _remove_dead_drafts(root)
        stem = f"{dt.datetime.now():%Y%m%d-%H%M%S}-{_slug(spec.name)}"
        me = _this_process()
        draft = cls(root / f".{stem}.{me['host']}-{me['pid']}-{me['started']}-{threading.get_ident()}.draft")
        try:
            with _storing(root):
                draft.path.mkdir()
                draft.logs.mkdir()
                # The spec is written under a temporary name and renamed, so spec.yaml is never a partial file.
                _write_synced(_tmp(draft.path / "spec.yaml"), spec.to_yaml().encode(),
                              os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                os.rename(_tmp(draft.path / "spec.yaml"), draft.path / "spec.yaml")
                created = draft._append_event({"state": "CREATED", **me})
                _sync_dir(draft.path)
            for attempt in range(1, 1000):
                path = root / (stem if attempt == 1 else f"{stem}-{attempt}")
                try:
                    os.rename(draft.path, path)  # refused onto another run's directory, which is never empty
                except OSError as exc:
                    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                        continue
                    with _storing(root):
                        raise
                with _storing(root):
                    _sync_dir(root)
                record = cls(path)
                try:
                    RunIndex(root).add(record, spec.name, created)
                except RecordError as exc:
                    # The run is whole but labkit stops here (a full disk): its record says why, if a line fits,
                    # rather than read later as abandoned by a labkit that stopped.
                    with contextlib.suppress(RecordError):
                        record._append_event({"state": "FAILED", "cause": f"not started: {exc}"})
                    raise
                return record
        except BaseException:
            if draft.path.exists():
                shutil.rmtree(draft.path, ignore_errors=True)
            raise
        shutil.rmtree(draft.path, ignore_errors=True)
        raise RecordError(f"could not create a new run directory under {root}")

    def _write_once(self, name: str, text: str, mode: int = 0o644) -> Path:
        """A file written whole or not at all, never overwritten: a temporary file synced, then linked to its name
        (os.link fails if the name exists, where a rename would replace it)."""
        path = self.path / name
        if self.read_only:
            return path
        tmp = _tmp(path)
        with _storing(self.path):
            try:
                _write_synced(tmp, text.encode(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.chmod(tmp, mode)
                os.link(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            _sync_dir(self.path)
        return path

    def write_script(self, name: str, text: str) -> Path:
        return self._write_once(name, text, 0o755)

    def reserve_log(self, name: str, size: int) -> Path:
        """A new file under logs/ of `size` blank bytes, synced: a process later overwrites it in place, which needs no
        new space (it still works on a disk that has filled up meanwhile)."""
        path = self.logs / name
        with _storing(self.path):
            _write_synced(path, b" " * (size - 1) + b"\n", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        return path

    @contextmanager
    def new_log(self, name: str):
        """A new file under logs/ for a process's output, open for writing."""
        with _storing(self.path):
            f = open(self.logs / name, "x")
        with f:
            yield f

    def attach(self, backend: str, layout: str, job_ids: list[str], **extra) -> None:
        info = {"backend": backend, "layout": layout, "job_ids": job_ids, "submitted": _now(), **extra}
        self._write_once("job.json", json.dumps(info, indent=2) + "\n")
        time = self._append_event({"state": "SUBMITTED", "job_ids": job_ids})
        RunIndex(self.root).update(self.run_id, backend=backend, layout=layout, job_ids=",".join(job_ids),
                                   state="SUBMITTED", updated=time)

    # --- reading -------------------------------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def spec(self) -> RunSpec:
        return load_spec(self.path / "spec.yaml")

    @property
    def job_info(self) -> dict:
        path = self.path / "job.json"
        return json.loads(path.read_text()) if path.exists() else {}

    @property
    def scripts(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir() if p.suffix in (".sbatch", ".sh"))

    def events(self) -> list[dict]:
        """Every event recorded; a line cut short by an interruption is skipped, the lines after it are kept."""
        path = self.path / "events.jsonl"
        if not path.exists():
            return []
        events = []
        for line in path.read_bytes().decode(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                events.append(event)
        return events

    def last_status(self) -> dict:
        events = [e for e in self.events() if "state" in e]
        return events[-1] if events else {}

    def attempts(self) -> list[dict]:
        """How each ended attempt of a requeued job ended, oldest first (see add_attempt)."""
        return [e for e in self.events() if "attempt" in e and "state" not in e]

    def add_attempt(self, number: int, outcome: str, exit_code: str | None, reason: str | None, cause: str,
                    logs: str, saved_iteration: int | None = None, stopped_on: str | None = None) -> None:
        """Record that attempt `number` ended (Slurm requeued the job): its outcome, cause and log directory, the
        iteration of the last checkpoint it saved (where the next attempt resumes) and the signal it stopped on."""
        self._append_event({"attempt": number, "outcome": outcome, "exit_code": exit_code, "reason": reason,
                            "cause": cause, "logs": logs, "saved_iteration": saved_iteration,
                            "stopped_on": stopped_on})

    def metrics(self) -> dict | None:
        path = self.path / "metrics.json"
        return json.loads(path.read_text()) if path.exists() else None

    def has_metrics(self) -> bool:
        """Whether metrics.json was written (without reading what may be a long iteration table)."""
        return (self.path / "metrics.json").exists()

    # --- updates -------------------------------------------------------------------------------------------------
    def _append_event(self, event: dict) -> str:
        """One whole line per event, in one write to a file opened for appending, so that events of several
        processes never interleave; after a line cut short (a crash mid-write), the event starts a line of its own."""
        time = _now()
        if self.read_only:
            return time
        line = (json.dumps({"time": time, **event}, default=str) + "\n").encode()
        with _storing(self.path):
            fd = os.open(self.path / "events.jsonl", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = b"\n" + line
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        return time

    def abandoned(self) -> bool:
        """A CREATED run without job.json whose creating process, on this host, is gone: labkit stopped between
        creating the run and recording its job. Such a job starts nothing (a Slurm job waits for job.json, a local one
        for labkit's go-ahead), so the run will never leave CREATED by itself."""
        creation = next((e for e in self.events() if e.get("state") == "CREATED"), None)
        if self.job_info:
            return False
        if creation is None:  # made in place by an older labkit, which stopped before it recorded the creation
            return True
        if creation.get("host") != socket.gethostname() or not creation.get("pid"):
            return False
        return _process_started(creation["pid"]) != creation.get("started")

    def settle_abandoned(self) -> bool:
        """Record an abandoned run (see `abandoned`) as FAILED, saying why; True if it was one."""
        if self.last_status().get("state", "CREATED") != "CREATED" or not self.abandoned():
            return False
        self.set_status("FAILED", cause=ABANDONED)
        creator = next((e.get("pid") for e in self.events() if e.get("state") == "CREATED"), None)
        for leftover in self.path.glob(f".*.{creator}-*.tmp") if creator else ():
            leftover.unlink(missing_ok=True)  # a file the killed labkit was writing (a script, job.json)
        return True

    def set_status(self, state, exit_code: str | None = None, reason: str | None = None,
                   cause: str | None = None) -> None:
        """Append a state change to events.jsonl, and make it status.json and the index's row."""
        event = dict(zip(STATUS_KEYS, (str(state), exit_code, reason, cause)))
        last = {"time": self._append_event(event), **event}
        if not self.read_only:
            self._copy_last(last)

    def settle_copies(self) -> None:
        """Copy the last event into status.json and the index's row again where a write that failed halfway (a full
        disk took the event, not its copies) left them behind it."""
        if self.read_only:
            return
        last = {key: self.last_status().get(key) for key in ("time", *STATUS_KEYS)}
        if last["state"] in (None, "CREATED"):  # a run's creation writes no status.json
            return
        try:
            copied = json.loads((self.path / "status.json").read_text())
        except (OSError, ValueError):
            copied = None
        if not isinstance(copied, dict) or {key: copied.get(key) for key in last} != last:
            self._copy_last(last)

    def _copy_last(self, last: dict) -> None:
        """Make `last` (the last event) status.json and the index's row. Pollers in several processes record states
        at once: each copies the last event, then copies again when another was appended meanwhile, so that the copy
        written last is of the last event."""
        while True:
            tmp = _tmp(self.path / "status.json")
            with _storing(self.path):
                try:
                    _write_synced(tmp, (json.dumps(last, indent=2) + "\n").encode(),
                                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.replace(tmp, self.path / "status.json")
                finally:
                    tmp.unlink(missing_ok=True)
                _sync_dir(self.path)
            RunIndex(self.root).update(self.run_id, state=last["state"], cause=last["cause"], updated=last["time"])
            latest = self.last_status()
            if latest.get("time") == last["time"] and latest.get("state") == last["state"]:
                return
            last = {"time": latest.get("time"), **{key: latest.get(key) for key in STATUS_KEYS}}

    def save_metrics(self, metrics: dict) -> None:
        """metrics.json, written once: the first end recorded stands."""
        try:
            self._write_once("metrics.json", json.dumps(metrics, indent=2) + "\n")
        except FileExistsError:
            pass

    def __repr__(self) -> str:
        return f"RunRecord({self.path})"


ABANDONED = ("labkit stopped after creating this run and before recording its job; that job started nothing (it "
             "waits for job.json)")


def _remove_dead_drafts(root: Path) -> None:
    """Remove the drafts of run directories (see RunRecord.create) whose creating process on this host is gone: it
    was killed while making one, before any job of it could start."""
    for draft in root.glob(".*.draft"):
        owner = _DRAFT.fullmatch(draft.name)
        if owner and owner["host"] == socket.gethostname() \
                and str(_process_started(int(owner["pid"]))) != owner["started"]:
            shutil.rmtree(draft, ignore_errors=True)


_DRAFT = re.compile(r"\.[^.]*\.(?P<host>.+)-(?P<pid>\d+)-(?P<started>\w+)-\d+\.draft")
"""A draft's name: .STEM.HOST-PID-START-THREAD.draft (the stem holds no dot)."""


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite refused a file as no database or a malformed one (not: locked, read-only, full)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT) if code is not None \
        else type(exc) is sqlite3.DatabaseError


def _this_process() -> dict:
    """Who creates a run: host, pid and the pid's start time (so that a reused pid is not taken for it)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_started(os.getpid())}


def _process_started(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None when it is gone or on a
    system without /proc."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    return stat.rpartition(")")[2].split()[19]


def load_run(run: str | os.PathLike, root: str | os.PathLike | None = None) -> RunRecord:
    """A run by directory, by id under the runs dir, or by a unique id prefix."""
    path = Path(run)
    if (path / "spec.yaml").exists():
        return RunRecord(path)
    base = runs_dir(root)
    if (base / str(run) / "spec.yaml").exists():
        return RunRecord(base / str(run))
    matches = sorted(p for p in base.glob(f"{run}*") if (p / "spec.yaml").exists()) if base.is_dir() else []
    if len(matches) == 1:
        return RunRecord(matches[0])
    if not matches:
        raise FileNotFoundError(f"no run {str(run)!r} under {base}")
    raise FileNotFoundError(f"{str(run)!r} matches several runs: {', '.join(p.name for p in matches)}")


class RunIndex:
    """runs/index.sqlite: one row per run. It is a cache of the run directories and can be rebuilt from them."""
    COLUMNS = ("run_id", "name", "backend", "layout", "job_ids", "state", "cause", "created", "updated")

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = runs_dir(root)
        self.path = self.root / "index.sqlite"

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, timeout=30)
        con.execute("CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, name TEXT, backend TEXT, layout TEXT, "
                    "job_ids TEXT, state TEXT, cause TEXT, created TEXT, updated TEXT)")
        return con

    def _execute(self, sql: str, values: tuple = ()) -> list[tuple]:
        with _storing(self.root), self._intact():
            con = self._connect()
            try:
                with con:
                    return con.execute(sql, values).fetchall()
            finally:
                con.close()

    @contextmanager
    def _intact(self):
        """A damaged index (not an SQLite file, or a malformed one) is an error that says how to rebuild it."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if not _damaged(exc):
                raise
            error = RecordError(f"the run index {self.path} is damaged ({exc}); `labkit runs --rebuild` rebuilds it "
                                "from the run directories")
            error.damaged = True
            raise error from exc

    def writable(self) -> bool:
        """Whether this process can write the runs directory and its index (not on a read-only one); a directory yet
        to be made counts as writable."""
        if not self.root.is_dir():
            return True
        return os.access(self.root, os.W_OK) and (not self.path.exists() or os.access(self.path, os.W_OK))

    def damaged(self) -> bool:
        """Whether the index file exists and is not a readable SQLite database."""
        try:
            self._read_only_rows()
        except RecordError as exc:
            return isinstance(exc.__cause__, sqlite3.DatabaseError) and _damaged(exc.__cause__)
        return False

    def _read_only_rows(self) -> list[tuple]:
        con = None
        with _storing(self.root), self._intact():
            try:
                con = sqlite3.connect(f"{self.path.absolute().as_uri()}?mode=ro", uri=True, timeout=30)
                return con.execute(f"SELECT {', '.join(self.COLUMNS)} FROM runs ORDER BY created, run_id").fetchall()
            finally:
                if con is not None:
                    con.close()

    def add(self, record: RunRecord, name: str, created: str | None = None) -> None:
        created = created or _now()
        self._execute("INSERT OR IGNORE INTO runs (run_id, name, state, created, updated) VALUES (?, ?, ?, ?, ?)",
                      (record.run_id, name, "CREATED", created, created))

    def update(self, run_id: str, **fields) -> None:
        fields = {k: v for k, v in fields.items() if k in self.COLUMNS and (v is not None or k == "cause")}
        fields.setdefault("updated", _now())
        self._execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in fields)} WHERE run_id = ?",
                      (*fields.values(), run_id))

    def exists(self) -> bool:
        return self.path.exists()

    def rows(self, read_only: bool = False) -> list[dict]:
        """Every run's row, oldest first. In a read-only runs directory (or with `read_only`, for a reader that found it
        cannot write: a full disk) the index is only read, and without one, or with a damaged one, the rows are read
        from the run directories; a writable index that cannot be written is read the same way."""
        if not self.root.is_dir():
            return []
        if read_only or not self.writable():
            return self._rows_as_they_are()
        try:
            found = self._execute(f"SELECT {', '.join(self.COLUMNS)} FROM runs ORDER BY created, run_id")
        except RecordError as exc:
            if exc.damaged:
                raise
            return self._rows_as_they_are()  # e.g. a full disk that leaves no room to make the index
        return [dict(zip(self.COLUMNS, row)) for row in found]

    def _rows_as_they_are(self) -> list[dict]:
        """The rows without writing anything: the index opened read-only, or the run directories' own files."""
        if self.exists():
            try:
                return [dict(zip(self.COLUMNS, row)) for row in self._read_only_rows()]
            except RecordError as exc:
                if not exc.damaged:
                    raise
        rows = [self.row_of(RunRecord(path, read_only=True)) for path in self.run_dirs()]
        return sorted(rows, key=lambda row: (row["created"] or "", row["run_id"]))

    def run_dirs(self) -> list[Path]:
        """The run directories under the root (those holding a spec; not the hidden drafts of runs being made)."""
        return sorted(p for p in self.root.iterdir() if not p.name.startswith(".") and (p / "spec.yaml").exists()) \
            if self.root.is_dir() else []

    def rebuild(self) -> int:
        """Re-read every run directory into the index (after the index was deleted or copied without it): the row
        of each run as its own files have it, with the times of its first and last events. A damaged index is kept
        beside it as index.sqlite.damaged and replaced."""
        if self.damaged():
            with _storing(self.root):
                os.replace(self.path, self.path.with_name(self.path.name + ".damaged"))
        count = 0
        for path in self.run_dirs():
            self.restore(RunRecord(path))
            count += 1
        return count

    def catch_up(self) -> None:
        """Rows for the run directories a crash left out of the index or behind their own files (no job ids yet, a
        state not finished): the index is a cache of the directories."""
        rows = {row["run_id"]: row for row in self.rows()}
        for path in self.run_dirs():
            row = rows.get(path.name)
            if row is None or row["state"] in UNFINISHED_STATES or not row["backend"]:
                self.restore(RunRecord(path))

    def restore(self, record: RunRecord) -> None:
        """Make the row of `record` what its files say (its job.json and its last recorded state), and its
        status.json a copy of that state again."""
        row = self.row_of(record)
        self.add(record, row["name"], row["created"])
        self.update(record.run_id, **{k: v for k, v in row.items() if k not in ("run_id", "name", "created")})
        record.settle_copies()

    @staticmethod
    def row_of(record: RunRecord) -> dict:
        """The row of `record` as its files have it: its name, job.json, last recorded state, and the times of its
        first and last events (a run without events is dated by its spec, not by the time it is read)."""
        name = re.search(r"^name: (.*)$", (record.path / "spec.yaml").read_text(errors="replace"), re.M)
        events = record.events()
        made = dt.datetime.fromtimestamp((record.path / "spec.yaml").stat().st_mtime).astimezone()
        created = events[0].get("time") if events else made.isoformat(timespec="seconds")
        info, last = record.job_info, record.last_status()
        return {"run_id": record.run_id, "name": name.group(1).strip().strip("'\"") if name else record.run_id,
                "backend": info.get("backend"), "layout": info.get("layout"),
                "job_ids": ",".join(info.get("job_ids", [])) or None, "state": last.get("state", "CREATED"),
                "cause": last.get("cause"), "created": created,
                "updated": events[-1].get("time") if events else created}

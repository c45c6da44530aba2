"""Run records: one directory per submission under runs/, and an SQLite index of them.

runs/<run-id>/
  spec.yaml       the resolved run spec (written once, before submission)
  job.sbatch ...  the rendered script(s) (written once)
  job.json        backend, layout, scheduler job ids, submission time (written once, after submission)
  events.jsonl    every state change, appended
  status.json     the latest state and its cause (a convenience copy of the last event)
  metrics.json    the parsed iteration table, once the job has ended
  logs/           slurm-JOBID.out and JOBID/NODE.out|err|gpu
runs/index.sqlite one row per run, for `labkit runs`

Append-only: a new run never reuses a directory, and a record is readable at every point of its life (an interrupted
run keeps its spec, script and logs; its last event says how far it got). A record only stores what it is given (a
spec, scripts, states, causes, metrics); labkit.jobs.job decides what to store.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import sqlite3
from pathlib import Path

from labkit.paths import runs_dir
from labkit.spec import RunSpec, load_spec


def _now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "run"


class RunRecord:
    def __init__(self, path: Path):
        self.path = Path(path)

    # --- creation ------------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, spec: RunSpec, root: str | os.PathLike | None = None) -> "RunRecord":
        root = runs_dir(root)
        root.mkdir(parents=True, exist_ok=True)
        stem = f"{dt.datetime.now():%Y%m%d-%H%M%S}-{_slug(spec.name)}"
        for attempt in range(1, 1000):
            path = root / (stem if attempt == 1 else f"{stem}-{attempt}")
            try:
                path.mkdir()
            except FileExistsError:
                continue
            record = cls(path)
            record.logs.mkdir()
            record._write_once("spec.yaml", spec.to_yaml())
            record._append_event({"state": "CREATED"})
            RunIndex(root).add(record, spec.name)
            return record
        raise RuntimeError(f"could not create a new run directory under {root}")

    def _write_once(self, name: str, text: str, mode: int = 0o644) -> Path:
        path = self.path / name
        with open(path, "x") as f:  # never overwrite
            f.write(text)
        path.chmod(mode)
        return path

    def write_script(self, name: str, text: str) -> Path:
        return self._write_once(name, text, 0o755)

    def attach(self, backend: str, layout: str, job_ids: list[str], **extra) -> None:
        info = {"backend": backend, "layout": layout, "job_ids": job_ids, "submitted": _now(), **extra}
        self._write_once("job.json", json.dumps(info, indent=2) + "\n")
        self._append_event({"state": "SUBMITTED", "job_ids": job_ids})
        RunIndex(self.root).update(self.run_id, backend=backend, layout=layout, job_ids=",".join(job_ids),
                                   state="SUBMITTED")

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
        path = self.path / "events.jsonl"
        if not path.exists():
            return []
        events = []
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by an interruption
                continue
        return events

    def last_status(self) -> dict:
        events = [e for e in self.events() if "state" in e]
        return events[-1] if events else {}

    def metrics(self) -> dict | None:
        path = self.path / "metrics.json"
        return json.loads(path.read_text()) if path.exists() else None

    # --- updates -------------------------------------------------------------------------------------------------
    def _append_event(self, event: dict) -> None:
        line = json.dumps({"time": _now(), **event})
        with open(self.path / "events.jsonl", "a") as f:
            f.write(line + "\n")

    def set_status(self, state, exit_code: str | None = None, reason: str | None = None,
                   cause: str | None = None) -> None:
        """Append a state change to events.jsonl, and make it status.json and the index's row."""
        event = {"state": str(state), "exit_code": exit_code, "reason": reason, "cause": cause}
        self._append_event(event)
        tmp = self.path / ".status.json.tmp"
        tmp.write_text(json.dumps({"time": _now(), **event}, indent=2) + "\n")
        os.replace(tmp, self.path / "status.json")
        RunIndex(self.root).update(self.run_id, state=str(state), cause=cause)

    def save_metrics(self, metrics: dict) -> None:
        """metrics.json, written once: the first end recorded stands."""
        try:
            self._write_once("metrics.json", json.dumps(metrics, indent=2) + "\n")
        except FileExistsError:
            pass

    def __repr__(self) -> str:
        return f"RunRecord({self.path})"


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

    def add(self, record: RunRecord, name: str) -> None:
        with self._connect() as con:
            con.execute("INSERT OR IGNORE INTO runs (run_id, name, state, created, updated) VALUES (?, ?, ?, ?, ?)",
                        (record.run_id, name, "CREATED", _now(), _now()))

    def update(self, run_id: str, **fields) -> None:
        fields = {k: v for k, v in fields.items() if k in self.COLUMNS and (v is not None or k == "cause")}
        fields["updated"] = _now()
        with self._connect() as con:
            con.execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in fields)} WHERE run_id = ?",
                        (*fields.values(), run_id))

    def rows(self) -> list[dict]:
        if not self.root.is_dir():
            return []
        with self._connect() as con:
            cursor = con.execute(f"SELECT {', '.join(self.COLUMNS)} FROM runs ORDER BY created, run_id")
            return [dict(zip(self.COLUMNS, row)) for row in cursor]

    def rebuild(self) -> int:
        """Re-read every run directory into the index (after the index was deleted or copied without it)."""
        count = 0
        for path in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if not (path / "spec.yaml").exists():
                continue
            record = RunRecord(path)
            name = re.search(r"^name: (.*)$", (path / "spec.yaml").read_text(), re.M)
            self.add(record, name.group(1) if name else record.run_id)
            info, last = record.job_info, record.last_status()
            self.update(record.run_id, backend=info.get("backend"), layout=info.get("layout"),
                        job_ids=",".join(info.get("job_ids", [])) or None, state=last.get("state"),
                        cause=last.get("cause"))
            count += 1
        return count

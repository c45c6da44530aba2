"""`labkit run`, `labkit status`, `labkit cancel`, `labkit runs`."""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from labkit.spec.errors import print_spec_errors
from labkit.spec import SpecError


def register(sub) -> None:
    p = sub.add_parser("run", help="submit a run spec to Slurm or run it here (--dry-run prints the job script)")
    p.add_argument("spec", help="YAML or JSON run spec")
    p.add_argument("--backend", choices=("local", "slurm", "k8s"),
                   help="default: slurm where sbatch exists, else local; k8s: a Kubeflow TrainJob (or PyTorchJob: "
                        "job.k8s.kind), applied with kubectl to its current context")
    p.add_argument("--dry-run", action="store_true", help="print the job script(s) and submit nothing")
    p.add_argument("--wait", action="store_true",
                   help="follow the job; exit 0 only if it COMPLETED, else print its state and cause and exit 1")
    p.add_argument("--poll", type=_seconds, metavar="SECONDS",
                   help="with --wait, ask the scheduler every SECONDS (default: 2 s after a change of state, "
                        "doubling up to 2 min for Slurm; every second for local runs)")
    p.add_argument("--layout", choices=("multinode", "hetjob", "pair"),
                   help="Slurm script layout (default: multinode for one node group, hetjob for several)")
    p.add_argument("--runs-dir", help="where run records go (default: $LABKIT_RUNS_DIR or ./runs)")
    p.add_argument("--json", action="store_true",
                   help="print the run (with --wait: and how it ended; with --dry-run: the scripts) as JSON")
    p.set_defaults(func=_run)

    p = sub.add_parser("status", help="state, cause, per-node log tails, job info and iteration times of a run")
    p.add_argument("run", nargs="?", help="run id (or unique prefix, or directory); default: the latest run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--lines", type=int, default=5, help="log lines per node and file (default 5)")
    p.add_argument("--runs-dir", help="where run records are (default: $LABKIT_RUNS_DIR or ./runs)")
    p.set_defaults(func=_status)

    p = sub.add_parser("cancel", help="cancel a submitted run")
    p.add_argument("run", help="run id (or unique prefix, or directory)")
    p.add_argument("--json", action="store_true", help="print the run and whether it was cancelled as JSON")
    p.add_argument("--runs-dir", help="where run records are (default: $LABKIT_RUNS_DIR or ./runs)")
    p.set_defaults(func=_cancel)

    p = sub.add_parser("runs", help="table of the runs recorded under runs/")
    p.add_argument("--runs-dir", help="where run records are (default: $LABKIT_RUNS_DIR or ./runs)")
    p.add_argument("--rebuild", action="store_true",
                   help="rebuild the index (runs/index.sqlite) from the run directories, keeping their times")
    p.add_argument("--json", action="store_true", help="print the runs as a JSON list")
    p.set_defaults(func=_runs)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _run(args) -> int:
    from labkit.jobs import K8sError, SlurmError, backend_named, default_backend
    from labkit.jobs.record import RecordError
    from labkit.jobs.report import format_report, report
    from labkit.jobs.render import render
    from labkit.paths import runs_dir
    from labkit.spec import load_spec

    submitting = False
    if args.poll is not None and not args.wait:
        print("--poll: sets how often --wait asks the scheduler; add --wait, or leave --poll out", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
        if not args.backend and spec.cluster is not None and spec.cluster.login:
            args.backend = "slurm"  # the login node's Slurm, whether or not this host has one
        if args.dry_run and args.backend == "k8s":
            from labkit.jobs.k8s import manifest_file, render_manifest

            text = render_manifest(spec)
            if args.json:
                print(json.dumps({"scripts": {manifest_file(spec): text}}, indent=2))
            else:
                print(text, end="")
            return 0
        if args.dry_run:
            backend = args.backend or default_backend().name
            layout = "local" if backend == "local" else args.layout
            rendered = render(spec, runs_dir(args.runs_dir) / "RUN_ID" / "logs", layout=layout)
            if args.json:
                print(json.dumps({"scripts": rendered.scripts}, indent=2))
                return 0
            for name, text in rendered.scripts.items():
                if len(rendered.scripts) > 1:
                    print(f"# ===== {name} =====")
                print(text, end="")
            return 0
        options = {"runs_dir": args.runs_dir}
        backend = backend_named(args.backend, **options) if args.backend else default_backend(**options)
        submitting = True
        job = backend.submit(spec, layout=args.layout) if backend.name == "slurm" else backend.submit(spec)
    except KeyboardInterrupt:
        if not submitting:
            raise  # nothing was submitted: labkit.cli says so
        where = f" --runs-dir {shlex.quote(args.runs_dir)}" if args.runs_dir else ""
        print(f"interrupted while submitting: `labkit runs{where}` lists the run if it was recorded, and "
              "`labkit cancel RUN` stops its job", file=sys.stderr)
        return 130
    except SpecError as exc:
        return print_spec_errors(args.spec, exc, as_json=args.json)
    except SlurmError as exc:
        from labkit.jobs.slurm import LoginError

        print(exc if isinstance(exc, LoginError) else f"sbatch refused the job: {exc}", file=sys.stderr)
        return 1
    except K8sError as exc:
        print(f"kubectl refused the job: {exc}", file=sys.stderr)
        return 1
    except RecordError as exc:
        print(exc, file=sys.stderr)
        return 1
    submitted = {"run_id": job.record.run_id, "backend": backend.name, "job_ids": job.job_ids,
                 "path": str(job.record.path)}
    try:  # from here until it has ended, a Ctrl-C leaves the job running, and says how to stop it
        if not args.json:
            print(f"run {job.record.run_id}: {backend.name} job {', '.join(job.job_ids)} ({job.record.path})")
        if not args.wait:
            if args.json:
                print(json.dumps(submitted, indent=2))
            return 0
        # The bar redraws itself in place: only on a terminal, never into a file or pipe that collects the output.
        progress = not args.json and sys.stdout.isatty() and sys.stderr.isatty()
        state = job.wait(progress=progress, poll_s=args.poll)
    except KeyboardInterrupt:
        print(_still_running(job, args), file=sys.stderr)
        return 130
    except RecordError as exc:
        return _end_not_recorded(job, exc, submitted, args)
    if args.json:
        print(json.dumps({**submitted, "state": state.name, "cause": job.cause()}, indent=2))
        return 0 if state.name == "COMPLETED" else 1
    if state.name == "COMPLETED":
        print(f"{job.record.run_id}: COMPLETED")
        return 0
    print(format_report(report(job)))
    print(f"{job.record.run_id}: {state}: {job.cause()}", file=sys.stderr)
    return 1


def _still_running(job, args) -> str:
    """The one line `labkit run --wait` leaves when interrupted: the job runs on, and how to cancel it (or, when it
    was seen to end just before, how it ended)."""
    status = job.status(refresh=False)
    if status.state.finished:
        return f"interrupted: run {job.record.run_id} ({job.spec.name}) had ended {status.state}"
    cancel = ["labkit", "cancel", job.record.run_id]
    if args.runs_dir:
        cancel += ["--runs-dir", args.runs_dir]
    return (f"interrupted: run {job.record.run_id} ({job.spec.name}, {job.backend.name} job {', '.join(job.job_ids)}) "
            f"keeps running; to stop it: {shlex.join(cancel)}")


def _end_not_recorded(job, exc, submitted: dict, args) -> int:
    """`labkit run --wait` when the job ended but its run record could not take the end (a full disk, a read-only runs
    directory): how it ended, and that the record does not hold it yet. Exit 0 only if it COMPLETED."""
    status = job.unrecorded
    if status is None or not status.state.finished:
        print(f"{job.record.run_id}: {exc}", file=sys.stderr)
        return 1
    cause = job.cause(status)
    later = (f"the run record does not hold this end ({exc}); `labkit status {job.record.run_id}` records it once the "
             "runs directory can be written")
    if args.json:
        print(json.dumps({**submitted, "state": status.state.name, "cause": cause, "recorded": False}, indent=2))
    else:
        print(f"{job.record.run_id}: {status.state}" + (f": {cause}" if cause else ""))
    print(f"{job.record.run_id}: {later}", file=sys.stderr)
    return 0 if status.state.name == "COMPLETED" else 1


def _unwritable_note(exc) -> str:
    return f"note: {exc}; states are as polled now, and nothing is recorded"


def _status(args) -> int:
    from labkit.jobs import job_of
    from labkit.jobs.report import format_report, report
    from labkit.jobs.record import RunIndex, load_run, unwritable

    note = None
    try:
        if args.run:
            record = load_run(args.run, args.runs_dir)
        else:
            index = RunIndex(args.runs_dir)
            if index.writable():
                try:
                    index.catch_up()  # the latest run, even one a crash left out of the index
                except RuntimeError as exc:
                    if not unwritable(exc):
                        raise
                    note = _unwritable_note(exc)  # a full disk: read the records as they are
            rows = index.rows(read_only=note is not None)
            if not rows:
                print("no runs yet", file=sys.stderr)
                return 1
            record = load_run(rows[-1]["run_id"], args.runs_dir)
        record.read_only = note is not None or not RunIndex(record.root).writable()  # read, not written
        try:
            record.settle_abandoned()
            rep = report(job_of(record), lines=args.lines)
        except RuntimeError as exc:
            if not unwritable(exc):
                raise
            note, record.read_only = _unwritable_note(exc), True  # a full disk: polled now, nothing recorded
            rep = report(job_of(record), lines=args.lines)
    except (FileNotFoundError, RuntimeError) as exc:  # RecordError included
        print(exc, file=sys.stderr)
        return 1
    if note:
        print(note, file=sys.stderr)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, default=str))
    else:
        print(format_report(rep))
    return 0


def _cancel(args) -> int:
    from labkit.jobs import SlurmError, job_of
    from labkit.jobs.record import RunIndex, load_run, unwritable
    from labkit.jobs.watcher import WATCHER

    note = None
    try:
        record = load_run(args.run, args.runs_dir)
        if not RunIndex(record.root).writable():  # a read-only runs directory is read, not written (as `status` does)
            note, record.read_only = f"note: {record.root} is read-only: nothing is recorded", True
        job = job_of(record)
        try:
            # How the run stands now, not as last recorded: a run that has already ended is not cancelled, and says
            # how it ended.
            ended = job.status().state.finished
            stopped = False if ended else job.cancel()
            if not stopped and not job.status(refresh=False).state.finished:
                WATCHER.refresh([job], force=True)  # it ended meanwhile, on its own: how
        except RuntimeError as exc:
            if not unwritable(exc):
                raise
            note, record.read_only = _unwritable_note(exc), True  # a full disk: say what happened, record nothing
            job = job_of(record)
            ended = job.status().state.finished
            stopped = False if ended else job.cancel()
    except (FileNotFoundError, RuntimeError, SlurmError) as exc:
        print(exc, file=sys.stderr)
        return 1
    if note:
        print(note, file=sys.stderr)
    status = job.status(refresh=False)
    if args.json:
        print(json.dumps({"run_id": job.record.run_id, "backend": job.backend.name, "job_ids": job.job_ids,
                          "cancelled": stopped, "state": status.state.name}, indent=2))
        return 0 if stopped else 1
    if not stopped:
        jobs = f"{job.backend.name} job {', '.join(job.job_ids)}"
        if status.state.finished:
            cause = job.cause()
            print(f"{job.record.run_id}: nothing to cancel: {jobs} already ended {status.state}"
                  + (f" ({cause})" if cause else ""), file=sys.stderr)
        else:
            print(f"{job.record.run_id}: nothing to cancel ({jobs} is not running; state {status.state})",
                  file=sys.stderr)
        return 1
    print(f"cancelled {job.record.run_id} ({job.backend.name} job {', '.join(job.job_ids)})")
    return 0


def _runs(args) -> int:
    from labkit.jobs import backend_named, job_of
    from labkit.jobs.record import UNFINISHED_STATES, RecordError, RunIndex, load_run, unwritable
    from labkit.jobs.watcher import WATCHER

    index = RunIndex(args.runs_dir)
    writable = index.writable()  # a read-only runs directory is listed as recorded, and polled without recording
    note = None if writable else f"note: {index.root} is read-only: states are as polled now, and nothing is recorded"

    def cannot_write(exc: BaseException) -> None:
        """A write failed (a full disk): from here on, read the records as they are and record nothing."""
        nonlocal writable, note
        if not unwritable(exc):
            raise exc
        writable, note = False, _unwritable_note(exc)

    try:
        if args.rebuild:  # asked for: a failure to write is the answer
            damaged = index.damaged()
            count = index.rebuild()
            print(f"rebuilt {index.path} from {count} run directories"
                  + (f" (the damaged index is kept as {index.path.name}.damaged)" if damaged else ""), file=sys.stderr)
        elif writable and ((not index.exists() and index.run_dirs()) or index.damaged()):
            damaged = index.damaged()
            try:
                count = index.rebuild()
                print(f"rebuilt {index.path} from {count} run directories"
                      + (f" (the damaged index is kept as {index.path.name}.damaged)" if damaged else ""),
                      file=sys.stderr)
            except RecordError as exc:
                cannot_write(exc)
        if writable:
            try:
                index.catch_up()
            except RecordError as exc:
                cannot_write(exc)
        rows = index.rows(read_only=not writable)
    except RecordError as exc:
        print(exc, file=sys.stderr)
        return 1
    # A CREATED run has no job to poll yet; one whose labkit stopped before recording its job never will.
    for row in rows:
        if row["state"] == "CREATED" and writable:
            try:
                load_run(row["run_id"], args.runs_dir).settle_abandoned()
            except FileNotFoundError:
                continue
            except RecordError as exc:
                if not unwritable(exc):
                    print(exc, file=sys.stderr)
                    return 1
                cannot_write(exc)
    unfinished = [r for r in rows if r["state"] in UNFINISHED_STATES - {"CREATED"}]
    backends: dict = {}  # one backend of each kind, so that one query serves all its runs
    jobs = []
    for row in unfinished:
        try:
            record = load_run(row["run_id"], args.runs_dir)
            record.read_only = not writable
            name = record.job_info.get("backend", "")
            backends[name] = backends.get(name) or backend_named(name)
            jobs.append(job_of(record, backends[name]))
        except (FileNotFoundError, RuntimeError, ValueError):
            continue
    for backend in backends.values():
        mine = [job for job in jobs if job.backend is backend]
        for _ in range(2):
            try:
                WATCHER.refresh(mine)
                break
            except RecordError as exc:  # a full disk: poll again without recording
                try:
                    cannot_write(exc)
                except RecordError:
                    print(f"could not refresh {backend.name} runs: {exc}", file=sys.stderr)
                    break
                for job in jobs:
                    job.record.read_only = True
            except Exception as exc:  # a scheduler that cannot be reached leaves the recorded states
                print(f"could not refresh {backend.name} runs: {exc}", file=sys.stderr)
                break
    try:
        rows = index.rows(read_only=not writable)
    except RecordError as exc:
        print(exc, file=sys.stderr)
        return 1
    if not writable:  # the states as polled now, which the records do not hold
        polled = {job.record.run_id: job for job in jobs}
        for i, row in enumerate(rows):
            job = polled.get(row["run_id"])
            if job is not None and job.status(refresh=False).state.name != row["state"]:
                rows[i] = {**row, "state": job.status(refresh=False).state.name, "cause": job.cause()}
        print(note, file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if not rows:
        print("no runs yet")
        return 0
    import pandas as pd
    table = pd.DataFrame(rows, columns=["run_id", "name", "backend", "job_ids", "state", "cause", "created"])
    table = table.fillna("")  # a run not submitted yet has no backend or job ids: blank, not NaN
    table["cause"] = table["cause"].str.slice(0, 60)
    with pd.option_context("display.max_rows", None, "display.width", 200, "display.max_colwidth", 60):
        print(table.to_string(index=False))
    return 0

"""labkit: plan, launch and read distributed GPT training runs (Megatron on Slurm, or locally).

Each area of the library registers its own subcommands here; the commands are thin over the library functions.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# Modules that add subcommands: each has `register(subparsers)`, adding parsers whose `func(args) -> int` runs them.
COMMAND_MODULES = [
    "labkit.cli",
    "labkit.lab",
    "labkit.diagrams",
    "labkit.data_prep",
    "labkit.estimate.cli",
    "labkit.plan.cli",
    "labkit.profiling.cli",
    "labkit.jobs.cli",
    "labkit.jobs.local_slurm",
    "labkit.logs.cli",
    "labkit.checkpoint.cli",
    "labkit.completion",
]


def register(sub) -> None:
    p = sub.add_parser("validate", help="check a run spec and print it resolved (exit 2 with every error)")
    p.add_argument("spec", help="YAML or JSON run spec")
    p.add_argument("--json", action="store_true", help="print the resolved spec, or its errors, as JSON")
    p.set_defaults(func=_validate)


def _validate(args) -> int:
    import json

    import yaml

    from labkit.estimate.checkpoint import requeue_notes
    from labkit.spec import SpecError, load_spec, resolved_summary
    from labkit.spec.errors import print_spec_errors
    from labkit.spec.files import path_notes

    try:
        spec = load_spec(args.spec)
    except SpecError as exc:
        return print_spec_errors(args.spec, exc, as_json=args.json)
    resolved = {"spec": spec.to_dict(), "resolved": resolved_summary(spec)}
    if args.json:
        print(json.dumps(resolved, indent=2))
    else:
        print(yaml.safe_dump(resolved, sort_keys=False), end="")
    for line in path_notes(spec) + requeue_notes(spec):  # on stderr: stdout stays the spec alone
        print(line, file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from labkit import __version__

    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"labkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = sys.modules[__name__] if name == __name__ else importlib.import_module(name)
        module.register(sub)
    return parser


INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT, as a shell reports a command that SIGINT stopped)."""


def main(argv: list[str] | None = None) -> int:
    """Run one command; Ctrl-C anywhere stops it with one line on stderr and exit status 130, never a traceback (a
    command that leaves something running, as `labkit run --wait` does, says so itself and how to stop it)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # A second Ctrl-C while the line is written changes nothing; called from Python (argv given), the caller's
        # handler is back afterwards.
        before = _ignore_ctrl_c()
        words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")][:1]
        print(f"{' '.join(['labkit', *words])}: interrupted", file=sys.stderr)
        if before is not None and argv is not None:
            signal.signal(signal.SIGINT, before)
        return INTERRUPTED
    finally:
        if argv is None:
            # The program's command has ended: a Ctrl-C while Python exits (which can take a tenth of a second after a
            # large parse) changes nothing, where it would kill the process silently once Python has put back
            # SIGINT's default action (an ignored signal it leaves ignored).
            _ignore_ctrl_c()


def _ignore_ctrl_c():
    """SIGINT ignored from here on; its handler before, or None where it cannot be set (outside the main thread)."""
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        return None


def _main(argv: list[str] | None) -> int:
    from labkit.catalog import CatalogError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # a reader that left (`labkit runs | head`) shows here, while the handler below runs
        return code
    except BrokenPipeError:
        # Python's docs on SIGPIPE (the signal module's "Note on SIGPIPE"): point stdout at devnull, so that the
        # flush at exit cannot fail again, and exit quietly with status 1.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except CatalogError as exc:  # a GPU catalog file (the user's gpus.yaml) with errors: each one, not a traceback
        print(exc, file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a module of an extra this install left out: say which extra, not a traceback
        from labkit.extras import install_hint

        hint = install_hint(f"labkit {args.command}", exc.name or "")
        if hint is None:
            raise
        print(hint, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

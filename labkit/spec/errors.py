"""How a problem with a run spec is worded and raised: 'field: what is wrong; how to fix it' strings, every one
collected into one SpecError, and the user's values quoted short.
"""
from __future__ import annotations

import json
import re
import reprlib
import sys

CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
"""Characters no single line of a job script, a name or a path may hold."""
QUOTE_CHARS = 200
"""Most characters of a user's value an error message quotes: a huge or aliased value must not flood the terminal."""
MAX_ERROR_CHARS = 600
"""Longest error message kept whole; longer ones (a field path thousands of keys long) are cut with an ellipsis."""
MAX_ERRORS = 50
"""Errors listed for one spec; a file of thousands of unknown keys reports the first ones and how many more."""
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = QUOTE_CHARS
_QUOTE.maxlist = _QUOTE.maxdict = _QUOTE.maxtuple = _QUOTE.maxset = 8
_QUOTE.maxlevel = 3


def quote(value) -> str:
    """repr(value) for an error message, at most about QUOTE_CHARS characters, without building the whole repr."""
    text = _QUOTE.repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS - 3] + "..."


def _clip(error: str) -> str:
    """One line of at most MAX_ERROR_CHARS: a control character a message carries from the user's value (a parser's
    message quotes it raw) is written as its escape, so that each error stays one line of the list."""
    error = CONTROL_CHARS.sub(lambda c: repr(c.group())[1:-1], error)
    return error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS - 3] + "..."


class SpecError(ValueError):
    """Every problem found in a spec. `errors` is a list of 'field: what is wrong; how to fix it' strings, each at most
    MAX_ERROR_CHARS long, at most MAX_ERRORS of them and then a count of the rest."""

    def __init__(self, errors: list[str]):
        errors = [_clip(e) for e in errors]
        if len(errors) > MAX_ERRORS:
            errors = errors[:MAX_ERRORS] + [f"spec: {len(errors) - MAX_ERRORS} more errors not shown; fix the above "
                                            "first"]
        self.errors = errors
        super().__init__("invalid run spec:\n" + "\n".join(f"  - {e}" for e in self.errors))


def print_spec_errors(where, exc, as_json: bool = False) -> int:
    """Every error of a SpecError on stderr, one per line (as_json: {"spec": where, "errors": [...]} on stdout, for a
    program to read); returns the exit status for invalid input (2)."""
    if as_json:
        print(json.dumps({"spec": str(where), "errors": exc.errors}, indent=2))
        return 2
    print(f"{where}: {len(exc.errors)} error(s)", file=sys.stderr)
    for error in exc.errors:
        print(f"  - {error}", file=sys.stderr)
    return 2

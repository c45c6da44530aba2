"""Check cells for the labs' exercises.

A student writes an answer in place of `...` and runs the check cell under it: an unanswered exercise says so and
passes (the lab still runs end to end), a right answer says so, a wrong one raises `Incorrect` with a hint. The
labs' check cells name their exercise and labkit.answer_key holds what it is compared with, so no notebook shows an
answer:

    answer_1 = ...                                 # the student's line
    check("05.1", answer_1)                        # labkit.answer_key: check_number(answer, gpt_params(...), ...)

What a check prints or raises, and the prediction table's headings, are in the edition's language (labkit.messages).
"""
from __future__ import annotations

import math
from typing import Any

from labkit.messages import say

UNANSWERED = (Ellipsis, None)


class Incorrect(AssertionError):
    """A wrong answer; the message says what was expected in kind (never the value itself) and how to get there."""


def _unanswered(answer: Any, name: str) -> bool:
    if any(answer is u for u in UNANSWERED):
        print(say("check.unanswered", name=name))
        return True
    return False


def _correct(name: str, detail: str = "") -> None:
    print(say("check.correct_detail", name=name, detail=detail) if detail else say("check.correct", name=name))


def check_number(answer: Any, expected: float, *, name: str, rel_tol: float = 0.01, hint: str = "") -> None:
    """Right when within `rel_tol` of `expected` (relative)."""
    if _unanswered(answer, name):
        return
    try:
        value = float(answer)
    except (TypeError, ValueError):
        raise Incorrect(say("check.not_a_number", name=name, kind=type(answer).__name__, answer=answer)) from None
    if math.isclose(value, expected, rel_tol=rel_tol, abs_tol=0.0 if expected else rel_tol):
        _correct(name)
        return
    raise Incorrect(say("check.too_high" if value > expected else "check.too_low", name=name, value=value,
                        rel_tol=rel_tol, hint=hint).strip())


def check_choice(answer: Any, expected: Any, *, name: str, choices: list | tuple, hint: str = "") -> None:
    """Right when `answer` is `expected`; an answer outside `choices` is refused with the list."""
    if _unanswered(answer, name):
        return
    if answer not in choices:
        raise Incorrect(say("check.not_a_choice", name=name, answer=answer, choices=list(choices)))
    if answer == expected:
        _correct(name)
        return
    raise Incorrect(say("check.wrong_choice", name=name, answer=answer, hint=hint).strip())


def check_spec(answer: Any, *, name: str, **expected: Any) -> None:
    """Right when the run spec validates and each named attribute (a dotted path, `__` between parts: e.g.
    `batch__micro=2`, `data_parallel=4`, `num_micro_batches=4`) has the expected value."""
    from labkit.spec import RunSpec, SpecError, validate

    if _unanswered(answer, name):
        return
    if not isinstance(answer, RunSpec):
        raise Incorrect(say("check.not_a_spec", name=name, kind=type(answer).__name__))
    try:
        validate(answer)
    except SpecError as exc:
        raise Incorrect(say("check.spec_invalid", name=name, errors="; ".join(exc.errors))) from None
    wrong = []
    for path, want in expected.items():
        value = answer
        for part in path.split("__"):
            value = getattr(value, part)
        if value != want:
            wrong.append(say("check.spec_field", path=path.replace("__", "."), value=value))
    if wrong:
        raise Incorrect(say("check.spec_wrong", name=name, wrong=", ".join(wrong)))
    _correct(name, ", ".join(f"{k.replace('__', '.')}={v!r}" for k, v in expected.items()))


def prediction_table(guesses: dict[str, Any], estimated: dict[str, Any], measured: dict[str, Any]):
    """Your prediction beside labkit's estimate and the measurement, one row per question (the keys of `guesses`).

    A lab asks for the prediction in a cell tagged `prediction`, before it shows the estimate or runs anything, and
    sets the three side by side once the runs are measured. A guess left as `...` reads "(not written)"; a question
    the estimate or the measurement does not answer reads "-".

    Taught in labs 01, 02, 03, 04, 05, 06, 07, 09 and 10.
    """
    import pandas as pd

    def shown(value: Any) -> str:
        if any(value is u for u in UNANSWERED):
            return say("prediction.not_written")
        if isinstance(value, (list, tuple)):
            return " < ".join(str(v) for v in value)
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    question, yours, estimate, measurement = (say(f"prediction.{part}")
                                              for part in ("question", "yours", "estimate", "measured"))
    return pd.DataFrame([{question: asked, yours: shown(guess), estimate: shown(estimated.get(asked, "-")),
                          measurement: shown(measured.get(asked, "-"))}
                         for asked, guess in guesses.items()]).set_index(question)

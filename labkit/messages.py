"""What labkit says to a student at run time (exercise checks, their hints, the prediction table's headings, the
sentences the labs' own code cells print) in each edition of the labs, from one table: labkit/data/messages.yaml,
{message id: {en: ..., ko: ...}}, each text a `str.format` template whose fields every language shares.

The language is chosen outside the notebooks, so that a Korean lab's code cells stay those of the English one:

1. LABKIT_LANG (en or ko), when set: `labkit lab --lang ko` sets it for the kernels it starts;
2. otherwise the edition folder the kernel runs in: Jupyter's server starts a notebook's kernel in the notebook's own
   folder (`cwd_for_path`, https://github.com/jupyter-server/jupyter_server/blob/main/jupyter_server/services/kernels/
   kernelmanager.py), as `labkit lab` has papermill do, so notebooks/ko/ and notebooks/ko/solutions/ speak Korean when
   opened in JupyterLab too;
3. otherwise English.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from labkit.paths import data_file

LANGUAGES = ("en", "ko")
"""The languages of the table; English is the source, and the other codes are the names of their editions' folders
inside notebooks/."""


def language(cwd: Path | None = None) -> str:
    """The language messages are written in now (see the module's docstring for how it is chosen)."""
    written = os.environ.get("LABKIT_LANG", "").strip()
    # a locale's form (ko_KR.UTF-8, ko-KR, KO) names its language first
    chosen = re.split(r"[_.@-]", written)[0].lower()
    if chosen:
        if chosen not in LANGUAGES:
            raise ValueError(f"LABKIT_LANG={written!r}: choose one of {', '.join(LANGUAGES)} (or unset it)")
        return chosen
    folder = Path.cwd() if cwd is None else cwd
    if folder.name == "solutions":
        folder = folder.parent
    if folder.name in LANGUAGES and folder.parent.name == "notebooks":
        return folder.name
    return "en"


@functools.cache
def table() -> dict[str, dict[str, str]]:
    """{message id: {language: template}}."""
    import yaml

    return yaml.safe_load(data_file("messages.yaml").read_text(encoding="utf-8"))


def say(message_id: str, lang: str | None = None, **fields) -> str:
    """Message `message_id` in `lang` (default: language()), its fields filled in.

    Taught in labs 00, 01, 02, 03, 04, 05, 06, 07, 08, 09 and 10.
    """
    if message_id not in table():
        raise KeyError(f"no message {message_id!r} in labkit/data/messages.yaml")
    return table()[message_id][lang or language()].format(**fields)

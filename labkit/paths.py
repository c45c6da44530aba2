"""Where labkit's files are: package data, the course files (notebooks, examples, images) and the user's directories.

This is the only module that knows a location. Package data (catalogs, tokenizer, corpus, profiles) lives inside the
package and is found with `importlib.resources` (the job templates with jinja2's PackageLoader), so a wheel installed
anywhere finds it. The course files live at the top of the source tree; a wheel carries a copy of them under
`labkit/course/` (see setup.py), and `labkit workspace DIR` copies them out for a pip-only install.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

_PACKAGE = Path(str(resources.files("labkit")))

DATA_DIR = _PACKAGE / "data"
"""Catalogs (gpus, models, clusters, published runs), the tokenizer, the corpus and the shipped profiles."""

COURSE_NAMES = ("notebooks", "examples", "images")
"""The course files a user works with: the labs (with their solutions), example run specs and the lab figures."""


def data_file(*parts: str) -> Path:
    """A file of the package data, e.g. data_file("tokenizer", "vocab.json").

    Taught in lab 08.
    """
    return DATA_DIR.joinpath(*parts)


def shipped_corpus() -> dict:
    """A spec's `data` section that trains on the corpus labkit ships (labkit/data/corpus/, tokenised; lab 08 builds
    it), for the labs whose lesson needs a loss that falls.

    Taught in labs 01, 02, 03 and 04.
    """
    return {"mock": False, "path": str(data_file("corpus", "corpus_text_document"))}


def mathjax_dir() -> Path:
    """MathJax 2.7 as the jupyter-server-mathjax package ships it (MathJax.js, config/, jax/, fonts/)."""
    return Path(str(resources.files("jupyter_server_mathjax"))) / "static"


def source_tree() -> Path | None:
    """The checkout labkit runs from (an editable install), or None for an installed wheel."""
    root = _PACKAGE.parent
    return root if (root / "pyproject.toml").is_file() and (root / "notebooks").is_dir() else None


def course_dir(name: str) -> Path:
    """One of COURSE_NAMES: from the checkout when there is one, else the copy the wheel carries."""
    if name not in COURSE_NAMES:
        raise ValueError(f"{name!r} is not one of {', '.join(COURSE_NAMES)}")
    root = source_tree()
    return (root / name) if root is not None else (_PACKAGE / "course" / name)


def example(name: str) -> Path:
    """A shipped example run spec, e.g. example("tiny-cpu.yaml").

    Taught in labs 00, 01, 02, 03, 04, 05, 07, 09 and 10.
    """
    return course_dir("examples") / name


def runs_dir(path: str | os.PathLike | None = None) -> Path:
    """Where run records and lab runs live: the argument, else $LABKIT_RUNS_DIR, else ./runs.

    Taught in labs 01, 06, 07 and 10.
    """
    return Path(path or os.environ.get("LABKIT_RUNS_DIR") or "runs").resolve()


def user_dir() -> Path:
    """Where labkit writes what it learns about the user's machines (profiles): $LABKIT_HOME, else ~/.labkit."""
    return Path(os.environ.get("LABKIT_HOME") or Path.home() / ".labkit")

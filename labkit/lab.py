"""Run the lab series headless: papermill executes each notebook into runs/lab-<timestamp>/, and an HTML index of the
executed notebooks is written beside them that opens offline (plotly.js inlined, diagrams embedded).

`labkit lab [--backend local|slurm] [-p key value] [--only NAMES] [--lang en|ko]`, or `make lab` (both editions). `labkit workspace DIR` copies the
notebooks, their solutions, the examples and the images out of an installed wheel into DIR, to work on them there;
`--no-solutions` leaves the solutions and the notebooks' stored outputs out (the students' copy; the instructor's
keeps them).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import html
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from labkit.paths import COURSE_NAMES, DATA_DIR, course_dir, runs_dir

BACKENDS = ("local", "slurm")


class LabError(ValueError):
    """A bad request to run the labs (unknown notebook, unknown parameter); says what to change."""


@dataclass
class NotebookResult:
    name: str
    status: str  # "ok" | "failed"
    seconds: float
    output: str  # executed notebook, relative to the run directory
    html: str | None = None
    error: str | None = None


@dataclass
class LabRun:
    directory: Path
    parameters: dict
    results: list[NotebookResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.results)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.results)

    @property
    def index(self) -> Path:
        return self.directory / "index.html"

    def summary(self) -> str:
        width = max([len(r.name) for r in self.results] + [8])
        lines = [f"{'notebook':<{width}}  {'status':<6}  {'seconds':>7}"]
        lines += [f"{r.name:<{width}}  {r.status:<6}  {r.seconds:7.1f}" + (f"  {r.error}" if r.error else "")
                  for r in self.results]
        lines.append(f"{'total':<{width}}  {'ok' if self.ok else 'failed':<6}  {self.seconds:7.1f}")
        return "\n".join(lines)


def default_notebook_dir() -> Path:
    """The labs to run: ./notebooks when the current directory has them (a checkout or a workspace), else the
    notebooks shipped with labkit."""
    here = Path("notebooks")
    return here.resolve() if any(here.glob("[0-9][0-9]_*.ipynb")) else course_dir("notebooks")


SOLUTIONS = "solutions"
"""The folder of notebooks/ that holds the worked answers."""


def strip_outputs(path: Path | str) -> None:
    """Clear, in place, every code cell's stored outputs and execution count, and the saved widget state: a notebook
    that shows no result before its cell is run. Plain JSON, written as nbformat writes it, so that the base install
    (no nbformat) copies a students' workspace too."""
    path = Path(path)
    notebook = json.loads(path.read_text(encoding="utf-8"))
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    notebook.get("metadata", {}).pop("widgets", None)
    path.write_text(json.dumps(notebook, sort_keys=True, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def copy_workspace(target: Path | str, solutions: bool = True) -> list[Path]:
    """Copy the course files (notebooks, with their solutions unless `solutions` is false, examples, images) into
    `target`; an existing file is never overwritten, so a student's edited notebook survives a second copy. Returns
    the files written.

    Without the solutions (the students' copy) the notebooks also lose their stored outputs: those are the results
    nbval compares (`labkit lab --store-outputs`), and some of them are the very numbers a lab asks its students to
    predict or to work out. The instructor's copy keeps them."""
    target = Path(target)
    written = []
    for name in COURSE_NAMES:
        source = course_dir(name)
        for path in sorted(p for p in source.rglob("*") if p.is_file() and ".ipynb_checkpoints" not in p.parts
                           and p.suffix in (".ipynb", ".yaml", ".svg", ".cfg")
                           and (solutions or not (name == "notebooks" and SOLUTIONS in p.relative_to(source).parts))):
            destination = target / name / path.relative_to(source)
            if destination.exists():
                continue
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination)
            if not solutions and destination.suffix == ".ipynb":
                strip_outputs(destination)
            written.append(destination)
    return written


EDITIONS = {"en": "", "ko": "ko"}
"""The editions of the series: {language code: its folder inside notebooks/}. English is the source at the top; a
translation is the same jupytext sources with translated text and identical code cells, in notebooks/<code>/ with its
own solutions/, and its notebooks carry the English notebooks' stored outputs (none of them a check's or a prediction
table's). `labkit lab --lang ko` executes the Korean notebooks themselves, whose kernels speak Korean
(labkit.messages)."""


def edition_dir(lang: str = "en", notebook_dir: Path | str | None = None) -> Path:
    """The folder of one edition's labs, inside `notebook_dir` (default: the labs `labkit lab` runs)."""
    if lang not in EDITIONS:
        raise LabError(f"--lang {lang!r}: choose one of {', '.join(EDITIONS)}")
    base = Path(notebook_dir) if notebook_dir is not None else default_notebook_dir()
    return base / EDITIONS[lang]


def translation_problems(english: Path | str, translated: Path | str) -> list[str]:
    """How a translated notebook differs from its English one in anything but its text: the cells' number, order and
    kinds, and every code cell's source, tags and stored outputs must be the same, so that running one edition runs
    the other's code. Both are read with jupytext (a .py source or an .ipynb)."""
    import jupytext

    english, translated = jupytext.read(english), jupytext.read(translated)
    if len(english.cells) != len(translated.cells):
        return [f"{len(translated.cells)} cells where the English has {len(english.cells)}"]
    problems = []
    for number, (ours, theirs) in enumerate(zip(english.cells, translated.cells), start=1):
        if ours.cell_type != theirs.cell_type:
            problems.append(f"cell {number}: {theirs.cell_type} where the English has {ours.cell_type}")
        elif ours.cell_type == "code":
            for part in ("source", "outputs"):
                if ours.get(part) != theirs.get(part):
                    problems.append(f"cell {number}: its {part} differs from the English")
            if ours.metadata.get("tags", []) != theirs.metadata.get("tags", []):
                problems.append(f"cell {number}: tags {theirs.metadata.get('tags', [])} where the English has "
                                f"{ours.metadata.get('tags', [])}")
    return problems


def write_translated_notebook(source: Path | str, english: Path | str) -> Path:
    """Write a translated lab's .ipynb beside its jupytext source: the English notebook (code cells, tags, stored
    outputs) with each text cell taken from the translation. Returns the notebook written."""
    import jupytext
    import nbformat

    source, english = Path(source), Path(english)
    problems = translation_problems(english.with_suffix(".py"), source)
    if problems:
        raise LabError(f"{source}: not a translation of {english.with_suffix('.py')}: {'; '.join(problems)}")
    notebook = nbformat.read(english, as_version=4)
    for cell, text in zip(notebook.cells, jupytext.read(source).cells):
        if cell.cell_type == "markdown":
            cell.source = text.source
    target = source.with_suffix(".ipynb")
    nbformat.write(notebook, target)
    return target


def lab_notebooks(directory: Path | str | None = None, only: list[str] | None = None) -> list[Path]:
    """The series in order (NN_name.ipynb); `only` picks by number ("05"), name ("05_performance_estimation") or
    a part of the name ("estimation")."""
    directory = Path(directory) if directory is not None else default_notebook_dir()
    notebooks = sorted(p for p in directory.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise LabError(f"no lab notebooks (NN_name.ipynb) in {directory}")
    if not only:
        return notebooks
    chosen = []
    for wanted in only:
        matches = [p for p in notebooks if p.stem == wanted or p.stem.startswith(f"{wanted}_") or wanted in p.stem]
        if not matches:
            names = ", ".join(p.stem for p in notebooks)
            raise LabError(f"--only {wanted!r} matches no notebook; choose from: {names}")
        chosen += [p for p in matches if p not in chosen]
    return sorted(chosen)


def declared_parameters(notebook: Path) -> dict:
    """The notebook's `parameters` cell as {name: default}."""
    import papermill

    return {name: info["default"] for name, info in papermill.inspect_notebook(str(notebook)).items()}


def new_run_directory(parent: Path | str | None = None, now: dt.datetime | None = None) -> Path:
    """runs/lab-YYYYmmdd-HHMMSS, with -2, -3... when that name is taken: an earlier run is never overwritten."""
    parent = runs_dir(parent)
    parent.mkdir(parents=True, exist_ok=True)
    stamp = (now or dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    for attempt in range(1, 1000):
        candidate = parent / (f"lab-{stamp}" if attempt == 1 else f"lab-{stamp}-{attempt}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise LabError(f"could not create a new lab directory under {parent}")


def strip_widget_state(path: Path) -> None:
    """Drop saved widget state: it only means something beside a live kernel, and it is most of a notebook's size."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    if nb.metadata.pop("widgets", None) is not None:
        nbformat.write(nb, path)


# A cell tagged `widgets` only builds widgets and is done in a second, but the notebook client can sit on its reply
# until the cell's timeout runs out (jupyter/nbclient#312): such cells get a short timeout, after which the reply is
# read.
WIDGETS_TAG, WIDGETS_TIMEOUT_S = "widgets", 20


def cell_timeout(cell, default_s: int) -> int:
    """Seconds the notebook client waits for a cell's reply."""
    return WIDGETS_TIMEOUT_S if WIDGETS_TAG in cell.metadata.get("tags", []) else default_s


def run_lab(only: list[str] | None = None, parameters: dict | None = None, backend: str | None = None,
            runs_dir: Path | str | None = None, notebook_dir: Path | str | None = None, progress: bool | None = None,
            timeout_s: int = 600, html_index: bool = True) -> LabRun:
    """Execute the chosen notebooks in order into a new run directory; a failing notebook is recorded and the series
    goes on. Parameters are passed to the notebooks that declare them; one that no notebook declares is an error.
    The progress bar over the notebooks goes to stderr, by default only when stderr is a terminal: redirected to a
    file or read by CI, it would fill the log with carriage returns."""
    from tqdm.auto import tqdm

    if progress is None:
        progress = sys.stderr is not None and sys.stderr.isatty()

    notebook_dir = Path(notebook_dir).resolve() if notebook_dir is not None else default_notebook_dir()
    notebooks = lab_notebooks(notebook_dir, only)
    parameters = dict(parameters or {})
    if backend is not None:
        if backend not in BACKENDS:
            raise LabError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        parameters["backend"] = backend
    declared = {nb: declared_parameters(nb) for nb in notebooks}
    unknown = sorted(set(parameters) - {name for params in declared.values() for name in params})
    if unknown:
        known = sorted({name for params in declared.values() for name in params})
        raise LabError(f"parameter(s) {', '.join(unknown)} are declared by none of the chosen notebooks; "
                       f"known parameters: {', '.join(known)}")

    run = LabRun(directory=new_run_directory(runs_dir), parameters=parameters)
    with _kernel_runs_dir(run.directory.parent):
        bar = tqdm(notebooks, desc="lab", unit="notebook", disable=not progress, file=sys.stderr)
        for notebook in bar:
            bar.set_postfix_str(notebook.stem)
            output = run.directory / notebook.name
            params = {k: v for k, v in parameters.items() if k in declared[notebook]}
            start = time.perf_counter()
            error = _execute(notebook, output, params, notebook_dir, timeout_s)
            run.results.append(NotebookResult(name=notebook.stem, status="failed" if error else "ok",
                                              seconds=round(time.perf_counter() - start, 2), output=output.name,
                                              error=error))
            _write_record(run)
        bar.close()
    if html_index:
        write_html_index(run, notebook_dir)
    return run


@contextlib.contextmanager
def _kernel_runs_dir(path: Path):
    """Kernels inherit this process's environment: the notebooks' own jobs are recorded beside the lab run, whatever
    directory a kernel starts in, unless the caller chose a runs directory; the caller's environment is restored."""
    previous = os.environ.get("LABKIT_RUNS_DIR")
    os.environ["LABKIT_RUNS_DIR"] = previous or str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LABKIT_RUNS_DIR", None)


@contextlib.contextmanager
def _kernel_language(lang: str):
    """Kernels inherit this process's environment: they speak the edition's language (LABKIT_LANG, read by
    labkit.messages) whatever the caller's is; the caller's environment is restored."""
    previous = os.environ.get("LABKIT_LANG")
    os.environ["LABKIT_LANG"] = lang
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LABKIT_LANG", None)
        else:
            os.environ["LABKIT_LANG"] = previous


def _execute(notebook: Path, output: Path, params: dict, cwd: Path, timeout_s: int) -> str | None:
    """Run one notebook into `output`; returns the error that stopped it, or None."""
    import papermill

    error = None
    try:
        # papermill's own bar over a notebook's cells stays off, in a terminal too: run_lab draws one over notebooks.
        papermill.execute_notebook(str(notebook), str(output), parameters=params, cwd=str(cwd), progress_bar=False,
                                   execution_timeout=timeout_s,
                                   timeout_func=functools.partial(cell_timeout, default_s=timeout_s))
    except papermill.PapermillExecutionError as exc:
        error = f"{exc.ename}: {exc.evalue}".strip()
    except Exception as exc:  # kernel died, timeout: the notebook failed, the series goes on
        error = f"{type(exc).__name__}: {exc}".strip()
    if output.exists():
        strip_widget_state(output)
    return error


def _write_record(run: LabRun) -> None:
    record = {"parameters": run.parameters, "ok": run.ok, "seconds": round(run.seconds, 2),
              "notebooks": [asdict(r) for r in run.results]}
    (run.directory / "lab.json").write_text(json.dumps(record, indent=2, default=str) + "\n")


CHECKED_TAG = "nbval-check-output"

CLAIM_TAG = "check-claim"
"""A code cell that asserts what the text around it says about a measured number (with a margin a loaded machine
keeps), so an executed lab never contradicts its text; the HTML pages leave it out."""


def store_checked_outputs(notebook: Path | str, timeout_s: int = 600) -> int:
    """Execute a source notebook in its own directory and keep, in place, only the outputs of cells tagged
    `nbval-check-output`: the deterministic results nbval compares in CI. Returns the number of cells kept."""
    import nbformat
    from nbclient import NotebookClient

    notebook = Path(notebook)
    nb = nbformat.read(notebook, as_version=4)
    executed = nbformat.from_dict(json.loads(json.dumps(nb)))
    NotebookClient(executed, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(notebook.parent)}}).execute()
    kept = 0
    for cell, ran in zip(nb.cells, executed.cells):
        if cell.cell_type != "code":
            continue
        if CHECKED_TAG in cell.metadata.get("tags", []):
            cell.outputs, cell.execution_count = ran.outputs, ran.execution_count
            kept += 1
        else:
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, notebook)
    return kept


# --- HTML -------------------------------------------------------------------------------------------------------------

PLOTLY_MIME = "application/vnd.plotly.v1+json"


def plotly_outputs_to_html(nb) -> int:
    """Give every plotly output a text/html rendering (a div and a Plotly.newPlot script); the first one carries
    plotly.js itself, so the page draws its figures with no network. Returns the number of figures."""
    import plotly.io as pio

    figures = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            figure = output.get("data", {}).get(PLOTLY_MIME)
            if figure is None:
                continue
            output["data"]["text/html"] = pio.to_html(figure, include_plotlyjs=figures == 0, full_html=False,
                                                      validate=False, div_id=f"labkit-figure-{figures}")
            del output["data"][PLOTLY_MIME]
            figures += 1
    return figures


MATHJAX = "mathjax"
"""The folder beside the lab runs (runs/mathjax/) that holds MathJax for every run's HTML pages."""


def offline_mathjax(runs_root: Path) -> str:
    """Copy MathJax (the jupyter-server-mathjax package's MathJax 2.7) under `runs_root` once, and return the URL of
    it that a page in runs_root/lab-*/ loads, so that formulas render with no network."""
    import shutil

    from labkit.paths import mathjax_dir

    target = runs_root / MATHJAX
    if not (target / "MathJax.js").exists():
        shutil.copytree(mathjax_dir(), target, dirs_exist_ok=True)
    return f"../{MATHJAX}/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"


def notebook_to_html(path: Path, resources_dir: Path, mathjax_url: str | None = None) -> str:
    """An executed notebook as an HTML page that needs no network: plotly.js inlined, MathJax from `mathjax_url`
    (see offline_mathjax)."""
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor

    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)  # widget views fall back to their text form; no widget JS exists offline
    plotly_outputs_to_html(nb)
    exporter = HTMLExporter(embed_images=True)
    exporter.register_preprocessor(TagRemovePreprocessor(remove_cell_tags={CLAIM_TAG}), enabled=True)
    if mathjax_url:
        exporter.mathjax_url = mathjax_url
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"path": str(resources_dir)}})
    # With require.js on the page, plotly.js registers as an AMD module instead of window.Plotly and no figure draws.
    return re.sub(r'<script src="[^"]*require\.min\.js"></script>\s*', "", body)


def write_html_index(run: LabRun, notebook_dir: Path | str) -> Path:
    """index.html linking each executed notebook's HTML page, with its status and run time."""
    mathjax_url = offline_mathjax(run.directory.parent)
    for result in run.results:
        source = run.directory / result.output
        if source.exists():
            page = source.with_suffix(".html")
            page.write_text(notebook_to_html(source, Path(notebook_dir), mathjax_url), encoding="utf-8")
            result.html = page.name
    rows = []
    for r in run.results:
        link = f'<a href="{html.escape(r.html)}">{html.escape(r.name)}</a>' if r.html else html.escape(r.name)
        error = f"<br><code>{html.escape(r.error)}</code>" if r.error else ""
        rows.append(f'<tr class="{r.status}"><td>{link}</td><td>{r.status}{error}</td>'
                    f'<td class="num">{r.seconds:.1f}</td>'
                    f'<td><a href="{html.escape(r.output)}">{html.escape(r.output)}</a></td></tr>')
    params = html.escape(json.dumps(run.parameters)) if run.parameters else "defaults"
    run.index.write_text(_INDEX_TEMPLATE.format(title=html.escape(run.directory.name), params=params,
                                                rows="\n".join(rows), total=f"{run.seconds:.1f}"), encoding="utf-8")
    _write_record(run)
    return run.index


_INDEX_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>labkit {title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }} td, th {{ padding: .3em .8em; border-bottom: 1px solid #ddd; text-align: left; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }} tr.failed {{ background: #fde8e8; }}
</style></head>
<body><h1>labkit {title}</h1>
<p>Parameters: <code>{params}</code></p>
<table><thead><tr><th>lab</th><th>status</th><th>seconds</th><th>notebook</th></tr></thead>
<tbody>
{rows}
</tbody>
<tfoot><tr><th>total</th><th></th><td class="num">{total}</td><th></th></tr></tfoot></table>
</body></html>
"""


# --- command line -----------------------------------------------------------------------------------------------------

def _parameter(text: str):
    return yaml.safe_load(text) if text.strip() else text


def register(sub) -> None:
    p = sub.add_parser("lab", help="run the lab notebooks headless into runs/lab-<timestamp>/ with an HTML index")
    p.add_argument("--backend", choices=BACKENDS, help="where the labs' jobs run (default: each notebook's own)")
    p.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="set a notebook parameter (VALUE read as YAML: 10, true, bf16); repeatable")
    p.add_argument("--only", action="append", default=[], metavar="NAMES",
                   help="run only these labs: numbers or names, comma-separated (e.g. 05,08)")
    p.add_argument("--runs-dir", help="parent of the lab-<timestamp> directory (default $LABKIT_RUNS_DIR, else runs)")
    p.add_argument("--timeout", type=int, default=600, help="seconds a single cell may run (default 600)")
    p.add_argument("--lang", choices=list(EDITIONS), default="en",
                   help="the edition to run: en (default) or ko, the Korean one (notebooks/ko/), whose checks and "
                        "prediction tables speak Korean")
    p.add_argument("--store-outputs", action="store_true",
                   help=f"instead of a lab run: execute the chosen source notebooks (and their solutions) in place, "
                        f"keeping only the outputs of cells tagged {CHECKED_TAG}, which nbval compares; with "
                        f"--lang ko, write the Korean notebooks from their sources with the English outputs")
    p.set_defaults(func=_lab_command)
    p = sub.add_parser("workspace", help="copy the lab notebooks, their solutions, the examples and the images into a "
                                         "directory to work in (files already there are kept)")
    p.add_argument("directory", help="where to copy them (created when missing)")
    p.add_argument("--no-solutions", dest="solutions", action="store_false",
                   help="leave notebooks/solutions/ and the notebooks' stored outputs out: the copy to hand to "
                        "students (the instructor's keeps them)")
    p.set_defaults(func=_workspace_command)


def _workspace_command(args: argparse.Namespace) -> int:
    written = copy_workspace(args.directory, solutions=args.solutions)
    print(f"copied {len(written)} file(s) into {Path(args.directory).resolve()}"
          f"{'' if args.solutions else ', without the solutions or stored outputs'}; "
          f"run the labs there with `labkit lab` or open notebooks/ in JupyterLab")
    return 0


def _lab_command(args: argparse.Namespace) -> int:
    only = [name.strip() for group in args.only for name in group.split(",") if name.strip()]
    parameters = {key: _parameter(value) for key, value in args.parameter}
    if args.store_outputs:
        try:
            chosen = lab_notebooks(None, only or None)
            for notebook in chosen + [p.parent / SOLUTIONS / p.name for p in chosen]:
                if not notebook.exists():
                    continue
                if args.lang == "en":
                    print(f"{notebook}: kept {store_checked_outputs(notebook, args.timeout)} checked output(s)")
                    continue
                source = edition_dir(args.lang, chosen[0].parent) / notebook.relative_to(chosen[0].parent)
                if source.with_suffix(".py").exists():
                    print(f"{write_translated_notebook(source.with_suffix('.py'), notebook)}: written")
        except LabError as exc:
            print(f"labkit lab: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        with _kernel_language(args.lang):
            run = run_lab(only=only or None, parameters=parameters, backend=args.backend, runs_dir=args.runs_dir,
                          timeout_s=args.timeout, notebook_dir=edition_dir(args.lang))
    except LabError as exc:
        print(f"labkit lab: {exc}", file=sys.stderr)
        return 2
    print(run.summary())
    print(f"executed notebooks and index: {run.index}")
    return 0 if run.ok else 1

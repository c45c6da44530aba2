import datetime as dt
import io
import json
import re
import shutil
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labkit import cli, lab


def _notebook(path, cells):
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    """Three tiny labs: one with a figure and a widget, one that fails, one that reads a parameter."""
    root = tmp_path_factory.mktemp("series")
    notebooks = root / "notebooks"
    notebooks.mkdir()
    params = new_code_cell("backend = 'local'\niterations = 2")
    params.metadata["tags"] = ["parameters"]
    # tagged as the labs tag their widget cells: the notebook client can otherwise sit on the reply for the whole
    # cell timeout (labkit.lab.WIDGETS_TAG)
    widget = new_code_cell("import ipywidgets as w\n_ = w.interact(lambda n=3: n * 2, n=(1, 5))")
    widget.metadata["tags"] = [lab.WIDGETS_TAG]
    _notebook(notebooks / "01_figure.ipynb", [
        new_markdown_cell("# A figure and a widget"), params,
        new_code_cell("import plotly.graph_objects as go\n"
                      "go.Figure(go.Bar(x=['a', 'b'], y=[1, iterations])).show()"),
        widget,
    ])
    _notebook(notebooks / "02_broken.ipynb", [new_code_cell("raise RuntimeError('the lab broke here')")])
    params3 = new_code_cell("iterations = 2")
    params3.metadata["tags"] = ["parameters"]
    claim = new_code_cell("assert iterations > 1, 'the text promised more than one iteration'")
    claim.metadata["tags"] = [lab.CLAIM_TAG]
    _notebook(notebooks / "03_params.ipynb", [params3, new_code_cell("print('iterations', iterations)"), claim])
    runs = root / "runs"
    run = lab.run_lab(parameters={"iterations": 7}, backend="slurm", runs_dir=runs, notebook_dir=notebooks,
                      progress=False)
    return notebooks, runs, run


def test_every_notebook_runs_and_a_failure_does_not_stop_the_series(series):
    _, _, run = series
    assert [r.name for r in run.results] == ["01_figure", "02_broken", "03_params"]
    assert [r.status for r in run.results] == ["ok", "failed", "ok"]
    assert "the lab broke here" in run.results[1].error
    assert not run.ok
    assert all(r.seconds > 0 for r in run.results)


def test_parameters_reach_only_the_notebooks_that_declare_them(series):
    _, _, run = series
    third = nbformat.read(run.directory / "03_params.ipynb", as_version=4)
    assert "iterations 7" in "".join(o.get("text", "") for c in third.cells for o in c.get("outputs", []))
    injected = [c for c in third.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert "backend" not in injected[0].source  # 03 declares no backend
    first = nbformat.read(run.directory / "01_figure.ipynb", as_version=4)
    injected = [c for c in first.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert "backend = \"slurm\"" in injected[0].source


def test_record_lists_each_notebook_with_its_time(series):
    _, _, run = series
    record = json.loads((run.directory / "lab.json").read_text())
    assert record["parameters"] == {"iterations": 7, "backend": "slurm"}
    assert [n["status"] for n in record["notebooks"]] == ["ok", "failed", "ok"]
    assert record["seconds"] == pytest.approx(sum(n["seconds"] for n in record["notebooks"]), abs=0.05)


def test_widget_state_is_stripped_from_executed_notebooks(series):
    _, _, run = series
    nb = nbformat.read(run.directory / "01_figure.ipynb", as_version=4)
    assert "widgets" not in nb.metadata
    widget_outputs = [o for c in nb.cells for o in c.get("outputs", [])
                      if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert widget_outputs, "interact should still leave its view output (rendered live by a kernel)"


def test_html_index_opens_offline_with_plotly_inlined(series):
    _, _, run = series
    index = run.index.read_text()
    assert 'href="01_figure.html"' in index and 'href="02_broken.html"' in index
    assert "the lab broke here" in index
    page = (run.directory / "01_figure.html").read_text()
    assert "Plotly.newPlot" in page and 'id="labkit-figure-0"' in page
    assert "plotly.js v" in page  # the library itself, not a link to it
    external_scripts = re.findall(r'<script[^>]*src="([^"]+)"', page)
    # MathJax is the only script loaded, from the copy beside the runs: formulas render with no network
    assert external_scripts == ["../mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"], external_scripts
    assert (run.directory.parent / "mathjax" / "MathJax.js").is_file()
    assert (run.directory.parent / "mathjax" / "config" / "TeX-AMS-MML_HTMLorMML-full.js").is_file()


def test_a_cell_that_checks_the_texts_claim_runs_but_stays_out_of_the_html(series):
    _, _, run = series
    assert run.results[2].status == "ok"
    page = (run.directory / "03_params.html").read_text()
    assert "iterations 7" in page and "the text promised" not in page


def test_a_second_run_never_overwrites_the_first(tmp_path):
    now = dt.datetime(2026, 1, 2, 3, 4, 5)
    first = lab.new_run_directory(tmp_path, now)
    second = lab.new_run_directory(tmp_path, now)
    assert first.name == "lab-20260102-030405"
    assert second.name == "lab-20260102-030405-2"


def test_only_picks_by_number_or_name_and_rejects_unknown_names(series):
    notebooks, _, _ = series
    assert [p.stem for p in lab.lab_notebooks(notebooks, ["03", "figure"])] == ["01_figure", "03_params"]
    with pytest.raises(lab.LabError, match="'09' matches no notebook; choose from: 01_figure"):
        lab.lab_notebooks(notebooks, ["09"])


def test_unknown_parameter_is_refused_before_anything_runs(series, tmp_path):
    notebooks, _, _ = series
    with pytest.raises(lab.LabError, match="itrations are declared by none"):
        lab.run_lab(parameters={"itrations": 3}, runs_dir=tmp_path, notebook_dir=notebooks, progress=False)
    assert not list(tmp_path.iterdir())


def test_cli_parses_parameters_as_yaml_and_reports_bad_requests(capsys, monkeypatch, tmp_path):
    seen = {}

    def fake_run_lab(**kwargs):
        seen.update(kwargs)
        raise lab.LabError("stop here")

    monkeypatch.setattr(lab, "run_lab", fake_run_lab)
    code = cli.main(["lab", "--backend", "local", "-p", "iterations", "10", "-p", "precision", "bf16",
                     "-p", "profile", "true", "--only", "05,08", "--runs-dir", str(tmp_path)])
    assert code == 2
    assert "stop here" in capsys.readouterr().err
    assert seen["parameters"] == {"iterations": 10, "precision": "bf16", "profile": True}
    assert seen["only"] == ["05", "08"] and seen["backend"] == "local"


class _Stderr(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [False, True])
def test_the_progress_bar_is_drawn_only_into_a_terminal(tty, monkeypatch, tmp_path):
    """`labkit lab 2> log.txt` or CI: stderr gets plain lines, no bar; papermill's bar over the cells stays off."""
    import papermill

    calls = []

    def fake_execute_notebook(notebook, output, **kwargs):
        calls.append(kwargs)
        shutil.copy(notebook, output)

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute_notebook)
    monkeypatch.setattr(lab, "write_html_index", lambda run, notebook_dir: run.index)
    (tmp_path / "notebooks").mkdir()
    _notebook(tmp_path / "notebooks" / "01_one.ipynb", [new_code_cell("1")])
    _notebook(tmp_path / "notebooks" / "02_two.ipynb", [new_code_cell("2")])
    monkeypatch.chdir(tmp_path)
    stderr = _Stderr(tty)
    monkeypatch.setattr(sys, "stderr", stderr)
    assert cli.main(["lab", "--runs-dir", str(tmp_path / "runs")]) == 0
    assert [call["progress_bar"] for call in calls] == [False, False]
    drawn = stderr.getvalue()
    if tty:
        assert "\r" in drawn and "2/2" in drawn
    else:
        assert "\r" not in drawn and "lab:" not in drawn


WIDGET_CALL = re.compile(r"\b(interact|widget|Dashboard)\(")


def test_every_cell_that_builds_widgets_is_tagged_for_the_short_timeout():
    tagged = 0
    for path in lab.lab_notebooks():
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code" and WIDGET_CALL.search(cell.source):
                assert lab.WIDGETS_TAG in cell.metadata.get("tags", []), f"{path.name}: {cell.source[:60]!r}"
                assert lab.cell_timeout(cell, default_s=600) == lab.WIDGETS_TIMEOUT_S
                tagged += 1
    assert tagged >= 5
    assert lab.cell_timeout(new_code_cell("x = 1"), default_s=600) == 600


def test_workspace_without_solutions_is_the_students_copy_and_the_instructors_keeps_them(tmp_path, capsys):
    assert cli.main(["workspace", str(tmp_path / "students"), "--no-solutions"]) == 0
    assert "without the solutions" in capsys.readouterr().out
    students = {p.relative_to(tmp_path / "students").as_posix() for p in (tmp_path / "students").rglob("*.ipynb")}
    labs = {f"notebooks/{p.name}" for p in lab.lab_notebooks()}
    assert labs <= students and not any("solutions" in name for name in students)
    assert "examples/tiny-cpu.yaml" in {p.relative_to(tmp_path / "students").as_posix()
                                        for p in (tmp_path / "students").rglob("*.yaml")}
    assert cli.main(["workspace", str(tmp_path / "instructor")]) == 0
    instructor = {p.relative_to(tmp_path / "instructor").as_posix()
                  for p in (tmp_path / "instructor").rglob("*.ipynb")}
    assert {name.replace("notebooks/", "notebooks/solutions/") for name in labs} <= instructor


def _stored(path) -> list[str]:
    """The code cells of a notebook that hold a stored output or an execution count."""
    return [cell.source[:60] for cell in nbformat.read(path, as_version=4).cells
            if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]


def test_the_students_copy_holds_no_stored_output_and_no_solution_and_the_instructors_keeps_them(tmp_path):
    """Lab 05's stored outputs are the very numbers its prediction cell asks for: the students' copy (both editions)
    shows no result before its cell is run, the instructor's copy is the course as it is."""
    students = tmp_path / "students"
    lab.copy_workspace(students, solutions=False)
    notebooks = sorted(students.rglob("*.ipynb"))
    assert {"notebooks/05_performance_estimation.ipynb", "notebooks/ko/05_performance_estimation.ipynb"} <= {
        p.relative_to(students).as_posix() for p in notebooks}
    assert not [p for p in notebooks if "solutions" in p.relative_to(students).parts]
    assert {p.relative_to(students).as_posix(): _stored(p) for p in notebooks if _stored(p)} == {}
    assert not [p for p in notebooks if "widgets" in nbformat.read(p, as_version=4).metadata]
    # the copy is still the same notebook, cell for cell, and opens as one
    shipped = lab.course_dir("notebooks") / "05_performance_estimation.ipynb"
    copied = nbformat.read(students / "notebooks" / "05_performance_estimation.ipynb", as_version=4)
    nbformat.validate(copied)
    assert [c.source for c in copied.cells] == [c.source for c in nbformat.read(shipped, as_version=4).cells]
    assert _stored(shipped), "lab 05 ships stored outputs: the test would prove nothing without them"

    instructor = tmp_path / "instructor"
    lab.copy_workspace(instructor)
    for name in ("05_performance_estimation.ipynb", "ko/05_performance_estimation.ipynb",
                 "solutions/05_performance_estimation.ipynb"):
        assert (instructor / "notebooks" / name).read_bytes() == (lab.course_dir("notebooks") / name).read_bytes()

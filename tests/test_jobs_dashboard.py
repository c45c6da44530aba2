"""The dashboard's data functions over a run index, and the widget wiring (no Jupyter needed)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from labkit.jobs.record import RunRecord
from labkit.jobs.dashboard import Dashboard, load_runs, run_table, view
from labkit.spec import load_spec

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "logs"


@pytest.fixture
def runs_root(tmp_path):
    spec = load_spec(ROOT / "examples" / "tiny-cpu.yaml")
    records = []
    for name, log, state in (("bert", "02-bert-vega-srun.log", "COMPLETED"),
                             ("gpt2", "03-mlm2025-gpt2-fp16-autodl.log", "RUNNING")):
        record = RunRecord.create(spec.replace(name=name), root=tmp_path)
        shutil.copy(FIXTURES / log, record.logs / "slurm-1.out")
        record.set_status(state)
        records.append(record)
    RunRecord.create(spec.replace(name="queued"), root=tmp_path)  # no logs yet
    return tmp_path, records


def test_run_table_and_load_runs(runs_root):
    root, (bert, gpt2) = runs_root
    table = run_table(root)
    assert table["name"].tolist() == ["bert", "gpt2", "queued"]
    assert table["state"].tolist() == ["COMPLETED", "RUNNING", "CREATED"]
    parsed, specs = load_runs(table["run_id"], root)
    assert list(parsed) == [bert.run_id, gpt2.run_id]  # the queued run has no log yet
    assert parsed[gpt2.run_id].iterations["iteration"].max() == 260 and specs[bert.run_id].name == "bert"
    comparison = view("comparison table", parsed, specs)
    assert list(comparison.index) == [bert.run_id, gpt2.run_id] and comparison["iteration_ms"].gt(0).all()
    assert "all ranks" in view("timeline per rank", parsed, specs).layout.title.text
    with pytest.raises(KeyError, match="metric"):
        view("nope", parsed)
    with pytest.raises(ValueError, match="no logs"):
        view("loss", {})


def test_dashboard_picks_views_and_stops_refreshing_when_runs_end(runs_root):
    root, (bert, gpt2) = runs_root
    dash = Dashboard(root, refresh_s=0.05)
    try:
        assert [value for _, value in dash.runs.options][:2] == [bert.run_id, gpt2.run_id]
        dash.runs.value = (bert.run_id, gpt2.run_id)
        assert dash.live_runs() == [gpt2.run_id] and "live" in dash.status.value
        fig = dash.render()
        assert [t.name for t in fig.data][:2] == [bert.run_id, f"{bert.run_id} (validation)"]
        dash.metric.value = "comparison table"
        assert list(dash.render().index) == [bert.run_id, gpt2.run_id]
        gpt2.set_status("COMPLETED")
        deadline = time.time() + 5
        while dash._thread is not None and dash._thread.is_alive() and time.time() < deadline:
            time.sleep(0.05)
        assert not dash._thread.is_alive() and dash.live_runs() == []
        dash.runs.value = ()
        assert "No runs" in dash.render()
    finally:
        dash.close()

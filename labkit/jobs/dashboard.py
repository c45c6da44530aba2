"""A notebook dashboard over the run index: pick runs, pick a view, watch running jobs refresh.

The widgets only arrange what tested functions return: `run_table` (the index as a DataFrame), `load_runs` (parsed
logs and specs of chosen runs) and `view` (a figure or table for one metric).

    from labkit.jobs.dashboard import Dashboard
    Dashboard().show()            # runs from ./runs (or $LABKIT_RUNS_DIR)
"""
from __future__ import annotations

import threading

import pandas as pd

from labkit.jobs.record import UNFINISHED_STATES, RunIndex, load_run
from labkit.logs import views
from labkit.logs.parse import ParsedLog, parse_log

METRICS = {
    "comparison table": lambda runs, specs: views.comparison_table(runs, specs=specs),
    "loss": lambda runs, specs: views.loss_figure(runs),
    "iteration time": lambda runs, specs: views.iteration_time_figure(runs),
    "timer breakdown": lambda runs, specs: views.timer_breakdown_figure(runs),
    "memory per rank": lambda runs, specs: views.memory_figure(_last(runs)),
    "timeline per rank": lambda runs, specs: views.timeline_figure(_last(runs)),
}


def _last(runs: dict) -> ParsedLog:
    """Single-run views show the last run picked."""
    return list(runs.values())[-1]


def run_table(root=None) -> pd.DataFrame:
    """The run index (labkit.jobs.record) as a table, newest last."""
    rows = RunIndex(root).rows()
    return pd.DataFrame(rows, columns=list(RunIndex.COLUMNS))


def load_runs(run_ids, root=None) -> tuple[dict[str, ParsedLog], dict]:
    """Parsed logs and specs of the chosen runs, keyed by run id; runs with no log yet are left out.

    Taught in lab 07.
    """
    parsed, specs = {}, {}
    for run_id in run_ids:
        record = load_run(run_id, root)
        try:
            parsed[record.run_id] = parse_log(record.logs)
        except FileNotFoundError:
            continue
        specs[record.run_id] = record.spec
    return parsed, specs


def view(metric: str, runs: dict[str, ParsedLog], specs: dict | None = None):
    """The figure or DataFrame for one metric of the chosen runs.

    Taught in lab 07.
    """
    if metric not in METRICS:
        raise KeyError(f"metric: {metric!r} is not one of {', '.join(METRICS)}")
    if not runs:
        raise ValueError("no logs yet for the chosen runs")
    return METRICS[metric](runs, specs or {})


class Dashboard:
    """Runs on the left, a metric above, the view below; while a chosen run is live, it refreshes every few seconds.

    Taught in lab 07.
    """

    def __init__(self, root=None, refresh_s: float = 10.0):
        import ipywidgets as w

        self.root = root
        self.refresh_s = refresh_s
        self.runs = w.SelectMultiple(description="runs", rows=8, layout=w.Layout(width="45%"))
        self.metric = w.Dropdown(options=list(METRICS), value="loss", description="view")
        self.live = w.Checkbox(value=True, description="live refresh while running")
        self.reload = w.Button(description="refresh", icon="refresh")
        self.status = w.HTML()
        self.output = w.Output()
        self._updating = False
        self.runs.observe(self._changed, names="value")
        self.metric.observe(self._changed, names="value")
        self.reload.on_click(lambda _: self.update_runs())
        self.widget = w.VBox([w.HBox([self.runs, w.VBox([self.metric, self.live, self.reload])]), self.status,
                              self.output])
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.update_runs()

    def show(self):
        from IPython.display import display
        display(self.widget)
        return self

    def update_runs(self) -> None:
        """Re-read the run index (new submissions, new states) and redraw."""
        table = run_table(self.root)
        self.states = dict(zip(table["run_id"], table["state"]))
        chosen = [r for r in self.runs.value if r in self.states]
        self._updating = True
        try:
            self.runs.options = [(f"{row.name} [{row.state}] {row.run_id}", row.run_id) for row in table.itertuples()]
            self.runs.value = tuple(chosen) or tuple(table["run_id"].tail(1))
        finally:
            self._updating = False
        self.refresh()

    def _changed(self, _change) -> None:
        if not self._updating:
            self.refresh()

    def render(self):
        """What the output area shows now: a figure, a table, or a sentence saying why there is nothing."""
        if not self.runs.value:
            return "No runs yet: submit one with labkit.jobs, then press refresh."
        parsed, specs = load_runs(self.runs.value, self.root)
        if not parsed:
            return "The chosen runs have no logs yet."
        return view(self.metric.value, parsed, specs)

    def refresh(self) -> None:
        from IPython.display import display
        shown = self.render()
        self.output.clear_output(wait=True)
        with self.output:
            print(shown) if isinstance(shown, str) else display(shown)
        live = self.live_runs()
        self.status.value = f"live: {', '.join(live)}" if live else ""
        if live and self.live.value:
            self._start_timer()

    def live_runs(self) -> list[str]:
        """Chosen runs whose job has not finished."""
        return [r for r in self.runs.value if str(self.states.get(r)) in UNFINISHED_STATES]

    def _start_timer(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.refresh_s):
            if not self.live.value:
                return
            self.update_runs()
            if not self.live_runs():
                return

    def close(self) -> None:
        self._stop.set()
        self.widget.close()

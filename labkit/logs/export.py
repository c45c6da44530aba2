"""A finished run's logs -> an MLflow run, written with mlflow's own client (`labkit logs export --mlflow STORE RUN`).

The logs are read by labkit's one parser (labkit.logs.parse): the arguments block becomes the run's parameters, each
logged iteration a step of the metrics below (under the parser's column names), each validation line's loss and
perplexity at its iteration under the names Megatron-LM gives them in TensorBoard and W&B (`lm loss validation`,
`lm loss validation ppl`), whether the line came during training or from the pass at its end (a line that names no
iteration, as before 2023, at the last logged one); the test set's under `lm loss test` and `lm loss test ppl`, where
Megatron-LM's TensorBoard files them under the validation tags too. The run is marked FAILED when its logs hold an
error.

STORE is a directory (MLflow's file store, `mlflow ui --backend-store-uri DIR` shows it) or any tracking URI mlflow
takes (sqlite:///mlflow.db needs the full `mlflow` package, an http:// server needs only mlflow-skinny). MLflow 3 keeps
its file store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE is true; asking for a directory is
asking for that store, so the export sets it for its own process.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pandas as pd

from labkit.logs.parse import ParsedLog, parse_log

METRICS = ("lm_loss", "lr", "grad_norm", "loss_scale", "elapsed_ms", "tflops_per_gpu", "samples_per_s",
           "tokens_per_gpu_per_s", "consumed_samples", "consumed_tokens", "global_batch_size", "skipped", "nan",
           "num_zeros", "params_norm")
"""The iteration columns exported as metrics (labkit.logs.parse.ITERATION_COLUMNS' names and units)."""

MAX_PARAM_CHARS = 6000
"""The longest parameter value an MLflow store takes (mlflow.utils.validation's MAX_PARAM_VAL_LENGTH)."""


def tracking_uri(store: str | os.PathLike) -> str:
    """A directory -> its file: URI (made absolute); a URI (scheme://..., sqlite:///...) as given."""
    text = os.fspath(store)
    if "://" in text or text.startswith(("sqlite:", "postgresql:", "mysql:", "databricks")):
        return text
    return Path(text).expanduser().resolve().as_uri()


def _epoch_ms(value) -> int | None:
    """A log's timestamp (the log's local time, as printed) -> milliseconds since the epoch; None when missing."""
    if value is None or pd.isna(value):
        return None
    return int(pd.Timestamp(value).to_pydatetime().timestamp() * 1000)


EVALUATED_SETS = {"valid": "validation", "validation": "validation", "val": "validation", "test": "test"}
"""The parser's validation splits -> the data set they measured: "valid" during training, "validation" or (before
2023) "val" at its end, "test" at its end."""


def validation_keys(split: str) -> tuple[str, str]:
    """The metric names of one validation line's loss and perplexity: Megatron-LM's TensorBoard tags."""
    name = f"lm loss {EVALUATED_SETS.get(split, split)}"
    return name, f"{name} ppl"


def metric_rows(parsed: ParsedLog) -> list[tuple[str, float, int, int | None]]:
    """(key, value, step, timestamp in ms or None) for every value the logs hold: iterations, then validation."""
    rows = []
    its = parsed.iterations
    for column in METRICS:
        if column not in its:
            continue
        for step, value, stamp in zip(its["iteration"], its[column], its["timestamp"]):
            if not pd.isna(value) and math.isfinite(float(value)):
                rows.append((column, float(value), int(step), _epoch_ms(stamp)))
    last = int(its["iteration"].max()) if not its.empty else 0
    for row in parsed.validation.itertuples():
        step = last if pd.isna(row.iteration) else int(row.iteration)
        for column, key in zip(("lm_loss", "lm_ppl"), validation_keys(row.split)):
            value = getattr(row, column)
            if not pd.isna(value):
                rows.append((key, float(value), step, None))
    return rows


def export_mlflow(logs, store: str | os.PathLike, experiment: str = "labkit", run_name: str | None = None) -> str:
    """Write the run in `logs` (a log file, a job's per-node files or a run directory) into the MLflow store as one
    run of `experiment`; returns the MLflow run id. Raises ValueError when the logs hold no iteration."""
    from labkit.extras import require

    require("labkit logs export --mlflow", "mlflow")
    parsed = parse_log(logs)
    if parsed.iterations.empty:
        raise ValueError(f"{', '.join(map(str, parsed.sources))}: no logged iteration to export")
    uri = tracking_uri(store)
    if uri.startswith("file:"):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.entities import Metric, Param, RunStatus
    from mlflow.tracking import MlflowClient

    paths = [Path(p) for p in ([logs] if isinstance(logs, (str, os.PathLike)) else logs)]
    name = run_name or (paths[0].name if paths[0].is_dir() else paths[0].stem)
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    now = int(time.time() * 1000)
    run = client.create_run(experiment_id, run_name=name,
                            tags={"labkit.logs": ", ".join(map(str, parsed.sources))})
    params = [Param(key, str(value)[:MAX_PARAM_CHARS]) for key, value in sorted(parsed.arguments.items())]
    metrics = [Metric(key, value, stamp if stamp is not None else now, step)
               for key, value, step, stamp in metric_rows(parsed)]
    client.log_batch(run.info.run_id, metrics=metrics, params=params)
    failed = (parsed.events["level"] == "error").any() if not parsed.events.empty else False
    client.set_terminated(run.info.run_id, status=RunStatus.to_string(RunStatus.FAILED if failed
                                                                      else RunStatus.FINISHED))
    return run.info.run_id

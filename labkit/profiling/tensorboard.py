"""TensorBoard event files -> DataFrames, read with the `tensorboard` package's own EventAccumulator.

A run's `--tensorboard-dir` holds `events.out.tfevents.*` files (one directory per writer); every scalar the driver
logs (loss, learning rate, loss scale, grad norm, iteration time, throughput, memory, timers) becomes rows of
(run, tag, step, value, wall_time).
"""
from __future__ import annotations

import shlex
from pathlib import Path

import pandas as pd

EVENT_FILE_GLOB = "events.out.tfevents.*"


def event_dirs(path) -> list[Path]:
    """Directories at or below PATH that hold TensorBoard event files (each is one TensorBoard "run")."""
    path = Path(path)
    if path.is_file():
        return [path.parent]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory; pass the run's --tensorboard-dir or run directory")
    return sorted({p.parent for p in path.rglob(EVENT_FILE_GLOB)})


def read_scalars(path) -> pd.DataFrame:
    """Every scalar under PATH: columns run (event directory relative to PATH, "." for PATH itself), tag, step,
    value, wall_time; sorted by run, tag and step.

    Taught in lab 02.
    """
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    root = Path(path) if Path(path).is_dir() else Path(path).parent
    dirs = event_dirs(path)
    if not dirs:
        raise FileNotFoundError(f"{path}: no TensorBoard event files ({EVENT_FILE_GLOB}); run the driver with "
                                f"--tensorboard-dir DIR")
    rows = []
    for d in dirs:
        accumulator = EventAccumulator(str(d), size_guidance={SCALARS: 0})  # 0 keeps every point, not a sample
        accumulator.Reload()
        run = str(d.relative_to(root))
        for tag in accumulator.Tags()["scalars"]:
            rows.extend((run, tag, e.step, e.value, e.wall_time) for e in accumulator.Scalars(tag))
    frame = pd.DataFrame(rows, columns=["run", "tag", "step", "value", "wall_time"])
    return frame.sort_values(["run", "tag", "step"], ignore_index=True)


def scalar_table(scalars: pd.DataFrame, tags: list[str] | None = None, run: str | None = None) -> pd.DataFrame:
    """Scalars as a wide table: one row per step, one column per tag (the last value where a step repeats)."""
    frame = scalars if run is None else scalars[scalars["run"] == run]
    if tags is not None:
        missing = sorted(set(tags) - set(frame["tag"]))
        if missing:
            raise KeyError(f"no scalar tag {missing}; the run has {sorted(frame['tag'].unique())}")
        frame = frame[frame["tag"].isin(tags)]
    return frame.pivot_table(index="step", columns="tag", values="value", aggfunc="last").rename_axis(columns=None)


def tensorboard_command(run_dir, port: int | None = None, bind_all: bool = False) -> str:
    """The shell command that opens a run (or a directory of runs, to compare them) in TensorBoard.

    Taught in lab 02.
    """
    parts = ["tensorboard", "--logdir", str(Path(run_dir))]
    if port is not None:
        parts += ["--port", str(port)]
    if bind_all:
        parts.append("--bind_all")
    return shlex.join(parts)

"""Losses of several runs side by side, from log lines in Megatron's format."""
import pytest

from labkit.logs import parse_text
from labkit.logs.losses import loss_table


def log(losses: dict[int, float | None]) -> str:
    lines = []
    for i, loss in losses.items():
        field = f"lm loss: {loss:.6E} | " if loss is not None else ""
        lines.append(f" iteration {i:8d}/      10 | elapsed time per iteration (ms): 50.0 | {field}loss scale: 1.0 |\n")
    return "".join(lines)


def test_columns_per_run_and_the_spread_of_each_iteration():
    runs = {"micro 2 x 4": parse_text(log({1: 6.943406, 2: 6.946426, 3: 6.941265})),
            "micro 8 x 1": parse_text(log({1: 6.943406, 2: 6.946428, 3: 6.941262}))}
    table = loss_table(runs)
    assert list(table.columns) == ["micro 2 x 4", "micro 8 x 1", "spread"]
    assert table.index.tolist() == [1, 2, 3]
    assert table["spread"].tolist() == pytest.approx([0.0, 2e-6, 3e-6])


def test_iterations_some_run_did_not_log_a_loss_for_are_left_out():
    runs = {"fp32": parse_text(log({1: 7.0, 2: 6.9, 3: 6.8})),
            "fp16": parse_text(log({1: None, 2: None, 3: 6.85})),
            "short": parse_text(log({1: 7.1, 3: 6.9}))}
    table = loss_table(runs)
    assert table.index.tolist() == [3]
    assert table.loc[3, "spread"] == pytest.approx(0.1)


def test_one_run_is_not_a_comparison():
    with pytest.raises(ValueError, match="at least two"):
        loss_table({"only": parse_text(log({1: 7.0}))})

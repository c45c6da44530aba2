"""fp16 loss-scale history from log lines in the driver's format, and the skipped-iteration count predicted from the
scale's fall (Megatron's dynamic scaler: the first overflow is absorbed by hysteresis 2, each further one halves)."""
from __future__ import annotations

import pytest

from labkit.logs import parse_text
from labkit.logs.loss_scale import loss_scale_history, skipped_until


def interval(i, scale, skipped, loss=None):
    loss_field = f"lm loss: {loss:.6E} | " if loss is not None else ""
    return (f" [2026-11-21 21:37:10] iteration {i:8d}/      20 | consumed samples: {8 * i:12d} | "
            f"elapsed time per iteration (ms): 120.0 | learning rate: 1.500000E-04 | global batch size:     8 | "
            f"{loss_field}loss scale: {scale:.1f} | number of skipped iterations: {skipped:3d} | "
            f"number of nan iterations:   0 |\n")


# What an fp16 run of the tiny model logs with --log-interval 1: skipped while 2^32 falls to 2^19, then trained.
FP16_LOG = "".join([interval(1, 2.0 ** 32, 1)] + [interval(i, 2.0 ** (33 - i), 1) for i in range(2, 15)]
                   + [interval(15, 2.0 ** 19, 0, 6.943), interval(16, 2.0 ** 19, 0, 6.944)])


def test_history_counts_skipped_iterations_and_marks_when_training_starts():
    history = loss_scale_history(parse_text(FP16_LOG))
    assert history["iteration"].tolist() == list(range(1, 17))
    assert history["loss_scale"].iloc[0] == 2.0 ** 32 and history["loss_scale"].iloc[-1] == 2.0 ** 19
    assert history["skipped_total"].tolist() == list(range(1, 15)) + [14, 14]
    assert history["trained"].tolist() == [False] * 14 + [True, True]


def test_intervals_longer_than_one_iteration_add_their_counts():
    text = interval(5, 2.0 ** 29, 5) + interval(10, 2.0 ** 24, 5) + interval(15, 2.0 ** 22, 2, 6.9)
    history = loss_scale_history(parse_text(text))
    assert history["skipped"].tolist() == [5, 5, 2]
    assert history["skipped_total"].tolist() == [5, 10, 12]


def test_skipped_iterations_predicted_from_the_scales_fall():
    history = loss_scale_history(parse_text(FP16_LOG))
    assert skipped_until(2 ** 32, history["loss_scale"].iloc[-1]) == history["skipped_total"].iloc[-1] == 14
    assert skipped_until(2 ** 32, 2 ** 16) == 17
    assert skipped_until(2 ** 32, 2 ** 16, hysteresis=1) == 16
    assert skipped_until(2 ** 16, 2 ** 16) == 0


@pytest.mark.parametrize("initial, final", [(2 ** 16, 2 ** 17), (2 ** 16, 3000.0), (0, 1)])
def test_a_scale_that_did_not_halve_its_way_there_is_refused(initial, final):
    with pytest.raises(ValueError):
        skipped_until(initial, final)

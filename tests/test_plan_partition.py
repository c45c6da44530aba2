import itertools

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.plan.partition import min_max_partition, stage_times


def all_splits(per_layer, fixed, caps):
    layers, stages = len(per_layer[0]), len(fixed)
    for cuts in itertools.combinations_with_replacement(range(layers + 1), stages - 1):
        bounds = [0, *cuts, layers]
        split = [b - a for a, b in zip(bounds, bounds[1:])]
        if all(n <= c for n, c in zip(split, caps)):
            yield split, stage_times(split, per_layer, fixed)


def brute_force(per_layer, fixed, caps):
    return min((max(times) for _, times in all_splits(per_layer, fixed, caps)), default=None)


@st.composite
def problems(draw):
    layers = draw(st.integers(1, 9))
    stages = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.lists(st.floats(0.01, 5.0), min_size=layers, max_size=layers), min_size=1, max_size=2))
    per_layer = [kinds[draw(st.integers(0, len(kinds) - 1))] for _ in range(stages)]
    fixed = draw(st.lists(st.floats(0.0, 3.0), min_size=stages, max_size=stages))
    caps = draw(st.lists(st.integers(0, layers), min_size=stages, max_size=stages))
    return per_layer, fixed, caps


@st.composite
def uniform_problems(draw):
    per_layer, fixed, caps = draw(problems())
    return [[costs[0]] * len(costs) for costs in per_layer], fixed, caps


@settings(max_examples=150, deadline=None)
@given(st.one_of(problems(), uniform_problems()))
def test_min_max_matches_brute_force(problem):
    per_layer, fixed, caps = problem
    best = brute_force(per_layer, fixed, caps)
    found = min_max_partition(per_layer, fixed, caps)
    if best is None:
        assert found is None
        return
    assert sum(found.layers) == len(per_layer[0])
    assert all(n <= c for n, c in zip(found.layers, caps))
    assert found.stage_times == pytest.approx(stage_times(found.layers, per_layer, fixed), rel=1e-12)
    assert abs(found.bottleneck - best) <= 1e-9 * best
    if all(len(set(costs)) == 1 for costs in per_layer):  # ties go to the least total time
        least = min(sum(times) for _, times in all_splits(per_layer, fixed, caps) if max(times) <= best * (1 + 1e-9))
        assert sum(found.stage_times) <= least * (1 + 1e-9)


def test_faster_stage_gets_more_layers():
    fast, slow = [1.0] * 12, [3.0] * 12
    found = min_max_partition([fast, slow, slow], [0.0, 0.0, 0.0])
    assert found.layers == [8, 2, 2]  # 8, 6, 6 seconds; an even-speed-blind [4, 4, 4] would take 12
    assert found.bottleneck == 8.0


def test_memory_caps_are_respected_and_can_make_it_infeasible():
    per_layer = [[1.0] * 10] * 2
    assert min_max_partition(per_layer, [0.0, 0.0], [3, 10]).layers == [3, 7]
    assert min_max_partition(per_layer, [0.0, 0.0], [3, 4]) is None


def test_fasop_shape_empty_end_stages_when_embedding_and_output_are_heavy():
    # FASOP's Megatron-LM scripts run 0-11-8-8-8-8-5-0: the first and last stages only hold the embedding and the
    # output layer
    per_layer = [[1.0] * 8] * 4
    found = min_max_partition(per_layer, [3.5, 0.0, 0.0, 3.5])
    assert found.layers == [0, 4, 4, 0]
    assert found.bottleneck == 4.0

"""Exact min-max partition of a model's layers over pipeline stages that run at different speeds.

Stage i runs layers [a, b) in `fixed[i] + prefix[i][b] - prefix[i][a]` seconds: its per-layer costs depend on the GPU it
runs on (an A100 stage is faster than an A10 one) and `fixed[i]` holds what does not move with the split (embedding on
the first stage, the output layer on the last, send/receive). The partition minimising the slowest stage is found
exactly by bisection on the bottleneck time with a greedy feasibility test: for a bound T, packing each stage with as
many layers as fit under T (and under its memory cap) reaches the end of the model if and only if some partition with
bottleneck <= T exists, because a stage's time only grows with the layers it holds. The answer is one of the finitely
many stage times, so bisection to float resolution finds it; the partition is then read off at that bound.
When each stage's layers all cost the same (profiles of identical transformer layers, analytic costs), the optimum is
found directly: hand out layers one at a time to the stage whose time would grow to the smallest value.

FASOP moves one layer at a time from the slowest stage to the fastest, which can stop in a local minimum.
"""
from __future__ import annotations

from dataclasses import dataclass
import heapq
from bisect import bisect_left
from itertools import accumulate


@dataclass(frozen=True)
class Partition:
    layers: list[int]  # transformer layers per stage, summing to the model's layers
    stage_times: list[float]  # seconds per stage under the costs given

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)


def stage_times(layers: list[int], per_layer: list[list[float]], fixed: list[float]) -> list[float]:
    """Seconds per stage for a given split (per_layer[i][k]: layer k's cost on stage i)."""
    times, start = [], 0
    for i, n in enumerate(layers):
        times.append(fixed[i] + sum(per_layer[i][start:start + n]))
        start += n
    return times


def min_max_partition(per_layer: list[list[float]], fixed: list[float], max_layers: list[int] | None = None,
                      balance: list[float] | None = None) -> Partition | None:
    """The split of layers over stages whose slowest stage is fastest; None when the memory caps cannot hold the model.

    per_layer[i][k] is layer k's time on stage i (stages of the same GPU type share one list), fixed[i] the stage's
    time independent of the split, max_layers[i] the most layers stage i can hold (memory). Stages may get no layer.
    When layers cost the same within each stage, ties in the bottleneck go to the split with the least total stage
    time (the 1F1B fill and drain), spread evenly over stages of equal speed; or, given `balance` (other fixed
    times, e.g. without the sends), to the split whose slowest stage under those times is fastest.
    """
    stages = len(fixed)
    num_layers = len(per_layer[0])
    caps = list(max_layers) if max_layers is not None else [num_layers] * stages
    if sum(min(c, num_layers) for c in caps) < num_layers:
        return None
    if all(min(costs) == max(costs) for costs in {id(c): c for c in per_layer}.values()):
        return _uniform_partition([costs[0] for costs in per_layer], fixed, caps, num_layers, balance)
    prefix_cache: dict[int, list[float]] = {}
    prefixes = []
    for costs in per_layer:  # identical lists (same GPU type) share one prefix-sum array
        key = id(costs)
        if key not in prefix_cache:
            prefix_cache[key] = [0.0, *accumulate(costs)]
        prefixes.append(prefix_cache[key])

    def pack(bound: float) -> list[int] | None:
        # Fill stages from the last one backwards: early 1F1B stages hold more micro-batches in flight, so the
        # spare room (if any) is left with them rather than with the stages that hold fewer activations.
        layers = [0] * stages
        end = num_layers
        for i in range(stages - 1, -1, -1):
            room = bound - fixed[i]
            if room < 0:
                return None
            prefix = prefixes[i]
            # smallest start a with prefix[end] - prefix[a] <= room
            start = _first_at_least(prefix, prefix[end] - room - tolerance, end)
            start = max(start, end - caps[i])
            layers[i] = end - start
            end = start
            if end == 0:
                break
        return layers if end == 0 else None

    lo = max(fixed)
    hi = max(f + p[-1] for f, p in zip(fixed, prefixes))  # one stage holding everything
    tolerance = 1e-12 * hi  # sums of equal layer costs differ in the last bits; do not let rounding drop a layer
    if pack(lo) is not None:
        hi = lo
    elif pack(hi) is None:
        return None  # only the memory caps can make even the loosest bound infeasible
    while hi - lo > 1e-10 * hi:
        mid = (lo + hi) / 2
        if pack(mid) is None:
            lo = mid
        else:
            hi = mid
    layers = pack(hi)
    return Partition(layers, stage_times(layers, per_layer, fixed))


def _first_at_least(prefix: list[float], target: float, end: int) -> int:
    """Smallest index a <= end with prefix[a] >= target (prefix is non-decreasing)."""
    return min(bisect_left(prefix, target, 0, end + 1), end)


def _uniform_partition(cost: list[float], fixed: list[float], caps: list[int], num_layers: int,
                       balance: list[float] | None = None) -> Partition:
    """Stage i takes fixed[i] + n * cost[i].

    The bottleneck: hand out layers one at a time to the stage whose time after taking it is smallest; the last one
    handed out sets the bottleneck, and no split does better, since every choice was the cheapest way to place one
    more layer. Among the splits under that bottleneck the pipeline's fill and drain (the sum of the stage times) is
    smallest with the layers on the cheapest stages, so those are filled first, up to the bottleneck; stages of the
    same speed share their layers evenly. With `balance`, the same one-at-a-time rule under the bottleneck's room,
    timed with `balance` instead of `fixed`, gives the split most even under those times.
    """
    stages = range(len(fixed))
    layers = _hand_out(cost, fixed, caps, num_layers)
    bound = max(f + n * c for f, n, c in zip(fixed, layers, cost))
    room = [max(0, min(caps[i], int((bound - fixed[i]) / cost[i] + 1e-9))) if cost[i] > 0 else caps[i] for i in stages]
    if balance is not None:
        layers = _hand_out(cost, balance, room, num_layers)
        return Partition(layers, [f + n * c for f, n, c in zip(fixed, layers, cost)])

    layers = [0] * len(fixed)
    left = num_layers
    for speed in sorted(set(cost)):
        group = [i for i in stages if cost[i] == speed and room[i] > 0]
        heap = [(fixed[i] + cost[i], i) for i in group]
        heapq.heapify(heap)
        while left and heap:
            _, i = heapq.heappop(heap)
            layers[i] += 1
            left -= 1
            if layers[i] < room[i]:
                heapq.heappush(heap, (fixed[i] + (layers[i] + 1) * cost[i], i))
    times = [f + n * c for f, n, c in zip(fixed, layers, cost)]
    return Partition(layers, times)


def _hand_out(cost: list[float], fixed: list[float], caps: list[int], num_layers: int) -> list[int]:
    """One layer at a time to the stage whose time would be smallest after taking it."""
    layers = [0] * len(fixed)
    heap = [(f + c, i) for i, (f, c) in enumerate(zip(fixed, cost)) if caps[i] > 0]
    heapq.heapify(heap)
    for _ in range(num_layers):
        _, i = heapq.heappop(heap)
        layers[i] += 1
        if layers[i] < caps[i]:
            heapq.heappush(heap, (fixed[i] + (layers[i] + 1) * cost[i], i))
    return layers

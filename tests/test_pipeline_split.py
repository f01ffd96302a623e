"""``balanced_split_points`` against every possible split, on unequal layer sizes.

The pipeline equivalence tests train layers of equal size, where many splits tie and an off-by-one in
the search still lands on an optimum (it survived the whole pipeline suite). Here the layer sizes
differ (seeded random, and hand-made cases where the best split is at an edge: the heavy layer
last, a stage count equal to the layer count), and the answer is compared with a brute force over
all ``C(n - 1, stages - 1)`` splits. Seen failing with the last allowed split point left out of the
search (``range(start + 1, n - k + 1)``: [1, 1, 10] in 2 stages split at 1 instead of 2), with the
first allowed point left out (``range(start + 2, ...)``), and with each stage's last layer reported
instead of the next stage's first (``(end - 1, ...)``: split point 0 in 4 stages of 4 layers).
"""

from __future__ import annotations

import itertools
import random

import pytest

from lit_ablate.strategies.pipeline_split import balanced_split_points, check_split_points


def _largest_stage(sizes: list[int], points: list[int], head: int, tail: int) -> int:
    bounds = [0, *points, len(sizes)]
    stages = [sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)]
    stages[0] += head
    stages[-1] += tail
    return max(stages)


def _brute_force(sizes: list[int], stages: int, head: int, tail: int) -> int:
    return min(
        _largest_stage(sizes, list(points), head, tail)
        for points in itertools.combinations(range(1, len(sizes)), stages - 1)
    )


@pytest.mark.parametrize(
    ("sizes", "stages", "head", "tail", "expected"),
    [
        ([1, 1, 10], 2, 0, 0, [2]),  # the heavy layer alone on the last stage: the last allowed point
        ([10, 1, 1], 2, 0, 0, [1]),  # the heavy layer alone on the first stage: the first allowed point
        ([3, 1, 4, 1], 4, 0, 0, [1, 2, 3]),  # as many stages as layers: one layer each
        ([1, 1, 1, 1], 2, 5, 0, [1]),  # a large embedding pushes the first split forward
        ([1, 1, 1, 1], 2, 0, 5, [3]),  # a large head pulls the last split back
    ],
)
def test_edge_splits(sizes, stages, head, tail, expected):
    assert balanced_split_points(sizes, stages, head, tail) == expected


def test_the_split_is_valid_and_as_balanced_as_any():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        sizes = [rng.randint(1, 100) for _ in range(n)]
        stages = rng.randint(1, n)
        head, tail = rng.randint(0, 150), rng.randint(0, 150)
        points = balanced_split_points(sizes, stages, head, tail)
        check_split_points(points, n, stages)  # stages - 1 increasing points in 1 .. n - 1
        assert _largest_stage(sizes, points, head, tail) == _brute_force(sizes, stages, head, tail), (
            sizes,
            stages,
            head,
            tail,
        )

"""Where the decoder layers split into pipeline stages: checked split points, or balanced by parameter count."""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING

from lit_ablate.errors import ConfigError
from lit_ablate.strategies.mesh import STRATEGY_KEY

if TYPE_CHECKING:
    pass


def check_split_points(points: list[int], num_layers: int, stages: int) -> None:
    """``stages - 1`` strictly increasing layer indices in ``1 .. num_layers - 1``."""
    inside = all(0 < p < num_layers for p in points)
    if len(points) != stages - 1 or not inside or any(b <= a for a, b in itertools.pairwise(points)):
        raise ConfigError(f"{STRATEGY_KEY}.split_points", points,
                          f"give {stages - 1} increasing decoder-layer indices between 1 and {num_layers - 1} "
                          "(where stages 2.. start), or null to balance by parameter count")


def balanced_split_points(layer_sizes: list[int], stages: int, head: int, tail: int) -> list[int]:
    """Split points minimising the largest stage's parameter count (``head`` on the first stage,
    ``tail`` on the last), each stage at least one layer."""
    n = len(layer_sizes)
    prefix = list(itertools.accumulate(layer_sizes, initial=0))

    def size(start: int, end: int) -> int:
        return prefix[end] - prefix[start] + (head if start == 0 else 0) + (tail if end == n else 0)

    @functools.cache
    def best(start: int, k: int) -> tuple[int, tuple[int, ...]]:
        if k == 1:
            return size(start, n), ()
        return min((max(size(start, end), best(end, k - 1)[0]), (end, *best(end, k - 1)[1]))
                   for end in range(start + 1, n - k + 2))

    return list(best(0, stages)[1])

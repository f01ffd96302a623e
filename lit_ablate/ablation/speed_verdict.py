"""The speed verdict: a variant's speed against the baseline's, from paired blocks, with an interval.

A study measures each run in blocks (``speed_blocks`` in its record): with ``interleave: steps`` the
variants of a seed take turns, one block of steps each per round, so load that drifts hits every
variant alike; with ``interleave: runs`` each run is one block and the seeds are the rounds. A block's
speed is its useful tokens over its seconds (the step clock's, which leaves out waiting for a turn).

For a variant, each round where it and the baseline both have a block gives one ratio (variant ÷
baseline). A pair is left out when the two blocks ran under different load from other processes
(``load_tolerance``, in cores): a burst on one side would read as that variant's speed. The estimate
is the median of the remaining ratios and the interval the sign test's for the median: the k-th
smallest and k-th largest ratio, k the largest count with ``P(Binomial(n, 1/2) < k) <= (1 - confidence)
/ 2``. It assumes only that rounds are independent: no normality, and one outlier moves it by one rank.
The verdict is one of ``VERDICTS``:

- *faster* / *slower*: the interval excludes 1 and the estimate is beyond the practical threshold;
- *no difference detected*: the whole interval lies within the threshold (``1/(1+t) .. 1+t``);
- *inconclusive*: fewer pairs than the interval needs, or an interval too wide to tell either way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lit_ablate.ablation.layout_change import ranks

FASTER, SLOWER, SAME, INCONCLUSIVE = "faster", "slower", "no difference detected", "inconclusive"
VERDICTS = (FASTER, SLOWER, SAME, INCONCLUSIVE)
SPEED_SERIES = "useful_tokens_per_sec"
"""What a block's speed is made of; a simulated rank, which records no job throughput, uses its own
``useful_tokens_per_sec_per_device``."""
SIMULATED_SERIES = "useful_tokens_per_sec_per_device"
INTERLEAVE_MODES = ("auto", "steps", "runs")


@dataclass(frozen=True)
class SpeedDesign:
    """How a study measures and judges speed (its ``speed:`` block).

    The defaults favour no false verdict over a verdict: with 10 paired blocks the 99% interval runs from
    the smallest ratio to the largest, so two variants that cannot differ are called faster or slower only
    when all ten pairs fall on one side, 2 in 1,024 studies whatever the noise; a verdict needs 8 pairs.

    Args:
        rounds: blocks per run: each variant of a seed runs its measured steps in this many blocks,
            in turns with the other variants.
        confidence: of the interval on each speed ratio (at least this; the sign test's coverage comes
            in steps, and the interval reached is reported).
        threshold: the practical threshold: a ratio within ``1/(1+threshold) .. 1+threshold`` is no
            difference worth naming.
        load_tolerance: CPU cores of other processes' load by which the two blocks of a pair may
            differ before the pair is left out.
        interleave: ``steps`` (variants take turns, block by block), ``runs`` (one block per run, the
            seeds are the rounds) or ``auto`` (steps where the study runs locally and its runs fit in
            memory together).
    """

    rounds: int = 10
    confidence: float = 0.99
    threshold: float = 0.05
    load_tolerance: float = 0.25
    interleave: str = "auto"


def min_pairs(confidence: float) -> int:
    """The fewest pairs whose sign-test interval (smallest to largest ratio) reaches ``confidence``."""
    n = 1
    while 1 - 2 * 0.5**n < confidence:
        n += 1
    return n


def sign_interval(values: Sequence[float], confidence: float) -> tuple[float, float, float] | None:
    """``(low, high, achieved confidence)`` of the median of ``values``, or None when too few."""
    ordered = sorted(values)
    n = len(ordered)
    k, achieved = 0, 0.0
    for candidate in range(1, n // 2 + 1):
        coverage = 1 - 2 * _binomial_cdf(candidate - 1, n)
        if coverage < confidence:
            break
        k, achieved = candidate, coverage
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k], achieved


def _binomial_cdf(k: int, n: int) -> float:
    """``P(Binomial(n, 1/2) <= k)``."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def block_speed(record: Mapping[str, Any], block: Mapping[str, Any]) -> float | None:
    """Useful tokens per second over the block's steps, by the step clock: ``first_step`` .. ``last_step``
    (None: from the first step after warm-up, to the last)."""
    series = SIMULATED_SERIES if record.get("simulated") else SPEED_SERIES
    first = block.get("first_step") or int(record.get("warmup_steps") or 0) + 1
    last = block.get("last_step") or math.inf
    tokens = seconds = 0.0
    for step in record.get("steps", []):
        if first <= step["step"] <= last:
            rate, time = step.get(series), step.get("step_time_s")
            if rate is None or not time or not math.isfinite(rate):
                continue
            tokens += rate * time
            seconds += time
    return tokens / seconds if seconds > 0 else None


def blocks_of(record: Mapping[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """The record's measured blocks keyed by ``(group, round)``, each with its ``speed`` and the ``ranks``
    it ran on. A record without blocks (a SLURM job, an older record) is one block of its seed, like
    ``interleave: runs``."""
    section = record.get("speed_blocks") or {
        "group": "runs",
        "blocks": [{"round": record.get("seed") or 0, "first_step": None, "last_step": None}],
    }
    keyed = {}
    for block in section.get("blocks", []):
        speed = block_speed(record, block)
        if speed is not None:
            keyed[(section.get("group", ""), block["round"])] = {**block, "speed": speed, "ranks": ranks(record)}
    return keyed


def judge_speed(
    variant_records: Sequence[Mapping[str, Any]],
    baseline_records: Sequence[Mapping[str, Any]],
    design: SpeedDesign,
    same_ranks: bool = True,
) -> dict[str, Any]:
    """The variant's speed ratio to the baseline, its interval and verdict, and what was left out.

    ``same_ranks``: the study runs the two variants on as many ranks, so a pair measured on different
    numbers (a study started again on another layout, ``layout_change``) compares layouts, and is left out.
    """
    mine = {key: block for record in variant_records for key, block in blocks_of(record).items()}
    theirs = {key: block for record in baseline_records for key, block in blocks_of(record).items()}
    paired = sorted(set(mine) & set(theirs), key=lambda key: (key[0], key[1]))
    ratios, loaded, other_layout = [], 0, 0
    for key in paired:
        a, b = mine[key], theirs[key]
        if same_ranks and a["ranks"] != b["ranks"]:
            other_layout += 1
            continue
        load_a, load_b = a.get("foreign_cores"), b.get("foreign_cores")
        if load_a is not None and load_b is not None and abs(load_a - load_b) > design.load_tolerance:
            loaded += 1
            continue
        ratios.append(a["speed"] / b["speed"])
    result: dict[str, Any] = {
        "ratio": statistics.median(ratios) if ratios else None,
        "low": None,
        "high": None,
        "confidence": None,
        "pairs": len(ratios),
        "excluded_for_load": loaded,
        "excluded_for_layout": other_layout,
        "unpaired": len(set(mine) ^ set(theirs)),
    }
    needed = min_pairs(design.confidence)
    interval = sign_interval(ratios, design.confidence)
    if interval is None:
        reason = f"{len(ratios)} paired block(s), {needed} needed for a {design.confidence:.0%} interval"
        if loaded:
            reason += f" ({loaded} left out: measured under different load from other processes)"
        if other_layout:
            reason += f" ({other_layout} left out: measured on different numbers of ranks)"
        return {**result, "verdict": INCONCLUSIVE, "reason": reason}
    low, high, achieved = interval
    result.update(low=low, high=high, confidence=achieved)
    top, bottom = 1 + design.threshold, 1 / (1 + design.threshold)
    if low > 1 and result["ratio"] >= top:
        return {**result, "verdict": FASTER, "reason": None}
    if high < 1 and result["ratio"] <= bottom:
        return {**result, "verdict": SLOWER, "reason": None}
    if bottom <= low and high <= top:
        return {**result, "verdict": SAME, "reason": None}
    return {
        **result,
        "verdict": INCONCLUSIVE,
        "reason": f"the interval {low:.3g}–{high:.3g} reaches beyond ±{design.threshold:.0%} without excluding 1"
        if low <= 1 <= high
        else f"a difference under the ±{design.threshold:.0%} threshold, or noise",
    }


def speed_figure(speed: Mapping[str, Any] | None) -> str | None:
    """``0.91× [0.88–0.95]``: the ratio and its interval (None when no block was paired)."""
    if not speed or speed.get("ratio") is None:
        return None
    interval = f" [{speed['low']:.2f}–{speed['high']:.2f}]" if speed.get("low") is not None else ""
    return f"{speed['ratio']:.2f}×{interval}"


def speed_words(speed: Mapping[str, Any] | None, with_figure: bool = True) -> str:
    """``slower 0.91× [0.88–0.95]``, or ``speed inconclusive (why)``: a ratio never stands without its verdict."""
    if not speed:
        return "speed not measured"
    figure = speed_figure(speed) if with_figure else None
    if speed["verdict"] == INCONCLUSIVE:
        return f"speed inconclusive{' ' + figure if figure else ''} ({speed['reason']})"
    word = "same speed" if speed["verdict"] == SAME else speed["verdict"]
    return f"{word} {figure}" if figure else word

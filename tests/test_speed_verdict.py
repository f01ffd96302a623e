"""The speed verdict (``lit_ablate.ablation.speed_verdict``): paired blocks, the sign-test interval, the four
verdicts, and pairs left out for load; and how the report and the terminal say it.

Records here are built by hand: each block's speed is what ``block_speed`` reads from the record's steps,
so every case states the ratios it is made of.
"""

from __future__ import annotations

import math
import random

import pytest

from lit_ablate.ablation.speed_verdict import (
    FASTER,
    INCONCLUSIVE,
    SAME,
    SLOWER,
    SpeedDesign,
    block_speed,
    judge_speed,
    min_pairs,
    sign_interval,
)
from lit_ablate.ablation.summary import study_summary
from lit_ablate.ablation.terminal_summary import terminal_summary

DEFAULTS = SpeedDesign()


def record(speeds: list[float], loads: list[float | None] | None = None, group: str = "g", seed: int = 0) -> dict:
    """A record whose block ``i`` (round ``i + 1``) ran two steps at ``speeds[i]`` useful tokens/s."""
    steps, blocks = [], []
    for i, speed in enumerate(speeds):
        first = 2 * i + 1
        for step in (first, first + 1):
            steps.append({"step": step, "useful_tokens_per_sec": speed, "step_time_s": 0.5})
        load = loads[i] if loads else None
        blocks.append({"round": i + 1, "first_step": first, "last_step": first + 1, "foreign_cores": load})
    return {
        "seed": seed,
        "warmup_steps": 0,
        "steps": steps,
        "speed_blocks": {"design": "steps", "group": group, "blocks": blocks},
        "summary": {"status": "ok"},
    }


def test_min_pairs_is_the_fewest_whose_extreme_interval_reaches_the_confidence():
    assert min_pairs(0.95) == 6 and min_pairs(0.99) == 8 and min_pairs(0.5) == 2


def test_the_sign_interval_is_the_kth_smallest_to_kth_largest_at_the_confidence():
    """n = 10 at 95%: k = 2 (coverage 1 - 2 * 11/1024 = 0.9785); at 99%: k = 1 (1 - 2/1024)."""
    values = [float(v) for v in range(1, 11)]
    low, high, reached = sign_interval(values, 0.95)
    assert (low, high) == (2.0, 9.0) and reached == pytest.approx(1 - 22 / 1024)
    low, high, reached = sign_interval(values, 0.99)
    assert (low, high) == (1.0, 10.0) and reached == pytest.approx(1 - 2 / 1024)
    assert sign_interval(values[:7], 0.99) is None


def test_a_block_s_speed_is_its_tokens_over_its_seconds():
    """Tokens over seconds, not the mean of rates: a 1 s step at 100 and a 3 s step at 300 make 250."""
    rec = {
        "steps": [
            {"step": 1, "useful_tokens_per_sec": 100.0, "step_time_s": 1.0},
            {"step": 2, "useful_tokens_per_sec": 300.0, "step_time_s": 3.0},
            {"step": 3, "useful_tokens_per_sec": 999.0, "step_time_s": 1.0},
        ]
    }
    assert block_speed(rec, {"first_step": 1, "last_step": 2}) == pytest.approx(250.0)
    assert block_speed({**rec, "warmup_steps": 2}, {"first_step": None, "last_step": None}) == 999.0


def test_a_real_difference_is_slower_with_an_interval_that_excludes_one():
    base = record([100.0 + i for i in range(10)])
    slow = record([(100.0 + i) / 4 * (1 + 0.01 * (-1) ** i) for i in range(10)])
    speed = judge_speed([slow], [base], DEFAULTS)
    assert speed["verdict"] == SLOWER and speed["high"] < 1 and speed["ratio"] == pytest.approx(0.25, rel=0.02)
    assert judge_speed([base], [slow], DEFAULTS)["verdict"] == FASTER


def test_equal_speeds_within_the_threshold_are_no_difference_and_noise_is_inconclusive():
    """A null variant measured within 2% of the baseline is *no difference detected*; one measured under
    noise of ±40% is *inconclusive*, never faster or slower, although its median ratio is 1.15."""
    base = record([100.0] * 10)
    close = record([100.0 * (1 + 0.02 * math.sin(i)) for i in range(10)])
    assert judge_speed([close], [base], DEFAULTS)["verdict"] == SAME
    noisy = record([100.0 * f for f in (1.4, 0.7, 1.3, 1.2, 0.6, 1.15, 1.35, 0.9, 1.1, 1.3)])
    speed = judge_speed([noisy], [base], DEFAULTS)
    assert speed["verdict"] == INCONCLUSIVE and speed["low"] < 1 < speed["high"] and "reaches beyond" in speed["reason"]


def test_too_few_pairs_are_inconclusive_naming_how_many_are_needed():
    speed = judge_speed([record([50.0] * 4)], [record([100.0] * 4)], DEFAULTS)
    assert speed["verdict"] == INCONCLUSIVE and speed["ratio"] == 0.5 and speed["low"] is None
    assert speed["reason"] == "4 paired block(s), 8 needed for a 99% interval"


def test_pairs_measured_under_different_load_are_left_out_and_can_make_the_verdict_inconclusive():
    """A burst of another process's load on one side of a pair reads as that variant's speed: such pairs
    (load differing by more than ``load_tolerance`` cores) are left out and counted. Here a null variant
    (1% under the baseline when quiet) ran six of its ten blocks beside a CPU-bound process, at half speed.
    Seen failing with the exclusion off (``load_tolerance`` 100): *slower*, 0.50× [0.50–0.99]."""
    base = record([100.0] * 10, loads=[0.0] * 10)
    loads = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    variant = record([50.0 if load else 99.0 for load in loads], loads)
    speed = judge_speed([variant], [base], DEFAULTS)
    assert speed["excluded_for_load"] == 6 and speed["pairs"] == 4 and speed["verdict"] == INCONCLUSIVE
    assert "6 left out: measured under different load" in speed["reason"]
    assert judge_speed([variant], [base], SpeedDesign(load_tolerance=100))["verdict"] == SLOWER  # the trap
    steady = record([50.0 if load else 100.0 for load in loads], [0.9] * 10)  # the same load on both sides
    assert judge_speed([steady], [record([100.0] * 10, loads=[1.0] * 10)], DEFAULTS)["excluded_for_load"] == 0


def test_blocks_pair_only_within_one_group_and_round():
    """Runs measured in different invocations (a resumed study) share no round: nothing is paired."""
    speed = judge_speed([record([50.0] * 10, group="today")], [record([100.0] * 10, group="yesterday")], DEFAULTS)
    assert speed["pairs"] == 0 and speed["unpaired"] == 20 and speed["verdict"] == INCONCLUSIVE


def test_records_without_blocks_are_one_block_each_paired_by_seed():
    """SLURM runs and older records: one block per run, the seeds as rounds (``interleave: runs``)."""

    def plain(seed: int, speed: float) -> dict:
        steps = [{"step": s, "useful_tokens_per_sec": speed, "step_time_s": 1.0} for s in range(1, 5)]
        return {"seed": seed, "warmup_steps": 1, "steps": steps, "summary": {"status": "ok"}}

    base = [plain(seed, 100.0) for seed in range(8)]
    speed = judge_speed([plain(seed, 200.0 + seed) for seed in range(8)], base, DEFAULTS)
    assert speed["pairs"] == 8 and speed["verdict"] == FASTER and speed["low"] == pytest.approx(2.0)


def test_null_studies_under_heavy_noise_almost_never_get_a_verdict():
    """The design's promise, simulated: 2,000 null studies whose blocks carry independent noise of up to
    ±50% (log-uniform) and 10 rounds get faster/slower only when all ten pairs fall on one side, about
    2 in 1,024 of them (7 here with this seed); a 95% interval (k = 2) gives 48."""
    rng = random.Random(0)
    wrong = 0
    for _ in range(2000):
        base = record([100.0 * math.exp(rng.uniform(-0.4, 0.4)) for _ in range(10)])
        null = record([100.0 * math.exp(rng.uniform(-0.4, 0.4)) for _ in range(10)])
        wrong += judge_speed([null], [base], DEFAULTS)["verdict"] in (FASTER, SLOWER)
    assert wrong <= 10


def test_the_terminal_and_the_report_never_show_a_bare_ratio(tmp_path):
    """Issue 48: ``lr1e-2 10.33× faster`` from one measured step. A ratio now always comes with its interval
    (or the reason there is none) and one of the four verdicts, on the terminal and in the report."""
    plan = {"name": "s", "baseline": "a", "variants": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}
    runs = [
        ("runs/a/seed0/run.json", {**record([100.0] * 10), "variant": "a"}),
        ("runs/b/seed0/run.json", {**record([1033.0] * 2), "variant": "b"}),
        ("runs/c/seed0/run.json", {**record([50.0] * 10), "variant": "c"}),
    ]
    for _, rec in runs:
        rec["summary"] = {"status": "ok", "final_loss": 1.0}
    summary = study_summary(plan, runs)
    text = terminal_summary(summary, tmp_path / "report.md")
    b_line = next(line for line in text.splitlines() if line.startswith("b "))
    assert "10.33×" in b_line and "speed inconclusive (2 paired block(s), 8 needed" in b_line and "faster" not in b_line
    c_line = next(line for line in text.splitlines() if line.startswith("c "))
    assert "0.50× [0.50–0.50]" in c_line and c_line.endswith("slower")
    variants = {v["name"]: v for v in summary["variants"]}
    assert variants["b"]["speed"]["verdict"] == INCONCLUSIVE and variants["c"]["speed"]["verdict"] == SLOWER

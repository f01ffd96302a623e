"""``expect_equal_gradients``: one step's gradient norms of a variant against the baseline's, tensor by tensor.

Each run of a study that asks for the check records, at the check's step, every parameter's gradient norm
(one per expert for stacked expert weights: ``GradientFingerprint``, under ``run.json["gradients"]``). A
variant passes when, for every seed both it and the baseline ran ok, every norm is within ``rtol`` of the
baseline's, relative to that tensor's largest norm in the baseline: two layouts of one model differ there
by float32 rounding (a few 1e-7), a gradient scaled by 1.01 on one expert by about 1e-2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lit_ablate.record import GRADIENTS_SECTION


def gradient_check(
    runs: Sequence[tuple[str, Mapping[str, Any]]],
    baseline_runs: Sequence[tuple[str, Mapping[str, Any]]],
    tolerance: Mapping[str, Any],
) -> dict[str, Any]:
    """One variant's check from its ``(path, record)`` runs and the baseline's: pass, fail, or ``incomplete``
    (never a silent pass). A variant without an ok run is not checked (``passed: None``); a seed of it that
    the baseline has no ok run of, or a run without the step's record, leaves the check incomplete."""
    mine, theirs = _ok_records(runs), _ok_records(baseline_runs)
    if not mine:
        return {"passed": None, "incomplete": False, "reason": "this variant has no ok run"}
    step = tolerance["step"]
    for seed in sorted(mine, key=_seed_order):
        if seed not in theirs:
            return _incomplete(f"the baseline has no ok run of seed {seed}")
        for who, record in (("this variant", mine[seed]), ("the baseline", theirs[seed])):
            section = record.get(GRADIENTS_SECTION) or {}
            if section.get("step") != step or not section.get("norms"):
                return _incomplete(f"seed {seed}: {who} recorded no gradients at step {step}")
    worst: dict[str, Any] = {"max_rel_diff": 0.0, "worst_tensor": None, "worst_seed": None}
    for seed in sorted(mine, key=_seed_order):
        norms, reference = mine[seed][GRADIENTS_SECTION]["norms"], theirs[seed][GRADIENTS_SECTION]["norms"]
        unmatched = sorted(set(norms) ^ set(reference))
        if unmatched:
            where = "this variant" if unmatched[0] in norms else "the baseline"
            return {
                "passed": False,
                "incomplete": False,
                **worst,
                "reason": f"seed {seed}: {len(unmatched)} of the tensors have a gradient in one of the runs "
                f"only ({unmatched[0]} only in {where})",
            }
        for name, expected in reference.items():
            found = norms[name]
            if len(found) != len(expected) or not all(_finite(x) for x in [*found, *expected]):
                return {
                    "passed": False,
                    "incomplete": False,
                    **worst,
                    "reason": f"seed {seed}: {name}: norms {_short(found)} vs {_short(expected)}",
                }
            scale = max(expected) or max(found) or 1.0
            for index, (x, y) in enumerate(zip(found, expected)):
                difference = abs(x - y) / scale
                if difference > worst["max_rel_diff"]:
                    label = name + (f" (expert {index})" if len(expected) > 1 else "")
                    worst = {"max_rel_diff": difference, "worst_tensor": label, "worst_seed": seed}
    seeds = sorted(mine, key=_seed_order)
    if worst["max_rel_diff"] > tolerance["rtol"]:
        return {
            "passed": False,
            "incomplete": False,
            "compared_seeds": seeds,
            **worst,
            "reason": f"seed {worst['worst_seed']}: {worst['worst_tensor']} off by {worst['max_rel_diff']:.2e} "
            "of its largest norm",
        }
    return {"passed": True, "incomplete": False, "reason": None, "compared_seeds": seeds, **worst}


def _ok_records(runs: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[Any, Mapping[str, Any]]:
    return {r.get("seed"): r for _, r in runs if (r.get("summary") or {}).get("status") == "ok"}


def _incomplete(reason: str) -> dict[str, Any]:
    return {"passed": None, "incomplete": True, "reason": reason}


def _finite(x: Any) -> bool:
    """A recorded norm: a number (a NaN or infinite one is recorded as null)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def _short(values: Sequence[Any]) -> str:
    return (
        "["
        + ", ".join("null" if v is None else f"{v:.4g}" for v in values[:4])
        + (", ...]" if len(values) > 4 else "]")
    )


def _seed_order(seed: int | None) -> tuple[bool, int]:
    return seed is None, seed or 0

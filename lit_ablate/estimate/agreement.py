"""Whether an estimate agrees with a measured run, category by category."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_ablate.estimate.shapes import MemoryEstimate

AGREEMENT_FACTORS: dict[str, float] = {
    "params": 1.05,
    "grads": 1.05,
    "optimizer": 1.1,
    "activations": 1.3,
    "transient": 2.0,
}
"""How far (either way) an estimated category may be from the measured one and still agree: the
state categories are exact byte counts (buffers and ZeRO-1's whole-tensor partitions make the
small difference); activations are a per-token model of what autograd saves; transient copies
depend on when a strategy frees its buffers. Checked on several shapes and strategies in
tests/test_estimate_memory.py; every study report marks the categories that disagree."""
NEGLIGIBLE_SHARE = 0.01
"""A category whose estimate and measurement differ by less than this share of the measured tensor
peak agrees whatever their ratio (a few KiB of batch tensors against an estimated 0)."""


def compare_with_measured(
    estimate: MemoryEstimate, breakdown: Mapping[str, Any], token_share: float | None = None
) -> dict[str, dict[str, Any]]:
    """Per category: estimated and measured bytes, their ratio and whether it is within
    ``AGREEMENT_FACTORS`` (or apart by a ``NEGLIGIBLE_SHARE`` of the peak). ``breakdown`` is a run
    record's ``tensor_breakdown``: each state category's maximum over the step, and for
    ``activations`` the most activations and temporaries reach together during forward and
    backward (what ``activation_bytes`` models).

    ``token_share``: the measured step's tokens over the ``micro_batch x seq_len`` the estimate counts,
    when its rows were shorter (padded to the batch's longest, or packed). The activations estimate is
    then an upper bound: above its factor it agrees, marked ``upper_bound``, if scaled to the step's
    tokens it is within the factor or below (activations grow with tokens); above even then, it does not.
    """
    measured = {
        **{c: int(breakdown["max"].get(c, 0)) for c in ("params", "grads", "optimizer", "transient")},
        "activations": int(breakdown["forward_backward_max"]),
    }
    measured["params"] += int(breakdown["max"].get("frozen_params", 0))  # the estimate's params: trainable and frozen
    negligible = NEGLIGIBLE_SHARE * sum(breakdown["at_peak"].values())
    out = {}
    for category, factor in AGREEMENT_FACTORS.items():
        estimated, actual = getattr(estimate, category), measured[category]
        ratio = estimated / actual if actual else None
        agrees = abs(estimated - actual) <= negligible or (ratio is not None and 1 / factor <= ratio <= factor)
        bound = (
            category == "activations"
            and not agrees
            and token_share is not None
            and token_share < 1
            and ratio is not None
            and ratio > factor
            and ratio * token_share <= factor
        )
        out[category] = {"estimated": estimated, "measured": actual, "ratio": ratio, "agrees": agrees or bound}
        if bound:
            out[category]["upper_bound"] = token_share
    return out

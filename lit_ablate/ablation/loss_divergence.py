"""How far each variant's loss curve is from the baseline's, step by step.

The report's final-loss delta shows where two curves end; a precision or numerics ablation (fp8
vs fp32, say) also needs how the gap grows: a constant offset from the first steps, a drift, or
a late divergence. Computed from the variants' loss curves (median over seeds per step) only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SHOWN_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""Besides step 1, the report's columns: these fractions of the baseline's last step."""


def loss_delta_by_step(variant: Mapping[str, Any], base: Mapping[str, Any] | None) -> dict[str, list] | None:
    """``{"step": [...], "delta": [...]}``: variant loss minus baseline loss at every step both have
    (None for the baseline itself, or without common steps)."""
    if base is None or variant is base:
        return None
    mine = dict(zip(variant["loss_curve"]["step"], variant["loss_curve"]["median"]))
    theirs = dict(zip(base["loss_curve"]["step"], base["loss_curve"]["median"]))
    steps = sorted(set(mine) & set(theirs))
    return {"step": steps, "delta": [mine[s] - theirs[s] for s in steps]} if steps else None


def loss_divergence_section(summary: Mapping[str, Any]) -> list[str]:
    """Markdown lines of the per-step table (nothing when no variant has a delta series)."""
    rows = [v for v in summary["variants"] if v.get("loss_delta_by_step")]
    if not rows:
        return []
    last = max(s for v in rows for s in v["loss_delta_by_step"]["step"])
    shown = sorted({1, *(max(1, round(f * last)) for f in SHOWN_FRACTIONS)})
    fp8 = any(v.get("fp8") for v in summary["variants"])
    header = ["variant", *(["fp8 matmuls"] if fp8 else []), *(f"Δ step {s}" for s in shown), "largest abs Δ (step)"]
    lines = [
        "",
        f"## Loss difference from the baseline ({summary['study']['baseline']}) by step",
        "",
        "Δ = the variant's loss minus the baseline's at the same step (median over seeds)."
        + (
            " fp8 matmuls: `real` fp8 kernels, or `emulated` (fp8-rounded operands multiplied in fp32: fp8's "
            "numerics, not its speed or memory), as each run recorded."
            if fp8
            else ""
        ),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for v in rows:
        delta = dict(zip(v["loss_delta_by_step"]["step"], v["loss_delta_by_step"]["delta"]))
        worst = max(delta, key=lambda s: abs(delta[s]))
        cells = [v["name"], *([v.get("fp8") or "—"] if fp8 else [])]
        cells += [f"{delta[s]:+.4f}" if s in delta else "—" for s in shown]
        cells.append(f"{abs(delta[worst]):.4f} ({worst})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines

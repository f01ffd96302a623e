"""What a finished study prints: one short row per variant, the study's problems and the report's path.

The report (``report.md``) has a column for every measurement; on the terminal a user first wants
to know, per variant, whether it ran, how its speed and memory compare with the baseline, how far
its final loss moved, and one verdict in words. The verdict never claims more than the report:
a speed ratio always comes with its interval and verdict (``speed_verdict.speed_words``: faster, slower,
same speed or inconclusive, never a bare ratio), a loss or gradient check is named only where the study
asked for one (``expect_equal_loss``, ``expect_equal_gradients``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lit_ablate.ablation.speed_verdict import speed_figure, speed_words

SAME_MEMORY = 0.05
"""A memory ratio within 1 ± this reads as "same memory" (tensor peaks of equal models differ by a
few buffers)."""
MESSAGE_CHARS = 70


def verdict(variant: Mapping[str, Any], baseline: str, with_figures: bool = True) -> str:
    """The variant in words: its status when not every seed ran ok, else speed, memory and the loss check."""
    status = variant["status"]
    if status != "ok":
        failed = next((r for r in variant["runs"] if r["status"] != "ok"), None)
        message = (failed or {}).get("message") or ""
        message = message if len(message) <= MESSAGE_CHARS else message[: MESSAGE_CHARS - 3] + "..."
        return f"{status}: {message}" if message else status
    if variant["name"] == baseline:
        return "baseline"
    words = [speed_words(variant.get("speed"), with_figure=with_figures)]
    memory = variant.get("memory_ratio")
    if memory is not None:
        words.append(
            "same memory" if abs(memory - 1) <= SAME_MEMORY else "less memory" if memory < 1 else "more memory"
        )
    check = variant.get("loss_agreement")
    if check:
        reference = variant.get("loss_reference") or baseline
        if check.get("passed"):
            words.append(f"loss = {reference}" if reference != baseline else "loss = baseline")
        elif check.get("passed") is False:
            words.append("LOSS DIFFERS")
        elif check.get("incomplete"):
            words.append("loss check incomplete")
    gradients = variant.get("gradient_agreement")
    if gradients:
        if gradients.get("passed"):
            words.append("gradients = baseline")
        elif gradients.get("passed") is False:
            words.append("GRADIENTS DIFFER")
        elif gradients.get("incomplete"):
            words.append("gradient check incomplete")
    return ", ".join(words) or "ok"


def terminal_summary(summary: Mapping[str, Any], report: Path) -> str:
    """The rows (variant, speed ×, memory ×, Δ loss, verdict), any study problems, and where the report is."""
    baseline = summary["study"]["baseline"]
    rows = [("variant", "speed × [interval]", "memory ×", "Δ loss", "verdict")]
    for v in summary["variants"]:
        rows.append(
            (
                v["name"],
                "1.00×" if v["name"] == baseline and v["status"] == "ok" else speed_figure(v.get("speed")) or "—",
                "—" if v.get("memory_ratio") is None else f"{v['memory_ratio']:.2f}",
                "—"
                if v.get("loss_delta") is None
                else f"{v['loss_delta']:+.4f}"
                if abs(v["loss_delta"]) >= 5e-5 or v["loss_delta"] == 0
                else f"{v['loss_delta']:+.1e}",
                verdict(v, baseline, with_figures=False),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row[:4], widths)))
        + "  "
        + row[4]
        for row in rows
    ]
    study = summary["study"]
    lines.insert(
        0,
        f"study {study.get('name') or 'runs'}: speed × and memory × relative to {baseline}, as in the report's columns",
    )
    lines += [f"problem: {p}" for p in summary.get("problems", [])]
    lines.append(f"report: {report}")
    return "\n".join(lines)

"""The study report's lines about the study as a whole: what it compared, how speed was measured, the
matmul ceilings the runs measured, and the environment. Both renderings (``report.md``, ``report.html``)
say them in these words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_ablate.ablation.report_table import format_spread

ORDER_WORDS = {
    "round_robin": "round-robin (the first seed of every variant, then the second seed of every variant, ...)",
    "by_variant": "variant by variant (every seed of a variant, then the next variant)",
}


def study_line(study: Mapping[str, Any]) -> str:
    """The baseline, the variables, seeds, steps, warm-up and run order, in one line."""
    details = [f"baseline **{study['baseline']}**"]
    if study.get("variables"):
        details.append("variable " + ", ".join(f"`{k}`" for k in study["variables"]))
    if study.get("seeds"):
        details.append(f"seeds {study['seeds']}")
    if study.get("steps"):
        details.append(f"{study['steps']} steps")
    if study.get("warmup_steps") is not None:
        details.append(f"warm-up steps excluded: {study['warmup_steps']}")
    if study.get("order"):
        details.append(f"run order: {ORDER_WORDS.get(study['order'], study['order'])}")
    return "; ".join(details) + "."


CEILING_REPEATABILITY = 0.10
"""How far ceilings measured under one condition spread on a quiet machine: the sweep's own noise
(measured on the 2-core VM: 2.5% over 6 one-process runs; up to 6.4% over the one-thread ranks of
2- and 4-rank runs, whose sweeps share the cores); a move within this is no evidence that the load changed."""


def ceiling_line(summary: Mapping[str, Any]) -> str | None:
    """The matmul ceilings the runs measured at their start (``mfu_measured``'s denominators), their spread
    per condition (dtype, device, threads: only ceilings of one condition are comparable), and a warning
    when one condition's moved more than ``CEILING_REPEATABILITY``: the machine's load changed during the
    study (the speed verdicts judge load per block on their own)."""
    groups = summary.get("matmul_ceilings")
    if not groups:
        return None
    floor = CEILING_REPEATABILITY
    parts, moved_conditions = [], []
    for group in groups:
        moved = (group["max"] - group["min"]) / group["median"]
        condition = group["conditions"] or "condition not recorded"
        parts.append(
            f"{condition}: {format_spread(group, lambda x: f'{x:.4g}')} TFLOP/s over {group['n']} runs "
            f"(moved {100 * moved:.1f}%)"
        )
        if moved > floor:
            moved_conditions.append(condition)
    line = "Matmul ceiling measured at each run's start, by condition: " + "; ".join(parts) + "."
    if moved_conditions:
        line += (
            f" **Warning: under {', '.join(moved_conditions)} it moved more than {100 * floor:.0f}%: "
            "the machine's load changed during the study, so MFU (measured) compares runs under different "
            "loads.**"
        )
    return line


def environment_line(summary: Mapping[str, Any]) -> str:
    env = summary["environment"]
    if not env:
        return "Environment: not recorded."
    parts = [f"device {env.get('device_name')} ({env.get('device_type')})"]
    parts += [f"{k} {env[k]}" for k in ("torch", "lightning", "transformers", "python") if env.get(k)]
    parts.append(f"commit {str(env['git_commit'])[:10]}" if env.get("git_commit") else "commit unknown")
    from lit_ablate.callbacks.run_recorder import git_commit  # imports Lightning: only when a report is written

    rendered = git_commit()
    if rendered and env.get("git_commit") and rendered != env["git_commit"]:  # the runs' numbers, a later renderer
        parts.append(f"report rendered at commit {rendered[:10]}")
    if env.get("hostname"):
        parts.append(f"host {env['hostname']}")
    if env.get("triton_kernels"):
        parts.append(f"Triton kernels {env['triton_kernels']}")
    line = "Environment: " + ", ".join(parts) + "."
    if summary["environment_mismatch"]:
        line += f" **Warning: runs differ in {', '.join(summary['environment_mismatch'])}; compare with care.**"
    return line


def speed_design_line(speed: Mapping[str, Any] | None) -> str | None:
    """How speed was measured and judged: the design, the interval, the threshold and the load seen."""
    if not speed:
        return None
    design = speed["design"]
    how = {
        "steps": f"the variants of each seed took turns, {design['rounds']} blocks of steps each",
        "runs": "one block per run, paired by seed",
    }
    modes = "; ".join(how.get(mode, mode) for mode in speed["interleave"])
    load = speed.get("foreign_cores")
    seen = (
        f"other processes' load during the blocks: {format_spread(load, lambda x: f'{x:.2f}')} cores"
        if load
        else "other processes' load not measured"
    )
    return (
        f"Speed: {modes}; each ratio is the median of the paired blocks' ratios with its "
        f"{design['confidence']:.0%} sign-test interval (a verdict needs {speed['needed_pairs']} pairs; pairs whose "
        f"load differed by more than {design['load_tolerance']:g} cores are left out); within "
        f"±{design['threshold']:.0%} is no difference; {seen}."
    )

"""The study report: ``report.md``, ``report.html``, ``report.json`` and PNG plots, made from the records alone.

It reads ``<dir>/study.json`` (the plan the runner wrote: baseline, axes, warm-up, tolerance)
and every ``<dir>/runs/<variant>/seed<k>/run.json``; nothing else. So ``lit-ablate report DIR``
re-renders the same files at any time, on any machine, and a study interrupted half-way still
gets a report of what finished.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_ablate.ablation.html_report import render_html
from lit_ablate.ablation.loss_divergence import loss_divergence_section
from lit_ablate.ablation.plots import write_plots
from lit_ablate.ablation.report_table import (
    agreement_factors,
    estimate_ratio,
    format_bytes,
    format_spread,
    mfu_cell,
    numbered_fallbacks,
    table_columns,
)
from lit_ablate.ablation.report_text import ceiling_line, environment_line, speed_design_line, study_line
from lit_ablate.ablation.summary import study_summary
from lit_ablate.ablation.terminal_summary import verdict
from lit_ablate.record import RECORD_FILENAME, read_record

PLAN_FILENAME = "study.json"
STDERR_TAIL_SHOWN = 15


def load_runs(directory: Path) -> tuple[dict[str, Any] | None, list[tuple[str, dict[str, Any]]]]:
    """The study plan (None when absent) and ``(relative path, record)`` of every run in ``directory``."""
    plan_path = directory / PLAN_FILENAME
    try:
        plan = json.loads(plan_path.read_text()) if plan_path.is_file() else None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{plan_path}: not valid JSON ({err.msg}); run lit-ablate ablate on the study again, which rewrites it"
        ) from err
    planned = {v["name"] for v in plan["variants"]} if plan else None
    runs = []
    for path in sorted(directory.glob(f"runs/*/*/{RECORD_FILENAME}")):
        try:
            record = read_record(path)
        except ValueError as err:
            raise ValueError(f"{err}; run lit-ablate ablate on the study again, which redoes that run") from err
        if planned is None or (record.get("variant") or path.parent.parent.name) in planned:
            runs.append((path.relative_to(directory).as_posix(), record))
    return plan, runs


def write_report(directory: str | Path) -> Path:
    """Write ``report.md``, ``report.html``, ``report.json`` and the plots into ``directory``; returns the
    Markdown path."""
    directory = Path(directory)
    plan, runs = load_runs(directory)
    if not runs:
        raise FileNotFoundError(f"{directory}: no run records under runs/<variant>/<seed>/{RECORD_FILENAME}")
    summary = study_summary(plan, runs)
    summary["plots"] = write_plots(summary, directory)
    (directory / "report.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    path = directory / "report.md"
    path.write_text(render_markdown(summary))
    (directory / "report.html").write_text(render_html(summary))
    return path


def render_markdown(summary: Mapping[str, Any]) -> str:
    """The report page: the study, the verdicts, the side-by-side table and its legend, plots, failures."""
    study, variants = summary["study"], summary["variants"]
    lines = [f"# Study `{study.get('name') or 'runs'}`", "", environment_line(summary), "", study_line(study), ""]
    for line in (speed_design_line(summary.get("speed")), ceiling_line(summary)):
        lines += [line, ""] if line else []
    if summary.get("problems"):
        lines += ["**Study problems (exit code 1):**", "", *(f"- {p}" for p in summary["problems"]), ""]
    lines += ["## Verdicts", "", *(f"- **{v['name']}**: {verdict(v, study['baseline'])}" for v in variants), ""]
    columns = table_columns(summary)
    lines += ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.cell(v) for c in columns) + " |" for v in variants]
    lines += ["", "Columns:", "", *(f"- **{c.header}**: {c.legend}." for c in columns[1:]), ""]
    fallbacks = numbered_fallbacks(summary)
    if fallbacks:  # what ran instead of what a row's config names (the run records' ``fallbacks``)
        lines += [
            "Fallbacks: what ran instead of what the row's config names, as its runs recorded.",
            "",
            *(f"{i}. {line}" for i, line in enumerate(fallbacks, start=1)),
            "",
        ]
    lines += simulated_ranks_section(variants)
    lines += [f"![{Path(name).stem}]({name})" for name in summary.get("plots", [])]
    lines += loss_divergence_section(summary)
    failures = [(v["name"], r) for v in variants for r in v["runs"] if r["status"] != "ok"]
    if failures:
        lines += ["", "## Runs that did not finish ok", ""]
        for name, run in failures:
            lines.append(
                f"- `{name}` seed {run['seed']}: **{run['status']}** — {run['message'] or 'no message'} "
                f"(`{run['path']}`)"
            )
            tail = (run.get("stderr_tail") or "").splitlines()[-STDERR_TAIL_SHOWN:]
            if tail and run["status"] != "skipped":
                lines += ["", "  ```text", *(f"  {line}" for line in tail), "  ```"]
    return "\n".join(lines).rstrip() + "\n"


SIMULATED_CATEGORIES = ("params", "grads", "optimizer", "activations", "transient")


def simulated_ranks_section(variants: Sequence[Mapping[str, Any]]) -> list[str]:
    """For variants whose runs were simulated ranks (``launch.simulate``): each category the rank held beside
    the estimate of that rank, by the rule the table's est. ÷ measured column applies, and its step time and
    MFU (no collective waits for another rank). Nothing for a study without them."""
    simulated = [v for v in variants if v.get("simulated")]
    if not simulated:
        return []
    lines = [
        "## Simulated ranks: estimate beside measurement",
        "",
        "Each row is one process that played one rank of the layout over a fake process group "
        "(lit-ablate's `docs/simulation.md`): its tensors by category on the tracked step "
        "(measured) beside the estimate of that rank (`lit-ablate estimate`; a pipeline rank's own stage), "
        f"as estimated / measured (estimate ÷ measured), **bold** where outside its factor ({agreement_factors()}). "
        "Step time and MFU are the rank's own: its compute, and the local copies a fake collective makes (an "
        "all-gather fills its output with the rank's shard), never a wait for another rank.",
        "",
        "| variant | rank | " + " | ".join(SIMULATED_CATEGORIES) + " | step time (s) | MFU (measured) |",
        "|" + "---|" * (len(SIMULATED_CATEGORIES) + 4),
    ]
    for v in simulated:
        comparison = v.get("estimate_vs_measured") or {}
        cells = []
        for category in SIMULATED_CATEGORIES:
            result = comparison.get(category)
            sizes = (
                "—" if result is None else f"{format_bytes(result['estimated'])} / {format_bytes(result['measured'])}"
            )
            text = sizes if result is None else f"{sizes} ({estimate_ratio(result)})"
            cells.append(text if result is None or result["agrees"] else f"**{text}**")
        rank = f"{v['simulated']['rank']} of {v['simulated']['world_size']}"
        lines.append(
            f"| {v['name']} | {rank} | "
            + " | ".join(cells)
            + f" | {format_spread(v['step_time_s'], lambda x: f'{x:.3g}')} | {mfu_cell(v, 'mfu_measured')} |"
        )
    return [*lines, ""]

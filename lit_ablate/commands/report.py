"""``lit-ablate report DIR``: re-render a study directory's report from its run records.

Its own module, apart from ``ablate``, so that it starts without what planning and running a study
import (Lightning, the strategies, the rules): re-rendering reads JSON and draws plots.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from lit_ablate.ablation.report import write_report
from lit_ablate.ablation.terminal_summary import terminal_summary

EXIT_STUDY_FAILED = 1
"""A study problem (a failed or unmade loss or gradient check, no variant finished ok) or a failed run
(``error``, ``oom``, ``timeout``, ``interrupted``; with ``--allow-failures`` failed runs are results)."""
EXIT_REFUSED = 2
ALLOW_FAILURES_HELP = (
    "exit 0 although runs failed (error, oom, timeout): for studies that expect some variants not to fit; "
    "failed checks still exit 1"
)
FAILED_STATUSES = ("error", "oom", "timeout", "interrupted")


def report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lit-ablate report", description="Re-render a study's report from its records.", allow_abbrev=False
    )
    parser.add_argument("directory", type=Path, help="a study output directory (holding runs/ and study.json)")
    parser.add_argument(
        "--allow-failures", "--allow_failures", dest="allow_failures", action="store_true", help=ALLOW_FAILURES_HELP
    )
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        Console(stderr=True).print(
            f"no report: {args.directory} is not a folder; give a study's output folder (lit-ablate ablate prints it)",
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_REFUSED
    try:
        report = write_report(args.directory)
    except (FileNotFoundError, ValueError) as err:  # no records; a record or plan that is not JSON
        Console(stderr=True).print(f"no report: {err}", highlight=False, soft_wrap=True)
        return EXIT_REFUSED
    print(printed_summary(report))
    return study_exit_code(args.directory, args.allow_failures)


def printed_summary(report: Path) -> str:
    """The end of a study on the terminal (``terminal_summary``); the full table is in ``report``."""
    return terminal_summary(json.loads((report.parent / "report.json").read_text()), report)


def study_exit_code(directory: Path, allow_failures: bool) -> int:
    """``EXIT_STUDY_FAILED`` when the report lists a study problem or, unless ``allow_failures``, a run
    failed; then one line on stderr counting what failed. Skipped runs (they cannot run here, as the plan
    said) are no failure."""
    summary = json.loads((directory / "report.json").read_text())
    statuses = [run["status"] for variant in summary["variants"] for run in variant["runs"]]
    failed = {s: statuses.count(s) for s in FAILED_STATUSES if statuses.count(s)}
    counted = (
        f"{sum(failed.values())} of {len(statuses)} runs failed ({', '.join(f'{s} {n}' for s, n in failed.items())})"
    )
    parts = ([counted] if failed else []) + (
        [f"{len(summary['problems'])} study problem(s)"] if summary["problems"] else []
    )
    if summary["problems"] or (failed and not allow_failures):
        print(f"study failed: {'; '.join(parts)}", file=sys.stderr)
        return EXIT_STUDY_FAILED
    if failed:
        print(f"{counted}: tolerated (--allow-failures)", file=sys.stderr)
    return 0

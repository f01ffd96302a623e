"""``lit-ablate report DIR``: re-render a study directory's report from its run records.

Its own module, apart from ``ablate``, so that it starts without what planning and running a study
import (Lightning, the strategies, preflight): re-rendering reads JSON and draws plots.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from lit_ablate.ablation.report import write_report
from lit_ablate.ablation.terminal_summary import terminal_summary

EXIT_LOSS_MISMATCH = 1
"""A study problem: a failed or unmade loss or gradient check, or no variant finished ok."""
EXIT_REFUSED = 2


def report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lit-ablate report", description="Re-render a study's report from its records.", allow_abbrev=False
    )
    parser.add_argument("directory", type=Path, help="a study output directory (holding runs/ and study.json)")
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
    return EXIT_LOSS_MISMATCH if loss_mismatch(args.directory) else 0


def printed_summary(report: Path) -> str:
    """The end of a study on the terminal (``terminal_summary``); the full table is in ``report``."""
    return terminal_summary(json.loads((report.parent / "report.json").read_text()), report)


def loss_mismatch(directory: Path) -> bool:
    """True when the report lists a study problem: an ``expect_equal_loss`` or ``expect_equal_gradients``
    check failed or could not be made (its reference has no ok run), or no variant finished ok."""
    summary = json.loads((directory / "report.json").read_text())
    return bool(summary["problems"])

"""Every figure the README's benchmark headlines quote is in the report it names (issue 30: README true).

A headline row is ``| `study` | finding |`` (or ``| `gpu/<kind>-<date>` | ... |``, a GPU lane run, whose
report is that folder's README.md); each decimal figure of the finding (``9.54e-07``, ``39.7``,
``1.89×``, ``95.3%``) and each whole percentage (``48%``) must appear in
``benchmarks/results/<study>/report.md``, written the same way up to the multiplication sign (reports
write ``x``). Seen failing on the README as it was: ``liger_vs_cce``'s
``9.6e-04``, a rounding of the report's 9.56e-04; and, once whole percentages counted, the H200 lane's
row quoting the seed's MFU as ``60-62%`` where the lane's report writes 0.60-0.62.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
ROW = re.compile(r"^\| `([\w/-]+)` \| (.+) \|$", re.MULTILINE)
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?:e[-+]\d+)?|(?<![\w.])\d+%")
"""A decimal figure, or a whole percentage with its sign (``48%``: a share of step time, of tokens)."""


def headline_rows() -> list[tuple[str, str]]:
    section = (ROOT / "README.md").read_text().split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    return ROW.findall(section)


def test_the_readme_has_headlines():
    assert len(headline_rows()) >= 10


@pytest.mark.parametrize(("study", "finding"), headline_rows(), ids=[s for s, _ in headline_rows()])
def test_every_quoted_figure_is_in_its_report(study: str, finding: str):
    report = ROOT / "benchmarks" / "results" / study / ("README.md" if study.startswith("gpu/") else "report.md")
    assert report.exists(), f"README quotes {study}, which has no committed report"
    text = report.read_text().replace("×", "x")
    missing = [f for f in FIGURE.findall(finding) if f not in text]
    assert not missing, f"{study}: {missing} are not in {report.relative_to(ROOT)}"

"""Every figure the technique pages quote from a study is in that study's report (issue 30: reports
and pages true at one commit).

A quoting passage is a bullet that opens with a shipped study's name (``- `study` ...``, continuation
lines included) or a table row that does (``| `study` ...``), on any page under ``docs/``; each decimal
figure in it (``2.38e-07``, ``0.85×``, ``36.5 MiB``, ``95.3%``) and each whole percentage (``48%``) must
appear in ``benchmarks/results/<study>/report.md``, written the same way up to the multiplication sign. The
README's headlines are checked by ``test_readme_figures.py`` the same way. Seen failing with the pages
as they were against the reports regenerated at one commit (every speed ratio and most memory
figures moved); the whole percentages, with the pages' pipeline-idle shares as they were against the
reports regenerated at d45f38e (49% and 30% where ``parallelism_4d``'s report says 48% and 31%).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_readme_figures import FIGURE

ROOT = Path(__file__).parents[1]
STUDIES = sorted(p.stem for p in (ROOT / "configs" / "studies").glob("*.yaml"))
OPENING = re.compile(r"^(?:- |\| )`(\w+)`")


def quoting_passages() -> list[tuple[str, str, str]]:
    """(page, study, passage) for every bullet or table row that opens with a shipped study's name."""
    passages = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            opening = OPENING.match(line)
            if not opening or opening.group(1) not in STUDIES:
                continue
            passage = [line]
            if line.startswith("- "):  # a bullet runs on over its indented continuation lines
                passage += [next_line for next_line in _continuation(lines[i + 1 :])]
            passages.append((page.name, opening.group(1), " ".join(passage)))
    return passages


def _continuation(lines: list[str]) -> list[str]:
    taken = []
    for line in lines:
        if not line.startswith("  "):
            break
        taken.append(line)
    return taken


def test_the_pages_quote_studies():
    assert len({study for _, study, _ in quoting_passages()}) >= 15


@pytest.mark.parametrize(
    ("page", "study", "passage"), quoting_passages(), ids=[f"{p}:{s}" for p, s, _ in quoting_passages()]
)
def test_every_figure_a_page_quotes_is_in_the_study_s_report(page: str, study: str, passage: str):
    report = ROOT / "benchmarks" / "results" / study / "report.md"
    assert report.exists(), f"docs/{page} quotes {study}, which has no committed report"
    text = report.read_text().replace("×", "x")
    missing = [f for f in FIGURE.findall(passage.replace("×", "x")) if f not in text]
    assert not missing, f"docs/{page}, {study}: {missing} are not in {report.relative_to(ROOT)}"

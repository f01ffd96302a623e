"""``benchmarks/regenerate_reports.py --check``: what keeps the shipped reports from being one regeneration.

On a made-up results tree: a study without a report, runs from two commits, a warning in a report's
environment line are each named, and a tree at one commit passes. Seen failing with the commit check
letting two commits pass.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.regenerate_reports import problems, studies


def _study(results: Path, name: str, commits: list[str], environment: str = "Environment: device cpu, commit x.") -> None:
    directory = results / name
    for i, commit in enumerate(commits):
        run = directory / "runs" / f"v{i}" / "seed0"
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"environment": {"git_commit": commit}}))
    (directory / "report.md").write_text(f"# {name}\n\n{environment}\n")


def test_one_commit_passes_and_each_problem_is_named(tmp_path: Path):
    _study(tmp_path, "a", ["c1", "c1"])
    _study(tmp_path, "b", ["c1"])
    assert problems(["a", "b"], tmp_path) == []
    _study(tmp_path, "c", ["c2"], "Environment: commit c2. **Warning: runs differ in git_commit; compare with care.**")
    found = problems(["a", "b", "c", "d"], tmp_path)
    assert any(p.startswith("d: no report") for p in found)
    assert any(p.startswith("c: the environment line has a warning") for p in found)
    assert any(p.startswith("runs come from 2 commits") for p in found)


def test_every_shipped_study_is_listed():
    names = studies()
    assert names == sorted(p.stem for p in (Path(__file__).parents[1] / "configs" / "studies").glob("*.yaml"))
    assert len(names) >= 28

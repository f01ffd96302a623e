"""Regenerate every shipped study report at one commit: ``python benchmarks/regenerate_reports.py``.

Each study of ``configs/studies/*.yaml`` runs with ``lit-ablate ablate`` into
``benchmarks/results/<study>/``. A run whose ``run.json`` names another commit is stale and is
deleted first; the runs already made at this commit are kept, so an interrupted regeneration resumes
where it stopped (``lit-ablate ablate`` resumes a half-done study by itself). The working tree must
be clean, or the commit the reports name would not be the code that made them.

``--check`` changes nothing: it lists every study without a report (``report.md`` and ``report.html``),
every run not at the one commit all reports must share, reports whose environment line carries a
warning, and files that name a path of this machine (a study folder must travel), and exits 1 if
there is any (what a finished regeneration must pass). ``--only a,b`` restricts either mode to some studies.
Ends with ``RESULT`` lines: the studies checked and how many of them are at one commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ROOT / "configs" / "studies"
RESULTS = ROOT / "benchmarks" / "results"
STUDY_ENVIRONMENT: dict[str, dict[str, str]] = {"liger_vs_cce": {"LIT_ABLATE_TRITON_INTERPRET": "1"}}
"""Variables a study's header says to run it with: liger_vs_cce runs Liger's and CCE's Triton kernels
through Triton's interpreter on a CPU (without it those variants are skipped as CUDA-only)."""


def studies(only: list[str] | None = None) -> list[str]:
    """Every shipped study, by name (its YAML's stem), in a fixed order."""
    names = sorted(p.stem for p in STUDIES.glob("*.yaml"))
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise SystemExit(f"--only: {unknown} are not studies in {STUDIES}; choose among {names}")
    return [n for n in names if not only or n in only]


def run_commits(result_dir: Path) -> dict[Path, str | None]:
    """Each run record of a study's results and the commit it names."""
    return {
        p: json.loads(p.read_text()).get("environment", {}).get("git_commit")
        for p in sorted(result_dir.glob("runs/*/*/run.json"))
    }


def started(record: Path) -> bool:
    """Whether a run started: a variant refused before launch (``skipped``: a GPU-only path on a CPU)
    measured nothing and records no environment, so no commit either."""
    return json.loads(record.read_text()).get("summary", {}).get("status") != "skipped"


def problems(names: list[str], results: Path = RESULTS) -> list[str]:
    """What keeps the shipped reports from being one regeneration at one commit (empty when none)."""
    found, commits = [], Counter()
    for name in names:
        directory = results / name
        if not (directory / "report.md").exists() or not (directory / "report.html").exists():
            found.append(f"{name}: no report ({directory / 'report.md'}, report.html)")
            continue
        placed = [str(p.relative_to(results)) for p in committable(directory) if _names_a_machine_path(p)]
        if placed:
            found.append(f"{name}: files naming a path of this machine (a study folder must travel): {placed[:3]}")
        runs = run_commits(directory)
        commits.update(c for record, c in runs.items() if started(record))
        if not runs:
            found.append(f"{name}: no run records")
        environment = next(
            (line for line in (directory / "report.md").read_text().splitlines() if line.startswith("Environment:")), ""
        )
        if "warning" in environment.lower() or "mismatch" in environment.lower():
            found.append(f"{name}: the environment line has a warning: {environment}")
    if len(commits) > 1 or None in commits:
        shown = ", ".join(f"{(c or 'unknown')[:10]} ({n} runs)" for c, n in commits.most_common())
        found.append(f"runs come from {len(commits)} commits: {shown}")
    return found


MACHINE_PATHS = tuple(str(p) for p in (ROOT, Path.home(), Path(sys.prefix)))
"""Absolute paths a committed study must not hold: this checkout, the home folder, the Python environment."""
ABSOLUTE_PATH = re.compile(r"""(?:^|[\s"'(=,\[])(/(?:[\w.-]+/){2,})""", re.MULTILINE)
"""Any absolute path two folders deep, as a log line or a record holds it (another machine's checkout too)."""
BUILD_LOCATION = re.compile(r"Triggered internally at /\S+")
"""Where in its C++ sources torch raised a warning (``/__w/pytorch/pytorch/...``, its build machine's
folder): part of torch's message, naming no machine a study ran on."""


def committable(directory: Path) -> list[Path]:
    """The files under ``directory`` that git would commit (tracked, or untracked and not ignored): what
    travels with the study. A run's ``trainer/lightning_logs`` (ignored) stays on the machine that made it.
    Outside a git checkout, every file."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=directory,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:  # not a git checkout
        return sorted(p for p in directory.rglob("*") if p.is_file())
    return sorted(directory / name for name in listed.stdout.split("\0") if name and (directory / name).is_file())


def _names_a_machine_path(path: Path) -> bool:
    if not path.is_file() or path.suffix == ".png":
        return False
    text = BUILD_LOCATION.sub("", path.read_text(errors="replace"))
    return any(f"{prefix}/" in text for prefix in MACHINE_PATHS) or ABSOLUTE_PATH.search(text) is not None


def head_commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def regenerate(name: str, commit: str) -> int:
    """Delete the study's stale runs, then run (or resume) it; returns ``lit-ablate ablate``'s exit code."""
    directory = RESULTS / name
    for record, run_commit in run_commits(directory).items():
        if run_commit != commit:
            shutil.rmtree(record.parent)
    command = ["lit-ablate", "ablate", "--config", str(STUDIES / f"{name}.yaml"), "--output_dir", str(directory)]
    print(" ".join(command), flush=True)
    return subprocess.run(command, cwd=ROOT, env={**os.environ, **STUDY_ENVIRONMENT.get(name, {})}).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--check", action="store_true", help="list what is not regenerated at one commit; change nothing"
    )
    parser.add_argument("--only", help="comma-separated study names")
    args = parser.parse_args(argv)
    names = studies(args.only.split(",") if args.only else None)
    if not args.check:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "lit_ablate", "configs", "pyproject.toml"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if dirty:
            raise SystemExit(f"commit first: the reports must name the code that made them\n{dirty}")
        commit = head_commit()
        failed = [name for name in names if regenerate(name, commit) != 0]
        if failed:
            print(f"studies that did not finish: {failed} (run again to resume)")
    found = problems(names)
    print("\n".join(found) if found else f"all {len(names)} reports are at one commit")
    print(f"RESULT studies={len(names)}")
    print(f"RESULT reports_with_problems={len(found)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

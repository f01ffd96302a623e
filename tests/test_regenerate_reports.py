"""``benchmarks/regenerate_reports.py --check``: what keeps the shipped reports from being one regeneration.

On a made-up results tree: a study without a report, runs from two commits, a warning in a report's
environment line are each named, and a tree at one commit passes. Seen failing with the commit check
letting two commits pass, and with a skipped variant (refused before launch, no environment)
counted as a run of an unknown commit.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.regenerate_reports import problems, studies


def _study(
    results: Path, name: str, commits: list[str | None], environment: str = "Environment: device cpu, commit x."
) -> None:
    """A study's results; a None commit is a variant refused before launch (skipped, no environment)."""
    directory = results / name
    for i, commit in enumerate(commits):
        run = directory / "runs" / f"v{i}" / "seed0"
        run.mkdir(parents=True)
        record = {"environment": {"git_commit": commit}, "summary": {"status": "ok"}}
        (run / "run.json").write_text(
            json.dumps(record if commit else {"environment": {}, "summary": {"status": "skipped"}})
        )
    (directory / "report.md").write_text(f"# {name}\n\n{environment}\n")
    (directory / "report.html").write_text(f"<html><body>{name}</body></html>\n")


def test_one_commit_passes_and_each_problem_is_named(tmp_path: Path):
    _study(tmp_path, "a", ["c1", "c1"])
    _study(tmp_path, "b", ["c1", None])  # a skipped variant measured nothing and names no commit
    assert problems(["a", "b"], tmp_path) == []
    _study(tmp_path, "c", ["c2"], "Environment: commit c2. **Warning: runs differ in git_commit; compare with care.**")
    found = problems(["a", "b", "c", "d"], tmp_path)
    assert any(p.startswith("d: no report") for p in found)
    assert any(p.startswith("c: the environment line has a warning") for p in found)
    assert any(p.startswith("runs come from 2 commits") for p in found)


def test_a_file_naming_a_path_of_this_machine_is_a_problem(tmp_path: Path):
    """Issue 49: 487 committed files named the machine that made them. A study folder whose logs, records or
    plan hold this checkout's, the home folder's or the Python environment's path is named (here a log line
    of a warning from site-packages), and one whose paths are portable passes."""
    from benchmarks.regenerate_reports import MACHINE_PATHS

    _study(tmp_path, "portable", ["c1"])
    (tmp_path / "portable" / "runs" / "v0" / "seed0" / "stderr.log").write_text("<python-env>/lib/x.py:3: Warning\n")
    assert problems(["portable"], tmp_path) == []
    torch_warning = "(Triggered internally at /__w/pytorch/pytorch/build/aten/src/ATen/core/TensorBody.h:493.)\n"
    (tmp_path / "portable" / "runs" / "v0" / "seed0" / "stdout.log").write_text(torch_warning)
    assert problems(["portable"], tmp_path) == []  # torch's own source location: no machine of a study
    _study(tmp_path, "placed", ["c1"])
    (tmp_path / "placed" / "runs" / "v0" / "seed0" / "stderr.log").write_text(f"{MACHINE_PATHS[2]}/lib/x.py:3: W\n")
    assert [p.split(":")[0] for p in problems(["placed"], tmp_path)] == ["placed"]


def test_a_file_git_ignores_stays_on_the_machine_and_is_not_a_problem(tmp_path: Path):
    """Lightning's own copy of a run's config (``trainer/lightning_logs/version_0/config.yaml``, ignored by the
    checkout's ``.gitignore``) holds the run's absolute folder; it is not committed, so it does not travel and
    is not a problem. The same path in a file git would commit is. Seen failing with every file of the folder
    read (all 30 shipped studies named for their ignored ``lightning_logs``)."""
    from benchmarks.regenerate_reports import MACHINE_PATHS

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("lightning_logs/\n")
    _study(tmp_path, "s", ["c1"])
    logs = tmp_path / "s" / "runs" / "v0" / "seed0" / "trainer" / "lightning_logs" / "version_0"
    logs.mkdir(parents=True)
    (logs / "config.yaml").write_text(f"default_root_dir: {MACHINE_PATHS[0]}/benchmarks/results/s\n")
    assert problems(["s"], tmp_path) == []
    (tmp_path / "s" / "runs" / "v0" / "seed0" / "config.yaml").write_text(f"root: {MACHINE_PATHS[0]}/x/y\n")
    assert [p.split(":")[0] for p in problems(["s"], tmp_path)] == ["s"]


def test_every_shipped_study_is_listed():
    names = studies()
    assert names == sorted(p.stem for p in (Path(__file__).parents[1] / "configs" / "studies").glob("*.yaml"))
    assert len(names) >= 28


def test_the_shipped_reports_are_one_regeneration_at_one_commit():
    """Issue 30's "done when": every study under ``configs/studies/`` has a committed report, every
    committed run of every report names one commit, and no report's environment line carries a
    warning. A study added without its report, or one report rerun at another commit alone, fails
    here: regenerate them all with ``python benchmarks/regenerate_reports.py``. Seen failing on the
    reports as they were before the regeneration (runs from 45 commits, 29 runs without one, 14
    environment lines warning)."""
    assert problems(studies()) == []


def test_every_shipped_study_tracks_tensor_memory():
    """Issue 30: "every study whose variable changes memory tracks tensors". Every shipped study's every
    variant runs ``MemoryMonitor`` with tensor tracking on (``tracked_steps`` not 0), so its report's
    memory columns are tensor bytes, not the process's RSS. Seen failing on bf16_vs_fp8 and
    bf16_vs_fp8_moe as they were (throughput and MFU only), and on liger_vs_cce with ``tracked_steps: 0``."""
    from lit_ablate.ablation.spec import load_study

    untracked = []
    for name in studies():
        spec = load_study(Path(__file__).parents[1] / "configs" / "studies" / f"{name}.yaml")
        for variant in spec.variants:
            callbacks = spec.fit_config(variant, spec.seeds[0], "/tmp/unused")["trainer"].get("callbacks") or []
            memory = [
                c for c in callbacks if isinstance(c, dict) and str(c.get("class_path", "")).endswith("MemoryMonitor")
            ]
            if not memory or any((c.get("init_args") or {}).get("tracked_steps") == 0 for c in memory):
                untracked.append(f"{name}/{variant.name}")
    assert not untracked, untracked


def test_a_study_s_header_variables_reach_its_regeneration():
    """A study whose header runs it with ``LIT_ABLATE_*`` variables (liger_vs_cce: Triton's interpreter)
    is regenerated with them. Seen failing as the script was: the first regeneration ran liger_vs_cce
    without the interpreter and every Liger and CCE variant was skipped as CUDA-only."""
    import re

    from benchmarks.regenerate_reports import STUDY_ENVIRONMENT

    for name in studies():
        header = (Path(__file__).parents[1] / "configs" / "studies" / f"{name}.yaml").read_text()
        wanted = dict(re.findall(r"^#\s+(LIT_ABLATE_\w+)=(\S+) lit-ablate ablate", header, re.MULTILINE))
        assert STUDY_ENVIRONMENT.get(name, {}) == wanted, name

"""``lit-ablate --help`` and ``--version`` answer at once, and a missing run config is refused at once: none
imports torch, Lightning or jsonargparse.

Seen failing with ``from jsonargparse import ArgumentError`` back at the top of ``lit_ablate/cli.py``
(the import check names jsonargparse), and with ``from lit_ablate.fit_cli import LitAblateCLI`` there
(the timing check: best of 3 took 8.5 s for ``--help``, 15 s for ``--version`` on a loaded machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HEAVY = ("torch", "lightning", "jsonargparse", "transformers")


def _console_script() -> str:
    """The installed ``lit-ablate`` beside this interpreter (what a user types), else ``python -m``."""
    beside = Path(sys.executable).with_name("lit-ablate")
    return str(beside) if beside.exists() else shutil.which("lit-ablate") or ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["fit", "--config", "missing.yaml"],
        ["estimate", "--config=missing.yaml", "--trainer.max_steps", "2"],
    ],
)
def test_help_version_and_a_missing_config_import_no_heavy_library(argv, tmp_path):
    """A run config that names no file is refused before the imports parsing it would need (it took
    ~8 s to say so): the same line as the parser's, exit 2. Seen importing them all with the check
    after ``from jsonargparse import ArgumentError``."""
    probe = (
        f"import sys\nfrom lit_ablate.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n"
        f"    print('exit', e.code)\n"
        f"print('\\n' + __import__('json').dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    if argv[0] in ("fit", "estimate"):
        assert "exit 2" in done.stdout
        assert done.stderr.strip() == (
            f"lit-ablate{' estimate' if argv[0] == 'estimate' else ''}: error: --config: File "
            f"does not exist: '{tmp_path / 'missing.yaml'}'; give the path of a YAML config"
        )
        # every rank of a launched job refuses alike: only rank 0 prints (seen printing on rank 1 too)
        other_rank = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**os.environ, "RANK": "1"},
        )
        assert "exit 2" in other_rank.stdout and other_rank.stderr.strip() == "", other_rank.stderr


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_answer_in_under_a_second(flag):
    """Wall time of the console script in a subprocess, best of 3 (a loaded machine slows one try, not all)."""
    script = _console_script()
    assert script, "the lit-ablate console script is not installed (pip install -e .)"
    times = []
    for _ in range(3):
        start = time.perf_counter()
        done = subprocess.run([script, flag], capture_output=True, text=True, timeout=120, env=os.environ)
        times.append(time.perf_counter() - start)
        assert done.returncode == 0, done.stderr
    assert "lit-ablate" in done.stdout
    assert min(times) < 1.0, f"lit-ablate {flag}: best of 3 took {min(times):.2f} s"


def test_report_imports_neither_torch_nor_lightning():
    """``lit-ablate report`` re-renders a study from JSON records: it starts without torch, Lightning or
    transformers (it lived beside ``ablate``, whose planning imports them all: ~8 s of start-up)."""
    probe = (
        "import sys\nimport lit_ablate.commands.report\n"
        "print('\\n' + __import__('json').dumps("
        "sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []

"""The research-code examples keep working: they are the documented extension points.

The commands in each example's docstring run exactly as written, from the repository root, through the
``lit-ablate`` console script in a subprocess (only output folders and step counts are added). Seen
failing with ``_import_from_working_directory`` removed from ``lit_ablate/cli.py`` ("No module named
'examples'", as issue 31 reported), and with custom_strategy.py's old ``--trainer.strategy
examples.custom_strategy.FeedForwardCheckpointing`` ("Invalid strategy name").
"""

from __future__ import annotations

import ast
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_ablate.cli import main
from lit_ablate.record import RECORD_PATH_ENV, read_record

REPOSITORY = Path(__file__).parents[1]
QUICKSTART = str(REPOSITORY / "configs" / "quickstart.yaml")
CONSOLE_SCRIPT = Path(sys.executable).with_name("lit-ablate")


def documented_commands(example: str) -> list[str]:
    """The shell commands of an example's docstring (``lit-ablate ...`` or ``python ...`` lines,
    backslash continuations joined)."""
    doc = ast.get_docstring(ast.parse((REPOSITORY / "examples" / example).read_text()))
    joined = re.sub(r"\\\n\s*", "", doc)
    return [line.strip() for line in joined.splitlines() if re.match(r"\s*(lit-ablate|python) ", line)]


def run_from_the_repository(
    command: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``command`` as a user types it in the repository root, without PYTHONPATH; ``extra`` appended."""
    argv = shlex.split(command)
    argv[0] = str(CONSOLE_SCRIPT) if argv[0] == "lit-ablate" else sys.executable
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [*argv, *extra], cwd=REPOSITORY, capture_output=True, text=True, timeout=900, env={**clean, **(env or {})}
    )


def checkout_outputs() -> set[str]:
    """What a run that ignored its output folder would leave in the checkout."""
    return {str(p) for name in ("runs", "lightning_logs") for p in (REPOSITORY / name).rglob("*")}


def test_custom_metric_lands_in_the_run_record(tmp_path, monkeypatch):
    monkeypatch.setenv(RECORD_PATH_ENV, str(tmp_path / "run.json"))
    main(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.max_steps",
            "3",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.callbacks+=examples.custom_metric.GradNormMonitor",
        ]
    )
    steps = read_record(tmp_path / "run.json")["steps"]
    norms = [s["grad_norm"] for s in steps]
    assert len(norms) == 3 and all(n is not None and math.isfinite(n) and n > 0 for n in norms)


@pytest.mark.slow
def test_custom_metric_runs_as_its_docstring_says(tmp_path):
    (command,) = documented_commands("custom_metric.py")
    assert "--trainer.callbacks+=examples.custom_metric.GradNormMonitor" in command
    before = checkout_outputs()
    done = run_from_the_repository(
        command,
        "--trainer.max_steps",
        "3",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--recorder.path",
        str(tmp_path / "run.json"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    norms = [s["grad_norm"] for s in read_record(tmp_path / "run.json")["steps"]]
    assert len(norms) == 3 and all(math.isfinite(n) and n > 0 for n in norms)
    assert checkout_outputs() == before


@pytest.mark.slow
def test_custom_strategy_runs_as_its_docstring_says(tmp_path):
    """Both documented commands: the strategy selected on the command line, and the script, whose table
    must show feed-forward checkpointing saving activation memory (measured: 48%, full 74%). The script
    itself trains the strategy selected by the same flag from the repository root (its middle row), so
    the documented ``fit`` is resolved (``--print_config``: the class imported from the working directory
    by the console script, with FSDP2Strategy's arguments) rather than trained a second time."""
    script, fit = documented_commands("custom_strategy.py")
    assert script == "python examples/custom_strategy.py"
    before = checkout_outputs()
    resolved = run_from_the_repository(fit, "--print_config")
    assert resolved.returncode == 0, resolved.stderr[-3000:]
    strategy = yaml.safe_load(resolved.stdout)["trainer"]["strategy"]
    assert strategy["class_path"] == "examples.custom_strategy.FeedForwardCheckpointing"
    assert strategy["init_args"]["dp_shard"] == -1  # FSDP2Strategy's arguments, as the docstring says

    printed = run_from_the_repository(script)
    assert printed.returncode == 0, printed.stderr[-3000:]
    rows = {line[:32].strip(): line[32:].split() for line in printed.stdout.splitlines()[1:]}
    saved = {name: float(cells[2].rstrip("%")) for name, cells in rows.items()}
    assert saved["no checkpointing"] == 0
    assert 20 < saved["feed-forward only (this file)"] < saved["every layer (full)"], printed.stdout
    assert checkout_outputs() == before

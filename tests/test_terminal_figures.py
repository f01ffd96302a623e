"""Every figure a run prints is its run record's: the summary lines' medians, the model's parameter count,
the progress bar's loss and where the record went; a simulated rank says so first and prints nothing its
record leaves out (docs/simulation.md).

Seen failing with the summary lines taking the warm-up's last step in (``data_wait_s`` 0.001325 printed for
the record's 0.001539), and, for a simulated rank, with its summary printing ``tokens_per_sec=7628`` (its
record: null), its progress bar showing ``train/loss: 5.788`` (null), and no line saying the run was
simulated (its first line was Lightning's "`Trainer.fit` stopped").
"""

from __future__ import annotations

import logging
import re
import statistics
from pathlib import Path

import pytest
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from lit_ablate.cli import main
from lit_ablate.record import read_record
from lit_ablate.simulated_rank import NOT_SIMULATED

CONFIGS = Path(__file__).parents[1] / "configs"
SUMMARY_LINE = re.compile(r"^(\w+) \(median after (\d+) warm-up steps\): (.*)$", re.MULTILINE)
PARAMETERS_LINE = re.compile(r"^Parameters: (\S+ ?\S*) \((\S+ ?\S*) trainable\)", re.MULTILINE)
PROGRESS_LOSS = re.compile(r"train/loss: ([0-9.]+)")


def printed_medians(text: str) -> dict[str, tuple[int, str]]:
    """``{series: (warm-up steps, printed median)}`` from every monitor's summary line."""
    figures = {}
    for _, warmup, pairs in SUMMARY_LINE.findall(text):
        for pair in pairs.split():
            name, value = pair.split("=")
            figures[name] = (int(warmup), value)
    return figures


def fit(tmp_path: Path, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture, *args: str) -> tuple[str, dict]:
    """Fit 5 steps; what it printed (Lightning's log lines, which under pytest go to the root logger's
    capture instead of a terminal, put back in order) and its run record."""
    caplog.set_level(logging.INFO)
    main(["fit", *args, "--trainer.max_steps", "5", "--trainer.default_root_dir", str(tmp_path)])
    out, err = capfd.readouterr()
    err = "\n".join([*caplog.messages, err])
    (record_line,) = re.findall(r"^run record: (.*)$", out + err, re.MULTILINE)
    return err + "\n" + out, read_record(Path(record_line))


def assert_printed_figures_are_the_record_s(text: str, record: dict) -> dict[str, tuple[int, str]]:
    medians = printed_medians(text)
    assert medians, text
    for name, (warmup, printed) in medians.items():
        values = [s[name] for s in record["steps"] if s["step"] > warmup and s.get(name) is not None]
        assert values, f"{name}={printed} printed, and the record holds no {name}"
        assert f"{statistics.median(values):.4g}" == printed, name
    total, trainable = PARAMETERS_LINE.search(text).groups()
    assert (total, trainable) == tuple(get_human_readable_count(record["model"][k]) for k in ("total", "trainable")), (
        text
    )
    return medians


def test_a_run_prints_its_record_s_figures(tmp_path: Path, capfd, caplog) -> None:
    text, record = fit(tmp_path, capfd, caplog, "--config", str(CONFIGS / "quickstart.yaml"))
    medians = assert_printed_figures_are_the_record_s(text, record)
    assert {"tokens_per_sec", "useful_tokens_per_sec", "step_time_s"} <= set(medians)
    (loss,) = PROGRESS_LOSS.findall(text)[-1:]
    assert loss == f"{record['steps'][-1]['loss']:.3f}"


def test_a_simulated_rank_says_so_first_and_prints_only_what_its_record_holds(tmp_path: Path, capfd, caplog) -> None:
    text, record = fit(tmp_path, capfd, caplog, "--config", str(CONFIGS / "fsdp2_tiny.yaml"), "--simulate", "64")
    first = next(line for line in text.splitlines() if line.strip())
    assert first.startswith("simulated: this process plays rank 0 of a 64-rank job over a fake process group")
    medians = assert_printed_figures_are_the_record_s(text, record)
    assert not set(medians) & set(NOT_SIMULATED) and "tokens_per_sec_per_device" in medians
    assert not PROGRESS_LOSS.search(text)
    assert all(step.get("loss") is None for step in record["steps"])

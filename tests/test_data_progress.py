"""The token cache build's progress bar: drawn on rank 0's terminal, quiet in tests and other ranks.

Seen failing with a bug put in, one at a time:
- ``progress_wanted`` ignoring whether stderr is a terminal: the quiet build prints a bar into the
  captured stderr (``test_a_build_without_a_terminal_prints_nothing``);
- the rank check taken out: rank 1 draws (``test_only_rank_zero_draws``);
- the source's row count not given as the bar's total: the first frame shows ``0/?``, not ``0/120``
  (``test_a_build_draws_rows_rate_and_eta``).
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from lit_ablate.data import LMDataModule, LocalFiles, SyntheticText, build_progress, token_cache


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, color_system=None, width=200), out


def test_a_build_draws_rows_rate_and_eta(tmp_path, monkeypatch):
    console, out = _console()
    monkeypatch.setattr(token_cache, "BATCH_ROWS", 16)
    monkeypatch.setattr(
        token_cache,
        "BuildProgress",
        lambda label, total_rows: build_progress.BuildProgress(label, total_rows, console=console),
    )
    LMDataModule(SyntheticText(num_documents=120), seq_len=16, storage="cache", cache_dir=str(tmp_path)).setup()
    drawn = out.getvalue()
    assert "data cache pretrain-" in drawn and "rows/s" in drawn and "ETA" in drawn
    assert "  0/120 rows" in drawn and "120/120 rows" in drawn  # the total is known from the first frame on


def test_a_build_without_a_terminal_prints_nothing(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv(build_progress.PROGRESS_ENV, raising=False)
    LMDataModule(SyntheticText(num_documents=120), seq_len=16, storage="cache", cache_dir=str(tmp_path)).setup()
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize(
    ("setting", "rank", "terminal", "drawn"),
    [("0", 0, True, False), ("1", 0, False, True), ("", 0, True, True), ("", 1, True, False), ("1", 1, False, False)],
)
def test_only_rank_zero_draws(setting, rank, terminal, drawn, monkeypatch):
    monkeypatch.setenv(build_progress.PROGRESS_ENV, setting)
    monkeypatch.setattr(build_progress.rank_zero_only, "rank", rank)
    out = io.StringIO()
    assert build_progress.progress_wanted(Console(file=out, force_terminal=terminal)) is drawn


def test_local_files_count_their_rows(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n' * 7 + '{"text": "last, no newline"}')
    assert LocalFiles(str(tmp_path / "a.jsonl")).num_rows() == 8
    assert LocalFiles(str(tmp_path / "a.jsonl"), max_rows=3).num_rows() == 3

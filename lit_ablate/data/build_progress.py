"""The progress bar of a token cache build: rows, rows/s, tokens and (when the source knows its row
count) the time left, drawn with ``rich`` on rank 0's terminal only.

A build of a large corpus takes minutes (about 7 MB of text per second and process with the byte
tokenizer), so a user needs to see it move; a log file, a test or another rank does not need a bar
redrawn ten times a second. It is drawn only in the process of global rank 0 (Lightning's
``rank_zero_only.rank``), and only when stderr is a terminal, unless ``LIT_ABLATE_PROGRESS`` says
otherwise (``0``: never, ``1``: also without a terminal). The process that builds an entry is the
one that takes its lock first: when another rank builds, rank 0 waits without a bar.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from lightning.fabric.utilities.rank_zero import rank_zero_only
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

PROGRESS_ENV = "LIT_ABLATE_PROGRESS"
"""``0``: never draw the bar; ``1``: draw it even when stderr is no terminal; unset: on a terminal."""


def progress_wanted(console: Console) -> bool:
    """Rank 0, and a terminal (or ``LIT_ABLATE_PROGRESS=1``), and not ``LIT_ABLATE_PROGRESS=0``."""
    setting = os.environ.get(PROGRESS_ENV, "")
    if setting == "0" or getattr(rank_zero_only, "rank", 0) != 0:
        return False
    return setting == "1" or console.is_terminal


class _RowsPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} rows/s" if speed else "- rows/s")


class BuildProgress:
    """Counts a build's rows and draws them as a bar when ``progress_wanted``.

    Args:
        label: what is being built (the entry's name).
        total_rows: called only when a bar is drawn (counting a file's lines costs a read): the
            source's row count for the ETA, or None (then rows and rows/s only).
        console: where to draw (default: stderr).
    """

    def __init__(self, label: str, total_rows: Callable[[], int | None], console: Console | None = None) -> None:
        self.rows = 0
        self.start = time.perf_counter()
        console = console or Console(stderr=True)
        self._bar: Progress | None = None
        if progress_wanted(console):
            self._bar = Progress(
                TextColumn("data cache {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rows"),
                _RowsPerSecond(),
                TextColumn("{task.fields[tokens]:,} tokens"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task(label, total=total_rows(), tokens=0)
            self._bar.start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, rows: int, tokens: int) -> None:
        self.rows += rows
        if self._bar is not None:
            self._bar.update(self._task, completed=self.rows, tokens=tokens)

    def close(self) -> None:
        """Leave the bar at its final state (also when the build failed)."""
        if self._bar is not None:
            self._bar.update(self._task, total=self.rows)
            self._bar.stop()
            self._bar = None

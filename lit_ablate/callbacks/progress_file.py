"""``ProgressFile``: where a run in flight stands, in a small JSON file another process can watch.

A study runs each variant as its own ``lit-ablate fit`` process with its output in log files, so
its terminal would otherwise show only a run counter. The runner sets ``LIT_ABLATE_PROGRESS_FILE``
for each run; the fit CLI then adds this callback, and rank 0 rewrites the file (atomically, at
most every ``every_s`` seconds and after the last step) with the step, the step limit, the loss,
tokens/s, elapsed seconds and an ETA. The runner reads it for its live line.

The numbers are rank 0's, taken without any collective (nothing here may slow or synchronise a
step): the loss is rank 0's micro-batches' token mean, tokens/s is rank 0's processed tokens times
the ranks holding different tokens. The run record keeps the exact, all-rank values.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from lit_ablate.callbacks.step_monitor import StepMonitor, batch_replicas

PROGRESS_PATH_ENV = "LIT_ABLATE_PROGRESS_FILE"
RECENT_STEPS = 10
"""The ETA divides the steps left by the median time of this many recent steps (the first step,
with its warm-up, leaves that window once there are others)."""


class ProgressFile(StepMonitor):
    """Rank 0 writes ``{"step", "max_steps", "loss", "tokens_per_sec", "elapsed_s", "eta_s"}`` to ``path``."""

    def __init__(self, path: str | Path, every_s: float = 0.5) -> None:
        super().__init__(warmup_steps=0, log_to_logger=False)
        self.path = Path(path)
        self.every_s = every_s
        self._started = self._written = 0.0
        self._seconds: list[float] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._started, self._written, self._seconds = time.monotonic(), 0.0, []

    def measure_timed(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        if trainer.global_rank != 0:
            return
        self._seconds.append(self.totals.seconds)
        now = time.monotonic()
        limit = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if now - self._written < self.every_s and step != limit:
            return
        self._written = now
        recent = self._seconds[1:][-RECENT_STEPS:] or self._seconds
        totals = self.totals
        data_ranks = max(1, trainer.world_size // batch_replicas(trainer))
        write_progress(
            self.path,
            {
                "step": step,
                "max_steps": limit,
                "loss": totals.loss_sum / totals.loss_units if totals.loss_units else None,
                "tokens_per_sec": totals.tokens * data_ranks / totals.seconds if totals.seconds > 0 else None,
                "elapsed_s": now - self._started,
                "eta_s": (limit - step) * statistics.median(recent) if limit else None,
            },
        )


def write_progress(path: Path, progress: dict[str, Any]) -> None:
    """Replace ``path`` in one step, so a reader never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(progress))
    os.replace(partial, path)


def read_progress(path: Path) -> dict[str, Any] | None:
    """The last progress a run wrote, or None before its first step."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None

"""``StepMonitor``: the base of every per-optimizer-step measurement callback.

It finds optimizer-step boundaries (a step spans ``accumulate_grad_batches`` micro-batches),
times the step with a clock shared by all monitors (synchronising CUDA so GPU work is inside
the window), sums what the module
reported (``StepOutput``), and keeps one value per step for each metric it records. Subclasses
override ``measure(trainer, pl_module, step)`` and call ``record``; ``RunRecorder`` collects the
series of every ``StepMonitor`` on the trainer into the run record. Subclass it for a custom
metric and your metric lands in ``run.json`` and the ablation report without further wiring.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info


@dataclass
class StepTotals:
    """What this rank processed during the current optimizer step."""

    tokens: int = 0
    useful_tokens: int = 0
    flops: float = 0.0
    loss_sum: float = 0.0
    micro_batches: int = 0
    seconds: float = 0.0


@dataclass
class StepClock:
    """One timing window per optimizer step, shared by every monitor on a trainer, so that all
    metrics of a step divide by the same seconds and no monitor's own work lands in another's
    window. The first monitor to see a step start opens it; the first to see it end closes it."""

    opened_at_step: int = -1
    closed_at_step: int = -1
    start: float = 0.0
    seconds: float = 0.0

    def open(self, step: int, device: torch.device) -> None:
        if self.opened_at_step != step:
            _synchronize(device)
            self.opened_at_step, self.start = step, time.perf_counter()

    def close(self, step: int, device: torch.device) -> float:
        if self.closed_at_step != step:
            _synchronize(device)
            self.closed_at_step, self.seconds = step, time.perf_counter() - self.start
        return self.seconds


_CLOCKS: weakref.WeakKeyDictionary[Trainer, StepClock] = weakref.WeakKeyDictionary()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepMonitor(Callback):
    """Base class: per-step series of named metrics, summarised after ``warmup_steps``.

    Args:
        warmup_steps: steps excluded from this monitor's end-of-fit summary line (compile and
            allocator warm-up make first steps unrepresentative).
        log_to_logger: also send each value to the Lightning loggers (CSV/TensorBoard).
    """

    def __init__(self, warmup_steps: int = 2, log_to_logger: bool = True) -> None:
        self.warmup_steps = warmup_steps
        self.log_to_logger = log_to_logger
        self.series: dict[str, dict[int, float | None]] = {}
        self.totals = StepTotals()
        self._open = False
        self._seen_step = 0
        self._to_log: dict[str, float] = {}

    # --- the subclass interface -------------------------------------------------------------
    def start_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Called once at the start of each optimizer step, before the first micro-batch."""

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        """Called once per finished optimizer step; ``self.totals`` holds what it processed."""

    def finalize(self, trainer: Trainer) -> None:
        """Called on every rank at the end of training (collectives are allowed here)."""

    def record(self, name: str, step: int, value: float | None) -> None:
        """Store ``value`` as metric ``name`` at ``step`` (and queue it for the loggers)."""
        self.series.setdefault(name, {})[step] = value
        if value is not None:
            self.log_value(name, value)

    def log_value(self, name: str, value: float) -> None:
        """Queue ``value`` for the Lightning loggers under ``log_prefix``; sent once per step."""
        if self.log_to_logger:
            self._to_log[f"{self.log_prefix}/{name}"] = float(value)

    def send_logs(self, trainer: Trainer, step: int) -> None:
        """One ``log_metrics`` call per logger, every ``trainer.log_every_n_steps`` steps.

        Not ``LightningModule.log``: its result bookkeeping costs about a millisecond per call on
        the step's critical path, which would be measured as framework overhead.
        """
        if self._to_log and step % max(1, trainer.log_every_n_steps) == 0:
            for logger in trainer.loggers:
                logger.log_metrics(self._to_log, step)
        self._to_log = {}

    @property
    def log_prefix(self) -> str:
        return type(self).__name__

    # --- Lightning hooks ----------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seen_step = trainer.global_step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._open:
            return
        self._open = True
        self.totals = StepTotals()
        self.start_step(trainer, pl_module)
        _CLOCKS.setdefault(trainer, StepClock()).open(trainer.global_step, pl_module.device)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        t = self.totals
        if isinstance(outputs, dict) and "tokens" in outputs:
            t.tokens += int(outputs["tokens"])
            t.useful_tokens += int(outputs["useful_tokens"])
            t.flops += float(outputs["flops"])
            t.loss_sum += float(outputs["loss_sum"])
        t.micro_batches += 1
        if trainer.global_step == self._seen_step:
            return  # still accumulating gradients
        t.seconds = _CLOCKS[trainer].close(trainer.global_step, pl_module.device)
        self._seen_step = trainer.global_step
        self._open = False
        self.measure(trainer, pl_module, trainer.global_step)
        self.send_logs(trainer, trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.finalize(trainer)
        if self.log_to_logger:
            rank_zero_info(self.summary_line())

    def summary_line(self) -> str:
        """One line: each public series' median over the steps after warm-up."""
        medians = []
        for name, values in sorted(self.series.items()):
            measured = [v for s, v in values.items() if s > self.warmup_steps and v is not None]
            if measured and not name.startswith("_"):
                medians.append(f"{name}={statistics.median(measured):.4g}")
        return f"{self.log_prefix} (median after {self.warmup_steps} warm-up steps): {' '.join(medians) or 'n/a'}"

    def reduce_over_ranks(self, trainer: Trainer, names: list[str]) -> dict[str, dict[int, float]]:
        """Sum each named series over all ranks, in one collective on a stacked tensor."""
        steps = sorted(self.series[names[0]]) if names and names[0] in self.series else []
        local = torch.tensor([[self.series[n].get(s) or 0.0 for n in names] for s in steps],
                             dtype=torch.float64, device=trainer.strategy.root_device)
        summed = trainer.strategy.reduce(local, reduce_op="sum") if trainer.world_size > 1 else local
        return {n: {s: float(summed[i, j]) for i, s in enumerate(steps)} for j, n in enumerate(names)}

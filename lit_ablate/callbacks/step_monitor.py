"""``StepMonitor``: the base of every per-optimizer-step measurement callback.

It finds optimizer-step boundaries (a step spans ``accumulate_grad_batches`` micro-batches),
reads the step's seconds from a clock shared by all monitors, sums what the module reported
(``StepOutput``), and keeps one value per step for each metric it records. Subclasses override
``measure(trainer, pl_module, step)`` and call ``record``; ``RunRecorder`` collects the series of
every ``StepMonitor`` on the trainer into the run record. Subclass it for a custom metric and
your metric lands in ``run.json`` and the ablation report without further wiring.
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

from lit_ablate.strategies.interface import interface_of

DEFAULT_WARMUP_STEPS = 3
"""Steps left out of every summary unless configured otherwise (compile, allocator and data-loader
warm-up make the first steps unrepresentative). One number for the console and the run record."""


@dataclass
class StepTotals:
    """What this rank processed during the current optimizer step.

    ``useful_tokens`` and ``loss_sum`` stay tensors on the device while the step runs (reading
    them would synchronise the host with the device every micro-batch); ``finish`` turns them
    into numbers once, at the step's end, where the clock synchronises anyway.
    """

    tokens: int = 0
    useful_tokens: Any = 0
    loss_units: Any = 0
    """What ``loss_sum`` averages over: useful tokens, or e.g. DPO's pairs (``StepOutput.loss_units``)."""
    flops: float = 0.0
    loss_sum: Any = 0.0
    micro_batches: int = 0
    seconds: float = 0.0
    data_wait_seconds: float = 0.0

    def add(self, outputs: Any) -> None:
        if isinstance(outputs, dict) and "tokens" in outputs:
            self.tokens += int(outputs["tokens"])
            self.useful_tokens = self.useful_tokens + outputs["useful_tokens"]
            self.loss_units = self.loss_units + outputs.get("loss_units", outputs["useful_tokens"])
            self.flops += float(outputs["flops"])
            self.loss_sum = self.loss_sum + outputs["loss_sum"]
        self.micro_batches += 1

    def finish(self, seconds: float, data_wait_seconds: float) -> None:
        self.useful_tokens, self.loss_sum = int(self.useful_tokens), float(self.loss_sum)
        self.loss_units = int(self.loss_units)
        self.seconds, self.data_wait_seconds = seconds, data_wait_seconds


class StepClock:
    """One clock per trainer, shared by every monitor, so that all metrics of a step divide by
    the same seconds.

    A step's time is the wall time from the end of the previous optimizer step (or the start of
    training) to the end of this one: data loading and collation, forward, backward, optimizer
    and every hook, for the first micro-batch as for the last, so accumulation variants and
    others pay for the same things. Validation runs are paused out of it. Inside that window,
    ``data_wait`` adds up the gaps between one micro-batch's end and the next one's start
    (fetching and collating the batch, moving it to the device, loop bookkeeping). The one
    device synchronisation per step happens when the step ends.
    """

    def __init__(self, first: StepMonitor | None = None, last: StepMonitor | None = None) -> None:
        self.first, self.last = first, last  # the monitors whose hooks mark micro-batch start and end
        self.mark = time.perf_counter()
        self.batch_ended = self.mark
        self.data_wait = 0.0
        self.paused = 0.0
        self._pause_start: float | None = None
        self.closed_step = -1
        self.seconds = self.data_wait_seconds = 0.0

    def batch_started(self) -> None:
        self.data_wait += time.perf_counter() - self.batch_ended

    def batch_ended_now(self) -> None:
        self.batch_ended = time.perf_counter()

    def pause(self) -> None:
        self._pause_start = time.perf_counter()

    def resume(self) -> None:
        if self._pause_start is not None:
            paused = time.perf_counter() - self._pause_start
            self.paused += paused
            self.batch_ended += paused  # a validation run is not data wait either
            self._pause_start = None

    def close(self, step: int, device: torch.device) -> tuple[float, float]:
        """Seconds and data-wait seconds of ``step`` (the first monitor to ask closes it)."""
        if self.closed_step != step:
            _synchronize(device)
            now = time.perf_counter()
            self.seconds, self.data_wait_seconds = now - self.mark - self.paused, self.data_wait
            self.closed_step, self.mark, self.paused, self.data_wait = step, now, 0.0, 0.0
        return self.seconds, self.data_wait_seconds


_CLOCKS: weakref.WeakKeyDictionary[Trainer, StepClock] = weakref.WeakKeyDictionary()


def step_clock(trainer: Trainer) -> StepClock:
    return _CLOCKS[trainer]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepMonitor(Callback):
    """Base class: per-step series of named metrics, summarised after ``warmup_steps``.

    Args:
        warmup_steps: steps excluded from this monitor's end-of-fit summary line (compile and
            allocator warm-up make first steps unrepresentative); ``null``: the run record's
            (``recorder.warmup_steps``), so the console and ``run.json`` summarise the same steps.
        log_to_logger: also send each value to the Lightning loggers (CSV/TensorBoard).
    """

    def __init__(self, warmup_steps: int | None = None, log_to_logger: bool = True) -> None:
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
        monitors = [c for c in trainer.callbacks if isinstance(c, StepMonitor)]
        if self.warmup_steps is None:  # no run recorder gave its own (RunRecorder.on_fit_start)
            self.warmup_steps = DEFAULT_WARMUP_STEPS
        if self is monitors[0]:  # the first monitor starts the first step's window, once per fit
            _CLOCKS[trainer] = StepClock(first=monitors[0], last=monitors[-1])

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        clock = _CLOCKS[trainer]
        if clock.first is self:
            clock.batch_started()
        if not self._open:
            self._open = True
            self.totals = StepTotals()
            self.start_step(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        clock = _CLOCKS[trainer]
        self.totals.add(outputs)
        if trainer.global_step != self._seen_step:  # an optimizer step just finished
            self.totals.finish(*clock.close(trainer.global_step, pl_module.device))
            self._seen_step = trainer.global_step
            self._open = False
            self.measure(trainer, pl_module, trainer.global_step)
            self.send_logs(trainer, trainer.global_step)
        if clock.last is self:
            clock.batch_ended_now()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        clock = _CLOCKS.get(trainer)
        if clock is not None and clock.first is self and trainer.state.fn == "fit":
            clock.pause()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        clock = _CLOCKS.get(trainer)
        if clock is not None and clock.first is self and trainer.state.fn == "fit":
            clock.resume()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.finalize(trainer)
        if self.log_to_logger:
            rank_zero_info(self.summary_line())

    def summary_line(self) -> str:
        """One line: each public series' median over the steps after warm-up."""
        medians = []
        for name, values in sorted(self.series.items()):
            measured = [v for s, v in values.items() if s > self.warmup_steps and isinstance(v, (int, float))]
            if measured and not name.startswith("_"):
                medians.append(f"{name}={statistics.median(measured):.4g}")
        return f"{self.log_prefix} (median after {self.warmup_steps} warm-up steps): {' '.join(medians) or 'n/a'}"

    def reduce_over_ranks(self, trainer: Trainer, names: list[str]) -> dict[str, dict[int, float]]:
        """Sum each named series over all ranks, in one collective on a stacked tensor."""
        steps, local = self._stacked(trainer, names)
        summed = trainer.strategy.reduce(local, reduce_op="sum") if trainer.world_size > 1 else local
        return {n: {s: float(summed[i, j]) for i, s in enumerate(steps)} for j, n in enumerate(names)}

    def gather_over_ranks(self, trainer: Trainer, names: list[str]) -> dict[str, dict[int, list[float]]]:
        """Each named series from every rank (a list in rank order per step), in one collective."""
        steps, local = self._stacked(trainer, names)
        gathered = _all_gather(local) if trainer.world_size > 1 else local.unsqueeze(0)
        return {n: {s: [float(v) for v in gathered[:, i, j]] for i, s in enumerate(steps)} for j, n in enumerate(names)}

    def _stacked(self, trainer: Trainer, names: list[str]) -> tuple[list[int], torch.Tensor]:
        steps = sorted(self.series[names[0]]) if names and names[0] in self.series else []
        local = torch.tensor([[self.series[n].get(s) or 0.0 for n in names] for s in steps],
                             dtype=torch.float64, device=trainer.strategy.root_device).reshape(len(steps), len(names))
        return steps, local


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` of every rank, stacked in rank order. Lightning's ``strategy.all_gather`` goes through
    ``torch.distributed.nn.functional.all_gather`` (autograd), which torch 2.13 deprecates with a
    warning per call; measurements need no gradient, so the plain collective serves."""
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)


def batch_replicas(trainer: Trainer) -> int:
    """How many ranks process the very same tokens (tensor-parallel peers): they must not each
    claim them (``StrategyInterface.batch_replicas``); data- and context-parallel ranks hold different
    tokens, so Lightning's strategies have 1."""
    return interface_of(trainer.strategy).batch_replicas


"""``StepMonitor``: the base of every per-optimizer-step measurement callback.

It finds optimizer-step boundaries (a step spans ``accumulate_grad_batches`` micro-batches),
reads the step's seconds and what the module reported (``StepOutput``, summed once per step) from a
clock shared by all monitors, and keeps one value per step for each metric it records. Subclasses override
``measure(trainer, pl_module, step)`` (at the step's end: what exists only then) and
``measure_timed(trainer, pl_module, step)`` (once the step's seconds and device sums are known)
and call ``record``; ``RunRecorder`` collects the series of every ``StepMonitor`` on the trainer
into the run record. Subclass it for a custom metric and your metric lands in ``run.json`` and the
ablation report without further wiring.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lit_ablate.callbacks.step_clock import RUNNING_CLOCKS, StepTotals, clock_for
from lit_ablate.simulated_rank import NOT_SIMULATED, current_simulation
from lit_ablate.strategies.interface import interface_of

DEFAULT_WARMUP_STEPS = 3
"""Steps left out of every summary unless configured otherwise (compile, allocator and data-loader
warm-up make the first steps unrepresentative). One number for the console and the run record."""


class StepMonitor(Callback):
    """Base class: per-step series of named metrics, summarised after ``warmup_steps``.

    Each optimizer step reaches a monitor twice: ``measure`` at its end, for what exists only then
    (allocator peaks, the learning rate, a hook's reading), and ``measure_timed`` once its seconds
    and device sums are known: one optimizer step later, the last step at the end of training, so
    that no monitor makes the host wait for the device at a step's end (``StepClock``). Metrics of
    the step's time and tokens (throughput, MFU, the loss) belong in ``measure_timed``.

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
        self._untimed: set[int] = set()  # closed steps not yet given to measure_timed
        self._logging_step = 0
        self._to_log: dict[int, dict[str, float]] = {}

    # --- the subclass interface -------------------------------------------------------------
    def start_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Called once at the start of each optimizer step, before the first micro-batch."""

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        """Called once per optimizer step, at its end. ``self.totals`` holds what it processed, but
        its seconds and device sums are not known yet (``measure_timed``)."""

    def measure_timed(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        """Called once per optimizer step, in step order, when ``self.totals`` holds its seconds and
        sums as numbers: at the end of the next step, or at the end of training."""

    def finalize(self, trainer: Trainer) -> None:
        """Called on every rank at the end of training (collectives are allowed here)."""

    def record(self, name: str, step: int, value: float | None) -> None:
        """Store ``value`` as metric ``name`` at ``step`` (and queue it for the loggers)."""
        self.series.setdefault(name, {})[step] = value
        if value is not None:
            self.log_value(name, value, step)

    def log_value(self, name: str, value: float, step: int | None = None) -> None:
        """Queue ``value`` for the Lightning loggers under ``log_prefix`` at ``step`` (default: the
        step being measured); sent once per step."""
        if self.log_to_logger:
            step = self._logging_step if step is None else step
            self._to_log.setdefault(step, {})[f"{self.log_prefix}/{name}"] = float(value)

    def send_logs(self, trainer: Trainer) -> None:
        """One ``log_metrics`` call per logger and step, every ``trainer.log_every_n_steps`` steps.

        Not ``LightningModule.log``: its result bookkeeping costs about a millisecond per call on
        the step's critical path, which would be measured as framework overhead.
        """
        for step, values in sorted(self._to_log.items()):
            if step % max(1, trainer.log_every_n_steps) == 0:
                for logger in trainer.loggers:
                    logger.log_metrics(values, step)
        self._to_log = {}

    def measure_closed_steps(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Give every closed step to ``measure_timed`` now (waits for the device once): at the end of
        training, before a checkpoint carries the series, after a failure."""
        clock = RUNNING_CLOCKS.get(trainer)
        if clock is not None:  # None: training never started
            clock.finish()
            self._measure_timed_before(trainer, pl_module, None)

    @property
    def log_prefix(self) -> str:
        return type(self).__name__

    @staticmethod
    def progress_bar_items(trainer: Trainer, final: bool = False) -> dict[str, float]:
        """What the progress bar shows of the run (``QuietProgressBar`` asks the first callback that
        answers): this rank's loss of the newest step the clock has read, a step late, so that drawing
        it never waits for the device; ``final`` (an epoch's last line) reads the last step too, waiting
        for the device once, so the line left on the screen is the record's last loss."""
        clock = RUNNING_CLOCKS.get(trainer)
        if final and clock is not None:
            clock.finish()
        latest = clock.latest() if clock is not None else None
        if latest is None or not latest.loss_units:
            return {}
        return {"train/loss": latest.loss_sum / latest.loss_units}

    # --- Lightning hooks ----------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seen_step = trainer.global_step
        monitors = [c for c in trainer.callbacks if isinstance(c, StepMonitor)]
        if self.warmup_steps is None:  # no run recorder gave its own (RunRecorder.on_fit_start)
            self.warmup_steps = DEFAULT_WARMUP_STEPS
        if self is monitors[0]:  # the first monitor starts the first step's window, once per fit
            RUNNING_CLOCKS[trainer] = clock_for(pl_module.device, first=monitors[0], last=monitors[-1])

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        clock = RUNNING_CLOCKS[trainer]
        if clock.first is self:
            clock.batch_started()
        if not self._open:
            self._open = True
            self.totals = clock.totals
            self.start_step(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        clock = RUNNING_CLOCKS[trainer]
        if clock.first is self:
            clock.add(outputs)
        step = trainer.global_step
        if step != self._seen_step:  # an optimizer step just finished
            clock.close(step)
            self.totals = clock.totals_of(step)
            self._untimed.add(step)
            self._seen_step, self._open, self._logging_step = step, False, step
            self.measure(trainer, pl_module, step)
            self._measure_timed_before(trainer, pl_module, step)
        if clock.last is self:
            clock.batch_ended_now()

    def _measure_timed_before(self, trainer: Trainer, pl_module: LightningModule, step: int | None) -> None:
        """``measure_timed`` for each closed step before ``step`` (None: all), oldest first."""
        clock = RUNNING_CLOCKS[trainer]
        for closed in sorted(s for s in self._untimed if step is None or s < step):
            self._untimed.discard(closed)
            self.totals = clock.timing(closed)
            self._logging_step = closed
            self.measure_timed(trainer, pl_module, closed)
        self.send_logs(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        clock = RUNNING_CLOCKS.get(trainer)
        if clock is not None and clock.first is self and trainer.state.fn == "fit":
            clock.pause()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        clock = RUNNING_CLOCKS.get(trainer)
        if clock is not None and clock.first is self and trainer.state.fn == "fit":
            clock.resume()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.measure_closed_steps(trainer, pl_module)
        self.finalize(trainer)
        if self.log_to_logger:
            rank_zero_info(self.summary_line())

    def summary_line(self) -> str:
        """One line: each public series' median over the steps after warm-up (a simulated rank's: only
        what it measures, as its run record holds it)."""
        medians = []
        unmeasured = NOT_SIMULATED if current_simulation() is not None else ()
        for name, values in sorted(self.series.items()):
            measured = [v for s, v in values.items() if s > self.warmup_steps and isinstance(v, (int, float))]
            if measured and not name.startswith("_") and name not in unmeasured:
                medians.append(f"{name}={statistics.median(measured):.4g}")
        return f"{self.log_prefix} (median after {self.warmup_steps} warm-up steps): {' '.join(medians) or 'n/a'}"

    def reduce_over_ranks(self, trainer: Trainer, names: list[str]) -> dict[str, dict[int, float]]:
        """Sum each named series over all ranks, in one collective on a stacked tensor."""
        steps, local = self._stacked(trainer, names)
        summed = trainer.strategy.reduce(local, reduce_op="sum") if communicates(trainer) else local
        return {n: {s: float(summed[i, j]) for i, s in enumerate(steps)} for j, n in enumerate(names)}

    def gather_over_ranks(self, trainer: Trainer, names: list[str]) -> dict[str, dict[int, list[float]]]:
        """Each named series from every rank (a list in rank order per step: ``gathered_ranks``), in one collective."""
        steps, local = self._stacked(trainer, names)
        gathered = _all_gather(local) if communicates(trainer) else local.unsqueeze(0)
        return {n: {s: [float(v) for v in gathered[:, i, j]] for i, s in enumerate(steps)} for j, n in enumerate(names)}

    def _stacked(self, trainer: Trainer, names: list[str]) -> tuple[list[int], torch.Tensor]:
        steps = sorted(self.series[names[0]]) if names and names[0] in self.series else []
        local = torch.tensor(
            [[self.series[n].get(s) or 0.0 for n in names] for s in steps],
            dtype=torch.float64,
            device=trainer.strategy.root_device,
        ).reshape(len(steps), len(names))
        return steps, local


def communicates(trainer: Trainer) -> bool:
    """Whether a measurement's collective reaches other ranks: more than one, and none imaginary (a
    simulated rank's fake collectives would hand back its own values as every rank's: it reports its own)."""
    return trainer.world_size > 1 and current_simulation() is None


def gathered_ranks(trainer: Trainer) -> list[int]:
    """The global ranks whose values ``gather_over_ranks`` returns, in its order."""
    return list(range(trainer.world_size)) if communicates(trainer) else [trainer.global_rank]


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

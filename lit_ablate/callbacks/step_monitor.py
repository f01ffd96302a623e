"""``StepMonitor``: the base of every per-optimizer-step measurement callback.

It finds optimizer-step boundaries (a step spans ``accumulate_grad_batches`` micro-batches),
reads the step's seconds from a clock shared by all monitors, sums what the module reported
(``StepOutput``), and keeps one value per step for each metric it records. Subclasses override
``measure(trainer, pl_module, step)`` (at the step's end: what exists only then) and
``measure_timed(trainer, pl_module, step)`` (once the step's seconds and device sums are known)
and call ``record``; ``RunRecorder`` collects the series of every ``StepMonitor`` on the trainer
into the run record. Subclass it for a custom metric and your metric lands in ``run.json`` and the
ablation report without further wiring.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lit_ablate.simulated_rank import current_simulation
from lit_ablate.strategies.interface import interface_of

DEFAULT_WARMUP_STEPS = 3
"""Steps left out of every summary unless configured otherwise (compile, allocator and data-loader
warm-up make the first steps unrepresentative). One number for the console and the run record."""
_DEVICE_SUMS = ("useful_tokens", "loss_units", "loss_sum")


@dataclass
class StepTotals:
    """What this rank processed during the current optimizer step.

    ``useful_tokens``, ``loss_units`` and ``loss_sum`` stay tensors on the device while the step runs
    (reading them would synchronise the host with the device every micro-batch); ``close`` starts
    copying them to the host at the step's end without waiting, and ``finish`` turns them into
    numbers a step later, when the clock knows the step's seconds and the copies are long done.
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
    _copies: dict[str, HostValue] = field(default_factory=dict, repr=False)

    def add(self, outputs: Any) -> None:
        if isinstance(outputs, dict) and "tokens" in outputs:
            self.tokens += int(outputs["tokens"])
            self.useful_tokens = self.useful_tokens + outputs["useful_tokens"]
            self.loss_units = self.loss_units + outputs.get("loss_units", outputs["useful_tokens"])
            self.flops += float(outputs["flops"])
            self.loss_sum = self.loss_sum + outputs["loss_sum"]
        self.micro_batches += 1

    def close(self, clock: StepClock) -> None:
        """The step ended: start copying its device sums to the host."""
        self._copies = {name: clock.read_later(getattr(self, name)) for name in _DEVICE_SUMS
                        if isinstance(getattr(self, name), torch.Tensor)}  # fmt: skip

    def finish(self, seconds: float, data_wait_seconds: float) -> None:
        for name, copy in self._copies.items():
            setattr(self, name, copy.get())
        self._copies = {}
        self.useful_tokens, self.loss_sum = int(self.useful_tokens), float(self.loss_sum)
        self.loss_units = int(self.loss_units)
        self.seconds, self.data_wait_seconds = seconds, data_wait_seconds


class HostValue:
    """A tensor on its way to host memory: copied without waiting for the device, read by ``get``,
    which waits (if at all) only for that copy."""

    def __init__(self, host: torch.Tensor, copied: Any = None) -> None:
        self._host, self._copied = host, copied  # ``copied``: an event recorded after the copy

    def get(self) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self._host.cpu()


class StepClock:
    """One clock per trainer, shared by every monitor, so that all metrics of a step divide by
    the same seconds.

    A step's time runs from the end of the previous optimizer step (or the start of training) to
    the end of this one: data loading and collation, forward, backward, optimizer and every hook,
    for the first micro-batch as for the last, so accumulation variants and others pay for the
    same things. Validation runs are paused out of it. Inside that window, ``data_wait`` adds up
    the gaps (host wall time) between one micro-batch's end and the next one's start (fetching and
    collating the batch, moving it to the device, loop bookkeeping).

    The clock marks each step boundary (``mark``) and reads the time between two marks a step
    later: ``close(N)`` marks step N's end and makes step N-1's seconds known (``timing``);
    ``finish`` makes the last step's known. On CUDA (``CudaEventClock``) a mark is an event recorded
    in the stream, so nothing waits at a step's end, and step N-1's end event, synchronised at step
    N's end, has long completed; elsewhere (``WallClock``) a mark is the host's wall time. Device
    tensors a monitor reads (``StepTotals``' sums) travel the same way: ``read_later`` copies them
    without waiting, ``HostValue.get`` reads them a step later.
    """

    def __init__(self, first: StepMonitor | None = None, last: StepMonitor | None = None) -> None:
        self.first, self.last = first, last  # the monitors whose hooks mark micro-batch start and end
        self.batch_ended = time.perf_counter()
        self.data_wait = 0.0
        self._pause_start: float | None = None
        self._pause_mark: Any = None
        self.closed_step = -1
        self._open_mark = self.mark()  # where the open step started
        self._open_pauses: list[tuple[Any, Any]] = []
        self._unread: dict[int, tuple[Any, Any, list[tuple[Any, Any]], float]] = {}  # step -> marks, pauses, wait
        self._timings: dict[int, tuple[float, float]] = {}

    # --- what an implementation provides ------------------------------------------------------
    def mark(self) -> Any:
        """A point on the clock's timeline, now (for the device: after the work issued so far)."""
        raise NotImplementedError

    def seconds_between(self, start: Any, end: Any) -> float:
        """Seconds from mark ``start`` to mark ``end``; ``end`` has been waited for."""
        raise NotImplementedError

    def wait_for(self, mark: Any) -> None:
        """Return once ``mark`` can be read."""

    def read_later(self, tensor: torch.Tensor) -> HostValue:
        """``tensor``'s values, for reading a step later without waiting for the device then."""
        return HostValue(tensor.detach())

    # --- shared by both -----------------------------------------------------------------------
    def batch_started(self) -> None:
        self.data_wait += time.perf_counter() - self.batch_ended

    def batch_ended_now(self) -> None:
        self.batch_ended = time.perf_counter()

    def pause(self) -> None:
        self._pause_start, self._pause_mark = time.perf_counter(), self.mark()

    def resume(self) -> None:
        if self._pause_start is not None:
            self.batch_ended += time.perf_counter() - self._pause_start  # a validation run is not data wait either
            self._open_pauses.append((self._pause_mark, self.mark()))
            self._pause_start = self._pause_mark = None

    def close(self, step: int) -> None:
        """Mark the end of ``step`` (the first monitor to ask closes it) and read the steps before it."""
        if self.closed_step == step:
            return
        end = self.mark()
        self._unread[step] = (self._open_mark, end, self._open_pauses, self.data_wait)
        self.closed_step, self._open_mark, self._open_pauses, self.data_wait = step, end, [], 0.0
        self._read(keep=step)

    def finish(self) -> None:
        """Read every closed step, the last one included (at the end of training: waits once)."""
        self._read(keep=None)

    def timing(self, step: int) -> tuple[float, float]:
        """Seconds and data-wait seconds of ``step``, once read (``close`` of a later step, ``finish``)."""
        return self._timings[step]

    def _read(self, keep: int | None) -> None:
        for step in sorted(s for s in self._unread if s != keep):
            start, end, pauses, data_wait = self._unread.pop(step)
            self.wait_for(end)  # every earlier mark of the stream is done too
            paused = sum(self.seconds_between(a, b) for a, b in pauses)
            self._timings[step] = (self.seconds_between(start, end) - paused, data_wait)


class WallClock(StepClock):
    """The host's wall time: on CPU every operation has finished when the host returns from it."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds_between(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock(StepClock):
    """CUDA events recorded in the current stream at each boundary (``torch.cuda.Event``, or an
    ``event_class`` with its interface in tests). A step's seconds are the device time between its
    two boundary events: exactly what a synchronisation at every step end measured, without the
    synchronisation, which would leave the device idle while the host prepares the next step."""

    def __init__(self, first: StepMonitor | None = None, last: StepMonitor | None = None,
                 event_class: Any = None) -> None:  # fmt: skip
        self.event_class = event_class or torch.cuda.Event
        super().__init__(first, last)

    def mark(self) -> Any:
        event = self.event_class(enable_timing=True)
        event.record()
        return event

    def seconds_between(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000  # milliseconds

    def wait_for(self, mark: Any) -> None:
        mark.synchronize()

    def read_later(self, tensor: torch.Tensor) -> HostValue:
        host = tensor.detach().to("cpu", non_blocking=True)  # into pinned memory, in stream order
        copied = self.event_class()
        copied.record()
        return HostValue(host, copied)


def clock_for(device: torch.device, first: StepMonitor, last: StepMonitor) -> StepClock:
    """The clock of a run on ``device``."""
    return CudaEventClock(first, last) if device.type == "cuda" else WallClock(first, last)


_CLOCKS: weakref.WeakKeyDictionary[Trainer, StepClock] = weakref.WeakKeyDictionary()


def step_clock(trainer: Trainer) -> StepClock:
    return _CLOCKS[trainer]


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
        self._untimed: dict[int, StepTotals] = {}  # closed steps not yet given to measure_timed
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
        clock = _CLOCKS.get(trainer)
        if clock is not None:  # None: training never started
            clock.finish()
            self._measure_timed_before(trainer, pl_module, None)

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
            _CLOCKS[trainer] = clock_for(pl_module.device, first=monitors[0], last=monitors[-1])

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
        step = trainer.global_step
        if step != self._seen_step:  # an optimizer step just finished
            clock.close(step)
            self.totals.close(clock)
            self._untimed[step] = self.totals
            self._seen_step, self._open, self._logging_step = step, False, step
            self.measure(trainer, pl_module, step)
            self._measure_timed_before(trainer, pl_module, step)
        if clock.last is self:
            clock.batch_ended_now()

    def _measure_timed_before(self, trainer: Trainer, pl_module: LightningModule, step: int | None) -> None:
        """``measure_timed`` for each closed step before ``step`` (None: all), oldest first."""
        clock = _CLOCKS[trainer]
        for closed in sorted(s for s in self._untimed if step is None or s < step):
            self.totals = self._untimed.pop(closed)
            self.totals.finish(*clock.timing(closed))
            self._logging_step = closed
            self.measure_timed(trainer, pl_module, closed)
        self.send_logs(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        clock = _CLOCKS.get(trainer)
        if clock is not None and clock.first is self and trainer.state.fn == "fit":
            clock.pause()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        clock = _CLOCKS.get(trainer)
        if clock is not None and clock.first is self and trainer.state.fn == "fit":
            clock.resume()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.measure_closed_steps(trainer, pl_module)
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
        summed = trainer.strategy.reduce(local, reduce_op="sum") if communicates(trainer) else local
        return {n: {s: float(summed[i, j]) for i, s in enumerate(steps)} for j, n in enumerate(names)}

    def gather_over_ranks(self, trainer: Trainer, names: list[str]) -> dict[str, dict[int, list[float]]]:
        """Each named series from every rank (a list in rank order per step: ``gathered_ranks``), in one collective."""
        steps, local = self._stacked(trainer, names)
        gathered = _all_gather(local) if communicates(trainer) else local.unsqueeze(0)
        return {n: {s: [float(v) for v in gathered[:, i, j]] for i, s in enumerate(steps)} for j, n in enumerate(names)}

    def _stacked(self, trainer: Trainer, names: list[str]) -> tuple[list[int], torch.Tensor]:
        steps = sorted(self.series[names[0]]) if names and names[0] in self.series else []
        local = torch.tensor([[self.series[n].get(s) or 0.0 for n in names] for s in steps],
                             dtype=torch.float64, device=trainer.strategy.root_device).reshape(len(steps), len(names))
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


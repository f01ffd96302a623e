"""The step clock: one per trainer, shared by every ``StepMonitor``, and the per-step totals it times.

A step's seconds and sums are read one step late (``StepClock``): on CUDA from events recorded in the
stream (``CudaEventClock``), so no monitor makes the host wait for the device at a step's end; elsewhere
from the host's wall time (``WallClock``). The clock keeps one ``StepTotals`` per step for all
monitors: what the module reported is summed once, its device sums copied to the host once, and read
once, in the one host read a step makes on purpose (``STEP_READ``).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer

from lit_ablate.callbacks.host_syncs import host_read

_DEVICE_SUMS = ("useful_tokens", "loss_units", "loss_sum")
STEP_READ = "step clock: the step before (its end event and sums)"
"""The host read of each optimizer step: the step before's time and device sums, which the device
finished a step ago (``KernelProfile``'s ``host_reads_per_step``)."""


@dataclass
class StepTotals:
    """What this rank processed during one optimizer step.

    ``useful_tokens``, ``loss_units`` and ``loss_sum`` (and the ``extra`` sums monitors asked for:
    ``StepClock.sum_outputs``) stay tensors on the device while the step runs (reading them would
    synchronise the host with the device every micro-batch); ``close`` starts copying them to the
    host at the step's end without waiting, in one copy, and ``finish`` turns them into numbers a step
    later, when the clock knows the step's seconds and the copy is long done.
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
    extra: dict[str, Any] = field(default_factory=dict)
    """Per output key a monitor asked for, its sum over the step's micro-batches (a list of numbers
    once finished)."""
    _copy: tuple[list[tuple[str, int]], torch.Tensor] | None = field(default=None, repr=False)

    def add(self, outputs: Any, extra_keys: tuple[str, ...] = ()) -> None:
        if isinstance(outputs, dict) and "tokens" in outputs:
            first = self.micro_batches == 0  # the first micro-batch's tensors are taken as they are: no add
            self.tokens += int(outputs["tokens"])
            units = outputs.get("loss_units", outputs["useful_tokens"])
            self.useful_tokens = outputs["useful_tokens"] if first else self.useful_tokens + outputs["useful_tokens"]
            self.loss_units = units if first else self.loss_units + units
            self.flops += float(outputs["flops"])
            self.loss_sum = outputs["loss_sum"] if first else self.loss_sum + outputs["loss_sum"]
        if isinstance(outputs, dict):
            for key in extra_keys:
                if key in outputs:
                    self.extra[key] = outputs[key] if key not in self.extra else self.extra[key] + outputs[key]
        self.micro_batches += 1

    def close(self, clock: StepClock) -> None:
        """The step ended: start copying its device sums to the host, all in one float64 tensor
        (exact for token counts up to 2^53)."""
        parts = [(name, getattr(self, name)) for name in _DEVICE_SUMS] + [
            (f"extra.{k}", v) for k, v in self.extra.items()
        ]
        tensors = [(name, t.detach().double().reshape(-1)) for name, t in parts if isinstance(t, torch.Tensor)]
        if tensors:
            layout = [(name, t.numel()) for name, t in tensors]
            self._copy = (layout, clock.read_later(torch.cat([t for _, t in tensors])))

    def finish(self, seconds: float, data_wait_seconds: float) -> None:
        if self._copy is not None:
            layout, host = self._copy
            values, start = host.tolist(), 0
            for name, size in layout:
                part, start = values[start : start + size], start + size
                if name.startswith("extra."):
                    self.extra[name.removeprefix("extra.")] = part
                else:
                    setattr(self, name, part[0])
            self._copy = None
        self.useful_tokens, self.loss_sum = int(self.useful_tokens), float(self.loss_sum)
        self.loss_units = int(self.loss_units)
        self.seconds, self.data_wait_seconds = seconds, data_wait_seconds


class StepClock:
    """One clock per trainer, shared by every monitor, so that all metrics of a step divide by
    the same seconds and read the same sums.

    A step's time runs from the end of the previous optimizer step (or the start of training) to
    the end of this one: data loading and collation, forward, backward, optimizer and every hook,
    for the first micro-batch as for the last, so accumulation variants and others pay for the
    same things. Validation runs are paused out of it. Inside that window, ``data_wait`` adds up
    the gaps (host wall time) between one micro-batch's end and the next one's start (fetching and
    collating the batch, moving it to the device, loop bookkeeping).

    The clock sums what the module reported (``add``, once per micro-batch) into the open step's
    ``StepTotals``, marks each step boundary (``mark``) and reads a step a step later: ``close(N)``
    starts copying step N's device sums to the host, then marks its end, and reads step N-1
    (``timing``); ``finish`` reads the last step. On CUDA (``CudaEventClock``) a mark is an event
    recorded in the stream, so nothing waits at a step's end, and step N-1's end event, waited for
    at step N's end, has long completed, and with it the copy issued before it: one host read per
    step (``STEP_READ``), never a stall. Elsewhere (``WallClock``) a mark is the host's wall time.
    """

    def __init__(self, first: Callback | None = None, last: Callback | None = None) -> None:
        # The monitors whose hooks mark micro-batch start and end, held weakly: ``RUNNING_CLOCKS`` holds the
        # clock as long as its trainer lives, and a monitor reaching the trainer (through the module) would
        # keep the trainer, its model and process groups alive until the interpreter's shutdown, where gloo's
        # threads, torn down with them, aborted a rank that had finished ("terminate called without an active
        # exception").
        self._first, self._last = (weakref.ref(m) if m is not None else None for m in (first, last))
        self.batch_ended = time.perf_counter()
        self.data_wait = 0.0
        self._pause_start: float | None = None
        self._pause_mark: Any = None
        self.closed_step = -1
        self.extra_keys: tuple[str, ...] = ()
        self.totals = StepTotals()
        """The open step's sums."""
        self._open_mark = self.mark()  # where the open step started
        self._open_pauses: list[tuple[Any, Any]] = []
        self._unread: dict[int, tuple[Any, Any, list[tuple[Any, Any]], float]] = {}  # step -> marks, pauses, wait
        self._closed: dict[int, StepTotals] = {}
        self._newest_read: int | None = None

    @property
    def first(self) -> Callback | None:
        return self._first() if self._first is not None else None

    @property
    def last(self) -> Callback | None:
        return self._last() if self._last is not None else None

    # --- what an implementation provides ------------------------------------------------------
    def mark(self) -> Any:
        """A point on the clock's timeline, now (for the device: after the work issued so far)."""
        raise NotImplementedError

    def seconds_between(self, start: Any, end: Any) -> float:
        """Seconds from mark ``start`` to mark ``end``; ``end`` has been waited for."""
        raise NotImplementedError

    def wait_for(self, mark: Any) -> None:
        """Return once ``mark`` can be read."""

    def read_later(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in host memory once the next mark has been waited for: copied without
        waiting, in the device's order (on a CPU the tensor itself)."""
        return tensor.detach()

    # --- shared by both -----------------------------------------------------------------------
    def add(self, outputs: Any) -> None:
        """What one micro-batch's ``training_step`` reported (``StepOutput``)."""
        self.totals.add(outputs, self.extra_keys)

    def sum_outputs(self, key: str) -> None:
        """Also sum ``outputs[key]`` (a device tensor) over each step's micro-batches and read it with the
        step (``StepTotals.extra[key]``, a list of numbers): for a monitor of its own device values."""
        if key not in self.extra_keys:
            self.extra_keys = (*self.extra_keys, key)

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
        """End ``step`` (the first monitor to ask closes it): start copying its sums, mark its end,
        and read the steps before it."""
        if self.closed_step == step:
            return
        self.totals.close(self)  # before the mark: waiting for the mark covers the copy
        end = self.mark()
        self._unread[step] = (self._open_mark, end, self._open_pauses, self.data_wait)
        self._closed[step] = self.totals
        self.closed_step, self._open_mark, self._open_pauses, self.data_wait = step, end, [], 0.0
        self.totals = StepTotals()
        self._read(keep=step)

    def finish(self) -> None:
        """Read every closed step, the last one included (at the end of training: waits once)."""
        self._read(keep=None)

    def totals_of(self, step: int) -> StepTotals:
        """The sums of closed ``step``: numbers once it was read (``timing``), device tensors before."""
        return self._closed[step]

    def timing(self, step: int) -> StepTotals:
        """``step``'s seconds, data-wait seconds and sums as numbers, once read (``close`` of a later step,
        ``finish``)."""
        if step in self._unread:
            raise KeyError(f"step {step} is not read yet")
        return self._closed[step]

    def latest(self) -> StepTotals | None:
        """The newest step read so far (None before the first)."""
        return None if self._newest_read is None else self._closed[self._newest_read]

    def _read(self, keep: int | None) -> None:
        for step in sorted(s for s in self._unread if s != keep):
            start, end, pauses, data_wait = self._unread.pop(step)
            with host_read(STEP_READ):
                self.wait_for(end)  # every earlier mark of the stream is done too, and the copies before it
                paused = sum(self.seconds_between(a, b) for a, b in pauses)
                self._closed[step].finish(self.seconds_between(start, end) - paused, data_wait)
            self._newest_read = step


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

    def __init__(self, first: Callback | None = None, last: Callback | None = None, event_class: Any = None) -> None:
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

    def read_later(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", non_blocking=True)  # into pinned memory, in stream order


def clock_for(device: torch.device, first: Callback, last: Callback) -> StepClock:
    """The clock of a run on ``device``."""
    return CudaEventClock(first, last) if device.type == "cuda" else WallClock(first, last)


RUNNING_CLOCKS: weakref.WeakKeyDictionary[Trainer, StepClock] = weakref.WeakKeyDictionary()
"""Each running trainer's clock, made by its first ``StepMonitor`` at the start of training."""


def step_clock(trainer: Trainer) -> StepClock:
    return RUNNING_CLOCKS[trainer]

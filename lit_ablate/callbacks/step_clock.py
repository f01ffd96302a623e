"""The step clock: one per trainer, shared by every ``StepMonitor``, and the per-step totals it times.

A step's seconds are read one step late (``StepClock``): on CUDA from events recorded in the stream
(``CudaEventClock``), so no monitor makes the host wait for the device at a step's end; elsewhere
from the host's wall time (``WallClock``). Device sums a monitor reports travel the same way
(``read_later``, ``HostValue``).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer

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
        self._copies = {
            name: clock.read_later(getattr(self, name))
            for name in _DEVICE_SUMS
            if isinstance(getattr(self, name), torch.Tensor)
        }

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

    def __init__(self, first: Callback | None = None, last: Callback | None = None) -> None:
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

    def read_later(self, tensor: torch.Tensor) -> HostValue:
        host = tensor.detach().to("cpu", non_blocking=True)  # into pinned memory, in stream order
        copied = self.event_class()
        copied.record()
        return HostValue(host, copied)


def clock_for(device: torch.device, first: Callback, last: Callback) -> StepClock:
    """The clock of a run on ``device``."""
    return CudaEventClock(first, last) if device.type == "cuda" else WallClock(first, last)


RUNNING_CLOCKS: weakref.WeakKeyDictionary[Trainer, StepClock] = weakref.WeakKeyDictionary()
"""Each running trainer's clock, made by its first ``StepMonitor`` at the start of training."""


def step_clock(trainer: Trainer) -> StepClock:
    return RUNNING_CLOCKS[trainer]

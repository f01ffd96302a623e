"""``ChunkTimer``: a pipeline stage's own compute time inside a schedule step (``PipelineBubbleMonitor`` reads it)."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    pass


class ChunkTimer:
    """The time one stage spends in its own forward and backward chunks during a schedule step (not
    waiting for its neighbours). On CUDA through events, since kernels run after the host returns;
    elsewhere the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    def reset(self) -> None:
        self._seconds, self._events = 0.0, []

    def timed(self, chunk: Any) -> Any:
        @functools.wraps(chunk)
        def timed_chunk(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = chunk(*args, **kwargs)
                end.record()
                self._events.append((start, end))
                return result
            started = time.perf_counter()
            try:
                return chunk(*args, **kwargs)
            finally:
                self._seconds += time.perf_counter() - started

        return timed_chunk

    def seconds(self) -> float:
        if self._events:
            torch.cuda.synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000
            self._events = []
        return self._seconds

"""``KernelProfile``: where a few optimizer steps spend their time, and what torch.compile did."""

from __future__ import annotations

import collections
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.profiler import ProfilerActivity

from lit_ablate.callbacks.host_syncs import count_host_syncs
from lit_ablate.callbacks.record_section import RecordSection
from lit_ablate.errors import ConfigError

SECTION = "profile"
HOST_SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that make the host wait for the device (a tensor's value read into Python,
``.item()`` or ``.tolist()`` of a device tensor, is a copy then a ``cudaStreamSynchronize``)."""
REASON_CHARS = 300


class KernelProfile(RecordSection):
    """Profiles optimizer steps ``start_step .. start_step + num_steps - 1`` with ``torch.profiler``
    (CPU activity, plus CUDA on a GPU) and writes into the run record (``run.json["profile"]``):

    - ``top``: the ``top`` kernels by device time on CUDA (CPU operators by self time elsewhere), each
      with ``time_ms`` (summed over the profiled steps), ``calls`` and ``share`` (of the device time,
      or CPU operator self time, of all profiled kernels, so shares add up to at most 1);
    - ``profiled_steps`` and the steps, ``wall_ms`` (host time of the window), ``device_ms`` (all
      kernels' summed time: idle gaps show as ``device_ms`` well below ``wall_ms``);
    - ``host_syncs_per_step``: on CUDA, how often the host waited for the device (``HOST_SYNCS``),
      per profiled step, outside the reads lit-ablate declares (the profiler's own synchronisation at
      its stop may count as one);
    - ``sync_ops_per_step``: on every device, the operators that make the host wait for the device on
      CUDA (``lit_ablate.callbacks.host_syncs``: ``.item()``, ``bool()`` of a tensor, boolean indexing,
      ``nonzero``, ``.tolist()``...), by the operator that asked, per profiled step: what a CPU run
      shows of a GPU step's stalls;
    - ``host_reads_per_step``: the reads of device values a step makes on purpose (``host_read``), by
      name, per profiled step (the step clock's read of the step before, once per optimizer step);
    - ``compile``: over the whole fit (compiles happen in the first steps), torch.compile's graph
      breaks (count and the most frequent reasons), graphs compiled, compiles, and recompiles (count
      and the guard failures that caused them; null on a torch whose compile callbacks pass no
      compile id).

    Choose it for a benchmark or a GPU run whose time must be explained. The profiled steps run
    slower (the profiler's own work, and a device synchronisation before the first of them): put
    them after the steps a summary should keep, or profile a separate run. Each rank profiles
    itself; the record holds rank 0's.

    Args:
        start_step: the first profiled optimizer step (1-based, as in the record's ``steps``).
        num_steps: how many consecutive steps to profile.
        top: how many kernels (or CPU operators) to keep.
        top_reasons: how many graph-break and recompile reasons to keep.
    """

    def __init__(self, start_step: int = 5, num_steps: int = 3, top: int = 20, top_reasons: int = 5) -> None:
        super().__init__(SECTION)
        for key, value in (
            ("start_step", start_step),
            ("num_steps", num_steps),
            ("top", top),
            ("top_reasons", top_reasons),
        ):
            if value < 1:
                raise ConfigError(f"trainer.callbacks[KernelProfile].init_args.{key}", value, "use 1 or more")
        self.start_step, self.num_steps, self.top, self.top_reasons = start_step, num_steps, top, top_reasons
        self._profiler: torch.profiler.profile | None = None
        self._device: torch.device | None = None
        self._started_at = 0.0
        self._steps: list[int] = []
        self._kernels: dict[str, Any] | None = None
        self._compile_start: dict[str, Any] = {}
        self._compile_ids: list[str | None] = []
        self._compile: dict[str, Any] | None = None

    # --- the profiled window --------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device = pl_module.device
        self._compile_start = _dynamo_state()
        _callback_handler().register_start_callback(self._compile_started)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step + 1  # the optimizer step this micro-batch belongs to
        if self._profiler is None and self._kernels is None and step == self.start_step:
            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self._device.type == "cuda" else [])]
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)  # nothing of earlier steps runs inside the window
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
            self._started_at = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step  # the last optimizer step that ended
        if self._profiler is not None and step >= self.start_step and step not in self._steps:
            self._steps.append(step)
            if len(self._steps) == self.num_steps:
                self._stop()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._profiler is not None:  # training ended inside the window
            self._stop()
        _callback_handler().remove_start_callback(self._compile_started)
        self._compile = self._compile_summary()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._profiler is not None:
            self._profiler.stop()  # never leave the profiler on; a failed window is not summarised
            self._profiler = None
        _callback_handler().remove_start_callback(self._compile_started)

    def _stop(self) -> None:
        self._profiler.stop()  # torch's profiler synchronises the device before it stops
        wall_ms = (time.perf_counter() - self._started_at) * 1e3
        events, self._profiler = self._profiler.events(), None
        self._kernels = {"wall_ms": wall_ms, **self._summarise(events)}

    # --- what the record gets -------------------------------------------------------------------
    def record_section(self) -> dict[str, Any] | None:
        if self._kernels is None and self._compile is None:
            return None
        return {
            "start_step": self.start_step,
            "profiled_steps": len(self._steps),
            "steps": list(self._steps),
            **(self._kernels or {"kind": None, "top": []}),
            "compile": self._compile,
        }

    def _summarise(self, events: Any) -> dict[str, Any]:
        """The top kernels (CUDA) or CPU operators (elsewhere), their shares, and the host's waits."""
        cuda = self._device.type == "cuda"
        averages = events.key_averages()
        if cuda:
            timed = [(e.key, e.self_device_time_total, e.count) for e in averages if e.device_type.name == "CUDA"]
        else:
            timed = [(e.key, e.self_cpu_time_total, e.count) for e in averages if e.device_type.name == "CPU"]
        total_us = sum(us for _, us, _ in timed)
        top = sorted((t for t in timed if t[1] > 0), key=lambda t: t[1], reverse=True)[: self.top]
        syncs = count_host_syncs(events, HOST_SYNCS if cuda else ())
        steps = max(1, len(self._steps))
        return {
            "kind": "cuda_kernels" if cuda else "cpu_operators",
            "device_ms": total_us / 1e3,
            "top": [
                {
                    "name": name[:REASON_CHARS],
                    "time_ms": us / 1e3,
                    "calls": calls,
                    "share": us / total_us if total_us else None,
                }
                for name, us, calls in top
            ],
            "host_syncs_per_step": _per_step(syncs.runtime_waits, steps),
            "sync_ops_per_step": _per_step(syncs.by_operator, steps),
            "host_reads_per_step": _per_step(syncs.declared, steps),
        }

    def _compile_started(self, args: Any = None) -> None:
        """torch's compile-start callback: its ``CallbackArgs`` (older torch passes none: no compile id)."""
        if args is None or args.callback_trigger.name == "DYNAMO":
            self._compile_ids.append(None if args is None else str(args.compile_id))

    def _compile_summary(self) -> dict[str, Any]:
        """torch.compile's graph breaks, graphs and recompiles since the fit started."""
        now, start = _dynamo_state(), self._compile_start
        breaks = now["graph_breaks"] - start["graph_breaks"]
        failures = collections.Counter()
        for code, reasons in now["guard_failures"].items():  # a reason per cache entry whose guards failed
            for reason in reasons[len(start["guard_failures"].get(code, [])) :]:
                failures[f"{getattr(code, 'co_name', code)}: {_one_line(reason)}"] += 1
        # "frame/n": the frame's n-th compile, a recompile from n = 1 ("!n": compiled autograd's graph)
        recompiles = (
            None
            if None in self._compile_ids
            else sum(1 for compile_id in self._compile_ids if "/" in compile_id and compile_id.rsplit("/", 1)[1] != "0")
        )
        return {
            "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": [
                {"reason": _one_line(reason), "count": count} for reason, count in breaks.most_common(self.top_reasons)
            ],
            "unique_graphs": now["unique_graphs"] - start["unique_graphs"],
            "compiles": len(self._compile_ids),
            "recompiles": recompiles,
            "recompile_reasons": [{"reason": r, "count": c} for r, c in failures.most_common(self.top_reasons)],
        }


def _per_step(counts: collections.Counter[str], steps: int) -> dict[str, float]:
    return {name: count / steps for name, count in sorted(counts.items())}


def _callback_handler() -> Any:
    from torch._dynamo.callback import callback_handler  # torch._dynamo loads slowly: only when a fit starts

    return callback_handler


def _dynamo_state() -> dict[str, Any]:
    """torch.compile's process-wide counters, copied: a fit reports what changed during it."""
    from torch._dynamo.utils import counters, guard_failures

    return {
        "graph_breaks": collections.Counter(counters["graph_break"]),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "guard_failures": {code: list(reasons) for code, reasons in guard_failures.items()},
    }


def _one_line(text: str) -> str:
    return " ".join(text.split())[:REASON_CHARS]

"""``MemoryMonitor``: the peak memory of each step, measured honestly and labelled with how."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lit_ablate.callbacks.step_monitor import StepMonitor

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tensor_breakdown(pl_module: LightningModule) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states held by this rank (local shards)."""
    params = [p.to_local() if hasattr(p, "to_local") else p for p in pl_module.parameters()]
    grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    states = []
    for optimizer in pl_module.trainer.optimizers:
        for state in optimizer.state.values():
            states += [v.to_local() if hasattr(v, "to_local") else v
                       for v in state.values() if isinstance(v, torch.Tensor)]
    return {"params": _tensor_bytes(params), "grads": _tensor_bytes(grads), "optimizer": _tensor_bytes(states)}


class MemoryMonitor(StepMonitor):
    """Per-step peak memory, with parameters/gradients/optimizer bytes beside it.

    On CUDA: the allocator's peak allocated and reserved bytes, reset at each step start. On CPU
    the allocator has no statistics (``torch.cuda.max_memory_allocated`` would be a silent 0), so
    the process's peak resident set (``VmHWM``) is used, reset per step through
    ``/proc/self/clear_refs``: it includes the Python interpreter and libraries, and the
    ``memory_method`` field says so. The breakdown counts the tensors this rank holds; the rest of
    the peak is activations and temporaries. It is counted on the first two measured steps (the
    optimizer creates its states in the first) and then reused: these sizes do not change while
    training, and walking every tensor each step would cost about a millisecond of Python.

    Every rank measures its own peak; at the end of training ``memory_peak_bytes`` becomes the
    largest over the ranks (the rank that runs out first decides whether a run fits) and
    ``memory_peak_bytes_per_rank`` keeps each rank's value, in rank order.
    """

    def __init__(self, warmup_steps: int | None = None) -> None:
        super().__init__(warmup_steps=warmup_steps)
        self.method: str | None = None
        self._breakdown: dict[str, int] = {}
        self._breakdown_counts = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            self.method = "cuda_max_allocated"
        elif _STATUS.exists():
            self.method = "cpu_process_peak_rss"
            if not self._reset_rss_peak():
                self.method = "cpu_process_peak_rss_since_start"
                rank_zero_warn("MemoryMonitor: cannot reset the RSS peak (/proc/self/clear_refs); "
                               "each step's peak is the peak since the process started")
        else:
            self.method = None
            rank_zero_warn("MemoryMonitor: no memory measurement on this platform; peak memory is not reported")

    @staticmethod
    def _reset_rss_peak() -> bool:
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            return False
        return True

    @staticmethod
    def _rss_peak_bytes() -> int:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("VmHWM missing from /proc/self/status")

    def start_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.method == "cuda_max_allocated":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        elif self.method == "cpu_process_peak_rss":
            self._reset_rss_peak()

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        if self.method == "cuda_max_allocated":
            self.record("memory_peak_bytes", step, torch.cuda.max_memory_allocated(pl_module.device))
            self.record("memory_reserved_bytes", step, torch.cuda.max_memory_reserved(pl_module.device))
        elif self.method is not None:
            self.record("memory_peak_bytes", step, self._rss_peak_bytes())
        if self._breakdown_counts < 2:
            self._breakdown, self._breakdown_counts = tensor_breakdown(pl_module), self._breakdown_counts + 1
        for name, value in self._breakdown.items():
            self.record(f"memory_{name}_bytes", step, value)

    def finalize(self, trainer: Trainer) -> None:
        if "memory_peak_bytes" not in self.series:
            return
        per_rank = self.gather_over_ranks(trainer, ["memory_peak_bytes"])["memory_peak_bytes"]
        self.series["memory_peak_bytes_per_rank"] = {s: [int(v) for v in values] for s, values in per_rank.items()}
        self.series["memory_peak_bytes"] = {s: max(values) for s, values in self.series["memory_peak_bytes_per_rank"].items()}

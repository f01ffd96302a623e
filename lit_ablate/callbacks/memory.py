"""``MemoryMonitor``: the peak memory of each step, measured honestly and labelled with how."""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed._tools.common_utils import get_untyped_storages

from lit_ablate.callbacks.step_clock import step_clock
from lit_ablate.callbacks.step_monitor import StepMonitor, gathered_ranks
from lit_ablate.callbacks.tensor_categories import CATEGORIES, TensorCategoryTracker, optimizer_states
from lit_ablate.errors import ConfigError
from lit_ablate.strategies.interface import interface_of

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _tensor_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each counted once: a quantised state (torchao's
    8-bit ``OptimState8bit``, a subclass whose shape is the fp32 one) counts its codes and scales, and
    a tied or flattened parameter its one storage."""
    storages = {storage for t in tensors for storage in get_untyped_storages(t)}
    return sum(storage.nbytes() for storage in storages)


def tensor_breakdown(pl_module: LightningModule) -> dict[str, int]:
    """Bytes of trainable and frozen parameters, gradients and optimizer states held by this rank (local shards)."""
    local = [(p.to_local() if hasattr(p, "to_local") else p, p.requires_grad) for p in pl_module.parameters()]
    params = [t for t, trains in local if trains]
    frozen = [t for t, trains in local if not trains]
    grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    states = [
        v.to_local() if hasattr(v, "to_local") else v
        for optimizer in pl_module.trainer.optimizers
        for v in optimizer_states(optimizer)
    ]
    return {
        "params": _tensor_bytes(params),
        "frozen_params": _tensor_bytes(frozen),
        "grads": _tensor_bytes(grads),
        "optimizer": _tensor_bytes(states),
    }


MEMORY_CATEGORIES_ATTRIBUTE = "memory_categories"
"""A LightningModule may name submodules whose parameters count in a category of their own:
``memory_categories = {"reference": ["reference"]}`` (category -> attribute paths; a path whose
attribute is ``None`` is skipped). DPO's frozen reference model is the case it exists for."""


def declared_categories(pl_module: LightningModule) -> dict[str, list[torch.nn.Module]]:
    """The submodules ``pl_module.memory_categories`` names, per category (absent ones skipped)."""
    declared = getattr(pl_module, MEMORY_CATEGORIES_ATTRIBUTE, None) or {}
    out: dict[str, list[torch.nn.Module]] = {}
    for category, paths in declared.items():
        if category in CATEGORIES:
            raise ValueError(
                f"{type(pl_module).__name__}.{MEMORY_CATEGORIES_ATTRIBUTE}: {category!r} is a built-in "
                f"category ({', '.join(CATEGORIES)}); name the submodules' category otherwise"
            )
        modules = [m for m in (_attribute_path(pl_module, path) for path in paths) if m is not None]
        if modules:
            out[category] = modules
    return out


def _attribute_path(root: object, path: str) -> torch.nn.Module | None:
    for name in path.split("."):
        root = getattr(root, name)
        if root is None:
            return None
    return root


class MemoryMonitor(StepMonitor):
    """Per-step peak memory, and on a few warm-up steps the tensor peak by category.

    Two measurements, because neither alone answers "what does a technique change":

    - Every step, the process peak. On CUDA: the allocator's peak allocated and reserved bytes,
      reset at each step start. On CPU the allocator has no statistics
      (``torch.cuda.max_memory_allocated`` would be a silent 0), so the process's peak resident set
      (``VmHWM``) is used, reset per step through ``/proc/self/clear_refs``: it includes the Python
      interpreter and libraries (~0.5 GB), and the ``memory_method`` field says so. Beside it, the
      bytes of parameters, gradients and optimizer states this rank holds (local shards), counted
      on the first two measured steps (the optimizer creates its states in the first) and reused.
    - On the *tracked steps*, the tensor peak by category (``TensorCategoryTracker``): trainable
      parameters (and buffers), frozen parameters (an adapter run's base), gradients, optimizer
      states, activations, temporaries, transient copies (gathered layers, communication buffers)
      and any category the module declares (``memory_categories``, e.g. a DPO reference model).
      Tracking runs a ``TorchDispatchMode`` over every operator, which slows a step several-fold, so
      it measures only the last ``tracked_steps`` warm-up steps (never the first, which creates the
      optimizer states), entered one step earlier (priming: buffers made before training, such as
      DDP's gradient buckets, become known when first written): all of them steps the summaries
      leave out. Its set-up cost is inside the priming step and its tear-down is paused out of the
      step clock, so no timed step pays for it. With fewer than two warm-up steps nothing is tracked
      (warned). Default warm-up 3: step 2 primes, step 3 is measured.

    ``tensor_peak_bytes`` is the step's tensor peak: on CPU the tracker's (tracked steps only), on
    CUDA the allocator's peak allocated (every step; the tracked steps' categories then add up to
    less, the rest is ``untracked``: tensors made before tracking began, e.g. DDP's buckets).

    Every rank measures its own peaks; at the end of training ``memory_peak_bytes`` and
    ``tensor_peak_bytes`` become the largest over the ranks (the rank that runs out first decides
    whether a run fits), ``..._per_rank`` keep each rank's value in rank order, and
    ``tensor_breakdown`` is the categories of the rank with the largest tensor peak. A simulated rank
    (``lit_ablate.simulated_rank``) has only its own values, and its breakdown names it.

    Args:
        warmup_steps: as ``StepMonitor``; the tracked steps are its last ones.
        tracked_steps: how many warm-up steps to track (0: none). Code compiled with
            ``torch.compile`` runs eagerly on tracked steps (torch refuses a dispatch mode beside it);
            when the process has any, ``fallbacks`` says so and the run record lists it.
    """

    def __init__(self, warmup_steps: int | None = None, tracked_steps: int = 1) -> None:
        super().__init__(warmup_steps=warmup_steps)
        if tracked_steps < 0:
            raise ConfigError(
                "trainer.callbacks[MemoryMonitor].init_args.tracked_steps", tracked_steps, "use 0 (no tracking) or more"
            )
        self.tracked_steps = tracked_steps
        self.method: str | None = None
        self.tensor_method: str | None = None
        self._breakdown: dict[str, int] = {}
        self._breakdown_counts = 0
        self._tracker: TensorCategoryTracker | None = None
        self._categories: tuple[str, ...] = CATEGORIES
        self.fallbacks: list[str] = []
        self._status: int | None = None  # descriptors kept open for the fit: a read is ~2 us, a reopen ~30
        self._clear_refs: int | None = None

    def tracked(self) -> list[int]:
        """The steps whose tensors are tracked: the last ``tracked_steps`` warm-up steps, from step 2."""
        last = self.warmup_steps or 0
        return list(range(max(2, last - self.tracked_steps + 1), last + 1))

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            self.method = "cuda_max_allocated"
        elif os.path.exists(_STATUS):
            self.method = "cpu_process_peak_rss"
            self._status = os.open(_STATUS, os.O_RDONLY)
            try:
                self._clear_refs = os.open(_CLEAR_REFS, os.O_WRONLY)
            except OSError:
                self._clear_refs = None
            if not self._reset_rss_peak():
                self.method = "cpu_process_peak_rss_since_start"
                rank_zero_warn(
                    "MemoryMonitor: cannot reset the RSS peak (/proc/self/clear_refs); "
                    "each step's peak is the peak since the process started"
                )
        else:
            self.method = None
            rank_zero_warn("MemoryMonitor: no memory measurement on this platform; peak memory is not reported")

    def _reset_rss_peak(self) -> bool:
        if self._clear_refs is None:
            return False
        try:
            os.write(self._clear_refs, b"5")
        except OSError:
            return False
        return True

    def _rss_peak_bytes(self) -> int:
        status = os.pread(self._status, 1 << 14, 0)
        start = status.find(b"VmHWM:")
        if start < 0:
            raise RuntimeError("VmHWM missing from /proc/self/status")
        return int(status[start:].split(maxsplit=2)[1]) * 1024

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for fd in (self._status, self._clear_refs):
            if fd is not None:
                os.close(fd)
        self._status = self._clear_refs = None

    def start_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.method == "cuda_max_allocated":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        elif self.method == "cpu_process_peak_rss":
            self._reset_rss_peak()
        step, tracked = trainer.global_step + 1, self.tracked()
        if tracked and step == tracked[0] - 1:  # the priming step
            extra = declared_categories(pl_module)
            self._categories = (*CATEGORIES, *extra)
            gc.freeze()  # what lives now is not the tracker's: the collection after tracking skips it
            held = interface_of(trainer.strategy).held_tensors
            self._tracker = TensorCategoryTracker(pl_module, trainer.optimizers, pl_module.device, extra, held)
            self._tracker.enter()
        if self._tracker is not None and step in tracked:
            self._tracker.start_measuring()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.tensor_method = "cuda_max_allocated" if pl_module.device.type == "cuda" else "cpu_tracked_tensors"
        if self.tracked_steps and not self.tracked():
            rank_zero_warn(
                f"MemoryMonitor: no tensor peak by category: it is tracked on warm-up steps after the "
                f"first, and warmup_steps is {self.warmup_steps}; set recorder.warmup_steps to 2 or more"
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._tracker is not None:
            self._tracker.new_micro_batch()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._tracker is not None:
            self._tracker.set_phase("backward")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._tracker is not None:
            self._tracker.set_phase("update")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._tracker is not None:  # never leave the dispatch mode on (or the heap frozen) after a failed step
            self._tracker.exit()
            self._tracker = None
            gc.unfreeze()

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        if self._tracker is not None and step in self.tracked():
            self._keep_tracked(step)
            if step == self.tracked()[-1]:
                self._stop_tracking(trainer)
        if self.method == "cuda_max_allocated":
            self.record("memory_peak_bytes", step, torch.cuda.max_memory_allocated(pl_module.device))
            self.record("memory_reserved_bytes", step, torch.cuda.max_memory_reserved(pl_module.device))
            self.record("tensor_peak_bytes", step, torch.cuda.max_memory_allocated(pl_module.device))
        elif self.method is not None:
            self.record("memory_peak_bytes", step, self._rss_peak_bytes())
        if self._breakdown_counts < 2:
            self._breakdown, self._breakdown_counts = tensor_breakdown(pl_module), self._breakdown_counts + 1
        for name, value in self._breakdown.items():
            self.record(f"memory_{name}_bytes", step, value)

    def _stop_tracking(self, trainer: Trainer) -> None:
        """Tear down after the last tracked step. The step clock closed that step already, so the
        tear-down is paused out of the next, timed, step: dropping every weak reference, and a
        garbage collection of the many small objects tracking made (else a later one would land
        in a timed step). The collection scans only what was made since tracking began: what lived
        before was frozen then (``gc.freeze``), and is unfrozen after. A full collection of a process
        holding torch, Lightning and transformers took a second of CPU on every rank of every fit."""
        tracker, self._tracker = self._tracker, None
        clock = step_clock(trainer)
        clock.pause()
        tracker.exit()
        if tracker.compiled_code_ran_eager:
            self.fallbacks = [
                "MemoryMonitor: torch.compile'd code ran eagerly on the tracked steps (torch refuses it "
                "under the tensor tracker): their tensor peak counts eager temporaries, an upper bound"
            ]
        del tracker
        gc.collect()
        gc.unfreeze()
        clock.resume()

    def _keep_tracked(self, step: int) -> None:
        tracker = self._tracker
        if self.tensor_method == "cpu_tracked_tensors":
            self.record("tensor_peak_bytes", step, tracker.peak)
        self.series.setdefault("_tracked_peak", {})[step] = tracker.peak
        self.series.setdefault("_forward_backward_max", {})[step] = tracker.forward_backward_max
        for category in self._categories:
            self.series.setdefault(f"_at_peak_{category}", {})[step] = tracker.at_peak[category]
            self.series.setdefault(f"_max_{category}", {})[step] = tracker.maxima[category]

    def finalize(self, trainer: Trainer) -> None:
        for name in ("memory_peak_bytes", "tensor_peak_bytes"):
            if name in self.series:
                per_rank = self.gather_over_ranks(trainer, [name])[name]
                self.series[f"{name}_per_rank"] = {s: [int(v) for v in values] for s, values in per_rank.items()}
                self.series[name] = {s: max(values) for s, values in self.series[f"{name}_per_rank"].items()}
        if "_tracked_peak" in self.series:
            self._gather_breakdowns(trainer)

    def _gather_breakdowns(self, trainer: Trainer) -> None:
        """``tensor_breakdown`` per tracked step: the categories of the rank with the largest peak."""
        names = [
            "_tracked_peak",
            "_forward_backward_max",
            *(f"_{kind}_{c}" for kind in ("at_peak", "max") for c in self._categories),
        ]
        gathered = self.gather_over_ranks(trainer, names)
        allocator = self.series.get("tensor_peak_bytes_per_rank", {})
        ranks = gathered_ranks(trainer)
        breakdowns = {}
        for step, peaks in gathered["_tracked_peak"].items():
            rank = max(range(len(peaks)), key=peaks.__getitem__)
            at_peak = {c: int(gathered[f"_at_peak_{c}"][step][rank]) for c in self._categories}
            if self.tensor_method == "cuda_max_allocated" and step in allocator:
                at_peak["untracked"] = max(0, allocator[step][rank] - int(peaks[rank]))
            breakdowns[step] = {
                "method": self.tensor_method,
                "rank": ranks[rank],
                "at_peak": at_peak,
                "max": {c: int(gathered[f"_max_{c}"][step][rank]) for c in self._categories},
                "forward_backward_max": int(gathered["_forward_backward_max"][step][rank]),
            }
        self.series["tensor_breakdown"] = breakdowns

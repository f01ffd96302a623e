"""``MFUMonitor``: model FLOPs utilisation against a known per-device peak."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import LightningModule, Trainer

from lit_ablate.callbacks.step_monitor import StepMonitor, batch_replicas

# Dense bf16 peak TFLOP/s (no 2:4 sparsity), matched against torch.cuda.get_device_name() in
# order: the first key contained in the lower-cased name wins, so specific names come first.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "h100 nvl": 835.0,
    "h100 pcie": 756.0,
    "h100": 989.0,  # SXM, and the default for an unqualified H100
    "h200 nvl": 835.0,
    "h200": 989.0,  # torch reports a plain "NVIDIA H200" for the SXM part
    "gb200": 2500.0,
    "b200": 2250.0,
    "a100": 312.0,
    "mi300x": 1307.0,
    "mi325x": 1307.0,
    "mi355x": 2500.0,
}


def peak_tflops_of(device_name: str) -> float | None:
    """The table's bf16 peak for a device name, or None when the device is not in it."""
    name = device_name.lower()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def runs_in_fp8(trainer: Trainer, pl_module: LightningModule) -> bool:
    """Whether the run computes matmuls in fp8, read from the config itself: a Lightning precision
    plugin that does (Transformer Engine), or a module that says so (``computes_in_fp8``)."""
    return "transformer-engine" in str(trainer.precision) or bool(getattr(pl_module, "computes_in_fp8", False))


class MFUMonitor(StepMonitor):
    """MFU = model FLOPs this rank computed in the step / step time / device peak.

    FLOPs are analytic (``lit_ablate.estimate``), never counted from kernels, so fused kernels that
    a FLOP counter cannot see do not bias a comparison. Which tokens count: every real token of
    the rank's batch (padding positions are not model FLOPs), each at its own document's
    context; tensor-parallel peers, which process the same tokens, each count their share
    (``1/tp``), and so do context-parallel ranks, which share each batch (``1/cp``: the
    strategy's ``flops_share``). When no honest peak is known (a CPU, an unlisted GPU, an fp8 run against a bf16
    table) MFU is recorded as unavailable (null) with the reason in the run record's
    ``mfu_peak``, rather than invented.

    Args:
        peak_tflops: per-device peak to divide by; overrides the table (and is the only way to
            get MFU on CPU or under fp8: give the peak of the precision the run computes in).
    """

    def __init__(self, peak_tflops: float | None = None, warmup_steps: int | None = None) -> None:
        super().__init__(warmup_steps=warmup_steps)
        self.peak_tflops = peak_tflops
        self.peak_source: str | None = None
        self._flops_share = 1.0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A strategy whose ranks share one batch's FLOPs says so (ContextParallelStrategy: 1 / cp).
        self._flops_share = getattr(trainer.strategy, "flops_share", 1.0) / batch_replicas(trainer)
        if self.peak_tflops is not None:
            self.peak_source = "peak_tflops (user)"
        elif runs_in_fp8(trainer, pl_module):
            self._unavailable("the run computes in fp8 and the table holds bf16 peaks; set peak_tflops", warn=True)
        elif pl_module.device.type != "cuda":
            # Expected on a CPU: recorded, not warned about on every run.
            self._unavailable(f"no peak is known for device type {pl_module.device.type!r}; set peak_tflops", warn=False)
        else:
            name = torch.cuda.get_device_name(pl_module.device)
            self.peak_tflops = peak_tflops_of(name)
            if self.peak_tflops is None:
                self._unavailable(f"{name!r} is not in the peak table; set peak_tflops", warn=True)
            else:
                self.peak_source = f"table: {name}"

    def _unavailable(self, why: str, warn: bool) -> None:
        self.peak_tflops = None
        self.peak_source = f"unavailable: {why}"
        if warn:
            warnings.warn(f"MFUMonitor: MFU not reported: {why}", stacklevel=2)

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        t = self.totals
        mfu = t.flops * self._flops_share / t.seconds / (self.peak_tflops * 1e12) if self.peak_tflops else None
        self.record("mfu", step, mfu)

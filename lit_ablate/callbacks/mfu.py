"""``MFUMonitor``: model FLOPs utilisation against a known per-device peak."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import LightningModule, Trainer

from lit_ablate.callbacks.step_monitor import StepMonitor

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


class MFUMonitor(StepMonitor):
    """MFU = analytic FLOPs of the step / step time / device peak, per device.

    FLOPs are analytic (``lit_ablate.estimate``), never counted from kernels, so fused kernels that
    a FLOP counter cannot see do not bias a comparison. When no honest peak is known (a CPU, an
    unlisted GPU) MFU is recorded as unavailable (null) rather than invented.

    Args:
        peak_tflops: per-device peak to divide by; overrides the table (required on CPU).
        fp8: the run computes in fp8; a bf16 peak would flatter it, so MFU is unavailable unless
            ``peak_tflops`` gives the fp8 peak explicitly.
    """

    def __init__(self, peak_tflops: float | None = None, fp8: bool = False, warmup_steps: int = 2) -> None:
        super().__init__(warmup_steps=warmup_steps)
        self.peak_tflops = peak_tflops
        self.fp8 = fp8
        self.peak_source: str | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.peak_tflops is not None:
            self.peak_source = "peak_tflops (user)"
            return
        if self.fp8:
            self._unavailable("the run uses fp8 and the table holds bf16 peaks; set peak_tflops")
        elif pl_module.device.type != "cuda":
            self._unavailable(f"no peak is known for device type {pl_module.device.type!r}; set peak_tflops")
        else:
            name = torch.cuda.get_device_name(pl_module.device)
            self.peak_tflops = peak_tflops_of(name)
            if self.peak_tflops is None:
                self._unavailable(f"{name!r} is not in the peak table; set peak_tflops")
            else:
                self.peak_source = f"table: {name}"

    def _unavailable(self, why: str) -> None:
        self.peak_source = f"unavailable: {why}"
        warnings.warn(f"MFUMonitor: MFU not reported: {why}", stacklevel=2)

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        t = self.totals
        mfu = t.flops / t.seconds / (self.peak_tflops * 1e12) if self.peak_tflops else None
        self.record("mfu", step, mfu)

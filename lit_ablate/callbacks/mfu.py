"""``MFUMonitor``: model FLOPs utilisation against the spec peak and the measured matmul ceiling."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from lit_ablate.callbacks.step_clock import RUNNING_CLOCKS
from lit_ablate.callbacks.step_monitor import StepMonitor, batch_replicas
from lit_ablate.errors import ConfigError
from lit_ablate.estimate.matmul_ceiling import MatmulCeiling, ceiling_here
from lit_ablate.estimate.peaks import PEAK_FP8_TFLOPS, peak_tflops_of
from lit_ablate.strategies.interface import interface_of

MAX_REMEASURES = 2
"""How often a run measures its ceiling again when it computed faster than it (each within
``RUN_BUDGET_SECONDS``)."""


def runs_in_fp8(trainer: Trainer, pl_module: LightningModule) -> bool:
    """Whether the run computes matmuls in fp8, read from the config itself: a Lightning precision
    plugin that does (Transformer Engine), or a module that says so (``computes_in_fp8``)."""
    return "transformer-engine" in str(trainer.precision) or bool(getattr(pl_module, "computes_in_fp8", False))


def run_dtype(trainer: Trainer, pl_module: LightningModule) -> torch.dtype:
    """The dtype the run's matmuls compute in: the precision plugin's half type, else the parameters'."""
    precision = str(trainer.precision)
    if "bf16" in precision:
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return next((p.dtype for p in pl_module.parameters() if p.is_floating_point()), torch.float32)


class MFUMonitor(StepMonitor):
    """MFU = model FLOPs this rank computed in the step / step time / a peak, against two peaks.

    ``mfu`` divides by the device's spec-sheet peak (dense bf16, ``PEAK_BF16_TFLOPS``, or
    ``peak_tflops``); ``mfu_measured`` by the measured matmul ceiling of the run's device, dtype and
    threads, measured by each rank at the run's start under the load the run sees, and recorded with
    its time (``lit_ablate.estimate.matmul_ceiling.ceiling_here``; ``lit-ablate peak`` prints a
    cached best). The spec peak is the number papers quote but is unreachable in practice and
    unknown for a CPU; the measured ceiling exists on every device and says how close the run gets
    to what the hardware really does, so it compares across devices. The run record names each
    denominator and its value (``summary.mfu_ceilings``).
    FLOPs are analytic (``lit_ablate.estimate``), never counted from kernels, so fused kernels that
    a FLOP counter cannot see do not bias a comparison. Which tokens count: every real token of
    the rank's batch (padding positions are not model FLOPs), each at its own document's
    context; ranks that process the same tokens each count their share, so the job counts the
    model once: tensor-parallel peers and the stages of a pipeline, which all read the whole batch
    (``1 / (tp x pp)``: the strategy's ``batch_replicas``), and context-parallel ranks, which share
    each batch (``1/cp``: its ``flops_share``). When no honest peak is known (a CPU, an unlisted GPU, an fp8 run
    against a bf16 table) ``mfu`` is recorded as unavailable (null) with the reason in the run
    record's ``mfu_peak``, rather than invented; under fp8 ``mfu_measured`` is too (no fp8 ceiling
    is measured), unless ``ceiling_tflops`` is given.

    Args:
        peak_tflops: per-device peak to divide ``mfu`` by; overrides the table (and is the only way
            to get ``mfu`` on CPU or under fp8: give the peak of the precision the run computes in).
        ceiling_tflops: the ceiling to divide ``mfu_measured`` by instead of measuring one (e.g. what
            ``lit-ablate peak`` printed on a node like this one).
        measure_ceiling: measure the ceiling when ``ceiling_tflops`` is not given (about a second, at
            every run's start, before the first step, never timed). ``false``: ``mfu_measured`` is null.
    """

    def __init__(
        self,
        peak_tflops: float | None = None,
        ceiling_tflops: float | None = None,
        measure_ceiling: bool = True,
        warmup_steps: int | None = None,
    ) -> None:
        super().__init__(warmup_steps=warmup_steps)
        for key, value in (("peak_tflops", peak_tflops), ("ceiling_tflops", ceiling_tflops)):
            if value is not None and not value > 0:
                raise ConfigError(
                    f"trainer.callbacks[MFUMonitor].init_args.{key}",
                    value,
                    "give the device's TFLOP/s, a positive number, or null",
                )
        self.peak_tflops = peak_tflops
        self.peak_source: str | None = None
        self.ceiling_tflops = ceiling_tflops
        self.measure_ceiling = measure_ceiling
        self.ceiling: float | None = None
        """The measured ceiling in use (TFLOP/s), or the one given; None when unavailable."""
        self.ceiling_source: str | None = None
        self.ceiling_measured_at: float | None = None
        """When this run measured its ceiling (``time.time()``), and how long the sweep took."""
        self.ceiling_sweep_seconds: float | None = None
        self.ceiling_conditions: str | None = None
        """What the measured ceiling depends on besides load (device, dtype, threads): a study compares
        only ceilings measured under one condition when it looks for a load change."""
        self.ceiling_doubt: str | None = None
        """Why the measured ceiling may be low (``MatmulCeiling.doubt``), or None."""
        self.remeasured = 0
        self.above_one: dict[str, list[int]] = {"mfu": [], "mfu_measured": []}
        self._flops_share = 1.0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A strategy whose ranks share one batch's FLOPs says so (ContextParallelStrategy: 1 / cp).
        self._flops_share = interface_of(trainer.strategy).flops_share / batch_replicas(trainer)
        self._set_peak(trainer, pl_module)
        self._set_ceiling(trainer, pl_module)

    def _set_peak(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.peak_tflops is not None:
            self.peak_source = "peak_tflops (user)"
        elif (
            getattr(pl_module, "fp8_kernels", None) == "emulated"
        ):  # lit_ablate.models.fp8.conversion on a device without fp8 kernels
            self._unavailable("fp8 is emulated (fp32 matmuls of fp8-rounded operands): no fp8 peak applies", warn=False)
        elif runs_in_fp8(trainer, pl_module):
            name = (
                torch.cuda.get_device_name(pl_module.device)
                if pl_module.device.type == "cuda"
                else pl_module.device.type
            )
            self.peak_tflops = peak_tflops_of(name, PEAK_FP8_TFLOPS)
            if self.peak_tflops is None:
                self._unavailable(
                    f"the run computes in fp8 and {name!r} is not in the fp8 peak table; set peak_tflops", warn=True
                )
            else:
                self.peak_source = f"table (fp8): {name}"
        elif pl_module.device.type != "cuda":
            # Expected on a CPU: recorded, not warned about on every run.
            self._unavailable(
                f"no peak is known for device type {pl_module.device.type!r}; set peak_tflops", warn=False
            )
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

    def _set_ceiling(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.ceiling_tflops is not None:
            self.ceiling, self.ceiling_source = self.ceiling_tflops, "ceiling_tflops (user)"
        elif runs_in_fp8(trainer, pl_module):
            self.ceiling, self.ceiling_source = None, "unavailable: the run computes in fp8; set ceiling_tflops"
        elif not self.measure_ceiling:
            self.ceiling, self.ceiling_source = None, "unavailable: measure_ceiling is false; set ceiling_tflops"
        else:
            self._use(ceiling_here(pl_module.device, run_dtype(trainer, pl_module)))  # every rank, in its process

    def _use(self, measured: MatmulCeiling) -> None:
        self.ceiling, self.ceiling_source = measured.tflops, f"measured: {measured.describe()}"
        self.ceiling_measured_at, self.ceiling_sweep_seconds = measured.measured_at, measured.sweep_seconds
        self.ceiling_conditions, self.ceiling_doubt = measured.conditions(), measured.doubt()

    def ceilings(self) -> dict[str, dict[str, Any]]:
        """Each MFU series' denominator (TFLOP/s) and where it came from, and the steps whose MFU came out
        above 1 and was left out as a measurement error: what the run record keeps."""
        return {
            "mfu": {"tflops": self.peak_tflops, "source": self.peak_source, "above_one_steps": self.above_one["mfu"]},
            "mfu_measured": {
                "tflops": self.ceiling,
                "source": self.ceiling_source,
                "measured_at": self.ceiling_measured_at,
                "sweep_seconds": self.ceiling_sweep_seconds,
                "conditions": self.ceiling_conditions,
                "doubt": self.ceiling_doubt,
                "remeasured": self.remeasured,
                "above_one_steps": self.above_one["mfu_measured"],
            },
        }

    def measure_timed(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        t = self.totals
        flops_per_second = t.flops * self._flops_share / t.seconds
        if (
            self.ceiling
            and flops_per_second > self.ceiling * 1e12
            and self.ceiling_tflops is None
            and self.remeasured < MAX_REMEASURES
        ):
            self._remeasure(trainer, pl_module)
        self._record_share("mfu", step, flops_per_second, self.peak_tflops)
        self._record_share("mfu_measured", step, flops_per_second, self.ceiling)

    def _record_share(self, name: str, step: int, flops_per_second: float, tflops: float | None) -> None:
        """``flops_per_second`` over ``tflops``; above 1 it is a measurement error (the denominator is too
        low), recorded as null, counted in the record and warned about once, never printed as a figure."""
        share = flops_per_second / (tflops * 1e12) if tflops else None
        if share is not None and share > 1.0:
            if not self.above_one[name]:
                warnings.warn(
                    f"MFUMonitor: {name} came out above 1 at step {step} ({share:.2f}): its denominator "
                    f"({self.peak_source if name == 'mfu' else self.ceiling_source}) is below what this run "
                    "reached, a measurement error; recorded as null. Measure the ceiling on an idle device "
                    "(`lit-ablate peak --remeasure`) or give peak_tflops / ceiling_tflops",
                    stacklevel=2,
                )
            self.above_one[name].append(step)
            share = None
        self.record(name, step, share)

    def _remeasure(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The run computed faster than its measured ceiling: the sweep at its start was low (load). Measure
        it again between steps (out of the step clock), keep the higher, and rescale the steps before."""
        clock = RUNNING_CLOCKS.get(trainer)
        if clock is not None:
            clock.pause()
        measured = ceiling_here(pl_module.device, run_dtype(trainer, pl_module))
        if clock is not None:
            clock.resume()
        self.remeasured += 1
        if self.ceiling is not None and measured.tflops > self.ceiling:
            old = self.ceiling
            self._use(measured)
            for step, value in self.series.get("mfu_measured", {}).items():
                if value is not None:
                    self.series["mfu_measured"][step] = value * old / self.ceiling

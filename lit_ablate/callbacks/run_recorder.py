"""``RunRecorder``: writes the run record (``run.json``) that the ablation report reads."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

import lit_ablate
from lit_ablate import record as run_record
from lit_ablate.callbacks.memory import MemoryMonitor
from lit_ablate.callbacks.mfu import MFUMonitor
from lit_ablate.callbacks.record_section import RecordSection
from lit_ablate.callbacks.step_monitor import DEFAULT_WARMUP_STEPS, StepMonitor
from lit_ablate.errors import ConfigError
from lit_ablate.models.losses import triton_interpreter
from lit_ablate.simulated_rank import NOT_SIMULATED, SimulatedRank, current_simulation
from lit_ablate.strategies.interface import interface_of
from lit_ablate.subnormals import flushes_subnormals
from lit_ablate.trackers import TRACKERS_BY_RUNNER_ENV, Destination, check_trackers, send


def git_commit() -> str | None:
    """The commit of the lit-ablate checkout that runs (not of the working directory: a study's runs
    start wherever the user is); None for an installed package."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(lit_ablate.__file__).resolve().parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(trainer: Trainer) -> dict[str, Any]:
    """Versions and hardware: what a reader needs to know whether two records are comparable."""
    import lightning
    import transformers

    device = trainer.strategy.root_device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
        "device_type": device.type,
        "device_name": name,
        "device_count": trainer.num_devices,
        "num_nodes": trainer.num_nodes,
        "world_size": trainer.world_size,
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
        "git_commit": git_commit(),
        "strategy": type(trainer.strategy).__name__,
        "precision": str(trainer.precision),
        "triton_kernels": triton_interpreter.kernel_mode(),
        "fp8": getattr(trainer.lightning_module, "fp8_kernels", None),  # real / emulated fp8 matmuls, or null
        "optimizer_implementation": getattr(trainer.lightning_module, "optimizer_implementation", None),
        "flush_denormal": flushes_subnormals(),  # subnormal floats flushed to zero on the CPU (lit_ablate.subnormals)
    }


_DEVICE_ERRORS = tuple(e for e in (getattr(torch, "AcceleratorError", None),) if e is not None)
"""A failed device (torch >= 2.8 raises CUDA errors as ``AcceleratorError``) answers no more events:
the steps whose time was still on it are left out of the record of such a failure."""

LOSS_CHECKPOINT_KEY = "lit_ablate_loss_by_step"
"""Where a checkpoint carries the loss of every step before it (``RunRecorder.on_save_checkpoint``)."""


def _loss(sums: dict[str, dict[int, float]]) -> dict[int, float | None]:
    return {s: (v / sums["_loss_units"][s] if sums["_loss_units"][s] else None) for s, v in sums["_loss_sum"].items()}


class RunRecorder(StepMonitor):
    """Collects loss, learning rate and every other ``StepMonitor``'s series into ``run.json``.

    The record is written atomically at fit start (status ``running``), at the end of fit (``ok``)
    and when fit raises (``error``, or ``oom`` for an out-of-memory error): a killed run leaves
    ``running``, which the ablation runner redoes. The loss per step is exact across gradient
    accumulation and data-parallel ranks: summed token losses over summed useful tokens. A fit
    resumed from a checkpoint records only its own steps (numbered on from the checkpoint's) and
    says where it came from in ``resumed_from``; the loss of every step before the checkpoint
    travels in the checkpoint (reduced over ranks when it is saved) and comes back as
    ``steps_before_resume``, so a killed run resumed elsewhere (a requeued SLURM job) still has
    its whole loss curve for the study to stitch.

    A simulated rank (``lit-ablate fit --simulate``) writes its own record, says so under ``simulated``
    (the job's world size and the rank it played) and leaves out what it cannot measure (``NOT_SIMULATED``).

    Args:
        path: where to write; default ``$LIT_ABLATE_RUN_RECORD``, else ``<log_dir>/run.json``.
        variant: the study variant name; default ``$LIT_ABLATE_VARIANT``.
        warmup_steps: steps excluded from the record's summary, and from the console summary of
            every monitor that does not set its own.
        trackers: experiment trackers that get a copy of the record when the run ends (``tensorboard``,
            ``wandb``, ``mlflow``: ``lit_ablate.trackers``; offline and local unless their environment says
            otherwise). In a study the runner sends them instead, with the report's verdicts.
    """

    def __init__(
        self,
        path: str | None = None,
        variant: str | None = None,
        warmup_steps: int = DEFAULT_WARMUP_STEPS,
        trackers: list[str] | None = None,
    ) -> None:
        if warmup_steps < 0:  # the summary said "median after -1 warm-up steps"
            raise ConfigError("recorder.warmup_steps", warmup_steps, "use 0 or more steps left out of the summary")
        self.trackers = check_trackers(trackers or [], "recorder.trackers")
        super().__init__(warmup_steps=warmup_steps, log_to_logger=False)
        self.path = path
        self.variant = variant or os.environ.get(run_record.VARIANT_ENV)
        self.resolved_config: dict[str, Any] | None = None
        self.record_path: Path | None = None
        self._env: dict[str, Any] = {}
        self._started = 0.0
        self._resumed_from: dict[str, Any] | None = None
        self._loss_before_resume: dict[int, float | None] = {}
        self._simulated: SimulatedRank | None = None
        self._step_lr: float | None = None

    def _target(self, trainer: Trainer) -> Path:
        path = self.path or os.environ.get(run_record.RECORD_PATH_ENV)
        if path:
            return Path(path)
        return Path(trainer.log_dir or trainer.default_root_dir) / run_record.RECORD_FILENAME

    # --- measurement ---------------------------------------------------------------------------
    def start_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The rate this step trains with: Lightning steps the scheduler before the step's end is seen.
        self._step_lr = trainer.optimizers[0].param_groups[0]["lr"]

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        self.series.setdefault("lr", {})[step] = self._step_lr

    def measure_timed(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        self.series.setdefault("_loss_sum", {})[step] = self.totals.loss_sum
        self.series.setdefault("_loss_units", {})[step] = self.totals.loss_units

    def finalize(self, trainer: Trainer) -> None:
        if "_loss_sum" in self.series:
            self._set_loss(self.reduce_over_ranks(trainer, ["_loss_sum", "_loss_units"]))

    def _set_loss(self, sums: dict[str, dict[int, float]]) -> None:
        self.series["loss"] = _loss(sums)

    # --- resuming -----------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Every rank saves a checkpoint together, so the collective that reduces the loss so far is safe here."""
        self.measure_closed_steps(trainer, pl_module)  # the step just closed travels with the checkpoint
        sums = self.reduce_over_ranks(trainer, ["_loss_sum", "_loss_units"]) if "_loss_sum" in self.series else None
        checkpoint[LOSS_CHECKPOINT_KEY] = {**self._loss_before_resume, **(_loss(sums) if sums else {})}

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._loss_before_resume = {int(s): v for s, v in checkpoint.get(LOSS_CHECKPOINT_KEY, {}).items()}

    # --- writing ------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for callback in trainer.callbacks:
            if isinstance(callback, StepMonitor) and callback.warmup_steps is None:
                callback.warmup_steps = self.warmup_steps  # one warm-up for the console and the record
        self._begin_record(trainer)
        self._write(trainer, pl_module, "running", None)

    def _begin_record(self, trainer: Trainer) -> None:
        """When the run started, where its record goes and what it runs on."""
        self._started = time.time()
        self.record_path = self._target(trainer)
        self._env = environment(trainer)
        self._simulated = current_simulation()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.ckpt_path:  # the step counter is restored by now: the first step here is offset + 1
            self._resumed_from = {"checkpoint": str(trainer.ckpt_path), "step_offset": trainer.global_step}

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = self._write(trainer, pl_module, "ok", None)
        if trainer.is_global_zero:
            rank_zero_info(f"run record: {self.record_path}")
        if record is not None and self.trackers and not os.environ.get(TRACKERS_BY_RUNNER_ENV):
            folder = self.record_path.parent
            to = Destination(group=Path(trainer.default_root_dir).name, name=folder.name, folder=folder)
            send(self.trackers, record, to)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.record_path is None and trainer.state.fn == TrainerFn.FITTING:
            self._begin_record(trainer)  # fit failed before on_fit_start (data set-up, model build, checkpoint load)
        if not isinstance(exception, _DEVICE_ERRORS):  # the device still answers: read the steps that ended
            for callback in trainer.callbacks:
                if isinstance(callback, StepMonitor):
                    callback.measure_closed_steps(trainer, pl_module)
        if "loss" not in self.series and "_loss_sum" in self.series:
            self._set_loss(self.series)  # this rank's view: collectives may be dead after a failure
        status = "oom" if isinstance(exception, torch.OutOfMemoryError) else "error"
        message = f"{type(exception).__name__}: {exception}".strip().splitlines()[0][:2000]
        self._write(trainer, pl_module, status, message)

    def _steps(self, trainer: Trainer) -> list[dict[str, Any]]:
        series: dict[str, dict[int, Any]] = {}
        for callback in trainer.callbacks:
            if isinstance(callback, StepMonitor):
                series.update({k: v for k, v in callback.series.items() if not k.startswith("_")})
        if self._simulated is not None:
            series = {name: values for name, values in series.items() if name not in NOT_SIMULATED}
        steps = sorted({s for values in series.values() for s in values})
        return [{"step": s, **{name: values.get(s) for name, values in series.items()}} for s in steps]

    @staticmethod
    def _fallbacks(trainer: Trainer, pl_module: LightningModule, memory: MemoryMonitor | None) -> list[str]:
        """What ran instead of what the config names: the module's, the strategy's and the memory tracker's."""
        module = getattr(pl_module, "fallbacks", [])
        return [*module, *interface_of(trainer.strategy).fallbacks, *(memory.fallbacks if memory else [])]

    def _write(
        self, trainer: Trainer, pl_module: LightningModule, status: str, message: str | None
    ) -> dict[str, Any] | None:
        """Write the record (rank 0, or a simulated rank); the record written, else None."""
        if not (trainer.is_global_zero or self._simulated) or self.record_path is None:
            return None
        steps = self._steps(trainer)
        memory = next((c for c in trainer.callbacks if isinstance(c, MemoryMonitor)), None)
        mfu = next((c for c in trainer.callbacks if isinstance(c, MFUMonitor)), None)
        summary = run_record.summarize_steps(steps, self.warmup_steps)
        summary.update(
            status=status,
            message=message,
            memory_method=memory.method if memory else None,
            mfu_peak=mfu.peak_source if mfu else None,
            mfu_ceilings=mfu.ceilings() if mfu else None,
        )
        counts = getattr(pl_module, "parameter_counts", None)
        sections = {c.section: c.record_section() for c in trainer.callbacks if isinstance(c, RecordSection)}
        record = {
            "schema_version": run_record.SCHEMA_VERSION,
            "variant": self.variant,
            "seed": (self.resolved_config or {}).get("seed_everything"),
            "config": self.resolved_config or {"model": dict(pl_module.hparams)},
            "environment": self._env,
            "simulated": self._simulated.section if self._simulated else None,
            "model": asdict(counts) if counts is not None else None,
            "warmup_steps": self.warmup_steps,
            "fallbacks": self._fallbacks(trainer, pl_module, memory),
            "started_at": self._started,
            "finished_at": None if status == "running" else time.time(),
            "resumed_from": self._resumed_from,
            "steps_before_resume": [
                {"step": s, "loss": v}
                for s, v in sorted(self._loss_before_resume.items())
                if self._resumed_from and s <= self._resumed_from["step_offset"]
            ]
            or None,
            "data": getattr(trainer.datamodule, "setup_record", None),
            "steps": steps,
            "summary": summary,
            **sections,
        }
        run_record.write_record(self.record_path, record)
        return record

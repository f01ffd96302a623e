"""Trainer values Lightning accepts but cannot run (or runs as nothing), a strategy string that names no
strategy and a loss backend's name: mistakes of the config whatever runs it, refused before anything is built."""

from __future__ import annotations

from typing import Any

import yaml

from lit_ablate.class_paths import import_class
from lit_ablate.errors import Refusal
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import BAREBONES_OFF, GPU_ACCELERATORS, RunConfig


@rule(Scope.CONFIG)
def strategy_is_named(run: RunConfig) -> Refusal | None:
    """A ``trainer.strategy`` string names one of Lightning's strategies or a strategy class."""
    return refusal_of(run.trainer.strategy.check_name)


@rule(Scope.CONFIG)
def ranks_are_placeable(run: RunConfig) -> Refusal | None:
    """``trainer.accelerator`` names one of Lightning's accelerators (or a class_path), and ``devices`` /
    ``num_nodes`` are counts Lightning can place ranks by (it refused them with a stack trace once built)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    trainer = run.trainer
    accelerator = trainer.accelerator
    names = sorted({*AcceleratorRegistry.available_accelerators(), *GPU_ACCELERATORS, "auto"})
    if isinstance(accelerator, str) and accelerator not in names and "." not in accelerator:
        return Refusal("trainer.accelerator", accelerator, f"use one of {', '.join(names)}")
    devices = trainer.devices
    if (
        devices is not None
        and devices not in ("auto", -1, "-1")
        and not _device_ids(devices)
        and (trainer.devices_per_node is None or trainer.devices_per_node < 1)
    ):
        return Refusal(
            "trainer.devices",
            devices,
            "use a positive number of devices per node, a list of device ids, -1 (all) or auto",
        )
    nodes = trainer.num_nodes
    if nodes is not None and (not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1):
        return Refusal("trainer.num_nodes", nodes, "use a positive number of nodes (1 on one machine)")
    return None


@rule(Scope.CONFIG)
def training_runs(run: RunConfig) -> Refusal | None:
    """When fitting, trainer values that fail late or silently: ``accumulate_grad_batches`` below 1 (a
    division by zero mid-loop), ``val_check_interval`` 0 (the same, after the first step), a negative
    clipping norm (Lightning: no clipping, no word), or a run that trains nothing and ends "successfully"
    (``max_steps`` 0, ``max_epochs`` 0, ``limit_train_batches`` 0)."""
    if not run.fits:
        return None
    trainer = run.trainer
    accumulate = trainer.accumulate_grad_batches
    if isinstance(accumulate, int) and accumulate < 1:
        return Refusal(
            "trainer.accumulate_grad_batches", accumulate, "use 1 (no accumulation) or more micro-batches per step"
        )
    max_steps = trainer.max_steps
    if isinstance(max_steps, int) and (max_steps == 0 or max_steps < -1):
        return Refusal("trainer.max_steps", max_steps, "train at least 1 step, or -1 to stop by max_epochs")
    if _is_number(trainer.max_epochs) and (trainer.max_epochs == 0 or trainer.max_epochs < -1):
        return Refusal("trainer.max_epochs", trainer.max_epochs, "train at least 1 epoch, or -1 to stop by max_steps")
    if _is_number(trainer.limit_train_batches) and trainer.limit_train_batches <= 0:
        return Refusal(
            "trainer.limit_train_batches",
            trainer.limit_train_batches,
            "trains nothing; use a positive count of batches, or a fraction of the epoch up to 1.0",
        )
    if _is_number(trainer.gradient_clip_val) and trainer.gradient_clip_val < 0:
        return Refusal(
            "trainer.gradient_clip_val",
            trainer.gradient_clip_val,
            "use a positive gradient norm to clip at, or 0 / null for no clipping",
        )
    if _is_number(trainer.val_check_interval) and trainer.val_check_interval <= 0:
        return Refusal(
            "trainer.val_check_interval",
            trainer.val_check_interval,
            "use a positive count of training batches, or a fraction of the epoch up to 1.0",
        )
    return None


@rule(Scope.CONFIG)
def barebones_asks_for_nothing_it_turns_off(run: RunConfig) -> Refusal | None:
    """``trainer.barebones`` turns off checkpointing, logging, the progress bar, the model summary, sanity
    checks, ``fast_dev_run``, anomaly detection and profiling, and Lightning raises from inside ``Trainer``
    (a stack trace) on a key that asks for one, the quickstart's ``log_every_n_steps: 5`` among them, or at
    the fit's start on a checkpoint callback."""
    trainer = run.trainer
    if not trainer.barebones:
        return None
    for key, value in trainer.barebones_off.items():
        if value != BAREBONES_OFF[key]:
            off = yaml.safe_dump(BAREBONES_OFF[key]).split("\n", 1)[0]
            return Refusal(f"trainer.{key}", value, f"trainer.barebones turns it off: set it to {off}")
    from lightning.pytorch.callbacks import Checkpoint

    for class_path in trainer.callbacks:
        try:
            callback = import_class(class_path)
        except ImportError:
            continue  # named in its own refusal
        if isinstance(callback, type) and issubclass(callback, Checkpoint):
            return Refusal("trainer.callbacks", class_path, "trainer.barebones turns checkpointing off: remove it")
    return None


@rule(Scope.CONFIG)
def fused_adamw_is_not_clipped_in_mixed_precision(run: RunConfig) -> Refusal | None:
    """``optimizer_options: {fused: true}`` with a mixed precision that clips: Lightning refuses to clip for a
    fused optimizer at the first step (``amp_clipping_rules_out_fused``); refused here before any rank starts."""
    from lit_ablate.modules.optim import OPTIMIZER_OPTIONS_KEY, amp_clipping_rules_out_fused

    options = run.model.option("optimizer_options") or {}
    why = amp_clipping_rules_out_fused(run.trainer.precision, run.trainer.gradient_clip_val)
    if (
        why is None
        or not isinstance(options, dict)
        or not options.get("fused")
        or run.model.optimizer not in (None, "adamw")
    ):
        return None
    return Refusal(f"{OPTIMIZER_OPTIONS_KEY}.fused", True, f"{why}: remove it")


@rule(Scope.CONFIG)
def loss_backend_is_named(run: RunConfig) -> Refusal | None:
    """A loss backend's name and options (what the module's construction refuses, before a trainer exists)."""
    if run.model.module.init_args.get("loss") is None:
        return None
    return refusal_of(run.model.loss.check_named)


def _device_ids(devices: Any) -> bool:
    """A non-empty list of device ids, or their comma-separated string (``"0,1"``)."""
    if isinstance(devices, str) and "," in devices:
        devices = [d.strip() for d in devices.split(",") if d.strip()]
        return bool(devices) and all(d.isdigit() for d in devices)
    return (
        isinstance(devices, list)
        and bool(devices)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

"""``AdapterCheckpoint``: checkpoints of an adapter run hold the adapters, not the frozen base.

With a frozen base (LoRA, QLoRA) only the trainable weights change, and the optimizer already
holds states for them alone; the base is rebuilt from the config (same seed or ``pretrained:``
folder) on resume. Adding this callback drops every frozen weight from the checkpoint's
``state_dict`` (a 0.6B model's checkpoint shrinks to its adapters: megabytes, not gigabytes) and
loads such a checkpoint back non-strictly (the base keeps the weights it was built with).

A resume on a *different* base would train silently wrong adapters, so the checkpoint also keeps a
fingerprint of the base (the float64 sum of every frozen tensor, packed 4-bit codes included),
and a resume whose rebuilt base does not match is refused. It is not a tamper-proof hash: it
catches a different seed, config or ``pretrained:`` folder.

Not a measurement: it is a callback because Lightning hands callbacks the checkpoint on save and
on load, whatever the strategy. Sharded (DCP) checkpoints read every key the model holds, so
under a mesh strategy set ``save_distributed_checkpoint: false`` (one file, gathered on rank 0).
One process, DDP and FSDP2/HSDP are supported; FSDP1 is refused (see ``setup``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import ConfigError

FINGERPRINT_KEY = "adapter_checkpoint_base_fingerprint"
"""Checkpoint entry: ``{frozen weight name: float64 sum}`` of the base the adapters trained on."""
FINGERPRINT_RTOL = 1e-9
"""The same weights summed in another order (another strategy's shards) differ by rounding only."""
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


class AdapterCheckpoint(Callback):
    """Save only the trainable (adapter) weights and their optimizer state; resume them on the same base.

    Add it to ``trainer.callbacks`` of a run with ``model.init_args.model.adapter`` (and of the run
    that resumes from its checkpoints). Refused at setup without adapters, under FSDP1, and under a
    mesh strategy writing sharded checkpoints (the fix is named).
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        factory = getattr(pl_module, "factory", None)
        if getattr(factory, "adapter", None) is None:
            raise ConfigError(
                "trainer.callbacks[AdapterCheckpoint]",
                "added",
                "the model trains no adapters (its whole state must be saved): add "
                "model.init_args.model.adapter or drop this callback",
            )
        if isinstance(trainer.strategy, ModelParallelStrategy) and trainer.strategy._save_distributed_checkpoint:
            raise ConfigError(
                "trainer.strategy.init_args.save_distributed_checkpoint",
                True,
                "a sharded (DCP) checkpoint is read back key by key, base included; with "
                "AdapterCheckpoint set it to false (one file of adapters, gathered on rank 0)",
            )
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ConfigError(
                TRAINER_STRATEGY_KEY,
                type(trainer.strategy).__name__,
                "AdapterCheckpoint is not built for FSDP1 (its flat parameters hold pieces of the frozen "
                "weights, which the base fingerprint would need to gather); use FSDP2Strategy or DDP",
            )
        pl_module.strict_loading = False  # the base's weights are absent from the checkpoint by design

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        trainable = trainable_names(pl_module)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint[FINGERPRINT_KEY] = base_fingerprint(pl_module)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if FINGERPRINT_KEY in checkpoint:  # else a full checkpoint: the base came from it
            check_same_base(
                checkpoint, pl_module, trainer.ckpt_path, "resume with the run's model config and seed_everything seed"
            )


def check_same_base(checkpoint: dict[str, Any], pl_module: LightningModule, ckpt_path: object, fix: str) -> None:
    """Raise ``ConfigError`` naming ``--ckpt_path`` when ``pl_module``'s frozen weights are not the base
    an adapter-only ``checkpoint`` was trained on (``base_fingerprint``); ``fix`` says what to do."""
    saved, built = checkpoint[FINGERPRINT_KEY], base_fingerprint(pl_module)
    differing = sorted(
        k
        for k in saved.keys() | built.keys()
        if k not in saved
        or k not in built
        or not math.isclose(saved[k], built[k], rel_tol=FINGERPRINT_RTOL, abs_tol=1e-12)
    )
    if differing:
        raise ConfigError(
            "--ckpt_path",
            str(ckpt_path),
            f"its adapters trained on another base ({len(differing)} "
            f"frozen weights differ, e.g. {differing[0]}): {fix}",
        )


def trainable_names(pl_module: LightningModule) -> set[str]:
    """State-dict names of the module's trainable parameters (wrapper prefixes removed)."""
    return {_clean(name) for name, p in pl_module.named_parameters() if p.requires_grad}


@torch.no_grad()
def base_fingerprint(pl_module: LightningModule) -> dict[str, float]:
    """``{name: float64 sum}`` of every frozen parameter (whole tensors: a sharded DTensor's sum is
    reduced over its mesh, so every rank gets the same numbers; call it on every rank).

    4-bit weights packed into a float ``quant_storage`` are summed as their bytes: the float view of
    packed bytes holds NaNs, whose sum matches nothing, itself included (seen: every FSDP2 QLoRA
    resume with float32 storage refused as "trained on another base")."""
    packed = {id(module.weight) for module in pl_module.modules() if getattr(module, "quant_state", None) is not None}
    sums = {}
    for name, p in pl_module.named_parameters():
        if p.requires_grad:
            continue
        values = p.detach()
        if id(p) in packed and values.is_floating_point():
            values = values.view(torch.uint8)
        total = values.to(torch.float64).sum()
        sums[_clean(name)] = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
    return sums


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name

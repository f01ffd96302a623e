"""Resuming a pipeline-parallel run: each stage reads its own weights and optimizer state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lit_ablate.errors import ConfigError


def load_stage_checkpoint(
    path: Path, model: nn.Module, optimizers: list[Optimizer], weights_only: bool | None = None
) -> dict[str, Any]:
    """Load this rank's stages of ``model`` and their ``optimizers``' state from the sharded DCP folder
    ``path``; returns the checkpoint's other contents (Lightning's loop state, callbacks).

    Lightning's loader looks for a module with DTensor parameters; a stage's are plain tensors (or,
    under ``dp_shard``, FSDP's DTensor shards, which DCP reads the same way).
    """
    from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not (path / _METADATA_FILENAME).is_file():
        raise ConfigError(
            "ckpt_path",
            str(path),
            "a pipeline-parallel run resumes from the sharded checkpoint folder such a run saves",
        )
    named = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(optimizers)}
    templates = {key: get_optimizer_state_dict(model, optimizer) for key, optimizer in named.items()}
    state = {
        "state_dict": get_model_state_dict(model),
        **{key: {"state": t["state"], "param_groups": t["param_groups"]} for key, t in templates.items()},
    }
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"])
    for key, optimizer in named.items():
        set_optimizer_state_dict(
            model,
            optimizer,
            optim_state_dict={"state": state[key]["state"], "param_groups": templates[key]["param_groups"]},
        )
        # DCP keeps one copy of an object every rank saves under the same key (the param groups,
        # which list one stage's parameters): take only their hyperparameters (lr, betas, ...).
        for group, saved in zip(optimizer.param_groups, state[key]["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

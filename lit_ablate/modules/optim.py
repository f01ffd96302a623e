"""AdamW with decoupled weight decay and a warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def decay_names(model: nn.Module, embedding: nn.Parameter) -> set[str]:
    """Names of the parameters that decay: matrices, except the input embedding. Call it on the
    unwrapped model; sharding wrappers may flatten shapes."""
    return {name for name, p in model.named_parameters() if p.ndim >= 2 and p is not embedding}


def decay_groups(model: nn.Module, decaying: set[str], weight_decay: float) -> list[dict]:
    """Two parameter groups: matrices decay; norms, biases and the input embedding do not.

    Decaying a norm's gain or a bias only pulls it toward zero without regularising capacity,
    and decaying embeddings penalises rare tokens; this split is the GPT-2/LLaMA convention.
    Names are matched after removing wrapper prefixes (FSDP1, activation checkpointing).
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if _clean(name) in decaying else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Linear warm-up to the base LR, then cosine decay to ``min_lr_ratio`` of it at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

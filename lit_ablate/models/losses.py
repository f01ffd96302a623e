"""Cross-entropy backends behind one contract, chosen by config (``model.init_args.loss``).

Every backend takes the final hidden states, the LM-head weight (and bias) and labels that are
already shifted (``labels[i]`` is the target of position ``i``, ``-100`` = no loss), and returns the
**sum** of per-token cross-entropy over the counted labels as an fp32 scalar. The caller divides
by the number of useful tokens, so all backends normalise the same way and an ablation compares
only the kernel. A fused backend never materialises the ``[tokens, vocab]`` logits.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_ablate.errors import ConfigError

IGNORE_INDEX = -100


class LossBackend(Protocol):
    """``(hidden [N, H], weight [V, H], labels [N], bias [V] | None) -> fp32 scalar sum``."""

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor: ...


def torch_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
    """The reference: full logits, then ``F.cross_entropy`` in fp32."""
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


LOSS_BACKENDS: dict[str, LossBackend] = {"torch": torch_cross_entropy}


def loss_backend(name: str) -> LossBackend:
    """The backend registered as ``name``; a clear error lists the known ones."""
    if name not in LOSS_BACKENDS:
        raise ConfigError("model.loss", name, f"choose one of {sorted(LOSS_BACKENDS)}")
    return LOSS_BACKENDS[name]

"""Preference losses over per-sequence log-probabilities: DPO (sigmoid), IPO, hinge, SimPO.

Inputs are, per pair, the policy's summed response log-probabilities of the chosen and rejected
sequences, the reference's (zeros when there is none), and each sequence's response-token count.
Formulas follow TRL's ``DPOTrainer`` (tested against it), with ``delta = (pi_c - ref_c) - (pi_r - ref_r)``:

- ``sigmoid`` (DPO, with conservative label smoothing ``eps``):
  ``-(1 - eps) * logsigmoid(beta * delta) - eps * logsigmoid(-beta * delta)``;
- ``hinge`` (SLiC): ``relu(1 - beta * delta)``;
- ``ipo``: ``(delta_avg - 1 / (2 * beta))^2`` where each log-ratio is divided by its sequence's
  response tokens (as TRL, confirmed with the IPO authors);
- ``simpo`` (reference-free): ``m = beta * (pi_c / n_c - pi_r / n_r) - gamma``, loss
  ``-(1 - eps) * logsigmoid(m) - eps * logsigmoid(-m)``.

Rewards are ``beta * (pi - ref)`` (SimPO: ``beta * pi / n``), the implicit rewards TRL logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_ablate.errors import ConfigError

LossType = Literal["sigmoid", "ipo", "hinge", "simpo"]
LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "simpo")
REFERENCE_FREE: tuple[str, ...] = ("simpo",)
"""Losses that use no reference model (``reference: none`` is then required)."""
SMOOTHED: tuple[str, ...] = ("sigmoid", "simpo")
"""Losses with a label-smoothing form; the others refuse ``label_smoothing != 0``."""
_KEY = "model.init_args"


class PairLosses(NamedTuple):
    """Per pair: the loss (differentiable) and the implicit rewards (detached)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


@dataclass(frozen=True)
class PreferenceLoss:
    """One preference loss and its hyper-parameters, validated at construction.

    Args:
        loss_type: ``sigmoid`` (DPO), ``ipo``, ``hinge`` or ``simpo`` (reference-free).
        beta: inverse temperature of the implicit reward (IPO: its regularisation strength).
        label_smoothing: assumed share of flipped preference labels (``sigmoid``/``simpo``), in [0, 0.5).
        gamma: SimPO's target reward margin.
    """

    loss_type: LossType = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"{_KEY}.loss_type", self.loss_type, f"choose one of {LOSS_TYPES}")
        if not self.beta > 0:
            raise ConfigError(f"{_KEY}.beta", self.beta, "use a positive beta, e.g. 0.1")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"{_KEY}.label_smoothing", self.label_smoothing, "use a value in [0, 0.5)")
        if self.label_smoothing and self.loss_type not in SMOOTHED:
            raise ConfigError(
                f"{_KEY}.label_smoothing",
                self.label_smoothing,
                f"{self.loss_type} has no label smoothing; use 0 or loss_type one of {SMOOTHED}",
            )
        if self.gamma < 0:
            raise ConfigError(f"{_KEY}.gamma", self.gamma, "use a non-negative SimPO margin, e.g. 0.5")

    @property
    def reference_free(self) -> bool:
        return self.loss_type in REFERENCE_FREE

    def __call__(
        self,
        chosen: Tensor,
        rejected: Tensor,
        ref_chosen: Tensor,
        ref_rejected: Tensor,
        chosen_tokens: Tensor,
        rejected_tokens: Tensor,
    ) -> PairLosses:
        """All inputs are ``[pairs]``; log-probabilities are summed over response tokens."""
        beta = self.beta
        if self.loss_type == "simpo":
            chosen_avg = chosen / chosen_tokens.clamp(min=1)
            rejected_avg = rejected / rejected_tokens.clamp(min=1)
            margin = beta * (chosen_avg - rejected_avg) - self.gamma
            return PairLosses(
                self._smoothed_logsigmoid(margin), beta * chosen_avg.detach(), beta * rejected_avg.detach()
            )
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        if self.loss_type == "sigmoid":
            losses = self._smoothed_logsigmoid(beta * (chosen_ratio - rejected_ratio))
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - beta * (chosen_ratio - rejected_ratio))
        else:  # ipo
            delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (delta - 1 / (2 * beta)) ** 2
        return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())

    def _smoothed_logsigmoid(self, logits: Tensor) -> Tensor:
        eps = self.label_smoothing
        losses = -F.logsigmoid(logits)
        return (1 - eps) * losses - eps * F.logsigmoid(-logits) if eps else losses

"""The MoE router: top-k softmax routing and the auxiliary losses that keep experts in use.

Routing follows the Hugging Face MoE families (Qwen3-MoE, OLMoE, Mixtral): softmax over all
experts in fp32, keep the ``top_k`` largest, optionally renormalise them to sum to one. The two
auxiliary losses are computed per layer, on the tokens this rank routed:

- load balancing (Switch Transformer, eq. 4-6, as transformers computes it for one layer):
  ``num_experts * sum_e f_e * P_e`` with ``f_e`` the fraction of tokens that picked expert ``e``
  (counting all ``top_k`` choices, so the ``f_e`` sum to ``top_k``) and ``P_e`` the mean router
  probability of ``e``. Perfectly balanced routing gives ``top_k``; its gradient reaches the
  router through ``P_e`` only.
- router z-loss (ST-MoE): the mean over tokens of ``logsumexp(logits)^2``; it keeps router
  logits small, which matters for low-precision training.

Both count every routed position, padding included (transformers masks padding with the
attention mask; a block does not see it): packed batches have no padding to count.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Routing(NamedTuple):
    """One routing decision for ``N`` tokens over ``E`` experts."""

    weights: Tensor
    """``[N, top_k]`` mixing weight of each chosen expert, in the hidden-state dtype."""
    indices: Tensor
    """``[N, top_k]`` int64 ids of the chosen experts."""
    probs: Tensor
    """``[N, E]`` fp32 softmax over all experts (what the load-balancing loss reads)."""
    logits: Tensor
    """``[N, E]`` router logits (what the z-loss reads)."""
    counts: Tensor
    """``[E]`` int64: how many of the ``N * top_k`` token copies each expert receives."""


class TopKRouter(nn.Module):
    """Linear gate + top-k softmax; holds the gate weight under the name HF checkpoints use.

    Args:
        weight: the ``[num_experts, hidden]`` gate weight (the HF router's own ``Parameter``, so
            patching a model keeps its weights and its state-dict keys).
        top_k: experts per token.
        normalize_top_k: renormalise the kept probabilities to sum to one (Qwen3-MoE's
            ``norm_topk_prob``; Mixtral always does).
    """

    def __init__(self, weight: nn.Parameter, top_k: int, normalize_top_k: bool) -> None:
        super().__init__()
        self.weight = weight
        self.num_experts = weight.shape[0]  # kept as a number: FSDP1 empties the weight between forwards
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k

    def forward(self, hidden: Tensor) -> Routing:
        """``hidden`` is ``[N, H]``."""
        logits = F.linear(hidden, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(top.to(hidden.dtype), indices, probs, logits, expert_token_counts(indices, self.num_experts))

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, normalize_top_k={self.normalize_top_k}"


def expert_token_counts(indices: Tensor, num_experts: int) -> Tensor:
    """``[E]`` int64: how many (token, choice) pairs went to each expert.

    ``scatter_add_`` rather than ``bincount``: on CUDA it needs no device-to-host sync.
    """
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs: Tensor, counts: Tensor) -> Tensor:
    """Switch-style loss ``E * sum_e f_e * P_e`` for one layer (``top_k`` when perfectly balanced)."""
    num_tokens, num_experts = probs.shape
    if num_tokens == 0:
        return probs.sum()
    fraction = counts.to(torch.float32) / num_tokens
    return num_experts * torch.sum(fraction * probs.mean(dim=0))


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE z-loss: mean over tokens of ``logsumexp(logits)^2``, in fp32."""
    if logits.shape[0] == 0:
        return logits.float().sum()
    return torch.logsumexp(logits.float(), dim=-1).square().mean()

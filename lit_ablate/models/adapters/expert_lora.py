"""LoRA on the routed experts of lit-ablate's MoE blocks (``RoutedExperts``: ``loop`` and ``grouped``).

peft adapts ``nn.Linear`` layers; the experts here are two stacked parameters (``gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``). peft's ``target_parameters`` adapts such parameters
through ``torch.nn.utils.parametrize``, which expert parallelism breaks: the EP strategy replaces
each expert weight by this rank's DTensor slice after the model is built, and the adapters must be
sliced with it. So this one adapter is written here, in peft's terms: every expert ``e`` gets its
own ``A_e`` ``[r, in]`` (peft's uniform init) and ``B_e`` ``[out, r]`` (zeros: the adapted model
computes its base until the first step), scaled by ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).

Like peft's parameter adapters it adds ``scaling * B_e A_e`` to each expert's weight before the
experts run, so it works unchanged with every experts implementation (loop, grouped matmul, its
padded fallback) and, with ``A``/``B`` sharded on the expert dimension like the weights, under
expert parallelism (``RoutedExperts.expert_dim_parameters``). The price, against an adapter on the
activations: one transient adapted copy of this rank's expert weights per layer, and their full
weight gradient in backward (``6 N`` per token on the active experts instead of ``4 N``).
No dropout (it acts on activations) and no DoRA on experts: both are refused naming the key.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class ExpertLoRA(nn.Module):
    """Low-rank updates of every expert's gate/up and down weights (one ``A``, ``B`` pair per expert).

    Args:
        gate_up: the experts' stacked gate/up weight ``[E, 2I, H]`` (shapes, dtype, device).
        down: the stacked down weight ``[E, H, I]``.
        r: rank per expert.
        alpha: scale numerator (``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``).
        use_rslora: rank-stabilised scaling.
    """

    def __init__(self, gate_up: Tensor, down: Tensor, r: int, alpha: float, use_rslora: bool = False) -> None:
        super().__init__()
        experts, two_i, hidden = gate_up.shape
        intermediate = down.shape[2]
        like = {"dtype": gate_up.dtype, "device": gate_up.device}
        self.gate_up_A = nn.Parameter(_uniform_init(torch.empty(experts, r, hidden, **like)))
        self.gate_up_B = nn.Parameter(torch.zeros(experts, two_i, r, **like))
        self.down_A = nn.Parameter(_uniform_init(torch.empty(experts, r, intermediate, **like)))
        self.down_B = nn.Parameter(torch.zeros(experts, hidden, r, **like))
        self.scaling = alpha / (math.sqrt(r) if use_rslora else r)
        self.enabled = True
        """Off inside ``adapters_disabled`` (e.g. DPO's reference forward): the base experts alone."""

    def forward(self, gate_up: Tensor, down: Tensor) -> tuple[Tensor, Tensor]:
        """The experts' weights (this rank's experts) with their adapters added."""
        if not self.enabled:
            return gate_up, down
        a_gu, b_gu, a_d, b_d = (_local(p) for p in (self.gate_up_A, self.gate_up_B, self.down_A, self.down_B))
        return gate_up + self.scaling * torch.bmm(b_gu, a_gu), down + self.scaling * torch.bmm(b_d, a_d)

    def enable_adapters(self, enabled: bool) -> None:
        """peft's name for switching a layer's adapters (``adapters_disabled`` calls it on every adapter)."""
        self.enabled = enabled

    def extra_repr(self) -> str:
        experts, r, _ = self.gate_up_A.shape
        return f"experts={experts}, r={r}, scaling={self.scaling:g}"


@torch.no_grad()
def merge_expert_adapters(model: nn.Module) -> None:
    """Add every expert adapter's update into its experts' weights and drop the adapters (export ``--merge``):
    the experts then compute what they computed with the adapters, in the Hugging Face layout."""
    from lit_ablate.models.moe.experts import RoutedExperts

    for experts in model.modules():
        if isinstance(experts, RoutedExperts) and experts.adapters is not None:
            gate_up, down = experts.adapters(experts.gate_up_proj, experts.down_proj)
            experts.gate_up_proj.copy_(gate_up)
            experts.down_proj.copy_(down)
            experts.adapters = None


def _uniform_init(a: Tensor) -> Tensor:
    """peft's ``lora_A`` init per expert: ``kaiming_uniform_(a=sqrt(5))`` of an ``[r, in]`` matrix,
    i.e. uniform in ``+-1/sqrt(in)`` (torch's fan-in of a 3-D tensor would also count the expert dim)."""
    bound = 1.0 / math.sqrt(a.shape[-1])
    return nn.init.uniform_(a, -bound, bound)


def _local(weight: Tensor) -> Tensor:
    """This rank's experts of an expert-parallel DTensor, else the tensor itself."""
    return weight.to_local() if hasattr(weight, "to_local") else weight

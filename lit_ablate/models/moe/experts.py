"""Experts implementations: every expert's gated MLP over token copies sorted by expert.

Each implementation takes token copies grouped by expert (``moe_dispatch`` sorts them) and the
number of copies per expert, and returns one output row per input row. They differ only in how
the per-expert matmuls are issued, which is what an experts ablation measures:

- ``loop``: one matmul per expert and projection: the readable reference;
- ``grouped``: one ``torch._grouped_mm`` per projection over all experts, no host sync; dropless
  (every copy is computed, no capacity factor). Where ``_grouped_mm`` cannot run (dtype,
  alignment, GPU generation) a padded batched matmul does the same work, with one warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

Activation = Callable[[Tensor], Tensor]
ExpertsFn = Callable[[Tensor, Tensor, Tensor, Tensor, Activation], Tensor]
"""``(tokens sorted by expert [M, H], counts [E], gate_up [E, 2I, H], down [E, H, I], act) -> [M, H]``"""


def loop_experts(
    tokens: Tensor,
    counts: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Activation,
    linear: Callable[[Tensor, Tensor], Tensor] = F.linear,
) -> Tensor:
    """The reference: each expert's contiguous rows through its own MLP, one matmul at a time
    (``linear``: ``F.linear``, or fp8's ``Fp8Matmul`` once ``lit_ablate.models.fp8.conversion`` converted the experts).

    Experts with no tokens still run on an empty slice, so their weights get zero (not missing)
    gradients, as with ``grouped``: an optimizer then updates both the same way. The weights are
    split with ``unbind`` (one gradient ``stack`` in backward) rather than indexed per expert,
    whose backward would materialise a full-size zero gradient for every expert.
    """
    outputs = [
        linear(act(gate) * up, w_down)
        for rows, w_gate_up, w_down in zip(tokens.split(counts.tolist()), gate_up.unbind(0), down.unbind(0))
        for gate, up in [linear(rows, w_gate_up).chunk(2, dim=-1)]
    ]
    return torch.cat(outputs)


def grouped_mm_experts(tokens: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, act: Activation) -> Tensor:
    """One grouped matmul per projection; the group offsets stay on the device."""
    offsets = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(tokens, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    return torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=offsets)


eager_grouped_mm_experts = torch.compiler.disable(grouped_mm_experts)
"""``grouped_mm_experts`` run eagerly inside a compiled layer: ``_grouped_mm`` runs float32 and
float16 on CPU, but its compile-time (meta) kernel accepts bfloat16 only (torch 2.13)."""


def padded_bmm_experts(tokens: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, act: Activation) -> Tensor:
    """``grouped_mm_experts`` with ``bmm`` over groups zero-padded to the largest one.

    A zero row gives ``act(0) * 0 = 0``, so padding contributes nothing to outputs or gradients.
    """
    num_experts = counts.numel()
    expert, slot = expert_slots(counts, tokens.shape[0])
    padded = tokens.new_zeros(num_experts, int(counts.max()), tokens.shape[1]).index_put((expert, slot), tokens)
    gate, up = torch.bmm(padded, gate_up.transpose(-2, -1)).chunk(2, dim=-1)
    return torch.bmm(act(gate) * up, down.transpose(-2, -1))[expert, slot]


def expert_slots(counts: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """For ``rows`` token copies sorted by expert (``counts`` per expert): each copy's expert and its
    index within that expert's rows, without a host sync."""
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=rows)
    return expert, torch.arange(rows, device=counts.device) - (counts.cumsum(0) - counts)[expert]


def grouped_mm_unsupported(tokens: Tensor, gate_up: Tensor, down: Tensor) -> str | None:
    """Why ``torch._grouped_mm`` cannot run these operands here, or None when it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    device, dtype = tokens.device, tokens.dtype
    if device.type == "cuda":
        if dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 0):
            return f"torch._grouped_mm on CUDA needs bfloat16 on sm80+ (got {dtype})"
        if any(t.data_ptr() % 16 for t in (tokens, gate_up, down)):  # e.g. views into a flat FSDP1 parameter
            return "torch._grouped_mm on CUDA needs 16-byte aligned operands"
    elif device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"torch._grouped_mm does not run {dtype} on {device.type}"
    align = 16 // tokens.element_size()  # every row stride must be a multiple of 16 bytes
    hidden, intermediate = down.shape[1], down.shape[2]
    if hidden % align or intermediate % align:
        return (
            f"torch._grouped_mm needs hidden ({hidden}) and expert intermediate ({intermediate}) sizes "
            f"divisible by {align}"
        )
    return None


_warned: set[str] = set()


class RoutedExperts(nn.Module):
    """All experts' gated-MLP weights, stacked, under transformers' names and layouts.

    ``gate_up_proj`` is ``[E, 2I, H]`` (gate rows first) and ``down_proj`` is ``[E, H, I]``.
    Called with token copies sorted by expert and the count per expert. An expert-parallel
    strategy may turn the weights into DTensors sharded on the expert dim; the computation then
    uses this rank's local experts, which are the experts its dispatcher sends it.

    Args:
        gate_up_proj: the stacked gate and up projections.
        down_proj: the stacked down projections.
        act_fn: the gate activation (the HF module's own, e.g. SiLU).
        implementation: ``loop`` or ``grouped``.
    """

    def __init__(
        self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, act_fn: nn.Module, implementation: str = "grouped"
    ) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.implementation = implementation
        self.fallback: str | None = None
        """Why ``grouped`` ran the padded-bmm path, if it did (for the run record)."""
        self.linear: Callable[[Tensor, Tensor], Tensor] = F.linear
        """The matmul ``loop`` calls per expert (fp8 conversion replaces it)."""
        self.grouped_mm: ExpertsFn | None = None
        """What ``grouped`` runs instead of torch's grouped matmul, and ``grouped_mm_note`` why (fp8
        conversion sets them: ``lit_ablate.models.fp8.grouped_experts``)."""
        self.grouped_mm_note: str | None = None
        self.adapters: nn.Module | None = None
        """Expert LoRA (``lit_ablate.models.adapters.expert_lora.ExpertLoRA``), set by ``apply_adapters``."""

    def forward(self, tokens: Tensor, counts: Tensor) -> Tensor:
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        if self.adapters is not None:
            gate_up, down = self.adapters(gate_up, down)
        return self._experts_fn(tokens, gate_up, down)(tokens, counts, gate_up, down, self.act_fn)

    def expert_dim_parameters(self) -> list[tuple[nn.Module, str]]:
        """``(owner, name)`` of every parameter whose first dimension is the expert, which expert
        parallelism slices: the two weights and their adapters."""
        owners = [(self, "gate_up_proj"), (self, "down_proj")]
        if self.adapters is not None:
            owners += [(self.adapters, name) for name, _ in self.adapters.named_parameters(recurse=False)]
        return owners

    def _experts_fn(self, tokens: Tensor, gate_up: Tensor, down: Tensor) -> ExpertsFn:
        if self.implementation == "loop":
            return functools.partial(loop_experts, linear=self.linear)
        if self.grouped_mm is not None:
            self.fallback = self.grouped_mm_note
            return self.grouped_mm
        self.fallback = grouped_mm_unsupported(tokens, gate_up, down)
        if self.fallback is None:
            if torch.compiler.is_compiling() and tokens.dtype != torch.bfloat16:
                return eager_grouped_mm_experts
            return grouped_mm_experts
        if self.fallback not in _warned:
            _warned.add(self.fallback)
            log.warning("grouped experts fall back to a padded bmm: %s", self.fallback)
        return padded_bmm_experts

    def extra_repr(self) -> str:
        experts, two_i, hidden = self.gate_up_proj.shape
        return f"experts={experts}, hidden={hidden}, intermediate={two_i // 2}, implementation={self.implementation}"


def _local(weight: Tensor) -> Tensor:
    """This rank's shard of a DTensor (experts sharded by an EP strategy), else the tensor itself."""
    return weight.to_local() if isinstance(weight, DTensor) else weight

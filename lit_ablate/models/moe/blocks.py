"""Mixture-of-experts blocks patched into Hugging Face MoE models, selected by config.

``apply_moe(model, MoEOptions(experts="grouped"))`` replaces every transformers sparse-MoE block
(Qwen3-MoE, OLMoE, Mixtral: a ``gate`` router and an ``experts`` module of stacked weights) with
an ``MoEBlock`` that holds the *same* parameters under the *same* names, so checkpoints load and
save unchanged. The block routes (``moe_router``), hands token copies sorted by expert to its
dispatcher (``moe_dispatch``: local, or expert-parallel once a strategy installs one), and its
experts compute them (``moe_experts``: ``loop`` or ``grouped``).

Auxiliary losses (load balancing, router z-loss) are stashed by each block during a training
forward; the training step adds ``collect_aux_losses(model)`` to its loss. Per-expert token
counts accumulate for ``ExpertLoadMonitor`` until it reads them: each training forward only writes
its own (a compiled decoder layer that read the running sums would be compiled again whenever they
were reset), which are added to the sums outside the layers: before the model's next forward (a
forward pre-hook ``apply_moe`` installs) or when the sums are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lit_ablate.errors import ConfigError
from lit_ablate.models.moe.dispatch import LocalDispatcher
from lit_ablate.models.moe.experts import RoutedExperts
from lit_ablate.models.moe.router import Routing, TopKRouter, load_balancing_loss, router_z_loss

MOE_KEY = "model.init_args.model.moe"
"""Where ``MoEOptions`` sit in a fit config (named in error messages)."""

EXPERTS_IMPLEMENTATIONS: tuple[str, ...] = ("loop", "grouped", "hf")
"""Config names: ``loop`` and ``grouped`` patch the model; ``hf`` leaves transformers' own blocks."""


@dataclass
class MoEOptions:
    """How MoE layers compute and what auxiliary losses train the router.

    Args:
        experts: ``grouped`` (fused grouped matmuls; choose it to train), ``loop`` (one matmul per
            expert: the reference and the naive baseline), or ``hf`` (transformers' own block,
            untouched: no auxiliary losses, nothing for ``ExpertLoadMonitor``).
        normalize_top_k: renormalise the top-k routing weights to sum to one; None keeps the
            model's own choice (Qwen3-MoE/OLMoE ``norm_topk_prob``; Mixtral always renormalises).
        load_balance_weight: weight of the Switch load-balancing loss (mean over MoE layers);
            None uses the model config's ``router_aux_loss_coef``.
        z_loss_weight: weight of the router z-loss (mean over MoE layers); 0 disables it.
    """

    experts: str = "grouped"
    normalize_top_k: bool | None = None
    load_balance_weight: float | None = None
    z_loss_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.experts not in EXPERTS_IMPLEMENTATIONS:
            raise ConfigError(f"{MOE_KEY}.experts", self.experts, f"choose one of {list(EXPERTS_IMPLEMENTATIONS)}")
        for key in ("load_balance_weight", "z_loss_weight"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ConfigError(f"{MOE_KEY}.{key}", value, "use a weight >= 0 (0 disables the loss)")


class ExpertLoad(NamedTuple):
    """What one MoE layer saw over the training forwards since it was last read."""

    counts: Tensor
    """``[E]`` token copies routed to each expert (int64, on this rank)."""
    load_balance_loss: float
    """Mean unweighted load-balancing loss over those forwards."""
    z_loss: float
    """Mean unweighted router z-loss over those forwards."""
    forwards: int


class MoEBlock(nn.Module):
    """Router + experts + dispatcher: the drop-in replacement of an HF sparse-MoE block.

    Args:
        gate: the router (its weight keeps the HF name ``gate.weight``).
        experts: the experts (their weights keep ``experts.gate_up_proj``/``experts.down_proj``).
        load_balance_weight: weight of this layer's load-balancing loss in the training loss.
        z_loss_weight: weight of this layer's router z-loss in the training loss.
        layer_index: the decoder layer this block sits in (names its metrics).
    """

    def __init__(
        self,
        gate: TopKRouter,
        experts: RoutedExperts,
        load_balance_weight: float = 0.0,
        z_loss_weight: float = 0.0,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.load_balance_weight = load_balance_weight
        self.z_loss_weight = z_loss_weight
        self.layer_index = layer_index
        self.dispatcher = LocalDispatcher()
        self._aux_losses: dict[str, Tensor] = {}
        self._load: Tensor | None = None  # fp64 sums since last read: [counts..., balance, z, forwards]
        self._observed: Tensor | None = None  # the last training forward's, not yet in _load

    def forward(self, hidden_states: Tensor) -> Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = self.gate(x)
        if self.training:
            self._note(routing)
        return self.dispatcher(x, routing, self.experts).view_as(hidden_states)

    def _note(self, routing: Routing) -> None:
        balance, z = load_balancing_loss(routing.probs, routing.counts), router_z_loss(routing.logits)
        self._aux_losses = {
            name: weight * loss
            for name, weight, loss in (
                ("load_balance_loss", self.load_balance_weight, balance),
                ("z_loss", self.z_loss_weight, z),
            )
            if weight > 0
        }
        observed = torch.cat(
            [
                routing.counts.double(),
                torch.stack([balance.detach(), z.detach()]).double(),
                routing.counts.new_ones(1).double(),
            ]
        )
        self._observed = observed  # written, never read, inside the (compiled) layer

    def keep_aux_losses(self, losses: dict[str, Tensor]) -> None:
        """Hold auxiliary losses computed elsewhere until ``pop_aux_losses`` (a pipeline's stages
        backpropagate their layers' own and leave the whole model's values for the training step to log)."""
        self._aux_losses = dict(losses)

    def pop_aux_losses(self) -> dict[str, Tensor]:
        """The weighted auxiliary losses of the last training forward (then forgotten)."""
        losses, self._aux_losses = self._aux_losses, {}
        return losses

    def pop_load(self) -> ExpertLoad | None:
        """Token counts and mean aux losses since the last call (None when no training forward ran)."""
        self.add_observed()
        if self._load is None:
            return None
        values, self._load = self._load.tolist(), None
        experts, forwards = self.gate.num_experts, values[-1]
        return ExpertLoad(
            torch.tensor(values[:experts], dtype=torch.int64),
            values[experts] / forwards,
            values[experts + 1] / forwards,
            int(forwards),
        )

    def add_observed(self) -> None:
        """Add the last training forward's counts and losses to the sums ``pop_load`` reads."""
        if self._observed is not None:
            self._load = self._observed if self._load is None else self._load + self._observed
            self._observed = None


def moe_blocks(module: nn.Module) -> list[MoEBlock]:
    """The patched MoE blocks of a model, in layer order."""
    return [m for m in module.modules() if isinstance(m, MoEBlock)]


def collect_aux_losses(module: nn.Module) -> dict[str, Tensor]:
    """Each auxiliary loss of the last training forward, averaged over MoE layers and weighted.

    The training step adds ``sum(collect_aux_losses(model).values())`` to its loss and logs each
    entry; names are ``load_balance_loss`` and ``z_loss`` (absent when their weight is 0).
    """
    per_name: dict[str, list[Tensor]] = {}
    for block in moe_blocks(module):
        for name, loss in block.pop_aux_losses().items():
            per_name.setdefault(name, []).append(loss)
    return {name: torch.stack(losses).mean() for name, losses in per_name.items()}


def experts_fallbacks(module: nn.Module) -> list[str]:
    """Distinct reasons why ``grouped`` experts ran something other than torch's grouped matmul (the
    padded-bmm fallback, fp8 emulation), for the run record."""
    return sorted({b.experts.fallback for b in moe_blocks(module) if b.experts.fallback})


def apply_moe(model: nn.Module, options: MoEOptions) -> list[MoEBlock]:
    """Replace each HF sparse-MoE block of ``model`` by an ``MoEBlock``; returns the new blocks.

    Parameters are reused, not copied: weights already loaded stay, and state-dict keys match the
    transformers checkpoint format. ``experts="hf"`` changes nothing and returns ``[]``.
    """
    if options.experts == "hf":
        return []
    config = getattr(model, "config", None)
    load_balance = options.load_balance_weight
    if load_balance is None:
        load_balance = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    blocks = []
    for name, hf_block in [(n, m) for n, m in model.named_modules() if _is_hf_moe_block(m)]:
        gate, experts = hf_block.gate, hf_block.experts
        _check_supported(name, hf_block)
        normalize = options.normalize_top_k
        if normalize is None:
            normalize = bool(getattr(gate, "norm_topk_prob", True))  # Mixtral's router always renormalises
        match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
        block = MoEBlock(
            TopKRouter(gate.weight, gate.top_k, normalize),
            RoutedExperts(experts.gate_up_proj, experts.down_proj, experts.act_fn, options.experts),
            load_balance_weight=load_balance,
            z_loss_weight=options.z_loss_weight,
            layer_index=int(match.group(1)) if match else len(blocks),
        )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, block)
        blocks.append(block)
    if not blocks:
        raise ConfigError(
            f"{MOE_KEY}.experts",
            options.experts,
            "the model has no sparse-MoE blocks; use an MoE model (e.g. preset tiny-qwen3-moe) or drop moe",
        )
    getattr(model, "base_model", model).register_forward_pre_hook(_add_observed_before_forward)
    return blocks


def _add_observed_before_forward(decoder: nn.Module, args: tuple) -> None:
    """Before each forward of the decoder (eager: its layers may be compiled), the last forward's counts
    go into the sums (``MoEBlock.add_observed``)."""
    for block in moe_blocks(decoder):
        block.add_observed()


def _is_hf_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return (
        not isinstance(module, MoEBlock)
        and isinstance(getattr(getattr(module, "gate", None), "weight", None), nn.Parameter)
        and isinstance(getattr(experts, "gate_up_proj", None), nn.Parameter)
        and isinstance(getattr(experts, "down_proj", None), nn.Parameter)
    )


def _check_supported(name: str, block: nn.Module) -> None:
    """Refuse what an ``MoEBlock`` would silently drop: shared experts, biases, jitter, other layouts."""
    unknown = sorted(set(dict(block.named_children())) - {"gate", "experts"})
    params = sorted(n for n, _ in block.experts.named_parameters())
    num_experts, hidden = block.gate.weight.shape
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    problem = None
    if unknown:
        problem = f"it has parts an MoEBlock does not compute: {unknown}"
    elif params != ["down_proj", "gate_up_proj"]:
        problem = f"its experts hold {params}, not just gate_up_proj/down_proj"
    elif not getattr(block.experts, "is_concatenated", True) or getattr(block.experts, "is_transposed", False):
        problem = "its expert weights are interleaved or transposed"
    elif not isinstance(getattr(block.gate, "top_k", None), int):
        problem = "its router has no top_k"
    elif getattr(block, "jitter_noise", 0.0):
        problem = "it uses router jitter noise; set router_jitter_noise: 0 in the model config"
    elif (
        gate_up.shape[::2] != (num_experts, hidden)
        or down.shape[:2] != (num_experts, hidden)
        or (gate_up.shape[1] != 2 * down.shape[2])
    ):
        problem = f"its expert weights have an unexpected layout {tuple(gate_up.shape)} / {tuple(down.shape)}"
    if problem:
        raise ConfigError(f"{MOE_KEY}.experts", type(block).__name__, f"{name}: {problem}; or use experts: hf")

"""DPO through Liger-Kernel's fused linear DPO loss (``model.init_args.logprobs: liger``).

Liger's ``LigerFusedLinearDPOFunction`` fuses the LM head, the per-sequence log-probs and the
preference loss, and forms the gradients of the hidden states and head weight during its forward,
a chunk of pairs at a time: only ``[2 x chunk_pairs, T, vocab]`` logits exist at once. It is plain
torch (``torch.func``, optionally ``torch.compile``), so it runs on CPU too. Its contract is
narrower than the per-token backends' (``lit_ablate.models.losses.logprobs``), and what it cannot do is
refused when the run is configured (``check_liger_dpo``) rather than computed differently:

- padded batches only: one sequence per row, all chosen rows then all rejected rows (TRL's
  layout); packed rows and prefix sharing need per-document sums, which Liger does not take;
- losses ``sigmoid`` without label smoothing and ``hinge`` (Liger's ``ipo`` is not implemented,
  its ``robust`` smoothing is another formula than TRL's conservative DPO, and SimPO is another
  Liger class);
- references ``frozen`` (the reference's last hidden states and its initial LM-head weight go in;
  Liger computes their log-probs in the same chunks) and ``none``. A precomputed reference cannot
  be passed in (Liger only takes reference hidden states), nor, for now, the adapter-disabled
  policy (untested).

The frozen reference's LM-head weight is read by Liger as one tensor inside the policy's forward; it
is kept as a frozen copy of the initial head inside the policy (``LigerDPOPolicy.reference_head``,
parameters without gradients: a sharding strategy shards it with the policy's root and gathers it
for the forward, as it does the policy's own head), so no wrapper has to hand out a gathered
parameter of another module. DPO counts it in the ``reference`` memory category.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedModel

from lit_ablate.errors import ConfigError
from lit_ablate.extras import not_installed
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.models.losses.sequence_logprobs import PairStep, SequenceLogProbs

LIGER = "liger"
LIGER_LOSS_TYPES = ("sigmoid", "hinge")
LIGER_REFERENCES = ("frozen", "none")
_KEY = "model.init_args"
PADDED_ONLY_FIX = (
    "logprobs: liger needs one sequence per row: use lit_ablate.data.PreferencePaddingCollator, or "
    "logprobs: chunked for packing"
)


def check_liger_dpo(loss_type: str, label_smoothing: float, reference: str) -> None:
    """Raise ``ConfigError`` when ``logprobs: liger`` cannot run this configuration."""
    missing = not_installed("liger_kernel", "Liger's fused DPO loss")
    if missing:
        raise ConfigError(
            f"{_KEY}.logprobs",
            LIGER,
            f"{missing} (on a machine without CUDA: 'lit-ablate[kernels-cpu]'; "
            "Liger's fused DPO is plain torch and runs on CPU too)",
        )
    if loss_type not in LIGER_LOSS_TYPES:
        raise ConfigError(
            f"{_KEY}.loss_type",
            loss_type,
            f"Liger's fused DPO supports {LIGER_LOSS_TYPES} here; use "
            "logprobs: chunked (same memory class, every loss)",
        )
    if label_smoothing:
        raise ConfigError(
            f"{_KEY}.label_smoothing",
            label_smoothing,
            "Liger's fused DPO has no conservative-DPO smoothing: use 0, or logprobs: chunked",
        )
    if reference not in LIGER_REFERENCES:
        raise ConfigError(
            f"{_KEY}.reference",
            reference,
            f"Liger's fused DPO takes the reference as hidden states: "
            f"use one of {LIGER_REFERENCES}, or logprobs: chunked",
        )


def check_padded_batch(batch: dict[str, Any]) -> None:
    """Liger sums log-probs per row: a packed or prefix-shared batch would mix sequences."""
    if batch.get("cu_seqlens") is not None or batch.get("branch_ids") is not None:
        raise ConfigError("data.init_args.collator", "packed preference rows", PADDED_ONLY_FIX)


@dataclass(frozen=True)
class LigerDPOLoss:
    """Liger's fused linear DPO loss with this run's ``beta`` and ``loss_type``.

    Args:
        beta, loss_type: the module's (``sigmoid`` or ``hinge``).
        chunk_pairs: pairs per chunk (``logprobs_options.chunk_pairs``): logits of ``2 x chunk_pairs``
            whole sequences exist at once.
        compile: let Liger ``torch.compile`` its chunk step (``logprobs_options.compile``; worth it
            on GPU, a long cold compile on CPU).
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    chunk_pairs: int = 1
    compile: bool = False

    def __post_init__(self) -> None:
        if self.chunk_pairs < 1:
            raise ConfigError(f"{_KEY}.logprobs_options.chunk_pairs", self.chunk_pairs, "use a positive pair count")

    def __call__(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        bias: Tensor | None,
        reference: tuple[Tensor, Tensor, Tensor | None] | None,
    ) -> PairStep:
        """``hidden [2P, T, H]`` and shifted ``labels [2P, T]`` (chosen rows, then rejected);
        ``reference``: its ``(hidden, head weight, head bias)`` or None (log-ratios against 0)."""
        from liger_kernel.chunked_loss.dpo_loss import LigerFusedLinearDPOFunction

        ref_hidden, ref_weight, ref_bias = reference if reference is not None else (None, None, None)
        loss, (chosen, rejected, _, _, _, chosen_rewards, rejected_rewards) = LigerFusedLinearDPOFunction.apply(
            hidden,
            weight,
            labels,
            bias,
            ref_hidden,
            ref_weight,
            ref_bias,
            IGNORE_INDEX,
            self.beta,
            False,  # compute_nll_loss
            self.compile,
            reference is not None,
            False,  # average_log_prob: sums over response tokens, as TRL
            self.chunk_pairs,
            self.loss_type,
        )
        pairs = labels.shape[0] // 2
        return PairStep(
            loss * pairs, chosen.detach(), rejected.detach(), chosen_rewards.detach(), rejected_rewards.detach()
        )  # Liger returns the mean over the micro-batch's pairs


class LigerDPOPolicy(SequenceLogProbs):
    """The DPO policy whose ``forward(batch, reference_hidden)`` is Liger's fused loss.

    ``reference_hidden`` is the frozen reference's ``[2P, T, H]`` last hidden states (its
    ``SequenceLogProbs.forward(batch, hidden_only=True)``), or None without a reference.
    ``forward(batch)`` without the fused loss is not offered: eval and precompute use the same call.
    """

    def __init__(self, lm: PreTrainedModel, loss_fn: LigerDPOLoss, frozen_reference: bool) -> None:
        super().__init__(lm, loss_fn)
        head = lm.get_output_embeddings()
        self.reference_head = (
            nn.Linear(
                head.in_features,
                head.out_features,
                bias=head.bias is not None,
                device=head.weight.device,
                dtype=head.weight.dtype,
            )
            if frozen_reference
            else None
        )
        if self.reference_head is not None:
            self.reference_head.load_state_dict(head.state_dict())
            self.reference_head.requires_grad_(False)

    def forward(self, batch: dict[str, Any], reference_hidden: Tensor | None = None) -> PairStep:  # type: ignore[override]
        check_padded_batch(batch)
        hidden = self.hidden_states(batch)
        head = self.lm.get_output_embeddings()
        reference = None
        if reference_hidden is not None:
            reference = (reference_hidden.to(hidden.dtype), self.reference_head.weight, self.reference_head.bias)
        return self.loss_fn(hidden, head.weight, batch["labels"], head.bias, reference)


def liger_dpo_loss(beta: float, loss_type: str, label_smoothing: float, reference: str, **options: Any) -> LigerDPOLoss:
    """The fused loss for this configuration; ``options`` are ``logprobs_options`` (``chunk_pairs``,
    ``compile``). Anything it cannot run raises ``ConfigError`` (``check_liger_dpo``)."""
    check_liger_dpo(loss_type, label_smoothing, reference)
    accepted = ("chunk_pairs", "compile")
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"{_KEY}.logprobs_options", options, f"'liger' takes no option {unknown}; it takes {list(accepted)}"
        )
    return LigerDPOLoss(beta, loss_type, **options)

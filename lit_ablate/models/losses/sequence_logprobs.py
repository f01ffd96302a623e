"""A Hugging Face causal LM that returns per-sequence response log-probabilities (for DPO).

It is a ``CausalLMWithLoss`` whose "loss" is a log-prob backend (``lit_ablate.models.losses.logprobs``),
so every strategy parallelises it exactly as it does a language model (FSDP units per decoder
layer, the LM head read inside the root's forward), the policy and a frozen reference alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from lit_ablate.errors import ConfigError
from lit_ablate.models.attention.backends import ATTENTION_KEY
from lit_ablate.models.attention.prefix_sharing import MASK_BACKENDS, prefix_sharing_mask
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX


class PairStep(NamedTuple):
    """One micro-batch of preference pairs, whichever backend computed it: the differentiable sum
    of its pair losses and, per pair, the policy's (detached) log-probs and implicit rewards."""

    loss_sum: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


class SequenceLogProbs(CausalLMWithLoss):
    """``forward(batch) -> (logps [S], response_tokens [S])`` over a preference batch's sequences.

    ``logps[s]`` is the fp32 sum of the label log-probabilities of sequence ``s``'s response
    tokens (EOS included), ``response_tokens[s]`` their count; sequences are numbered by the
    batch's ``sequence_ids`` (``2 * num_pairs`` of them: chosen ``0..P-1``, rejected ``P..2P-1``),
    so padded, packed and prefix-shared batches reduce alike. ``hidden_only=True`` returns the last
    hidden states ``[B, T, H]`` instead (a frozen reference feeding a fused loss that takes hidden
    states, ``lit_ablate.models.losses.liger_dpo``).
    """

    def forward(self, batch: dict[str, Any], hidden_only: bool = False) -> tuple[Tensor, Tensor] | Tensor:
        if batch.get("branch_ids") is not None:
            backend = self.lm.config._attn_implementation
            if backend not in MASK_BACKENDS:
                raise ConfigError(
                    ATTENTION_KEY,
                    backend,
                    f"prefix sharing needs an attention backend that takes its "
                    f"branch mask: use one of {MASK_BACKENDS}, or prefix_sharing: false",
                )
            batch = {**batch, "attention_mask": prefix_sharing_mask(batch["position_ids"], batch["branch_ids"])}
        hidden = self.hidden_states(batch)
        if hidden_only:
            return hidden
        return self.head_outputs(hidden, batch)

    def head_outputs(self, hidden: Tensor, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """``(logps, response_tokens)`` of the batch's sequences from the decoder's last hidden states."""
        head = self.lm.get_output_embeddings()
        labels = batch["labels"].reshape(-1)
        per_token = self.loss_fn(hidden.reshape(-1, hidden.shape[-1]), head.weight, labels, head.bias)
        sequences = batch["sequence_ids"].reshape(-1)
        count = 2 * int(batch["num_pairs"])
        logps = per_token.new_zeros(count).index_add(0, sequences, per_token)
        tokens = torch.zeros(count, dtype=torch.long, device=labels.device).index_add(
            0, sequences, (labels != IGNORE_INDEX).long()
        )
        return logps, tokens

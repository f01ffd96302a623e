"""Per-token log-probability backends for preference training, chosen by config (``model.init_args.logprobs``).

DPO needs, for every response token, ``log p(label | prefix)`` under the policy and the reference,
with gradients for the policy. Every backend takes the final hidden states, the LM-head weight
(and bias) and labels that are already shifted (``labels[i]`` is the target of position ``i``,
``-100`` = not a response token) and returns an fp32 ``[N]`` tensor: the label's log-probability
at counted positions, exactly 0 elsewhere. Sequence sums are the caller's (``SequenceLogProbs``).

- ``torch``: full ``[tokens, vocab]`` logits in fp32, then ``-cross_entropy(reduction="none")``.
  The reference, and what TRL computes.
- ``chunked``: never holds ``[tokens, vocab]`` logits (see ``chunked_label_logprobs``).

Liger-Kernel's fused linear DPO fuses the loss into the LM head (one padded ``[chosen; rejected]``
batch, its own loss formulas), so it does not fit this per-token contract: it is the ``liger``
choice of the same key, built by ``lit_ablate.models.losses.liger_dpo`` (``FUSED_BACKENDS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.chunked_cross_entropy import IGNORE_INDEX, ChunkGradients, chunked_lse
from lit_ablate.models.losses.cross_entropy import named_class

LOGPROBS_KEY = "model.init_args.logprobs"
LOGPROBS_OPTIONS_KEY = "model.init_args.logprobs_options"


class LogProbBackend(Protocol):
    """``(hidden [N, H], weight [V, H], labels [N], bias [V] | None) -> fp32 [N]`` (0 where label is -100)."""

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor: ...


@dataclass(frozen=True)
class TorchLogProbs:
    """The reference: full fp32 logits, log-softmax at the label. Memory grows with tokens x vocab
    (the fp32 logits, their log-softmax kept for backward, and the gradient of the logits)."""

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        logits = F.linear(hidden, weight, bias).float()
        return -F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


@dataclass(frozen=True)
class ChunkedLogProbs:
    """Label log-probs over token (and vocabulary) chunks with an fp32 log-sum-exp; never holds
    ``[tokens, vocab]`` logits, in forward or backward. Pure torch: runs on any device.

    Choose it when tokens x vocab is large (long pairs, big vocabularies): extra memory is about
    ``chunk_tokens x chunk_vocab x 4`` bytes plus an fp32 weight-gradient accumulator when the
    weights are lower precision. It costs one more logits matmul per chunk than ``torch`` (the
    backward recomputes each chunk's logits: per-token gradients are only known then).

    Args:
        chunk_tokens: tokens per chunk.
        chunk_vocab: vocabulary columns per chunk (None: the whole vocabulary at once).
    """

    chunk_tokens: int = 1024
    chunk_vocab: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ConfigError(
                f"{LOGPROBS_OPTIONS_KEY}.chunk_tokens", self.chunk_tokens, "use a positive number of tokens, e.g. 1024"
            )
        if self.chunk_vocab is not None and self.chunk_vocab < 1:
            raise ConfigError(
                f"{LOGPROBS_OPTIONS_KEY}.chunk_vocab", self.chunk_vocab, "use a positive column count or null"
            )

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        return chunked_label_logprobs(hidden, weight, labels, bias, self.chunk_tokens, self.chunk_vocab)


def chunked_label_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
) -> Tensor:
    """fp32 ``[N]``: ``logit[label] - logsumexp(logits)`` per counted position, 0 elsewhere.

    Written by hand (no maintained pure-torch library offers it): the forward keeps only the
    ``[N]`` log-sum-exp; the backward recomputes each chunk's logits and accumulates
    ``d logp_t / d logits_t = onehot(label_t) - softmax_t`` times the incoming per-token gradient
    into the hidden, weight and bias gradients (``chunked_cross_entropy``'s accumulators, with the
    signs of a log-probability instead of a loss).
    """
    vocab = weight.shape[0]
    counted = labels != IGNORE_INDEX
    torch._assert_async(((labels >= 0) & (labels < vocab) | ~counted).all(), "log-probs: a label is outside [0, vocab)")
    return _ChunkedLabelLogProbs.apply(hidden, weight, bias, labels, chunk_tokens, chunk_vocab or vocab)


class _ChunkedLabelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        chunk_tokens: int,
        chunk_vocab: int,
    ) -> Tensor:
        lse, target = chunked_lse(hidden, weight, bias, labels, chunk_tokens, chunk_vocab)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk_tokens, ctx.chunk_vocab = chunk_tokens, chunk_vocab
        return torch.where(labels != IGNORE_INDEX, target - lse, 0.0)

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        grads = ChunkGradients(hidden, weight, bias, ctx.needs_input_grad[:3])
        # d logp / d logits = onehot - softmax: the cross-entropy gradient with both scales negated.
        scale = -(grad_logprobs.float() * (labels != IGNORE_INDEX))
        grads.add_every_token(hidden, weight, bias, labels, lse, (scale, scale), ctx.chunk_tokens, ctx.chunk_vocab)
        return (*grads.finished(None), None, None, None)


LOGPROB_BACKENDS: dict[str, type[LogProbBackend]] = {"torch": TorchLogProbs, "chunked": ChunkedLogProbs}
FUSED_BACKENDS = ("liger",)
"""Choices of the same key that fuse the loss too (``lit_ablate.models.losses.liger_dpo``), not per-token backends."""


def logprob_backend(name: str, **options: Any) -> LogProbBackend:
    """Build backend ``name`` with its options; unknown names or options raise ``ConfigError``."""
    keys = {"key": LOGPROBS_KEY, "options_key": LOGPROBS_OPTIONS_KEY}
    return named_class(LOGPROB_BACKENDS, name, options, **keys, other_choices=FUSED_BACKENDS)(**options)

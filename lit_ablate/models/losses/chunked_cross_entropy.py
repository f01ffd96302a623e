"""Linear + cross-entropy over token (and optionally vocabulary) chunks, in pure torch.

Written by hand because no maintained pure-torch library offers it: Liger and CCE need Triton
and CUDA, and a plain loop over chunks under autograd would keep every chunk's logits for the
backward. Here an ``autograd.Function`` never keeps more than one chunk of logits alive. For
each token chunk the forward computes the logits, reduces them to the fp32 log-sum-exp and the
target logit, then drops them. The gradients come from the same chunk logits, formed either

* in the forward (``grad_in_forward=True``, as Liger does): while the chunk's logits exist, their
  share of ``grad_hidden`` and ``grad_weight`` is accumulated; the backward only scales the
  result by the incoming gradient. Three ``[chunk, H] x [H, vocab]`` matmuls per chunk, as torch.
* in the backward (``grad_in_forward=False``): the forward keeps only the ``[N]`` log-sum-exp and
  the backward recomputes each chunk's logits. Four matmuls per chunk, but nothing beyond the
  log-sum-exp is held between forward and backward (useful when several forwards precede one
  backward).

With vocabulary chunks a row's log-sum-exp is only known after all its vocabulary chunks, so the
gradient pass recomputes the logits in both modes.

Public building blocks (also used by ``lit_ablate.models.losses.logprobs``' chunked label log-probs, whose
gradient is this one with the signs of a log-probability): ``chunk_logits``, ``target_in_chunk``
and ``ChunkGradients``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    z_loss_weight: float = 0.0,
    grad_in_forward: bool = True,
) -> Tensor:
    """fp32 sum over counted tokens of ``CE + z_loss_weight * logsumexp^2`` (``-100`` ignored).

    Args:
        hidden: ``[N, H]`` final hidden states.
        weight: ``[V, H]`` LM-head weight; ``bias``: ``[V]`` or None.
        labels: ``[N]`` target ids, already shifted.
        chunk_tokens: tokens per chunk; one chunk's logits are ``chunk_tokens x chunk_vocab`` fp32.
        chunk_vocab: vocabulary columns per chunk (None: the whole vocabulary at once).
        z_loss_weight: weight of the z-loss term ``logsumexp(logits)^2`` per counted token.
        grad_in_forward: form the gradients during the forward (see the module docstring).
    """
    vocab = weight.shape[0]
    counted = labels != IGNORE_INDEX
    in_range = (labels >= 0) & (labels < vocab)
    # Asynchronous on CUDA, so a correct run pays no host sync for the check.
    torch._assert_async((in_range | ~counted).all(), "chunked cross-entropy: a label is outside [0, vocab)")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _ChunkedLinearCrossEntropy.apply(
        hidden,
        weight,
        bias,
        labels,
        chunk_tokens,
        chunk_vocab or vocab,
        z_loss_weight,
        grad_in_forward and needs_grad,
    )


def chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, v0: int, v1: int) -> Tensor:
    """fp32 logits of vocabulary columns ``[v0, v1)`` for ``hidden`` ``[n, H]``: ``[n, v1 - v0]``.

    Rounded like the torch reference (matmul in the input dtype, then fp32), so chunked and full
    logits agree bit for bit per element."""
    return F.linear(hidden, weight[v0:v1], None if bias is None else bias[v0:v1]).float()


def target_in_chunk(labels: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """``(column [n, 1], inside [n])``: each row's target column inside vocab chunk ``[v0, v1)``
    (clamped into it, so it can always be gathered) and whether the target really is in the chunk
    (multiply gathered values by ``inside``). Labels of ``-100`` are never inside."""
    inside = (labels >= v0) & (labels < v1)
    return (labels - v0).clamp(0, v1 - v0 - 1).unsqueeze(1), inside


def token_chunk_lse(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk_vocab: int, keep_softmax: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(lse [n], target logit [n], softmax [n, V] or None)`` of one token chunk ``hidden`` ``[n, H]``,
    with one vocabulary chunk of fp32 logits alive at a time. ``keep_softmax`` (only meaningful when
    one chunk spans the whole vocabulary) returns that chunk's softmax, made in the logits' buffer."""
    vocab = weight.shape[0]
    lse = torch.full((hidden.shape[0],), float("-inf"), dtype=torch.float32, device=hidden.device)
    target = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    softmax = None
    for v0 in range(0, vocab, chunk_vocab):
        v1 = min(v0 + chunk_vocab, vocab)
        logits = chunk_logits(hidden, weight, bias, v0, v1)
        column, inside = target_in_chunk(labels, v0, v1)
        target += logits.gather(1, column).squeeze(1) * inside
        # exp(logits - row max) in place: no second [chunk, vocab] buffer.
        row_max = logits.amax(dim=1)
        exp_shifted = logits.sub_(row_max[:, None]).exp_()
        lse = torch.logaddexp(lse, exp_shifted.sum(dim=1).log_().add_(row_max))
        softmax = exp_shifted.mul_((row_max - lse).exp_()[:, None]) if keep_softmax else None
        del logits, exp_shifted  # before the next chunk's logits exist
    return lse, target, softmax


def chunked_lse(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk_tokens: int, chunk_vocab: int
) -> tuple[Tensor, Tensor]:
    """``(lse [N], target logit [N])`` of every token, ``chunk_tokens`` at a time (``token_chunk_lse``)."""
    n_tokens = hidden.shape[0]
    lse = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    target = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    for t0 in range(0, n_tokens, chunk_tokens):
        t1 = min(t0 + chunk_tokens, n_tokens)
        lse[t0:t1], target[t0:t1], _ = token_chunk_lse(hidden[t0:t1], weight, bias, labels[t0:t1], chunk_vocab)
    return lse, target


def _add_matmul(accumulator: Tensor, a: Tensor, b: Tensor) -> None:
    """``accumulator += a @ b``; in place when dtypes agree, else via one product (fp32 sums of bf16)."""
    if accumulator.dtype == a.dtype:
        accumulator.addmm_(a, b)
    else:
        accumulator.add_(a @ b)


class ChunkGradients:
    """Gradient accumulators of ``hidden``, ``weight`` and ``bias`` for a loss whose gradient with
    respect to a token's logits is ``softmax_scale * softmax - row_scale * onehot(label)``.

    Cross-entropy uses ``softmax_scale = row_scale = grad`` per counted token; a label
    log-probability uses both scales negated. Feed every token chunk once (``add_token_chunk``),
    then take the gradients (``finished``). Accumulators are fp32 where the inputs are lower
    precision. ``needs`` says which of the three inputs need a gradient (autograd's
    ``ctx.needs_input_grad``)."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, needs: tuple[bool, ...]) -> None:
        self.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        # fp32 sums across token chunks; bf16 sums would round once per chunk.
        self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        self.bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs[2] else None

    def add_token_chunk(
        self,
        probs: Tensor | None,
        h: Tensor,
        t0: int,
        t1: int,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        lse: Tensor,
        row_scale: Tensor,
        softmax_scale: Tensor,
        chunk_vocab: int,
    ) -> None:
        """Add token chunk ``[t0, t1)``'s gradients; ``probs`` is its softmax when one vocab chunk
        covers the vocabulary and the caller still has it (else the logits are recomputed)."""
        vocab = weight.shape[0]
        grad_h = None
        if self.hidden is not None:
            grad_h = (
                self.hidden[t0:t1].zero_()
                if self.hidden.dtype == torch.float32
                else torch.zeros(t1 - t0, h.shape[1], dtype=torch.float32, device=h.device)
            )
        for v0 in range(0, vocab, chunk_vocab):
            v1 = min(v0 + chunk_vocab, vocab)
            if probs is None:
                probs = chunk_logits(h, weight, bias, v0, v1).sub_(lse[:, None]).exp_()
            # d loss / d logits = (1 + 2 z lse) * softmax - onehot(target), per counted row.
            grad_logits = probs.mul_(softmax_scale[:, None])
            column, inside = target_in_chunk(labels, v0, v1)
            grad_logits.scatter_add_(1, column, (-row_scale * inside).unsqueeze(1))
            if self.bias is not None:
                self.bias[v0:v1] += grad_logits.sum(dim=0)
            grad_logits = grad_logits.to(h.dtype)
            if grad_h is not None:
                _add_matmul(grad_h, grad_logits, weight[v0:v1])
            if self.weight is not None:
                _add_matmul(self.weight[v0:v1], grad_logits.t(), h)
            probs = grad_logits = None  # free this chunk before the next chunk's logits exist
        if grad_h is not None and grad_h.dtype != self.hidden.dtype:
            self.hidden[t0:t1] = grad_h

    def add_every_token(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        lse: Tensor,
        scales: tuple[Tensor, Tensor],
        chunk_tokens: int,
        chunk_vocab: int,
    ) -> None:
        """``add_token_chunk`` over every token, ``chunk_tokens`` at a time, each chunk's logits
        recomputed; ``scales`` is ``(row_scale, softmax_scale)`` of every token."""
        for t0 in range(0, hidden.shape[0], chunk_tokens):
            t1 = min(t0 + chunk_tokens, hidden.shape[0])
            chunk = (s[t0:t1] for s in (hidden, labels, lse, *scales))
            h, chunk_labels, chunk_lse, row_scale, softmax_scale = chunk
            self.add_token_chunk(
                None, h, t0, t1, weight, bias, chunk_labels, chunk_lse, row_scale, softmax_scale, chunk_vocab
            )

    def finished(self, grad_loss: Tensor | None) -> tuple[Tensor | None, ...]:
        """The gradients in the inputs' dtypes, times ``grad_loss`` if given (in place)."""
        grads = (self.hidden, self.weight, self.bias)
        if grad_loss is not None:
            grads = tuple(None if g is None else g.mul_(grad_loss) for g in grads)
        return tuple(None if g is None else g.to(dtype) for g, dtype in zip(grads, self.dtypes))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        chunk_tokens: int,
        chunk_vocab: int,
        z_loss_weight: float,
        grad_in_forward: bool,
    ) -> Tensor:
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        counted = labels != IGNORE_INDEX
        lse = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        target_logit = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        grads = ChunkGradients(hidden, weight, bias, ctx.needs_input_grad[:3]) if grad_in_forward else None
        # One vocab chunk and gradients now: its softmax is still at hand, no recompute needed.
        keep_softmax = grads is not None and chunk_vocab >= vocab
        for t0 in range(0, n_tokens, chunk_tokens):
            t1 = min(t0 + chunk_tokens, n_tokens)
            lse_c, target_logit[t0:t1], softmax = token_chunk_lse(
                hidden[t0:t1], weight, bias, labels[t0:t1], chunk_vocab, keep_softmax
            )
            lse[t0:t1] = lse_c
            if grads is not None:
                scales = row_scales(counted[t0:t1], lse_c, z_loss_weight, torch.ones((), device=hidden.device))
                grads.add_token_chunk(
                    softmax, hidden[t0:t1], t0, t1, weight, bias, labels[t0:t1], lse_c, *scales, chunk_vocab
                )
            del softmax
        per_token = lse - target_logit
        if z_loss_weight:
            per_token = per_token + z_loss_weight * lse.square()
        ctx.grad_in_forward, ctx.grads = grad_in_forward, grads
        if not grad_in_forward:
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk_tokens, ctx.chunk_vocab, ctx.z_loss_weight = chunk_tokens, chunk_vocab, z_loss_weight
        return torch.where(counted, per_token, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        not_differentiable = (None,) * 5  # labels, chunk_tokens, chunk_vocab, z_loss_weight, grad_in_forward
        if ctx.grad_in_forward:
            if ctx.grads is None:
                raise RuntimeError(
                    "chunked cross-entropy with grad_in_forward runs backward once; "
                    "for retain_graph set the loss option grad_in_forward: false"
                )
            grads, ctx.grads = ctx.grads, None
            return (*grads.finished(grad_loss), *not_differentiable)
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        grads = ChunkGradients(hidden, weight, bias, ctx.needs_input_grad[:3])
        scales = row_scales(labels != IGNORE_INDEX, lse, ctx.z_loss_weight, grad_loss)
        grads.add_every_token(hidden, weight, bias, labels, lse, scales, ctx.chunk_tokens, ctx.chunk_vocab)
        return (*grads.finished(None), *not_differentiable)


def row_scales(counted: Tensor, lse: Tensor, z_loss_weight: float, grad_loss: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: the onehot's scale (``grad_loss`` if counted, else 0) and the softmax's
    (that times ``1 + 2 z lse``, the z-loss derivative)."""
    row_scale = counted.float() * grad_loss.float()
    return row_scale, row_scale * (1.0 + 2.0 * z_loss_weight * lse)

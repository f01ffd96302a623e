"""Log-probability backends for DPO: ``chunked`` against the ``torch`` reference.

Values and gradients (hidden, weight, bias) under a per-token backward seed that differs from
token to token, as a DPO loss gives (each sequence's tokens get their pair's gradient, with
opposite signs for chosen and rejected). fp32 within 1e-5 relative (max abs difference over max
abs value). Breaking the chunked backward on purpose (a softmax scale of ``+g`` instead of
``-g``, i.e. the cross-entropy sign) fails ``test_chunked_matches_torch`` on every gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.models.losses.logprobs import ChunkedLogProbs, TorchLogProbs, logprob_backend

FP32_RTOL = 1e-5


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def make_inputs(tokens: int, vocab: int, hidden: int, bias: bool = False, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[torch.rand(tokens, generator=generator) < 0.3] = IGNORE_INDEX
    return {
        "hidden": torch.randn(tokens, hidden, generator=generator).requires_grad_(),
        "weight": (torch.randn(vocab, hidden, generator=generator) * 0.5).requires_grad_(),
        "labels": labels,
        "bias": torch.randn(vocab, generator=generator).requires_grad_() if bias else None,
        "seed": torch.randn(tokens, generator=generator),  # d loss / d logp_t, different per token
    }


def values_and_grads(backend, inputs: dict) -> list[torch.Tensor]:
    logps = backend(inputs["hidden"], inputs["weight"], inputs["labels"], inputs["bias"])
    wrt = [inputs[k] for k in ("hidden", "weight", "bias") if inputs[k] is not None]
    return [logps.detach(), *torch.autograd.grad(logps, wrt, grad_outputs=inputs["seed"])]


@pytest.mark.parametrize("chunk_tokens,chunk_vocab,bias", [(7, None, False), (16, 40, True), (1024, None, True)])
def test_chunked_matches_torch(chunk_tokens: int, chunk_vocab: int | None, bias: bool) -> None:
    """Token chunks that do not divide the tokens, vocabulary chunks that do not divide the vocabulary."""
    inputs = make_inputs(61, 203, 24, bias=bias)
    reference = values_and_grads(TorchLogProbs(), inputs)
    chunked = values_and_grads(ChunkedLogProbs(chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab), inputs)
    for name, got, want in zip(["logps", "d hidden", "d weight", "d bias"], chunked, reference):
        assert relative_error(got, want) <= FP32_RTOL, name
    ignored = inputs["labels"] == IGNORE_INDEX
    assert ignored.any() and (chunked[0][ignored] == 0).all() and (chunked[0][~ignored] < 0).all()


def peak_bytes(backend, inputs: dict) -> int:
    """Peak tensor bytes one forward + backward allocates above its inputs (MemTracker, CPU)."""
    tracker = MemTracker()
    tracker.track_external(inputs["hidden"], inputs["weight"], inputs["labels"], inputs["seed"])
    cpu = torch.device("cpu")
    with tracker:
        before = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        logps = backend(inputs["hidden"], inputs["weight"], inputs["labels"])
        logps.backward(inputs["seed"])
    return tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before


def test_chunked_never_holds_full_logits() -> None:
    """The chunked peak stays below a quarter of one ``[tokens, vocab]`` fp32 buffer; torch's is
    at least two of them (logits and their log-softmax or gradient)."""
    tokens, vocab, hidden, chunk = 512, 8192, 16, 32
    logits_bytes = tokens * vocab * 4
    assert peak_bytes(TorchLogProbs(), make_inputs(tokens, vocab, hidden)) >= 2 * logits_bytes
    chunked_peak = peak_bytes(ChunkedLogProbs(chunk_tokens=chunk), make_inputs(tokens, vocab, hidden))
    grads_bytes = (vocab + tokens) * hidden * 4
    assert chunked_peak <= 3 * chunk * vocab * 4 + grads_bytes + 64 * 1024
    assert chunked_peak < logits_bytes / 4


def test_backend_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"logprobs=.*choose one of"):
        logprob_backend("fused")
    with pytest.raises(ConfigError, match="takes no option"):
        logprob_backend("torch", chunk_tokens=4)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        logprob_backend("chunked", chunk_tokens=0)

"""Attention backends keep packed documents apart: a packed row computes what each document alone does.

Tolerance: fp32 logits agree to atol 2e-5 (the same math under different masks and kernels;
observed differences are ~1e-6).
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
import torch.nn.functional as F

from lit_ablate.errors import ConfigError
from lit_ablate.models.attention import backends as attention
from lit_ablate.models.attention.backends import (
    check_attention_backend,
    cu_seqlens_from_position_ids,
    document_causal_mask,
)
from lit_ablate.models.factory import ModelFactory

ATOL = 2e-5
FORWARD_ON_CPU = ["sdpa", "eager", "sdpa_packed", "flex"]
LENGTHS = (7, 12, 5)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(attn: str, preset: str = "tiny-llama", device: str = "cpu"):
    torch.manual_seed(0)
    return ModelFactory(preset=preset, attn_implementation=attn).build().to(device).eval()


def _documents(lengths=LENGTHS, seed: int = 1, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 259, (n,), generator=generator).to(device) for n in lengths]


def _packed_logits(model, docs: list[torch.Tensor], **kwargs) -> torch.Tensor:
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d), device=ids.device) for d in docs])[None]
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions, use_cache=False, **kwargs).logits[0]


def _alone_logits(model, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=d[None], use_cache=False).logits[0] for d in docs]


def _split(logits: torch.Tensor, lengths) -> list[torch.Tensor]:
    return list(logits.split(list(lengths)))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("attn", FORWARD_ON_CPU)
def test_packed_row_logits_equal_each_document_alone(attn, preset):
    model, docs = _model(attn, preset), _documents()
    for packed, alone in zip(_split(_packed_logits(model, docs), LENGTHS), _alone_logits(model, docs)):
        torch.testing.assert_close(packed, alone, rtol=0, atol=ATOL)


@pytest.mark.parametrize("attn", FORWARD_ON_CPU)
def test_changing_one_document_never_changes_another(attn):
    model, docs = _model(attn), _documents()
    reference = _split(_packed_logits(model, docs), LENGTHS)
    changed = [_documents((11,), seed=9)[0], docs[1], docs[2]]  # other tokens and another length
    after = _split(_packed_logits(model, changed), (11, *LENGTHS[1:]))
    assert not torch.allclose(after[0][:5], reference[0][:5], atol=1e-3)  # the change is real
    torch.testing.assert_close(after[1], reference[1], rtol=0, atol=ATOL)
    torch.testing.assert_close(after[2], reference[2], rtol=0, atol=ATOL)


@pytest.mark.parametrize("side", ["right", "left"])
def test_sdpa_packed_padded_batch_matches_transformers_sdpa(side):
    docs = _documents((9, 4))
    ids = torch.full((2, 9), 256)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for row, d in enumerate(docs):
        cols = slice(0, len(d)) if side == "right" else slice(9 - len(d), 9)
        ids[row, cols], mask[row, cols] = d, 1
    with torch.no_grad():
        ours = _model("sdpa_packed")(input_ids=ids, attention_mask=mask, use_cache=False).logits
        reference = _model("sdpa")(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.isfinite(ours).all()
    real = mask.bool()
    torch.testing.assert_close(ours[real], reference[real], rtol=0, atol=ATOL)


def test_sdpa_packed_keeps_documents_apart_even_with_a_kv_cache():
    """transformers derives documents from position_ids only without a cache (docs/platform.md);
    sdpa_packed builds its mask itself, so a cache changes nothing."""
    model, docs = _model("sdpa_packed"), _documents()
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        cached = model(input_ids=ids, position_ids=positions, use_cache=True).logits[0]
    for packed, alone in zip(_split(cached, LENGTHS), _alone_logits(model, docs)):
        torch.testing.assert_close(packed, alone, rtol=0, atol=ATOL)


def test_sdpa_packed_greedy_generation_matches_sdpa():
    prompt = _documents((6,))[0][None]
    ours = _model("sdpa_packed").generate(prompt, max_new_tokens=5, do_sample=False)
    reference = _model("sdpa").generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(ours, reference)


def test_document_causal_mask_is_block_diagonal_and_causal():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_causal_mask(positions, None, batch=1, q_len=6, kv_len=6)[0, 0]
    docs = torch.tensor([0, 0, 0, 1, 1, 2])
    expected = (docs[:, None] == docs[None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)


def _segment_attention(q, k, v, cu_q, cu_k, max_q, causal, scale, enable_gqa):
    """Attention per segment of the flat ``[T, H, D]`` tokens in plain torch, checking the segments."""
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and max_q == int(cu_q.diff().max())
    out = torch.empty_like(q)
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        segment = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*segment, is_causal=causal, scale=scale, enable_gqa=enable_gqa)[
            0
        ].transpose(0, 1)
    return out


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=True):
    """flash-attn's varlen contract in plain torch: causal SDPA per segment of the flat tokens."""
    return _segment_attention(q, k, v, cu_q, cu_k, max_q, causal, softmax_scale, enable_gqa=True)


def _torch_varlen_is_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's ``varlen_attn``: ``is_causal``; no ``scale`` (always 1/sqrt(D)) and no GQA."""
    assert query.shape[1] == key.shape[1] == value.shape[1], "as many K/V heads as query heads"
    return _segment_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, is_causal, None, enable_gqa=False)


def _torch_varlen_window(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    seqused_k=None,
):
    """A later ``varlen_attn``: ``scale``, causal only as ``window_size == (-1, 0)``; no GQA."""
    assert query.shape[1] == key.shape[1] == value.shape[1], "as many K/V heads as query heads"
    assert window_size in ((-1, -1), (-1, 0)), "no sliding window here"
    return _segment_attention(
        query, key, value, cu_seq_q, cu_seq_k, max_q, window_size == (-1, 0), scale, enable_gqa=False
    )


def _torch_varlen_window_gqa(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """torch 2.13's ``varlen_attn``: ``scale``, causal as ``window_size == (-1, 0)``, ``enable_gqa``."""
    assert enable_gqa or query.shape[1] == key.shape[1], "fewer K/V heads need enable_gqa"
    assert window_size in ((-1, -1), (-1, 0)), "no sliding window here"
    return _segment_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, window_size == (-1, 0), scale, enable_gqa)


TORCH_VARLEN_SIGNATURES = {
    "is_causal": _torch_varlen_is_causal,
    "window": _torch_varlen_window,
    "window_gqa": _torch_varlen_window_gqa,
}
"""Stand-ins for torch's ``varlen_attn`` (CUDA only) with each signature it has had, strict about
their arguments as the real ones are (an unknown keyword is a TypeError)."""


def test_fa_varlen_plumbing_with_a_reference_kernel(monkeypatch):
    """Runs fa_varlen's flattening, segmenting and unpadding on CPU, with flash-attn's kernel
    swapped for a plain-torch one of the same contract (the kernel itself is GPU-only)."""
    monkeypatch.setattr(attention, "varlen_kernel", lambda: _reference_varlen)
    model, docs = _model("fa_varlen"), _documents()
    alone = _alone_logits(model, docs)
    for packed, single in zip(_split(_packed_logits(model, docs), LENGTHS), alone):  # from position_ids
        torch.testing.assert_close(packed, single, rtol=0, atol=ATOL)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(positions)
    assert cu_seqlens.tolist() == [0, 7, 19, 24] and max_seqlen == 12
    given = _packed_logits(
        model, docs, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=12, max_length_k=12
    )
    torch.testing.assert_close(given, torch.cat(alone), rtol=0, atol=ATOL)
    ids, mask = torch.full((2, 12), 256), torch.zeros(2, 12, dtype=torch.long)  # a padded batch
    for row, d in enumerate(docs[:2]):
        ids[row, : len(d)], mask[row, : len(d)] = d, 1
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(padded[mask.bool()], torch.cat(alone[:2]), rtol=0, atol=ATOL)


def test_fa_varlen_takes_the_packers_segments_from_the_batch(monkeypatch):
    """A packed batch's ``cu_seqlens`` reach the kernel as given (no recomputation from positions),
    and the loss equals sdpa_packed's."""
    from lit_ablate.data import PackingCollator
    from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
    from lit_ablate.models.losses.cross_entropy import loss_backend

    seen = []

    def spying_kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.append((cu_q, max_q))
        return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    monkeypatch.setattr(attention, "varlen_kernel", lambda: spying_kernel)
    monkeypatch.setattr(attention, "cu_seqlens_from_position_ids", lambda *a: pytest.fail("recomputed segments"))
    collator = PackingCollator(max_tokens=16, static_shape=True)
    collator.bind(pad_id=256, seq_len=16)
    docs = _documents()
    example = [{"input_ids": d, "labels": d.roll(-1)} for d in docs]  # lengths 7, 12, 5
    batch = collator([[example[0], example[2]], [example[1]]])
    assert batch["cu_seqlens"].tolist() == [0, 7, 12, 16, 28, 32]  # rows padded to 16: padding is its own segment
    losses = {}
    for attn in ("fa_varlen", "sdpa_packed"):
        torch.manual_seed(0)
        model = CausalLMWithLoss(
            ModelFactory(preset="tiny-llama", attn_implementation=attn).build(), loss_backend("torch")
        )
        with torch.no_grad():
            losses[attn] = model(batch)[0]
    assert seen and all(cu is batch["cu_seqlens"] and m == batch["max_seqlen"] for cu, m in seen)
    torch.testing.assert_close(losses["fa_varlen"], losses["sdpa_packed"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("signature", list(TORCH_VARLEN_SIGNATURES))
def test_torch_varlen_glue_equals_sdpa_packed(monkeypatch, signature):
    """``torch_varlen``'s glue through each signature torch's kernel has had, against ``sdpa_packed``:
    outputs and the gradients of q, k, v, with fewer K/V heads (GQA) and a non-default scaling, on
    unequal documents packed in two rows (segments from ``position_ids``, then as given) and on a
    right-padded batch (padding dropped before the kernel, zeros after). Seen failing (by hand, once
    each): K/V heads tiled (``repeat``) instead of interleaved (3.1, the signatures without GQA);
    causal dropped (``window_size=(-1, -1)`` / ``is_causal=False``: 3.1, every signature); the
    scaling left out where the kernel takes no ``scale`` (0.23)."""
    monkeypatch.setattr(attention, "torch_varlen_kernel", lambda: TORCH_VARLEN_SIGNATURES[signature])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 16, 8, generator=gen),
        torch.randn(2, 2, 16, 8, generator=gen),
        torch.randn(2, 2, 16, 8, generator=gen),
    )
    cotangent = torch.randn(2, 16, 4, 8, generator=gen)
    rows = ((7, 5, 4), (3, 13))
    positions = torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in rows])
    cu_seqlens, longest = cu_seqlens_from_position_ids(positions)
    padding = (torch.arange(16)[None] < torch.tensor([[11], [16]])).long()
    cases = {
        "positions": ({"position_ids": positions}, None),
        "given segments": ({"position_ids": positions, "cu_seq_lens_q": cu_seqlens, "max_length_q": longest}, None),
        "padded": ({}, padding),
    }
    for case, (inputs, mask) in cases.items():
        results = []
        for backend in (attention.torch_varlen_attention, attention.sdpa_packed_attention):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = backend(None, *leaves, mask, scaling=0.3, **inputs)[0]
            real = torch.ones(2, 16, dtype=torch.bool) if mask is None else mask.bool()
            (out * cotangent)[real].sum().backward()
            results.append([out.detach()[real], *(t.grad for t in leaves)])
        for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m, c=case, n=name: f"{c}, {n}: {m}")


@pytest.mark.parametrize("signature", ["is_causal", "window_gqa"])
def test_torch_varlen_trains_the_packers_batch_like_sdpa_packed(monkeypatch, signature):
    """A packed batch's ``cu_seqlens`` reach torch's kernel as given (tiny Qwen3: 4 query heads, 2
    K/V heads), and the loss and every gradient equal ``sdpa_packed``'s. Seen failing with
    ``torch_varlen`` left out of the backends that take the batch's segments (segments recomputed)."""
    from lit_ablate.data import PackingCollator
    from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
    from lit_ablate.models.losses.cross_entropy import loss_backend

    seen = []

    def spying_kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.append((cu_q, max_q))
        return TORCH_VARLEN_SIGNATURES[signature](q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    spying_kernel.__signature__ = inspect.signature(TORCH_VARLEN_SIGNATURES[signature])
    monkeypatch.setattr(attention, "torch_varlen_kernel", lambda: spying_kernel)
    monkeypatch.setattr(attention, "cu_seqlens_from_position_ids", lambda *a: pytest.fail("recomputed segments"))
    collator = PackingCollator(max_tokens=16, static_shape=True)
    collator.bind(pad_id=256, seq_len=16)
    example = [{"input_ids": d, "labels": d.roll(-1)} for d in _documents()]  # lengths 7, 12, 5
    batch = collator([[example[0], example[2]], [example[1]]])
    results = {}
    for attn in ("torch_varlen", "sdpa_packed"):
        torch.manual_seed(0)
        model = CausalLMWithLoss(
            ModelFactory(preset="tiny-qwen3", attn_implementation=attn).build(), loss_backend("torch")
        )
        loss = model(batch)[0]
        loss.backward()
        results[attn] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert seen and all(cu is batch["cu_seqlens"] and m == batch["max_seqlen"] for cu, m in seen)
    torch.testing.assert_close(results["torch_varlen"][0], results["sdpa_packed"][0], rtol=1e-5, atol=0)
    for name, grad in results["torch_varlen"][1].items():  # a summed loss: gradients up to ~8, differences 5.3e-6 seen
        torch.testing.assert_close(grad, results["sdpa_packed"][1][name], rtol=1e-4, atol=2e-5, msg=name)


def test_torch_varlen_is_refused_where_it_cannot_train(monkeypatch):
    if not torch.cuda.is_available():
        with pytest.raises(
            ConfigError,
            match=r"'torch_varlen': torch's varlen attention runs flash kernels on CUDA only; "
            r"on CPU use sdpa_packed$",
        ):
            check_attention_backend("torch_varlen", training=True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch.nn.attention.varlen" else find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"has no torch\.nn\.attention\.varlen \(torch 2\.10\+\)"):
        check_attention_backend("torch_varlen", training=True)


def test_check_attention_backend_rejects_what_cannot_run_here():
    with pytest.raises(ConfigError, match=r"model\.init_args\.model\.attn_implementation='nope'"):
        check_attention_backend("nope", training=False)
    for name in ("sdpa", "eager", "sdpa_packed"):
        check_attention_backend(name, training=True)
    check_attention_backend("flex", training=False)  # the forward runs everywhere
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="flex attention trains only on CUDA"):
            check_attention_backend("flex", training=True)
        with pytest.raises(ConfigError, match="flash-attn varlen needs CUDA"):
            check_attention_backend("fa_varlen", training=True)
        for name in ("flash_attention_2", "flash_attention_3"):  # transformers' own: known, CUDA only
            with pytest.raises(ConfigError, match=f"transformers' {name} needs CUDA"):
                check_attention_backend(name, training=True)


GPU_TRAINING_BACKENDS = [
    "flex",
    pytest.param(
        "fa_varlen",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("flash_attn") is None, reason="needs the flash-attn package (not installed)"
        ),
    ),
    pytest.param(
        "torch_varlen",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("torch.nn.attention.varlen") is None,
            reason="needs torch.nn.attention.varlen (torch 2.10+)",
        ),
    ),
]
"""Backends whose training runs only on CUDA; one that needs a missing package skips with that reason
(``check_attention_backend`` would refuse it), so any other refusal on a GPU machine fails the test."""
VARLEN_BACKENDS = ("fa_varlen", "torch_varlen")
"""Flash kernels: bfloat16 or float16 only."""


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("attn", GPU_TRAINING_BACKENDS)
def test_gpu_backends_train_packed_like_separate_documents(attn):
    """Packed training on the real kernel against each document alone through fp32 ``sdpa``: within
    TF32 / fused-kernel rounding in fp32 (1e-3), bf16 rounding for the flash kernels (3e-2; on CPU
    ``sdpa_packed`` in bf16 lands within 8e-3 of the fp32 reference). Not yet measured on a GPU."""
    check_attention_backend(attn, training=True)
    docs = _documents(device="cuda")
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d), device="cuda") for d in docs])[None]
    model = _model(attn, device="cuda").train()
    if attn in VARLEN_BACKENDS:
        with pytest.raises(ConfigError, match=r"model\.init_args\.model\.dtype='float32'.*bfloat16 or float16 only"):
            model(input_ids=ids, position_ids=positions, use_cache=False)
        model = model.to(torch.bfloat16)
    packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    packed.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    reference = _model("sdpa", device="cuda")
    atol = 3e-2 if attn in VARLEN_BACKENDS else 1e-3
    for got, alone in zip(_split(packed.detach().float(), LENGTHS), _alone_logits(reference, docs)):
        torch.testing.assert_close(got, alone, rtol=0, atol=atol)

"""Context-parallel attention (``ring``, ``allgather``) equals one-process attention.

Each rank holds its shard (``contiguous`` or ``zigzag``) of the same random q/k/v (4 query heads,
2 key/value heads: GQA), runs the backend the way transformers calls it, and backpropagates its
shard of one random output gradient. Reassembled, the output and dQ, dK, dV must equal SDPA on
the whole sequence under lit-ablate's one-process mask (``attention.document_causal_mask``:
causal, per document, no padding keys), for three batches: one document per row, packed
documents whose boundaries fall inside chunks and across ranks, and a right-padded row.
Padding queries carry no label in training (their output gradient is zero here) and their
output is never read, so outputs and dQ are compared on real tokens, dK/dV everywhere.

Tolerance (fp32): ``ATOL = 2e-5``; measured differences are at most 1.5e-6 at 2 and 4 ranks (blocks
merged by log-sum-exp sum in another order). Seen failing with the technique broken on purpose (by hand, each once):
leaving a fully masked row's block log-sum-exp at the kernel's 0 instead of -inf (packed and
padded cases, outputs off by ~0.5); stopping the dK/dV ring one hop short of the owner (dK/dV off
by O(1), every ring case). ``test_a_wrong_merge_is_caught`` keeps the first break in the suite.
Giving zigzag's second chunk to the wrong rank (``SequenceLayout.chunks`` returning ``(r, cp + r)``)
keeps attention exact (any permutation of chunks does) and fails the balance test instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lit_ablate.models import block_attention as block_module
from lit_ablate.models.attention import document_causal_mask
from lit_ablate.models.chunk_masks import ChunkMasks
from lit_ablate.models.context_parallel_attention import (
    CONTEXT_PARALLEL_ATTRIBUTE,
    CONTEXT_PARALLEL_BACKENDS,
    ContextParallelGroup,
)
from lit_ablate.models.sequence_layout import SequenceLayout
from tests.distributed import run_ranks

B, H, HKV, T, D = 2, 4, 2, 48, 16
ATOL = 2e-5
IMPLS = ("ring", "allgather")
LAYOUTS = ("contiguous", "zigzag")
DOCUMENTS = {"one_document": [[48], [48]], "packed": [[5, 13, 20, 10], [30, 7, 11]], "padded": [[48], [48]]}
PADDED_ROW_LENGTH = 29  # row 1 of the padded case: 29 real tokens, then padding


def inputs(case: str) -> dict[str, torch.Tensor]:
    """The whole-sequence tensors of a case (the same on every rank: seeded)."""
    gen = torch.Generator().manual_seed(0)
    q, grad = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
    k, v = torch.randn(B, HKV, T, D, generator=gen), torch.randn(B, HKV, T, D, generator=gen)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS[case]])
    padding = torch.ones(B, T, dtype=torch.long)
    if case == "padded":
        padding[1, PADDED_ROW_LENGTH:] = 0
    grad = grad * padding[:, None, :, None]  # no gradient reaches padding queries in training
    return {"q": q, "k": k, "v": v, "grad": grad, "position_ids": position_ids, "padding": padding}


def reference(case: str) -> dict[str, torch.Tensor]:
    x = inputs(case)
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    mask = document_causal_mask(x["position_ids"], x["padding"], B, T, T)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(x["grad"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _sharded(rank: int, world_size: int, impl: str, layout_name: str, case: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    layout = SequenceLayout(layout_name, world_size)
    x = {name: t.to(device) for name, t in inputs(case).items()}
    q, k, v = (layout.shard(x[n], rank, dim=2).requires_grad_() for n in "qkv")
    module = nn.Module()
    setattr(module, CONTEXT_PARALLEL_ATTRIBUTE, ContextParallelGroup(dist.group.WORLD, layout, rank))
    padding = layout.shard(x["padding"], rank) if case == "padded" else None
    out, _ = CONTEXT_PARALLEL_BACKENDS[impl](module, q, k, v, padding, position_ids=layout.shard(x["position_ids"], rank))
    out = out.transpose(1, 2)
    out.backward(layout.shard(x["grad"], rank, dim=2))
    return {"out": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}


def _all_cases(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    return {f"{impl}-{layout}-{case}": _sharded(rank, world_size, impl, layout, case)
            for impl in IMPLS for layout in LAYOUTS for case in DOCUMENTS}  # fmt: skip


def assert_equals_reference(shards: list[dict[str, torch.Tensor]], layout: SequenceLayout, case: str,
                            atol: float = ATOL) -> None:  # fmt: skip
    expected = reference(case)
    real = inputs(case)["padding"].bool()[:, None, :, None]
    for name in ("out", "dq", "dk", "dv"):
        got = layout.unshard([s[name] for s in shards], dim=2)
        want = expected[name]
        if name in ("out", "dq"):
            got, want = got * real, want * real
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_all_cases_then_cuda_kernels, 2)


@pytest.mark.parametrize("case", list(DOCUMENTS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_two_ranks_equal_full_attention(two_ranks, impl, layout, case):
    assert_equals_reference([r[f"{impl}-{layout}-{case}"] for r in two_ranks], SequenceLayout(layout, 2), case)


def test_four_ranks_equal_full_attention():
    ranks = run_ranks(_all_cases, 4, timeout_s=300)
    for impl in IMPLS:
        for layout in LAYOUTS:
            for case in DOCUMENTS:
                assert_equals_reference([r[f"{impl}-{layout}-{case}"] for r in ranks], SequenceLayout(layout, 4), case)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_rank_equals_full_attention(impl):
    """Without a group (the backend chosen by name on one process) it is plain attention."""
    for case in DOCUMENTS:
        assert_equals_reference([_sharded(0, 1, impl, "contiguous", case)], SequenceLayout("contiguous", 1), case)


def _merge_without_neg_inf(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """The ring with its block kernel's fully masked rows left at log-sum-exp 0 (the kernel's value)."""

    def block_forward(q, k, v, block, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, block.causal, attn_mask=block.additive(q.dtype), scale=scale)

    block_module.block_forward = block_forward
    return _sharded(rank, world_size, "ring", "zigzag", "packed")


def test_a_wrong_merge_is_caught():
    """The regression guard: a block whose rows see no key must weigh nothing in the merge."""
    shards = run_ranks(_merge_without_neg_inf, 2)
    with pytest.raises(AssertionError):
        assert_equals_reference(shards, SequenceLayout("zigzag", 2), "packed")


def attention_work(layout: SequenceLayout, rank: int) -> int:
    """Query-key pairs the ring's kernel computes on ``rank`` for one causal document per row: a
    full block counts chunk_len^2, a diagonal (causal) block chunk_len * (chunk_len + 1) / 2."""
    masks = ChunkMasks(layout, torch.zeros(layout.size, 1, T // layout.size, dtype=torch.long))
    c, work = masks.chunk_len, 0
    for _, q_chunk in masks.slots(rank):
        for k_chunk in range(layout.num_chunks):
            block = masks.block(q_chunk, k_chunk)
            if block is not None:
                work += c * (c + 1) // 2 if block.causal else c * c
    return work


@pytest.mark.parametrize("size", [2, 4])
def test_zigzag_balances_attention_work(size):
    """Measure: query-key pairs each rank's kernel computes (``attention_work``). zigzag: equal on
    every rank; contiguous: rank r computes r full blocks and one diagonal one."""
    zigzag = [attention_work(SequenceLayout("zigzag", size), r) for r in range(size)]
    contiguous = [attention_work(SequenceLayout("contiguous", size), r) for r in range(size)]
    assert len(set(zigzag)) == 1, zigzag
    c = T // size
    assert contiguous == [r * c * c + c * (c + 1) // 2 for r in range(size)]


# --- the CUDA block kernels ---------------------------------------------------------------------
# On CPU: the CUDA kernels' adapters (``cuda_block_forward``/``_backward``: K/V heads expanded for
# the kernel and their gradients summed back, the bias laid out as the kernel reads it, the padded
# log-sum-exp cut and re-padded, rows that see no key zeroed) run against stand-ins of torch's
# CUDA memory-efficient op, written from its contract (its meta registration's shapes, the
# flash-attention backward from the whole output and log-sum-exp) and strict about it: equal
# heads, a [B, H, Q, K] bias with 16-aligned rows, a log-sum-exp padded to 32 queries (NaN in the
# padding), NaN output for rows that see no key (the worst a kernel may return). Then ring and
# all-gather through them must equal full SDPA as the CPU kernel does. Seen failing with the adapter
# broken on purpose (by hand, once each): summing dK/dV over the wrong head axis (``view(b, groups,
# h // groups, ...)``: dk/dv off by O(1), GQA); not zeroing rows that see no key (packed and padded
# outputs NaN). On a GPU the real op runs (``@pytest.mark.gpu``, 1 GPU, and 2 GPUs over NCCL).

GPU_ATOL = 1e-4
"""fp32 on a GPU: another kernel's summation order (and no TF32 in the memory-efficient kernel)."""


def _scores(q, k, bias, is_causal, scale):
    scores = (q @ k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    if bias is not None:
        scores = scores + bias
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return scores


def _padded_rows(q):
    return -(-q.shape[2] // 32) * 32


def _efficient_attention_stand_in(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, scale=None):
    assert q.shape[1] == k.shape[1] == v.shape[1], "the memory-efficient kernel wants equal query and key heads"
    assert bias is None or (bias.shape == (*q.shape[:3], k.shape[2]) and bias.stride(-2) % 16 == 0), "bias layout"
    assert compute_log_sumexp and dropout_p == 0.0
    scores = _scores(q, k, bias, is_causal, scale)
    lse = torch.nn.functional.pad(scores.logsumexp(-1), (0, _padded_rows(q) - q.shape[2]), value=float("nan"))
    no_seed = torch.zeros((), dtype=torch.long)
    return torch.softmax(scores, -1) @ v, lse, no_seed, no_seed  # softmax of a row without keys: NaN


def _efficient_attention_backward_stand_in(grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                                           is_causal=False, scale=None):  # fmt: skip
    assert q.shape[1] == k.shape[1] and lse.shape[-1] == _padded_rows(q), "heads or log-sum-exp layout"
    p = torch.exp(_scores(q, k, bias, is_causal, scale) - lse[..., : q.shape[2], None])
    ds = p * (grad_out @ v.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))
    s = scale or q.shape[-1] ** -0.5
    return ds @ k * s, ds.transpose(-1, -2) @ q * s, p.transpose(-1, -2) @ grad_out, None


def _use_cuda_kernels_on_cpu(set_attribute) -> None:
    set_attribute(block_module.BLOCK_KERNELS, "cpu", block_module.BLOCK_KERNELS["cuda"])
    set_attribute(torch.ops.aten, "_scaled_dot_product_efficient_attention", _efficient_attention_stand_in)
    set_attribute(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward",
                  _efficient_attention_backward_stand_in)  # fmt: skip


def _set(target, name, value) -> None:
    if isinstance(target, dict):
        target[name] = value
    else:
        setattr(target, name, value)


def _all_cases_then_cuda_kernels(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """``_all_cases``, then (one rank group for both) ring and all-gather through the CUDA kernels."""
    cases = _all_cases(rank, world_size)
    _use_cuda_kernels_on_cpu(_set)  # a rank process of its own: nothing to restore
    return cases | {f"cuda_kernels-{impl}-{case}": _sharded(rank, world_size, impl, "zigzag", case)
                    for impl in IMPLS for case in ("packed", "padded")}  # fmt: skip


def test_cuda_block_kernels_compute_full_attention_on_one_rank(monkeypatch):
    """One rank, zigzag: two chunks, so three blocks merge per call (masked, causal, skipped)."""
    _use_cuda_kernels_on_cpu(lambda target, name, value: (monkeypatch.setitem if isinstance(target, dict)
                                                          else monkeypatch.setattr)(target, name, value))  # fmt: skip
    for impl in IMPLS:
        for case in DOCUMENTS:
            assert_equals_reference([_sharded(0, 1, impl, "zigzag", case)], SequenceLayout("zigzag", 1), case)


def test_cuda_block_kernels_compute_full_attention_on_two_ranks(two_ranks):
    for name in (n for n in two_ranks[0] if n.startswith("cuda_kernels-")):
        assert_equals_reference([r[name] for r in two_ranks], SequenceLayout("zigzag", 2), name.split("-")[2])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_block_kernels_equal_full_attention(impl):
    """The real memory-efficient op on one GPU (zigzag over one rank: merged blocks, every case)."""
    for case in DOCUMENTS:
        got = _sharded(0, 1, impl, "zigzag", case, device="cuda")
        assert_equals_reference([got], SequenceLayout("zigzag", 1), case, atol=GPU_ATOL)


def _on_gpus(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return {f"{impl}-{layout}-{case}": _sharded(rank, world_size, impl, layout, case, device="cuda")
            for impl in IMPLS for layout in LAYOUTS for case in DOCUMENTS}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_ring_and_allgather_on_two_gpus_equal_one_process():
    shards = run_ranks(_on_gpus, 2, init_process_group=False)
    for name in shards[0]:
        _, layout, case = name.split("-")
        assert_equals_reference([s[name] for s in shards], SequenceLayout(layout, 2), case, atol=GPU_ATOL)

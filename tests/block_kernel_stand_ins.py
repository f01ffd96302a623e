"""CPU stand-ins that let the GPU block kernels' glue run here (``lit_ablate.models.attention.block_kernels``).

- ``CudaSdpaOnCpu``: ``sdpa``'s CUDA path (memory-efficient op) on CPU, its op replaced by
  ``efficient_attention_stand_in`` (``use_efficient_attention_stand_ins``).
- ``FlashAttnOnCpu``: ``flash_attn``'s adapter (layout, GQA, masked blocks sent to ``sdpa``)
  against stand-ins of flash-attn's registered ops, written from their schema and strict about
  it: ``[B, T, H, D]`` contiguous tensors, K/V heads dividing query heads, no dropout, window,
  softcap or ALiBi, and a backward that reads the given (merged) output and log-sum-exp and
  writes into the given gradient buffers.
- ``FlexOnCpu``: the real ``flex_attention`` forward (which runs on CPU) with its recomputed
  backward through ``math_attention``, a differentiable stand-in (flex has no CPU backward).

Each stand-in computes attention in plain fp32 torch ops, so what a test compares is the glue.
"""

from __future__ import annotations

import torch
import torch.utils.flop_counter  # registers formulas on the real aten ops before any stand-in replaces one
from torch import Tensor

from lit_ablate.models.attention.block_kernels import (
    BlockInputs,
    FlashAttnBlockKernel,
    FlexBlockKernel,
    SdpaBlockKernel,
)


def _scale(q: Tensor, scale: float | None) -> float:
    return scale if scale is not None else q.shape[-1] ** -0.5


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _causal(scores: Tensor) -> Tensor:
    return scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))


def math_attention(x: BlockInputs) -> tuple[Tensor, Tensor]:
    """``(output, log-sum-exp)`` of one block in plain ops, differentiable in both; rows that see
    no key: 0 and -inf (their scores replaced by zeros first, so no NaN reaches autograd)."""
    q, k, v, block, scale = x
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    scores = q @ k.transpose(-1, -2) * _scale(q, scale)
    if block.causal:
        scores = _causal(scores)
    if block.mask is not None:
        scores = scores.masked_fill(~block.mask, float("-inf"))
    has_key = (scores > float("-inf")).any(-1, keepdim=True)
    safe = scores.masked_fill(~has_key, 0.0)
    lse = safe.logsumexp(-1, keepdim=True)
    out = (torch.exp(safe - lse) * has_key) @ v
    return out, lse.squeeze(-1).masked_fill(~has_key.squeeze(-1), float("-inf"))


class FlexOnCpu(FlexBlockKernel):
    """``flex``: flex's own forward; its backward differentiates ``math_attention`` instead."""

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def attend(self, x: BlockInputs) -> tuple[Tensor, Tensor]:
        if torch.is_grad_enabled():
            return math_attention(x)
        return super().attend(x)


class CudaSdpaOnCpu(SdpaBlockKernel):
    """``sdpa``'s CUDA path, on CPU tensors."""

    def forward(self, x):
        return self.cuda_forward(x)

    def backward(self, x, out, lse, grad_out):
        return self.cuda_backward(x, out, lse, grad_out)


class FlashAttnOnCpu(FlashAttnBlockKernel):
    """``flash_attn`` on CPU tensors: unmasked blocks through the flash-attn stand-ins (fp32 allowed,
    the stand-ins compute in it), masked ones through ``sdpa``'s CUDA path and its stand-ins."""

    dtypes = (torch.float32,)

    def unavailable(self, device: torch.device) -> str | None:
        return None

    cpu_forward = staticmethod(SdpaBlockKernel.cuda_forward)
    cpu_backward = staticmethod(SdpaBlockKernel.cuda_backward)


# --- torch's CUDA memory-efficient op, from its contract (meta registration's shapes) -----------


def _padded_rows(q: Tensor) -> int:
    return -(-q.shape[2] // 32) * 32


def _efficient_scores(q, k, bias, is_causal, scale):
    scores = (q @ k.transpose(-1, -2)) * _scale(q, scale)
    if bias is not None:
        scores = scores + bias
    return _causal(scores) if is_causal else scores


def efficient_attention_stand_in(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, scale=None):
    assert q.shape[1] == k.shape[1] == v.shape[1], "the memory-efficient kernel wants equal query and key heads"
    assert bias is None or (bias.shape == (*q.shape[:3], k.shape[2]) and bias.stride(-2) % 16 == 0), "bias layout"
    assert compute_log_sumexp and dropout_p == 0.0
    scores = _efficient_scores(q, k, bias, is_causal, scale)
    lse = torch.nn.functional.pad(scores.logsumexp(-1), (0, _padded_rows(q) - q.shape[2]), value=float("nan"))
    no_seed = torch.zeros((), dtype=torch.long)
    return torch.softmax(scores, -1) @ v, lse, no_seed, no_seed  # softmax of a row without keys: NaN


def efficient_attention_backward_stand_in(
    grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False, scale=None
):
    assert q.shape[1] == k.shape[1] and lse.shape[-1] == _padded_rows(q), "heads or log-sum-exp layout"
    p = torch.exp(_efficient_scores(q, k, bias, is_causal, scale) - lse[..., : q.shape[2], None])
    ds = p * (grad_out @ v.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))
    s = _scale(q, scale)
    return ds @ k * s, ds.transpose(-1, -2) @ q * s, p.transpose(-1, -2) @ grad_out, None


def use_efficient_attention_stand_ins(set_attribute) -> None:
    """``set_attribute(target, name, value)``: monkeypatch's in a test, plain ``setattr`` in a rank process."""
    set_attribute(torch.ops.aten, "_scaled_dot_product_efficient_attention", efficient_attention_stand_in)
    set_attribute(
        torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", efficient_attention_backward_stand_in
    )


# --- flash-attn's registered ops (flash_attn 2.7+: torch.ops.flashattn), from their schema --------


def _check_flash_call(
    q: Tensor, k: Tensor, v: Tensor, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes
) -> None:
    assert all(t.is_contiguous() for t in (q, k, v)), "flash-attn takes contiguous [B, T, H, D] tensors"
    assert k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3], "layout"
    assert q.shape[2] % k.shape[2] == 0, "K/V heads must divide query heads"
    assert dropout_p == 0.0 and window_size_left == window_size_right == -1 and softcap == 0.0 and alibi_slopes is None


def _flash_scores(q: Tensor, k: Tensor, softmax_scale: float, causal: bool) -> Tensor:
    """``[B, H, Q, K]`` scores from flash-attn's layout (GQA: K/V head h // groups)."""
    qh, kh = q.transpose(1, 2), _repeat_heads(k.transpose(1, 2), q.shape[2])
    scores = qh @ kh.transpose(-1, -2) * softmax_scale
    return _causal(scores) if causal else scores


def flash_attn_forward_stand_in(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):
    _check_flash_call(q, k, v, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    assert isinstance(softmax_scale, float) and not return_softmax
    scores = _flash_scores(q, k, softmax_scale, causal)
    out = torch.softmax(scores, -1) @ _repeat_heads(v.transpose(1, 2), q.shape[2])
    return out.transpose(1, 2).contiguous(), scores.logsumexp(-1), torch.empty(0), torch.zeros(2, dtype=torch.long)


def flash_attn_backward_stand_in(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    _check_flash_call(q, k, v, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    assert out.shape == dout.shape == q.shape and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    groups = q.shape[2] // k.shape[2]
    p = torch.exp(_flash_scores(q, k, softmax_scale, causal) - softmax_lse[..., None])
    do, o = dout.transpose(1, 2), out.transpose(1, 2)
    ds = p * (do @ _repeat_heads(v.transpose(1, 2), q.shape[2]).transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    grad_q = ds @ _repeat_heads(k.transpose(1, 2), q.shape[2]) * softmax_scale
    grad_k = ds.transpose(-1, -2) @ q.transpose(1, 2) * softmax_scale
    grad_v = p.transpose(-1, -2) @ do
    b, h, t, d = grad_k.shape
    dq.copy_(grad_q.transpose(1, 2))
    dk.copy_(grad_k.view(b, h // groups, groups, t, d).sum(2).transpose(1, 2))
    dv.copy_(grad_v.view(b, h // groups, groups, t, d).sum(2).transpose(1, 2))
    return torch.empty(0)


def use_flash_attn_stand_ins(set_attribute) -> None:
    """The stand-ins as ``torch.ops.flashattn``'s ops (and the CUDA path's, for masked blocks)."""
    set_attribute(torch.ops.flashattn, "_flash_attn_forward", flash_attn_forward_stand_in)
    set_attribute(torch.ops.flashattn, "_flash_attn_backward", flash_attn_backward_stand_in)
    use_efficient_attention_stand_ins(set_attribute)

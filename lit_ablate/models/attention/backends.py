"""Attention backends, registered in transformers' attention interface and chosen by config.

``ModelFactory(attn_implementation=NAME)`` builds any Hugging Face model with one of them; the
model code is unchanged. Importing this module registers the names:

- ``sdpa`` (transformers' own): padding mask; transformers itself detects packed batches from
  ``position_ids``, but only when there is no KV cache
  (docs/platform.md#packed-position_ids-leak-across-documents-with-a-kv-cache). Runs everywhere.
- ``sdpa_packed``: SDPA under a block-diagonal causal boolean mask built here from
  ``position_ids`` (a document starts where the position is 0) and the padding mask. Runs and
  trains everywhere, CPU included; independent of the cache.
- ``flex``: ``flex_attention`` under a document ``BlockMask`` built once per forward. The
  forward runs anywhere; training needs CUDA (CPU has no flex backward).

For these two, lit-ablate's training step builds the mask of the whole batch once per forward
(``PREPARED_MASKS``) and hands it to the model as a prepared 4-D mask, which transformers passes to
every layer as it is: no layer builds its own, and transformers' own mask preprocessing, whose
detection of packed rows reads a value back to the host (a stall on a GPU), does not run.
- ``ring`` / ``allgather``: context-parallel attention over a sequence sharded across ranks
  (``lit_ablate.models.attention.context_parallel``; ``ContextParallelStrategy`` selects them
  during its steps). On one process they equal ``sdpa_packed``. Their block kernels: torch's SDPA
  ops, flash-attn or flex (``block_kernels.BLOCK_KERNELS``, the strategy's ``cp_block_kernel``).
- ``fa_varlen``: flash-attn's ``flash_attn_varlen_func`` over the flattened tokens, segments
  from the batch's ``cu_seq_lens_q``/``max_length_q`` when given, else from ``position_ids``
  (or from the padding mask). Needs CUDA and the flash-attn package.
- ``torch_varlen``: the same flattening and segments through torch's own flash kernels
  (``torch.nn.attention.varlen.varlen_attn``, torch 2.10+): no package beyond torch. Needs CUDA.

(Not ``flash_varlen``: transformers treats any implementation name containing "flash" as its
own FlashAttention and tries to load a kernel by that name.) transformers' own
``flash_attention_2``/``flash_attention_3`` are accepted too, on CUDA with their package.

Choosing a backend that cannot train here is a ``ConfigError`` from ``check_attention_backend``
at start-up, never a silent fallback to another kernel.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from lit_ablate.errors import ConfigError
from lit_ablate.extras import EXTRAS, installed, not_installed
from lit_ablate.models.attention.block_kernels import flex_kernel
from lit_ablate.models.attention.context_parallel import allgather_attention_backend, ring_attention_backend

ATTENTION_KEY = "model.init_args.model.attn_implementation"
CONFIG_KEY = "model.init_args.model.config"
"""The model's config keys (its attention dropout, named where a backend has none)."""
TRANSFORMERS_BACKENDS = ("sdpa", "eager")
TRANSFORMERS_FLASH_BACKENDS = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
"""transformers' own FlashAttention integrations (they read packed documents from ``position_ids``)
and the package each needs; CUDA only."""


def document_ids(position_ids: Tensor) -> Tensor:
    """Per token, the index of its document in the row: a document starts where the position is 0."""
    return (position_ids == 0).cumsum(-1)


def document_causal_mask(
    position_ids: Tensor | None, padding_mask: Tensor | None, batch: int, q_len: int, kv_len: int
) -> Tensor:
    """``[B, 1, Q, KV]`` boolean mask: causal, within one document, never onto padding.

    Queries are the last ``q_len`` of ``kv_len`` positions (a KV cache while decoding). Documents
    are split only when queries and keys are the same tokens (training, prefill). A query that
    sees no key (left padding) sees itself, so SDPA stays finite where no label reads it.
    """
    device = (
        position_ids.device if position_ids is not None else padding_mask.device if padding_mask is not None else None
    )
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = (k_pos <= q_pos).expand(batch, 1, q_len, kv_len)
    if position_ids is not None and q_len == kv_len:
        docs = document_ids(position_ids.expand(batch, -1))
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    if padding_mask is not None:
        mask = (mask & padding_mask[:, None, None, :].bool()) | (k_pos == q_pos)
    return mask


def sdpa_packed_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``[B, H, T, D]`` inputs -> ``[B, T, H, D]`` output, as transformers' attention interface expects."""
    _no_sliding_window(sliding_window)
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.ndim == 4:
        mask = attention_mask  # prepared once per forward (PREPARED_MASKS)
    else:
        mask = document_causal_mask(position_ids, attention_mask, batch, q_len, kv_len)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def flex_block_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Tensor] = causal_mask_function,
    attention_mask: Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> Any:
    """The ``BlockMask`` for one forward: transformers' mask function (causal, documents from
    ``position_ids`` when packed) and the padding mask. Compiled on CUDA, eager elsewhere."""
    from torch.nn.attention.flex_attention import create_block_mask

    padding = attention_mask.bool() if attention_mask is not None else None

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        allowed = mask_function(b, h, q + q_offset, kv + kv_offset)
        return allowed & padding[b, kv] if padding is not None else allowed

    return create_block_mask(
        mask_mod, batch_size, None, q_length, kv_length, device=device, _compile=torch.device(device).type == "cuda"
    )


def flex_document_mask(
    position_ids: Tensor | None, padding_mask: Tensor | None, batch: int, length: int, device: torch.device
) -> Any:
    """The ``BlockMask`` of a batch of ``length`` tokens per row: causal, within one document (from
    ``position_ids``, as ``document_causal_mask``), never onto padding. Compiled on CUDA, eager elsewhere."""
    from torch.nn.attention.flex_attention import create_block_mask

    positions = position_ids if position_ids is not None else torch.arange(length, device=device)[None]
    docs = document_ids(positions.expand(batch, -1))
    padding = padding_mask.bool() if padding_mask is not None else None

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        allowed = (q >= kv) & (docs[b, q] == docs[b, kv])
        return allowed & padding[b, kv] if padding is not None else allowed

    return create_block_mask(mask_mod, batch, None, length, length, device=device, _compile=device.type == "cuda")


def flex_document_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``flex_attention`` under the forward's ``BlockMask``; compiled once on CUDA (eager flex
    materialises scores), eager on CPU where only the forward exists."""
    _no_sliding_window(sliding_window)
    if dropout:
        raise ConfigError(f"{CONFIG_KEY}.attention_dropout", dropout, "flex attention has no dropout; set it to 0")
    out = flex_kernel(query.device)(
        query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


SegmentKernel = Callable[[Tensor, Tensor, Tensor, Tensor, int, float | None, float], Tensor]
"""``(q, k, v, cu_seqlens, max_seqlen, scaling, dropout) -> out``: causal attention within each
segment of the flattened tokens (``[T, H, D]``; ``k``/``v`` may have fewer heads than ``q``)."""

HALF_PRECISION = (torch.bfloat16, torch.float16)


def varlen_attention(
    kernel: SegmentKernel,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: Tensor | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A varlen ``kernel`` over the batch's tokens flattened to ``[B*T, H, D]``: one segment per
    document of a packed batch, or per row of a padded one (padding dropped before the kernel)."""
    _no_sliding_window(sliding_window)
    batch, heads, q_len, head_dim = query.shape
    if key.shape[2] != q_len:
        raise ValueError("varlen attention backends are for training: no KV cache (generate with sdpa)")
    if query.is_cuda and query.dtype not in HALF_PRECISION:
        raise ConfigError(
            "model.init_args.model.dtype",
            str(query.dtype).removeprefix("torch."),
            "varlen flash attention (fa_varlen, torch_varlen) computes in bfloat16 or float16 only: set "
            "dtype: bfloat16 or trainer.precision: bf16-mixed, or use flex or sdpa_packed",
        )
    q, k, v = (t.transpose(1, 2).reshape(batch * q_len, t.shape[1], head_dim) for t in (query, key, value))
    keep = None
    if attention_mask is not None and not bool(attention_mask.all()):
        keep = attention_mask.reshape(-1).bool().nonzero().squeeze(1)
        q, k, v = q[keep], k[keep], v[keep]
        lengths = attention_mask.sum(-1)
        cu_seqlens, max_seqlen = F.pad(lengths.cumsum(0), (1, 0)).int(), int(lengths.max())
    elif cu_seq_lens_q is not None:
        cu_seqlens, max_seqlen = cu_seq_lens_q.int(), int(max_length_q)
    else:
        cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(_row_positions(position_ids, batch, q_len, query.device))
    out = kernel(q, k, v, cu_seqlens, max_seqlen, scaling, dropout)
    if keep is not None:
        out = out.new_zeros(batch * q_len, heads, head_dim).index_copy_(0, keep, out)
    return out.reshape(batch, q_len, heads, head_dim), None


def fa_varlen_attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, None]:
    """``varlen_attention`` through flash-attn's ``flash_attn_varlen_func``."""
    return varlen_attention(flash_attn_segments, query, key, value, attention_mask, **kwargs)


def torch_varlen_attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, None]:
    """``varlen_attention`` through torch's own ``torch.nn.attention.varlen.varlen_attn``."""
    return varlen_attention(torch_varlen_segments, query, key, value, attention_mask, **kwargs)


def flash_attn_segments(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scaling: float | None, dropout: float
) -> Tensor:
    """A ``SegmentKernel`` from flash-attn (which takes fewer K/V heads as they are)."""
    return varlen_kernel()(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scaling, causal=True
    )


def torch_varlen_segments(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scaling: float | None, dropout: float
) -> Tensor:
    """A ``SegmentKernel`` from torch's varlen attention, whichever signature this torch has (read
    at call time): causal as ``window_size=(-1, 0)`` (torch 2.13) or ``is_causal=True`` (2.10);
    fewer K/V heads through ``enable_gqa`` where it exists, else repeated here as transformers'
    ``repeat_kv`` does (query head ``h`` reads K/V head ``h // groups``); without a ``scale``
    argument the queries carry a non-default scaling themselves. It has no dropout."""
    if dropout:
        raise ConfigError(
            f"{CONFIG_KEY}.attention_dropout", dropout, "torch's varlen attention has no dropout; set it to 0"
        )
    kernel = torch_varlen_kernel()
    accepts = inspect.signature(kernel).parameters
    options: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in accepts else {"is_causal": True}
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in accepts:
        options["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "scale" in accepts:
        options["scale"] = scaling
    elif scaling is not None and scaling != q.shape[-1] ** -0.5:
        q = q * (scaling * q.shape[-1] ** 0.5)
    return kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)


def cu_seqlens_from_position_ids(position_ids: Tensor) -> tuple[Tensor, int]:
    """``(cu_seqlens int32 [n_docs+1], max_seqlen)`` over the flattened ``[B, T]`` positions
    (one host sync: pass ``cu_seq_lens_q``/``max_length_q`` from the batch to avoid it)."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().squeeze(1)
    cu_seqlens = torch.cat([starts, starts.new_tensor([flat.numel()])]).int()
    return cu_seqlens, int(cu_seqlens.diff().max())


def varlen_kernel() -> Callable[..., Tensor]:
    """flash-attn's varlen function (imported lazily: the package exists only on CUDA machines)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def torch_varlen_kernel() -> Callable[..., Tensor]:
    """torch's varlen flash attention (imported lazily: ``torch.nn.attention.varlen`` is torch 2.10+)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def _row_positions(position_ids: Tensor | None, batch: int, length: int, device: torch.device) -> Tensor:
    if position_ids is None:
        return torch.arange(length, device=device).expand(batch, length)
    return position_ids.expand(batch, length)


def _passthrough_padding_mask(attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """The 2D padding mask, handed to every layer unchanged: the backend builds its own mask."""
    return attention_mask


def _no_sliding_window(sliding_window: int | None) -> None:
    if sliding_window:
        raise ConfigError(ATTENTION_KEY, sliding_window, "this backend has no sliding window; use sdpa for such models")


BACKENDS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "sdpa_packed": (sdpa_packed_attention, _passthrough_padding_mask),
    "flex": (flex_document_attention, flex_block_mask),
    "fa_varlen": (fa_varlen_attention, _passthrough_padding_mask),
    "torch_varlen": (torch_varlen_attention, _passthrough_padding_mask),
    "ring": (ring_attention_backend, _passthrough_padding_mask),
    "allgather": (allgather_attention_backend, _passthrough_padding_mask),
}
"""Our backends: name -> (attention function, the once-per-forward mask function)."""

PREPARED_MASKS: dict[str, Callable[[Tensor | None, Tensor | None, int, int, torch.device], Any]] = {
    "sdpa_packed": lambda positions, padding, batch, length, device: document_causal_mask(
        positions, padding, batch, length, length
    ),
    "flex": flex_document_mask,
}
"""Backends whose mask of a whole batch is built once per forward, ``(position_ids, padding mask, rows,
length, device) -> mask``, and handed to the model as a prepared 4-D mask (see the module docstring)."""

for _name, (_attention, _mask) in BACKENDS.items():
    AttentionInterface.register(_name, _attention)
    AttentionMaskInterface.register(_name, _mask)


def check_attention_backend(name: str, training: bool) -> None:
    """Start-up check: raises ``ConfigError`` (reason and fix) if ``name`` cannot run here.

    The ablation runner calls it to mark such variants ``skipped``; the module calls it before
    building the model, so a run never falls back to another kernel silently.
    """
    known = (*TRANSFORMERS_BACKENDS, *BACKENDS, *TRANSFORMERS_FLASH_BACKENDS)
    if name not in known:
        reserved = (
            " (transformers reserves names containing 'flash' for its own kernels: use fa_varlen)"
            if "flash" in name
            else ""
        )
        raise ConfigError(ATTENTION_KEY, name, f"choose one of {list(known)}{reserved}")
    if name == "fa_varlen" and not torch.cuda.is_available():
        raise ConfigError(
            ATTENTION_KEY,
            name,
            "flash-attn varlen needs CUDA (and flash-attn: pip install 'lit-ablate[gpu]'); on CPU use sdpa_packed",
        )
    if name == "fa_varlen" and not installed("flash_attn"):
        raise ConfigError(
            ATTENTION_KEY, name, f"{not_installed('flash_attn', 'flash-attn varlen')}; on CPU use sdpa_packed"
        )
    if name == "torch_varlen":
        problem = torch_varlen_unavailable()
        if problem:
            raise ConfigError(ATTENTION_KEY, name, f"{problem}; on CPU use sdpa_packed")
    package = TRANSFORMERS_FLASH_BACKENDS.get(name)
    if package and not torch.cuda.is_available():
        raise ConfigError(
            ATTENTION_KEY, name, f"transformers' {name} needs CUDA and the {package} package; on CPU use sdpa_packed"
        )
    if package and not installed(package):
        missing = (
            not_installed(package, f"transformers' {name}")
            if package in EXTRAS
            else f"transformers' {name} needs the {package} package, which is not installed here"
        )
        raise ConfigError(ATTENTION_KEY, name, missing)
    if name == "flex" and training and not torch.cuda.is_available():
        raise ConfigError(
            ATTENTION_KEY, name, "flex attention trains only on CUDA (CPU has its forward only); use sdpa_packed"
        )


def torch_varlen_unavailable() -> str | None:
    """Why torch's varlen attention cannot train here, or None when it can."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch 2.10+); use flex on CUDA"
    if not torch.cuda.is_available():
        return "torch's varlen attention runs flash kernels on CUDA only"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"torch's varlen flash kernels need compute capability 8.0+ ({torch.cuda.get_device_name()} is below)"
    return None

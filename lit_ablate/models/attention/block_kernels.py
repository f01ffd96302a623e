"""Block kernels of context-parallel attention, chosen by the strategy's ``cp_block_kernel``.

A block kernel computes one (query chunk, key chunk) block: its output and fp32 log-sum-exp, and
its backward from the *whole* attention's output and log-sum-exp (the flash-attention backward),
which is what lets ``block_attention`` merge blocks and the ring recompute them one at a time.

- ``sdpa``: torch's own ops, in every build, no extra package. On CPU ATen's flash op (masks of
  the query's dtype, GQA and the log-sum-exp built in); on CUDA the memory-efficient op, the one
  CUDA SDPA kernel that takes a mask and returns the log-sum-exp.
- ``flash_attn``: the flash-attn package (2.7+, whose kernels are registered torch ops with a
  stable schema) on CUDA in fp16/bf16, for every block one document covers without padding
  (unmasked, or plain causal on the diagonal): all blocks of unpacked batches. flash-attn takes
  no mask, so blocks with document or padding masks run through ``sdpa``'s memory-efficient op.
- ``flex``: ``flex_attention`` with the block's mask as its ``BlockMask`` (compiled on CUDA),
  documents and padding included. Its backward differentiates a recomputed block
  (``RecomputedBlockKernel``). Training needs CUDA: flex's backward raises NotImplementedError on a CPU.

A subclass of ``BlockKernel`` registered in ``BLOCK_KERNELS`` is a new choice.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lit_ablate.errors import ConfigError
from lit_ablate.extras import not_installed
from lit_ablate.models.attention.chunk_masks import BlockMask

KERNEL_KEY = "trainer.strategy.init_args.cp_block_kernel"
"""Where the choice sits in a fit config (named in error messages)."""
DEVICES = ("cpu", "cuda")
"""Device types with block kernels (``sdpa`` serves both)."""
BlockKernelName = Literal["sdpa", "flash_attn", "flex"]


class BlockInputs(NamedTuple):
    """One block's queries, keys and values, its mask and the softmax scale (None: ``D ** -0.5``)."""

    q: Tensor
    k: Tensor
    v: Tensor
    block: BlockMask
    scale: float | None

    def detached(self, requires_grad: bool = False) -> BlockInputs:
        """The same block on detached ``q``/``k``/``v`` (leaves of a recomputation when ``requires_grad``)."""
        q, k, v = (t.detach().requires_grad_(requires_grad) for t in self[:3])
        return self._replace(q=q, k=k, v=v)


class BlockKernel(ABC):
    """One block's attention forward and its backward from the merged output (see the module docstring).

    Shapes: ``q`` ``[B, H, Q, D]``, ``k``/``v`` ``[B, H_kv, K, D]`` (GQA: ``H`` a multiple of
    ``H_kv``), ``out``/``grad_out`` like ``q``, ``lse`` ``[B, H, Q]`` fp32.
    """

    def unavailable(self, device: torch.device) -> str | None:
        """Why the kernel cannot train on ``device`` (checked when the strategy starts), or None."""
        return None

    def fallbacks(self) -> list[str]:
        """What ran instead of this kernel so far, in words (the run record's ``fallbacks``)."""
        return []

    @abstractmethod
    def forward(self, x: BlockInputs) -> tuple[Tensor, Tensor]:
        """``(output, fp32 log-sum-exp)`` of the block; rows that see no key may hold anything."""

    @abstractmethod
    def backward(self, x: BlockInputs, out: Tensor, lse: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of the block, given the whole attention's output and log-sum-exp."""


class SdpaBlockKernel(BlockKernel):
    """torch's ops: ATen's CPU flash op, the CUDA memory-efficient op (its contract handled here:
    equal query and key heads, K/V expanded for the kernel only, never on the wire; a
    ``[B, H, Q, K]`` bias with 16-element aligned rows; a log-sum-exp padded to a multiple of 32
    queries, except on ROCm, cut back)."""

    def forward(self, x: BlockInputs) -> tuple[Tensor, Tensor]:
        return (self.cuda_forward if x.q.is_cuda else self.cpu_forward)(x)

    def backward(self, x: BlockInputs, out: Tensor, lse: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return (self.cuda_backward if x.q.is_cuda else self.cpu_backward)(x, out, lse, grad_out)

    @staticmethod
    def cpu_forward(x: BlockInputs) -> tuple[Tensor, Tensor]:
        q, k, v, block, scale = x
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, block.causal, attn_mask=block.additive(q.dtype), scale=scale
        )
        return out, lse

    @staticmethod
    def cpu_backward(x: BlockInputs, out: Tensor, lse: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, block, scale = x
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, block.causal, attn_mask=block.additive(q.dtype), scale=scale
        )

    @staticmethod
    def cuda_forward(x: BlockInputs) -> tuple[Tensor, Tensor]:
        q, k, v, block, scale = x
        groups = q.shape[1] // k.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.contiguous(),
            expand_heads(k, groups),
            expand_heads(v, groups),
            _efficient_bias(block, q, k),
            True,
            0.0,
            block.causal,
            scale=scale,
        )
        return out, lse[..., : q.shape[-2]]

    @staticmethod
    def cuda_backward(x: BlockInputs, out: Tensor, lse: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, block, scale = x
        groups = q.shape[1] // k.shape[1]
        rows = q.shape[-2]
        padded = rows if torch.version.hip else math.ceil(rows / 32) * 32
        lse = torch.nn.functional.pad(lse, (0, padded - rows))
        no_dropout = torch.zeros((), dtype=torch.long)  # seed and offset: unread without dropout
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out.contiguous(),
            q.contiguous(),
            expand_heads(k, groups),
            expand_heads(v, groups),
            _efficient_bias(block, q, k),
            out.contiguous(),
            lse.contiguous(),
            no_dropout,
            no_dropout,
            0.0,
            [True, True, True, False],
            block.causal,
            scale=scale,
        )
        return dq, sum_heads(dk, groups), sum_heads(dv, groups)


class FlashAttnBlockKernel(SdpaBlockKernel):
    """flash-attn's kernels for the blocks without a mask, ``SdpaBlockKernel`` for the others.

    Called through the ops flash-attn 2.7+ registers (``torch.ops.flashattn._flash_attn_forward``
    and ``_flash_attn_backward``): their schema is the package's stable interface, unlike its
    Python helpers' signatures, which changed across releases. flash-attn lays tensors out
    ``[B, T, H, D]`` and does GQA itself (dK/dV come back per K/V head).
    """

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"flash-attn runs on CUDA only, this run is on {device.type}; use cp_block_kernel: sdpa"
        missing = not_installed("flash_attn", "the flash_attn block kernel")
        if missing:
            return f"{missing}; or use cp_block_kernel: sdpa"
        try:
            import flash_attn.flash_attn_interface  # noqa: F401 (registers torch.ops.flashattn)
        except (ImportError, OSError) as err:  # e.g. built for another torch or CUDA
            return f"flash-attn does not import here ({err}); reinstall it for this torch, or use cp_block_kernel: sdpa"
        if not hasattr(torch.ops.flashattn, "_flash_attn_backward"):
            return (
                "flash-attn is older than 2.7 (no registered _flash_attn_backward op): "
                "upgrade it or use cp_block_kernel: sdpa"
            )
        return None

    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    """What flash-attn computes in."""

    blocks = 0
    """Blocks computed so far (forward), and those with a mask, which flash-attn cannot take."""
    masked_blocks = 0

    def fallbacks(self) -> list[str]:
        if not self.masked_blocks:
            return []
        return [
            f"cp_block_kernel flash_attn: {self.masked_blocks} of {self.blocks} attention blocks had a document or "
            "padding mask and ran on torch's memory-efficient SDPA op (flash-attn takes no mask)"
        ]

    def forward(self, x: BlockInputs) -> tuple[Tensor, Tensor]:
        self.blocks += 1
        if x.block.mask is not None:
            self.masked_blocks += 1
            return super().forward(x)
        self.check_inputs(x.q)
        out, lse, _, _ = torch.ops.flashattn._flash_attn_forward(
            *_flash_layout(x.q, x.k, x.v), **_flash_options(x), return_softmax=False
        )
        return out.transpose(1, 2), lse

    def backward(self, x: BlockInputs, out: Tensor, lse: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if x.block.mask is not None:
            return super().backward(x, out, lse, grad_out)
        q, k, v = _flash_layout(x.q, x.k, x.v)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flashattn._flash_attn_backward(
            *_flash_layout(grad_out),
            q,
            k,
            v,
            *_flash_layout(out),
            lse.contiguous(),
            dq,
            dk,
            dv,
            **_flash_options(x),
            deterministic=False,
            rng_state=None,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def check_inputs(self, q: Tensor) -> None:
        """One line naming ``cp_block_kernel`` for queries flash-attn cannot take (dtype, head size)."""
        if q.dtype not in self.dtypes:
            raise ConfigError(
                KERNEL_KEY,
                "flash_attn",
                f"flash-attn computes in fp16/bf16, these queries are {q.dtype}: "
                "train in bf16 (trainer.precision: bf16-mixed or bf16-true) or use cp_block_kernel: sdpa",
            )
        if q.shape[-1] % 8 or q.shape[-1] > 256:
            raise ConfigError(
                KERNEL_KEY,
                "flash_attn",
                f"flash-attn takes head dimensions that are multiples of 8 up "
                f"to 256, this model's is {q.shape[-1]}; use cp_block_kernel: sdpa",
            )


class RecomputedBlockKernel(BlockKernel):
    """A kernel whose backward differentiates a recomputed block through autograd, for kernels
    without a backward from the merged log-sum-exp (``flex_attention``'s is autograd only).

    The block's share of the merged output is ``w * out_b`` with ``w = exp(lse_b - lse)``, so the
    block receives ``w * dO`` on its output and ``w * (dO . out_b - dO . out)`` per row on its
    log-sum-exp; autograd turns both into exactly the flash backward's
    ``dS = P (dO V^T - dO . out)`` with ``P = exp(S - lse)``. Subclasses provide ``attend``,
    differentiable in its output and log-sum-exp.
    """

    @abstractmethod
    def attend(self, x: BlockInputs) -> tuple[Tensor, Tensor]:
        """The block's ``(output, log-sum-exp)``, differentiable in both; rows without a key: 0 and -inf."""

    def forward(self, x: BlockInputs) -> tuple[Tensor, Tensor]:
        with torch.no_grad():  # detached too: flex refuses inputs that require grad where it has no backward
            out, lse = self.attend(x.detached())
        return out, lse.float()

    def backward(self, x: BlockInputs, out: Tensor, lse: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = x.detached(requires_grad=True)
        with torch.enable_grad():
            block_out, block_lse = self.attend(x)
        weight = torch.exp(block_lse.float() - lse)  # 0 for rows that see no key of the block
        grad_o = grad_out.float()
        grad_lse = weight * ((grad_o * block_out.float()).sum(-1) - (grad_o * out.float()).sum(-1))
        grad_block_out = (grad_o * weight[..., None]).to(block_out.dtype)
        return torch.autograd.grad((block_out, block_lse), x[:3], (grad_block_out, grad_lse.to(block_lse.dtype)))


class FlexBlockKernel(RecomputedBlockKernel):
    """``flex_attention`` with the block's mask (documents, padding, causal) as a ``BlockMask``."""

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return (
                f"flex_attention trains on CUDA only (no CPU backward), this run is on {device.type}; "
                "use cp_block_kernel: sdpa"
            )
        return None

    def attend(self, x: BlockInputs) -> tuple[Tensor, Tensor]:
        from torch.nn.attention.flex_attention import AuxRequest

        q, k, v, block, scale = x
        out, aux = flex_kernel(q.device)(
            q,
            k,
            v,
            block_mask=_flex_block_mask(block, q, k),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            return_aux=AuxRequest(lse=True),
        )
        return out, aux.lse


SDPA = SdpaBlockKernel()
"""The default kernel (stateless, so one instance serves every call)."""

BLOCK_KERNELS: dict[str, type[BlockKernel]] = {
    "sdpa": SdpaBlockKernel,
    "flash_attn": FlashAttnBlockKernel,
    "flex": FlexBlockKernel,
}
"""``cp_block_kernel`` name -> kernel class."""


def block_kernel(name: str, device: torch.device) -> BlockKernel:
    """The kernel ``name`` for ``device``; ``ConfigError`` naming ``cp_block_kernel`` (or the
    accelerator, on a device no kernel serves) when it cannot train there."""
    if device.type not in DEVICES:
        raise ConfigError(
            "trainer.accelerator",
            device.type,
            f"context-parallel attention has block kernels for {' and '.join(DEVICES)} devices only; use one of them",
        )
    if name not in BLOCK_KERNELS:
        raise ConfigError(KERNEL_KEY, name, f"choose one of {list(BLOCK_KERNELS)}")
    kernel = BLOCK_KERNELS[name]()
    reason = kernel.unavailable(device)
    if reason:
        raise ConfigError(KERNEL_KEY, name, reason)
    return kernel


_compiled_flex: Callable[..., Tensor] | None = None


def flex_kernel(device: torch.device) -> Callable[..., Tensor]:
    """``flex_attention``, compiled once on CUDA (eager flex materialises the scores), eager
    elsewhere (where only its forward runs)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    _compiled_flex = _compiled_flex or torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def expand_heads(t: Tensor, groups: int) -> Tensor:
    """``[B, H_kv, T, D]`` -> ``[B, H_kv * groups, T, D]``, query head h using K/V head h // groups (GQA)."""
    b, h, n, d = t.shape
    return t[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d).contiguous()


def sum_heads(t: Tensor, groups: int) -> Tensor:
    """The gradient of ``expand_heads``: each K/V head sums its query heads' gradients."""
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


def _efficient_bias(block: BlockMask, q: Tensor, k: Tensor) -> Tensor | None:
    """The block's mask as the memory-efficient kernel reads a bias: ``[B, H, Q, K]`` (heads
    broadcast), each row starting on a 16-element boundary (allocated wider, then cut)."""
    if block.mask is None:
        return None
    b, _, rows, keys = block.mask.shape
    aligned = torch.zeros((b, 1, rows, math.ceil(keys / 16) * 16), dtype=q.dtype, device=q.device)
    bias = aligned[..., :keys].masked_fill_(~block.mask, float("-inf"))
    return bias.expand(b, q.shape[1], rows, keys)


def _flash_layout(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``[B, H, T, D]`` -> flash-attn's contiguous ``[B, T, H, D]``."""
    return tuple(t.transpose(1, 2).contiguous() for t in tensors)


def _flash_options(x: BlockInputs) -> dict[str, object]:
    """What flash-attn's forward and backward ops both take besides tensors: no dropout, window,
    softcap or ALiBi; the block's scale and causality."""
    scale = x.scale if x.scale is not None else x.q.shape[-1] ** -0.5
    return {
        "dropout_p": 0.0,
        "softmax_scale": scale,
        "causal": x.block.causal,
        "window_size_left": -1,
        "window_size_right": -1,
        "softcap": 0.0,
        "alibi_slopes": None,
    }


def _flex_block_mask(block: BlockMask, q: Tensor, k: Tensor):  # flex's BlockMask, imported lazily
    """flex's ``BlockMask`` of the block: None (every key), causal, or the block's boolean mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    if block.mask is None and not block.causal:
        return None
    rows, keys = q.shape[-2], k.shape[-2]
    compiled = q.device.type == "cuda"
    if block.mask is None:
        return create_block_mask(
            lambda b, h, qi, ki: qi >= ki, None, None, rows, keys, device=q.device, _compile=compiled
        )
    mask = block.mask
    return create_block_mask(
        lambda b, h, qi, ki: mask[b, 0, qi, ki], mask.shape[0], None, rows, keys, device=q.device, _compile=compiled
    )

"""MoE grouped experts in fp8: torchao's rowwise scaled grouped matmul on GPUs that have it.

With ``moe: {experts: grouped}`` and ``fp8: {recipe: rowwise}``, each projection of all experts is
one call of torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm``: token copies cast to e4m3 per
row, each expert's weight per output column, with power-of-two scales (the ``rowwise`` recipe's
scaling, per expert), multiplied by ``torch._scaled_grouped_mm`` (compute capability 9.0+:
Hopper, Blackwell); its backward casts the same way (weight gradients per expert and column over
that expert's tokens). Its groups must be multiples of 16 rows, so each expert's rows are laid out
padded to 16 (``padded_group_layout``): zero rows, whose output is dropped and which add nothing
to weight gradients.

Emulated runs (no such GPU, or ``emulate: true``) compute the same numerics per expert with the
loop experts' ``Fp8Matmul`` (torchao's ``Float8Linear`` matmul under the ``rowwise`` config, whose
scales are per row of the tokens and per output row of each expert's weight, gradients per expert
over its tokens), so one config trains real fp8 on such a GPU and its numerics elsewhere; which
one ran is the experts' ``fallback``, recorded like every grouped fallback.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lit_ablate.errors import ConfigError
from lit_ablate.models.fp8.matmul import Fp8Matmul
from lit_ablate.models.moe.experts import Activation, RoutedExperts, expert_slots, loop_experts

GROUP_ALIGNMENT = 16
"""Rows per group must be a multiple of this for ``torch._scaled_grouped_mm``."""
MIN_CAPABILITY = (9, 0)
"""``torch._scaled_grouped_mm`` runs on Hopper (9.0) and later."""
GROUPED_RECIPE = "rowwise"
"""The only recipe torchao's scaled grouped matmul implements (fp8 weight gradients, rowwise scales)."""


def padded_group_layout(counts: Tensor, rows: int, alignment: int) -> tuple[Tensor, Tensor, int]:
    """Where each of ``rows`` token copies (sorted by expert, ``counts`` per expert) goes when every
    expert's rows are padded to a multiple of ``alignment``.

    Returns ``(row of each copy [M], group end offsets [E] int32, rows of the buffer)``. No host
    sync: the buffer has the most rows padding can take, ``M + E (alignment - 1)`` rounded up, and
    the last group ends at the buffer's end (its extra rows are zeros), so every row belongs to a
    group and each group is a multiple of ``alignment``.
    """
    padded = (counts + alignment - 1) // alignment * alignment
    ends = padded.cumsum(0)
    expert, slot = expert_slots(counts, rows)
    destination = (ends - padded)[expert] + slot
    buffer_rows = -(-(rows + counts.numel() * (alignment - 1)) // alignment) * alignment
    ends[-1] = buffer_rows
    return destination, ends.to(torch.int32), buffer_rows


def scaled_grouped_mm(a: Tensor, b_t: Tensor, offsets: Tensor) -> Tensor:
    """``a [M, K] @ b_t [E, K, N]`` per group of rows (``offsets``: group ends), in fp8 (torchao)."""
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        a, b_t, offsets, out_dtype=a.dtype, pad_token_groups_for_grouped_mm=False
    )


def fp8_grouped_mm_experts(tokens: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, act: Activation) -> Tensor:
    """``grouped_mm_experts`` through ``scaled_grouped_mm``, each expert's rows padded to 16."""
    destination, offsets, rows = padded_group_layout(counts, tokens.shape[0], GROUP_ALIGNMENT)
    padded = tokens.new_zeros(rows, tokens.shape[1]).index_copy(0, destination, tokens)
    gate, up = scaled_grouped_mm(padded, gate_up.transpose(-2, -1), offsets).chunk(2, dim=-1)
    return scaled_grouped_mm(act(gate) * up, down.transpose(-2, -1), offsets)[destination]


def convert_grouped_experts(
    name: str,
    module: RoutedExperts,
    recipe: str,
    emulate: bool,
    config,
    options_key: str,
) -> None:
    """Make grouped ``module`` compute in fp8 (see the module docstring), or raise ``ConfigError``
    naming ``options_key`` when the recipe or the GPU cannot. ``config``: torchao's
    ``Float8LinearConfig`` of the run (for the emulated per-expert matmul)."""
    if recipe != GROUPED_RECIPE:
        raise ConfigError(
            f"{options_key}.recipe",
            recipe,
            f"{name}: torchao's scaled grouped matmul for grouped experts "
            f"implements the rowwise recipe only; use recipe: rowwise, or moe experts: loop for {recipe}",
        )
    if emulate:
        module.grouped_mm = functools.partial(loop_experts, linear=Fp8Matmul(config))
        module.grouped_mm_note = (
            "fp8 emulated: the grouped experts' rowwise fp8 numerics computed per expert "
            "(Float8Linear's matmul), not torchao's scaled grouped matmul"
        )
        return
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"{options_key}.emulate",
            False,
            f"{name}: torchao's scaled grouped matmul needs compute "
            f"capability 9.0+ (this GPU: {capability[0]}.{capability[1]}); use moe experts: loop or "
            "emulate: auto",
        )
    module.grouped_mm = fp8_grouped_mm_experts
    module.grouped_mm_note = None

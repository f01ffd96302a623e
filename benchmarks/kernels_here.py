"""Which kernels a benchmark uses by default on this machine: the fastest that train here.

Each candidate that cannot run says why (one ``note:`` line): a GPU without flash-attn then shows
why torch's varlen kernel (or flex) measured instead, never silently.
"""

from __future__ import annotations

from lit_ablate.errors import ConfigError

PACKED_ATTENTION_ORDER = ("fa_varlen", "torch_varlen", "flex")
"""Packed-document attention backends, fastest first; ``sdpa_packed`` (a dense mask) trains everywhere."""


def fastest_packed_attention() -> str:
    """The first packed-document backend of ``PACKED_ATTENTION_ORDER`` that trains here, else ``sdpa_packed``."""
    from lit_ablate.models.attention.backends import check_attention_backend

    for name in PACKED_ATTENTION_ORDER:
        try:
            check_attention_backend(name, training=True)
            return name
        except ConfigError as err:
            print(f"note: {err}")
    return "sdpa_packed"


def memory_efficient_loss(fallback: str = "torch") -> str:
    """Liger's fused linear cross-entropy where it runs (a CUDA device, liger-kernel), else ``fallback``."""
    from lit_ablate.models.losses.cross_entropy import check_loss_backend

    try:
        check_loss_backend("liger")
        return "liger"
    except ConfigError as err:
        print(f"note: {err}")
        return fallback

"""The context-parallel attention backends ``ring`` and ``allgather``, as transformers calls them.

``ContextParallelStrategy`` shards each batch along the sequence, attaches a
``ContextParallelGroup`` to every attention module of the model and selects one of these
backends while it runs a step, so the Hugging Face model code runs unchanged on its shard. Per
call, each rank computes its tokens' segments (``chunk_masks``) from the explicit ``position_ids``
(packed documents restart at 0) and the padding mask, the ranks exchange them (one small
all-gather), and the chosen implementation attends over every rank's keys. Without a group (the
backend chosen by name on one process) the same code runs on one rank, which equals
``sdpa_packed``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lit_ablate.errors import ConfigError
from lit_ablate.models.attention.allgather import allgather_attention
from lit_ablate.models.attention.block_kernels import SDPA, BlockKernel
from lit_ablate.models.attention.chunk_masks import ChunkMasks, segment_ids
from lit_ablate.models.attention.ring import ring_attention
from lit_ablate.models.attention.sequence_layout import SequenceLayout
from lit_ablate.torch_versions import all_gather_into

CONTEXT_PARALLEL_ATTRIBUTE = "context_parallel"
"""The attribute of an attention module that holds its ``ContextParallelGroup``."""


@dataclass(frozen=True)
class ContextParallelGroup:
    """What a context-parallel attention call needs besides its tensors.

    Args:
        group: the context-parallel ranks (None: this rank alone).
        layout: how each sequence is split over them.
        rank: this rank's index in ``group`` (and in ``layout``).
        kernel: what computes each (query chunk, key chunk) block (``block_kernels``).
    """

    group: ProcessGroup | None = None
    layout: SequenceLayout = field(default_factory=SequenceLayout)
    rank: int = 0
    kernel: BlockKernel = SDPA

    def masks(
        self, position_ids: Tensor | None, padding_mask: Tensor | None, batch: int, local_len: int, device: torch.device
    ) -> ChunkMasks:
        """Every rank's token segments for this call (one all-gather of ``[B, T_local]`` integers)."""
        size = self.layout.size
        if position_ids is None:
            if size > 1:
                raise ValueError(
                    "context-parallel attention needs explicit position_ids (each shard's own positions); "
                    "ContextParallelStrategy passes them"
                )
            position_ids = torch.arange(local_len, device=device)
        indices = self.layout.token_indices(self.rank, local_len * size, device)
        segments = segment_ids(indices, position_ids.expand(batch, local_len), padding_mask).contiguous()
        if size == 1:
            return ChunkMasks(self.layout, segments[None])
        gathered = segments.new_empty((size * batch, local_len))
        all_gather_into(gathered, segments, self.group)
        return ChunkMasks(self.layout, gathered.view(size, batch, local_len))


class ContextParallelBackend:
    """A context-parallel attention backend in transformers' attention interface: ``[B, H, T, D]`` inputs ->
    ``[B, T, H, D]`` output, this rank's queries attending over the keys of every rank of its group by
    ``implementation`` (``ring_attention``: K/V passed around the ranks; ``allgather_attention``: every rank
    gathers all K/V)."""

    def __init__(self, implementation: Callable[..., Tensor]) -> None:
        self.implementation = implementation

    @torch.compiler.disable
    def __call__(
        self,
        module: nn.Module,
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
        """Runs eagerly inside a compiled decoder layer (``compile_layers``): the exchange and the
        per-block mask checks are data-dependent, so dynamo would break its graph at every block pair;
        the layer compiles its projections, norms and MLP around this one call instead."""
        if dropout:
            raise ConfigError(
                "model.init_args.model.config.attention_dropout",
                dropout,
                "context-parallel attention has no dropout; set attention_dropout: 0",
            )
        if sliding_window:
            raise ConfigError(
                "model.init_args.model.config.sliding_window",
                sliding_window,
                "context-parallel attention has no sliding window; use a model without one",
            )
        if key.shape[2] != query.shape[2]:
            raise ValueError("ring/allgather attention are training backends: no KV cache (generate with sdpa_packed)")
        context = getattr(module, CONTEXT_PARALLEL_ATTRIBUTE, None) or ContextParallelGroup()
        batch, _, local_len, _ = query.shape
        masks = context.masks(position_ids, attention_mask, batch, local_len, query.device)
        out = self.implementation(query, key, value, masks, context.group, scaling, context.kernel)
        return out.transpose(1, 2).contiguous(), None


ring_attention_backend = ContextParallelBackend(ring_attention)
allgather_attention_backend = ContextParallelBackend(allgather_attention)


CONTEXT_PARALLEL_BACKENDS: dict[str, Callable[..., tuple[Tensor, None]]] = {
    "ring": ring_attention_backend,
    "allgather": allgather_attention_backend,
}
"""Backend name (the strategy's ``cp_impl``) -> the attention function transformers calls."""

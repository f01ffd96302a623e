"""``ExpertContextParallelStrategy``: expert parallelism and context parallelism on one mesh."""

from __future__ import annotations

from typing import Any

from lit_ablate.models.attention.sequence_layout import LayoutName
from lit_ablate.strategies.context_parallel import ContextParallelImpl, ContextParallelStrategy
from lit_ablate.strategies.expert_parallel import DispatchMode, ExpertParallelStrategy


class ExpertContextParallelStrategy(ContextParallelStrategy, ExpertParallelStrategy):
    """A long-context MoE: experts split over ``ep`` ranks, every sequence over ``cp`` ranks.

    Each step is both strategies' at once: the ``ep`` ranks read different batches, the ``cp``
    ranks of one ``ep`` rank share a batch (each holding its slice of every sequence, attention
    through ``cp_impl``), and tokens travel to their experts over ``ep``. Expert weights are
    FSDP-sharded over ``dp_shard x cp`` (``ExpertParallelStrategy.expert_fsdp_mesh``), the rest over
    ``dp_shard x ep x cp``; gradient clipping goes through ``clip_grad_norm_across_meshes``, which
    handles the experts' ``(cp, ep)`` DTensors. Trains the one-process model (tested at ep=2 x cp=2)
    except for the MoE load-balancing loss, which, like under data parallelism, is a statistic of
    the tokens each rank routes: a shard's, not the whole sequence's.

    Args:
        ep: expert-parallel ranks (must divide the number of experts).
        cp: context-parallel ranks (``-1``: the ranks left after the other mesh sizes).
        cp_impl, cp_layout: as ``ContextParallelStrategy``'s.
        dispatch: as ``ExpertParallelStrategy``'s.
        dp_shard: FSDP ranks beside them (``dp_shard x ep x cp`` ranks in all).
        **kwargs: the other ``FSDP2Strategy`` / ``MeshStrategy`` arguments.
    """

    def __init__(self, ep: int, cp: int = -1, cp_impl: ContextParallelImpl = "ring", cp_layout: LayoutName = "zigzag",
                 dispatch: DispatchMode = "all_to_all", dp_shard: int = 1, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(cp=cp, cp_impl=cp_impl, cp_layout=cp_layout, dp_shard=dp_shard, ep=ep, dispatch=dispatch, **kwargs)

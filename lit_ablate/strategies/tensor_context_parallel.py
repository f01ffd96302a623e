"""``TensorContextParallelStrategy``: tensor parallelism and context parallelism on one mesh."""

from __future__ import annotations

from typing import Any

from lit_ablate.errors import ConfigError
from lit_ablate.models.attention.sequence_layout import LayoutName
from lit_ablate.strategies.context_parallel import ContextParallelImpl, ContextParallelStrategy
from lit_ablate.strategies.mesh import STRATEGY_KEY
from lit_ablate.strategies.tensor_parallel import TensorParallelStrategy


class TensorContextParallelStrategy(TensorParallelStrategy, ContextParallelStrategy):
    """Long sequences on a model split by matrices: ``cp`` ranks share each sequence, and inside each
    ``cp`` rank ``tp`` ranks split every matrix (``tp`` innermost, on the fastest links).

    A step is both strategies' at once: the ``cp x tp`` ranks of a data-parallel group read the
    same batch; each ``cp`` rank keeps its slice of every sequence (``cp_impl`` attention over its
    ``tp`` rank's heads), each ``tp`` rank its heads, MLP columns and vocabulary columns. Parameters
    are FSDP2-sharded over ``dp_shard x cp``; gradient clipping takes the norm over the TP and
    FSDP meshes as under ``tp x dp_shard``. Sequence parallelism is refused: the sequence is already
    split over ``cp``.

    Args:
        tp: tensor-parallel ranks.
        cp: context-parallel ranks (``-1``: the ranks left after the other mesh sizes).
        cp_impl, cp_layout: as ``ContextParallelStrategy``'s.
        dp_shard: FSDP ranks beside them (``dp_shard x cp x tp`` ranks in all).
        **kwargs: the other ``FSDP2Strategy`` / ``MeshStrategy`` arguments.
    """

    def __init__(self, tp: int, cp: int = -1, cp_impl: ContextParallelImpl = "ring", cp_layout: LayoutName = "zigzag",
                 dp_shard: int = 1, **kwargs: Any) -> None:  # fmt: skip
        if kwargs.get("sequence_parallel"):
            raise ConfigError(f"{STRATEGY_KEY}.sequence_parallel", True,
                              "context parallelism already splits the sequence over cp; use sequence_parallel: false")
        super().__init__(tp=tp, cp=cp, cp_impl=cp_impl, cp_layout=cp_layout, dp_shard=dp_shard, **kwargs)

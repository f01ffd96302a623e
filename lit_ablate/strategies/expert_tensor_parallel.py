"""``ExpertTensorParallelStrategy``: tensor parallelism for the dense parts, expert parallelism for the experts."""

from __future__ import annotations

from typing import Any

from lit_ablate.strategies.expert_parallel import DispatchMode, ExpertParallelStrategy
from lit_ablate.strategies.tensor_parallel import TensorParallelStrategy


class ExpertTensorParallelStrategy(TensorParallelStrategy, ExpertParallelStrategy):
    """An MoE whose attention and dense matrices are split over ``tp`` ranks and whose experts are
    split over ``ep`` ranks: the "TP vs TP + EP" ablation of a large MoE.

    Each step is both strategies' at once: the ``ep`` ranks read different batches (``ep`` is a
    data-parallel dimension for the dense parts), the ``tp`` ranks of one ``ep`` rank read the same
    batch and each holds its heads, MLP columns and vocabulary columns; tokens travel to their
    experts over ``ep``, among the ranks with the same ``tp`` index. The experts are not split by
    ``tp`` (the plan keeps MoE blocks whole): the ``tp`` peers of an ``ep`` rank hold the same
    experts and compute the same expert work, which is what this layout costs against splitting
    experts by ``tp`` too (not built). Dense parameters are FSDP2-sharded over ``dp_shard x ep``,
    experts over ``dp_shard``; clipping takes the norm over the TP, expert and FSDP meshes
    (``clip_grad_norm_across_meshes``). Trains the one-process model (tested at tp=2 x ep=2, with
    and without sequence parallelism) except for the MoE load-balancing loss, which, as under data
    parallelism, is a statistic of each ``ep`` rank's tokens.

    Args:
        tp: tensor-parallel ranks (must divide the attention and key/value heads and the vocabulary).
        ep: expert-parallel ranks (must divide the number of experts).
        dispatch, sequence_parallel, dp_shard: as ``ExpertParallelStrategy``'s and
            ``TensorParallelStrategy``'s (``dp_shard x ep x tp`` ranks in all, times ``dp_replicate``).
        **kwargs: the other ``FSDP2Strategy`` / ``MeshStrategy`` arguments.
    """

    def __init__(self, tp: int, ep: int, dispatch: DispatchMode = "all_to_all", sequence_parallel: bool = False,
                 dp_shard: int = 1, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(tp=tp, ep=ep, dispatch=dispatch, sequence_parallel=sequence_parallel, dp_shard=dp_shard,
                         **kwargs)

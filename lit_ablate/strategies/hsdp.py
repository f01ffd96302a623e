"""``HSDPStrategy``: hybrid sharding, a replicate x shard 2-D mesh."""

from __future__ import annotations

from typing import Any

from lit_ablate.strategies.fsdp2 import FSDP2Strategy


class HSDPStrategy(FSDP2Strategy):
    """FSDP2 on a 2-D mesh: shard within each of ``dp_replicate`` groups, replicate across them.

    Choose it when the all-gathers of plain FSDP over every rank are too slow for the links
    between groups (typically nodes): parameters are gathered only inside a group (fast links),
    and only gradients cross groups (one all-reduce per step). Memory per rank is that of FSDP
    over ``dp_shard`` ranks. Usual layout: ``dp_shard`` = devices per node, ``dp_replicate: -1``.

    Args:
        dp_replicate: number of replica groups (``-1``: world size / ``dp_shard``).
        dp_shard: ranks sharding each replica.
        **kwargs: the other ``FSDP2Strategy`` arguments (resharding, mixed precision,
            activation checkpointing, compile, checkpoint format).
    """

    def __init__(self, dp_replicate: int = 2, dp_shard: int = -1, **kwargs: Any) -> None:
        super().__init__(dp_replicate=dp_replicate, dp_shard=dp_shard, **kwargs)

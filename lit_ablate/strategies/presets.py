"""The named mesh strategies: presets of ``MeshParallelStrategy`` that accept only their own dimensions.

Each is what a config names by ``class_path`` (``lit_ablate.strategies.TensorParallelStrategy``) to
ablate one technique; its signature is its schema, so a dimension it does not take (``tp`` for
``FSDP2Strategy``) is refused by the parser in one line, and by the constructor when called from
Python. A technique's own options come as ``**kwargs`` typed by its options (``ContextParallelOptions``:
``cp_impl``, ``cp_layout``, ``cp_block_kernel``; with FSDP2's and the mesh's), which the parser reads.
Presets add no behaviour: everything they do is ``MeshParallelStrategy``'s steps at the sizes they set.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import Unpack

from lit_ablate.errors import ConfigError
from lit_ablate.models.attention.block_kernels import BlockKernelName
from lit_ablate.models.attention.sequence_layout import LayoutName
from lit_ablate.strategies.context_parallel import ContextParallelImpl
from lit_ablate.strategies.expert_parallel import DispatchMode
from lit_ablate.strategies.fsdp2 import FSDPOptions
from lit_ablate.strategies.mesh import STRATEGY_OPTIONS_KEY
from lit_ablate.strategies.mesh_parallel import MeshParallelStrategy


class TensorParallelOptions(FSDPOptions, total=False):
    sequence_parallel: bool


class ContextParallelOptions(FSDPOptions, total=False):
    cp_impl: ContextParallelImpl
    cp_layout: LayoutName
    cp_block_kernel: BlockKernelName


class ExpertParallelOptions(FSDPOptions, total=False):
    dispatch: DispatchMode


class ExpertTensorParallelOptions(TensorParallelOptions, ExpertParallelOptions, total=False):
    pass


class ExpertContextParallelOptions(ContextParallelOptions, ExpertParallelOptions, total=False):
    pass


class _Preset(MeshParallelStrategy):
    """A preset: the mesh sizes it sets and the options its ``OPTIONS`` allow, passed on to the one strategy."""

    OPTIONS: type = FSDPOptions

    def __init__(self, sizes: dict[str, int], options: dict[str, Any]) -> None:
        for key, value in options.items():
            if key not in self.OPTIONS.__optional_keys__:
                raise ConfigError(
                    f"{STRATEGY_OPTIONS_KEY}.{key}",
                    value,
                    f"{type(self).__name__} does not take {key}; use a strategy that does "
                    "(MeshParallelStrategy takes every mesh dimension)",
                )
        super().__init__(**sizes, **options)


class FSDP2Strategy(_Preset):
    """Fully sharded data parallelism (FSDP2, ``fully_shard``): each decoder layer, then the root.

    Choose it to train a model whose parameters, gradients and optimizer states do not fit one
    device replicated (ZeRO-3 with ``reshard_after_forward: true``; ZeRO-2-like with ``false``).
    With ``dp_replicate > 1`` it is HSDP (see ``HSDPStrategy``).

    Args:
        dp_shard: ranks sharding parameters, gradients and optimizer states (``-1``: every rank).
        dp_replicate: replica groups beside them.
        **kwargs: FSDP2's and the mesh's options (``FullyShardSteps``, ``MeshStrategy``).
    """

    def __init__(self, dp_shard: int = -1, dp_replicate: int = 1, **kwargs: Unpack[FSDPOptions]) -> None:
        super().__init__({"dp_shard": dp_shard, "dp_replicate": dp_replicate}, kwargs)


class HSDPStrategy(_Preset):
    """FSDP2 on a 2-D mesh: shard within each of ``dp_replicate`` groups, replicate across them.

    Choose it when the all-gathers of plain FSDP over every rank are too slow for the links
    between groups (typically nodes): parameters are gathered only inside a group, and only
    gradients cross groups. Usual layout: ``dp_shard`` = devices per node, ``dp_replicate: -1``.

    Args:
        dp_replicate: number of replica groups (``-1``: world size / ``dp_shard``).
        dp_shard: ranks sharding each replica.
        **kwargs: FSDP2's and the mesh's options.
    """

    def __init__(self, dp_replicate: int = 2, dp_shard: int = -1, **kwargs: Unpack[FSDPOptions]) -> None:
        super().__init__({"dp_replicate": dp_replicate, "dp_shard": dp_shard}, kwargs)


class TensorParallelStrategy(_Preset):
    """Tensor parallelism (Megatron's layout through DTensor's ``parallelize_module``), optionally
    sequence parallel (``sequence_parallel: true``), with FSDP2 over ``dp_shard`` beside it.

    Choose it when one layer's matrices or activations are too large for one device, or to ablate
    it against FSDP at the same world size: the ``tp`` ranks of a group read the same batch and each
    holds ``1 / tp`` of every attention and MLP matrix, the embedding and the LM head
    (``TensorParallelSteps``).

    Args:
        tp: tensor-parallel ranks (``-1``: the ranks left); must divide the heads and the vocabulary.
        dp_shard: FSDP ranks beside the tensor-parallel ones; they read different batches.
        dp_replicate: replica groups beside them.
        **kwargs: ``sequence_parallel``, FSDP2's and the mesh's options.
    """

    OPTIONS = TensorParallelOptions

    def __init__(
        self, tp: int = -1, dp_shard: int = 1, dp_replicate: int = 1, **kwargs: Unpack[TensorParallelOptions]
    ) -> None:
        super().__init__({"tp": tp, "dp_shard": dp_shard, "dp_replicate": dp_replicate}, kwargs)


class ContextParallelStrategy(_Preset):
    """Context parallelism: the ``cp`` ranks share each batch, each holding a slice of every sequence.

    Choose it when one sequence's activations do not fit a device (long context): activations and
    attention work per rank shrink by ``cp``, at the price of exchanging keys and values in every
    attention layer (``ContextParallelSteps``: ``cp_impl`` ring or allgather, ``cp_layout`` zigzag or
    contiguous, ``cp_block_kernel`` sdpa, flash_attn or flex).

    Args:
        cp: context-parallel ranks (``-1``: the ranks left).
        dp_shard: FSDP ranks beside the context-parallel ones; they read different batches.
        dp_replicate: replica groups beside them.
        **kwargs: ``cp_impl``, ``cp_layout``, ``cp_block_kernel``, FSDP2's and the mesh's options.
    """

    OPTIONS = ContextParallelOptions

    def __init__(
        self, cp: int = -1, dp_shard: int = 1, dp_replicate: int = 1, **kwargs: Unpack[ContextParallelOptions]
    ) -> None:
        super().__init__({"cp": cp, "dp_shard": dp_shard, "dp_replicate": dp_replicate}, kwargs)


class ExpertParallelStrategy(_Preset):
    """Expert parallelism (torchtitan's): each ``ep`` rank holds ``num_experts / ep`` experts.

    Choose it when the experts' weights dominate memory, or to ablate all-to-all dispatch against the
    naive all-reduce (``dispatch``; ``ExpertParallelSteps``). EP ranks read different batches, like
    data-parallel ranks.

    Args:
        ep: expert-parallel ranks (``-1``: the ranks left); must divide the number of experts.
        dp_shard: FSDP ranks per expert shard.
        dp_replicate: replica groups beside them.
        **kwargs: ``dispatch``, FSDP2's and the mesh's options.
    """

    OPTIONS = ExpertParallelOptions

    def __init__(
        self, ep: int = -1, dp_shard: int = 1, dp_replicate: int = 1, **kwargs: Unpack[ExpertParallelOptions]
    ) -> None:
        super().__init__({"ep": ep, "dp_shard": dp_shard, "dp_replicate": dp_replicate}, kwargs)


class ExpertTensorParallelStrategy(_Preset):
    """An MoE whose dense matrices are split over ``tp`` ranks and whose experts over ``ep`` ranks: the
    "TP vs TP + EP" ablation of a large MoE. The plan keeps MoE blocks whole, so the ``tp`` peers of
    an ``ep`` rank compute the same expert work.

    Args:
        tp: tensor-parallel ranks; ep: expert-parallel ranks.
        dp_shard, dp_replicate: data-parallel ranks beside them.
        **kwargs: ``dispatch``, ``sequence_parallel``, FSDP2's and the mesh's options.
    """

    OPTIONS = ExpertTensorParallelOptions

    def __init__(
        self, tp: int, ep: int, dp_shard: int = 1, dp_replicate: int = 1, **kwargs: Unpack[ExpertTensorParallelOptions]
    ) -> None:
        super().__init__({"tp": tp, "ep": ep, "dp_shard": dp_shard, "dp_replicate": dp_replicate}, kwargs)


class TensorContextParallelStrategy(_Preset):
    """Long sequences on a model split by matrices: ``cp`` ranks share each sequence, and inside each
    ``cp`` rank ``tp`` ranks split every matrix. No sequence parallelism: ``cp`` splits the sequence.

    Args:
        tp: tensor-parallel ranks; cp: context-parallel ranks (``-1``: the ranks left).
        dp_shard, dp_replicate: data-parallel ranks beside them.
        **kwargs: ``cp_impl``, ``cp_layout``, ``cp_block_kernel``, FSDP2's and the mesh's options.
    """

    OPTIONS = ContextParallelOptions

    def __init__(
        self, tp: int, cp: int = -1, dp_shard: int = 1, dp_replicate: int = 1, **kwargs: Unpack[ContextParallelOptions]
    ) -> None:
        super().__init__({"tp": tp, "cp": cp, "dp_shard": dp_shard, "dp_replicate": dp_replicate}, kwargs)


class ExpertContextParallelStrategy(_Preset):
    """A long-context MoE: experts split over ``ep`` ranks, every sequence over ``cp`` ranks.

    Args:
        ep: expert-parallel ranks; cp: context-parallel ranks (``-1``: the ranks left).
        dp_shard, dp_replicate: data-parallel ranks beside them.
        **kwargs: ``cp_impl``, ``cp_layout``, ``cp_block_kernel``, ``dispatch``, FSDP2's and the mesh's options.
    """

    OPTIONS = ExpertContextParallelOptions

    def __init__(
        self,
        ep: int,
        cp: int = -1,
        dp_shard: int = 1,
        dp_replicate: int = 1,
        **kwargs: Unpack[ExpertContextParallelOptions],
    ) -> None:
        super().__init__({"ep": ep, "cp": cp, "dp_shard": dp_shard, "dp_replicate": dp_replicate}, kwargs)

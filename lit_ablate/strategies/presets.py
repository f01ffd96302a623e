"""The named mesh strategies: presets of ``MeshParallelStrategy`` that accept only their own dimensions.

Each is what a config names by ``class_path`` (``lit_ablate.strategies.TensorParallelStrategy``) to
ablate one technique. A preset declares the mesh sizes it takes, with their defaults (``DIMENSIONS``),
and the steps whose options it takes besides FSDP2's and the mesh's (``STEPS``); its ``__init__`` is made
from them, so its signature, the schema jsonargparse parses, lists exactly those: a dimension or an option
it does not take (``tp`` for ``FSDP2Strategy``) is refused by the parser in one line, and by the constructor
when called from Python. Each option keeps its one declaration, in its step (``strategies.options``).
Presets add no behaviour: everything they do is ``MeshParallelStrategy``'s steps at the sizes they set.
"""

from __future__ import annotations

import inspect
from typing import Any

from typing_extensions import Unpack

from lit_ablate.mesh_sizes import MESH_DIMS
from lit_ablate.strategies.context_parallel import ContextParallelSteps
from lit_ablate.strategies.expert_parallel import ExpertParallelSteps
from lit_ablate.strategies.fsdp2 import FullyShardSteps
from lit_ablate.strategies.mesh import MeshStrategy
from lit_ablate.strategies.mesh_parallel import MeshParallelStrategy
from lit_ablate.strategies.options import check_options, keyword_options, options_type
from lit_ablate.strategies.tensor_parallel import TensorParallelSteps

REQUIRED = inspect.Parameter.empty
"""A preset dimension without a default: the config must give it."""


class _Preset(MeshParallelStrategy):
    """A preset, declared by its class keywords: ``dimensions``, the mesh sizes it takes (name -> default,
    ``REQUIRED`` for none), and ``steps``, those whose options it takes; a subclass of a preset (research
    code's) declares nothing and keeps its preset's arguments."""

    def __init_subclass__(
        cls, dimensions: dict[str, Any] | None = None, steps: tuple[type, ...] = (), **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if dimensions is not None:
            cls.__init__ = _preset_init(cls, dimensions, steps)


def _preset_init(preset: type[_Preset], dimensions: dict[str, Any], steps: tuple[type, ...]) -> Any:
    """The ``__init__`` of ``preset``: its dimensions as arguments (in their order), and its steps', FSDP2's
    and the mesh's options as ``**kwargs`` typed by them."""
    options = options_type(
        f"{preset.__name__}Options",
        *(keyword_options(step) for step in (*steps, FullyShardSteps)),
        keyword_options(MeshStrategy, leave_out=MESH_DIMS),
    )
    parameter = inspect.Parameter
    signature = inspect.Signature(
        [
            parameter("self", parameter.POSITIONAL_OR_KEYWORD),
            *(
                parameter(dim, parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=int)
                for dim, default in dimensions.items()
            ),
            parameter("kwargs", parameter.VAR_KEYWORD, annotation=Unpack[options]),
        ],
        return_annotation=None,
    )

    def __init__(self: _Preset, *args: Any, **kwargs: Any) -> None:
        arguments = signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        given = dict(arguments.arguments)
        check_options(type(self).__name__, options, given["kwargs"])
        MeshParallelStrategy.__init__(self, **{dim: given[dim] for dim in dimensions}, **given["kwargs"])

    __init__.__signature__ = signature
    __init__.__qualname__ = f"{preset.__qualname__}.__init__"
    __init__.__module__ = preset.__module__
    __init__.__doc__ = preset.__doc__
    return __init__


class FSDP2Strategy(_Preset, dimensions={"dp_shard": -1, "dp_replicate": 1}):
    """Fully sharded data parallelism (FSDP2, ``fully_shard``): each decoder layer, then the root.

    Choose it to train a model whose parameters, gradients and optimizer states do not fit one
    device replicated (ZeRO-3 with ``reshard_after_forward: true``; ZeRO-2-like with ``false``).
    With ``dp_replicate > 1`` it is HSDP (see ``HSDPStrategy``).

    Args:
        dp_shard: ranks sharding parameters, gradients and optimizer states (``-1``: every rank).
        dp_replicate: replica groups beside them.
        **kwargs: FSDP2's and the mesh's options (``FullyShardSteps``, ``MeshStrategy``).
    """


class HSDPStrategy(_Preset, dimensions={"dp_replicate": 2, "dp_shard": -1}):
    """FSDP2 on a 2-D mesh: shard within each of ``dp_replicate`` groups, replicate across them.

    Choose it when the all-gathers of plain FSDP over every rank are too slow for the links
    between groups (typically nodes): parameters are gathered only inside a group, and only
    gradients cross groups. Usual layout: ``dp_shard`` = devices per node, ``dp_replicate: -1``.

    Args:
        dp_replicate: number of replica groups (``-1``: world size / ``dp_shard``).
        dp_shard: ranks sharding each replica.
        **kwargs: FSDP2's and the mesh's options.
    """


class TensorParallelStrategy(
    _Preset, dimensions={"tp": -1, "dp_shard": 1, "dp_replicate": 1}, steps=(TensorParallelSteps,)
):
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


class ContextParallelStrategy(
    _Preset, dimensions={"cp": -1, "dp_shard": 1, "dp_replicate": 1}, steps=(ContextParallelSteps,)
):
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


class ExpertParallelStrategy(
    _Preset, dimensions={"ep": -1, "dp_shard": 1, "dp_replicate": 1}, steps=(ExpertParallelSteps,)
):
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


class ExpertTensorParallelStrategy(
    _Preset,
    dimensions={"tp": REQUIRED, "ep": REQUIRED, "dp_shard": 1, "dp_replicate": 1},
    steps=(TensorParallelSteps, ExpertParallelSteps),
):
    """An MoE whose dense matrices are split over ``tp`` ranks and whose experts over ``ep`` ranks: the
    "TP vs TP + EP" ablation of a large MoE. The plan keeps MoE blocks whole, so the ``tp`` peers of
    an ``ep`` rank compute the same expert work.

    Args:
        tp: tensor-parallel ranks; ep: expert-parallel ranks.
        dp_shard, dp_replicate: data-parallel ranks beside them.
        **kwargs: ``dispatch``, ``sequence_parallel``, FSDP2's and the mesh's options.
    """


class TensorContextParallelStrategy(
    _Preset, dimensions={"tp": REQUIRED, "cp": -1, "dp_shard": 1, "dp_replicate": 1}, steps=(ContextParallelSteps,)
):
    """Long sequences on a model split by matrices: ``cp`` ranks share each sequence, and inside each
    ``cp`` rank ``tp`` ranks split every matrix. No sequence parallelism: ``cp`` splits the sequence.

    Args:
        tp: tensor-parallel ranks; cp: context-parallel ranks (``-1``: the ranks left).
        dp_shard, dp_replicate: data-parallel ranks beside them.
        **kwargs: ``cp_impl``, ``cp_layout``, ``cp_block_kernel``, FSDP2's and the mesh's options.
    """


class ExpertContextParallelStrategy(
    _Preset,
    dimensions={"ep": REQUIRED, "cp": -1, "dp_shard": 1, "dp_replicate": 1},
    steps=(ContextParallelSteps, ExpertParallelSteps),
):
    """A long-context MoE: experts split over ``ep`` ranks, every sequence over ``cp`` ranks.

    Args:
        ep: expert-parallel ranks; cp: context-parallel ranks (``-1``: the ranks left).
        dp_shard, dp_replicate: data-parallel ranks beside them.
        **kwargs: ``cp_impl``, ``cp_layout``, ``cp_block_kernel``, ``dispatch``, FSDP2's and the mesh's options.
    """

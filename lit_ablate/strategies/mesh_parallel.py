"""``MeshParallelStrategy``: the one mesh strategy, every step switched on by the size of its dimension."""

from __future__ import annotations

from typing_extensions import Unpack

from lit_ablate.errors import ConfigError
from lit_ablate.models.attention.block_kernels import BlockKernelName
from lit_ablate.models.attention.sequence_layout import LayoutName
from lit_ablate.strategies.context_parallel import ContextParallelImpl, ContextParallelSteps
from lit_ablate.strategies.expert_parallel import DispatchMode, ExpertParallelSteps
from lit_ablate.strategies.fsdp2 import FSDPOptions
from lit_ablate.strategies.mesh import STRATEGY_OPTIONS_KEY
from lit_ablate.strategies.tensor_parallel import TensorParallelSteps


class MeshParallelStrategy(TensorParallelSteps, ContextParallelSteps, ExpertParallelSteps):
    """Data, expert, context and tensor parallelism on one ``dp_replicate x dp_shard x ep x cp x tp``
    mesh, applied to a built model in one ordered list of steps (``MeshStrategy.apply_steps``): TP ->
    EP -> CP -> activation checkpointing -> compile -> the experts' FSDP -> FSDP. Each dimension's step
    runs when its size is above 1, so any combination of sizes is this one class; a new dimension adds
    one step to the list, never a class per pair.

    The named strategies (``FSDP2Strategy``, ``HSDPStrategy``, ``TensorParallelStrategy``,
    ``ContextParallelStrategy``, ``ExpertParallelStrategy`` and the pairs) are presets of it: each
    accepts only its own dimensions, so a config that asks a preset for another is refused at
    parse time in one line. Choose this class itself for a combination no preset names, or
    subclass it and override one ``apply_*`` step.

    Pipeline parallelism is this class with one step more, ``PipelineParallelStrategy``: it keeps each
    rank's stage before the steps above (applied to the stage) and replaces the module's training
    step by the stages' schedule, so it is the subclass to name for ``pp`` with any of these
    dimensions; ``pp`` above 1 here is refused in one line pointing at it.

    Args:
        dp_replicate, dp_shard, ep, cp, tp: the mesh sizes (one may be ``-1``: the ranks left).
        pp: 1 (pipeline stages: ``PipelineParallelStrategy``).
        sequence_parallel: TP's sequence parallelism (not with ``cp``: the sequence is split there already).
        cp_impl, cp_layout, cp_block_kernel: context parallelism's exchange, layout and block kernel.
        dispatch: expert parallelism's token dispatch.
        **kwargs: FSDP2's options (resharding, mixed precision, offload) and the ``MeshStrategy``
            options (activation checkpointing, compile, checkpoint format, backend, timeout).
    """

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        ep: int = 1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        sequence_parallel: bool = False,
        cp_impl: ContextParallelImpl = "ring",
        cp_layout: LayoutName = "zigzag",
        cp_block_kernel: BlockKernelName = "sdpa",
        dispatch: DispatchMode = "all_to_all",
        **kwargs: Unpack[FSDPOptions],
    ) -> None:
        if sequence_parallel and cp != 1:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.sequence_parallel",
                True,
                "context parallelism already splits the sequence over cp; use sequence_parallel: false",
            )
        super().__init__(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            ep=ep,
            cp=cp,
            tp=tp,
            pp=pp,
            sequence_parallel=sequence_parallel,
            cp_impl=cp_impl,
            cp_layout=cp_layout,
            cp_block_kernel=cp_block_kernel,
            dispatch=dispatch,
            **kwargs,
        )

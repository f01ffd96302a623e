"""``MeshParallelStrategy``: the one mesh strategy, every step switched on by the size of its dimension."""

from __future__ import annotations

from lit_ablate.strategies.context_parallel import ContextParallelSteps
from lit_ablate.strategies.expert_parallel import ExpertParallelSteps
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

    Its arguments are its steps' (each declared once, in its step): the mesh sizes and the mesh's options
    (``MeshStrategy``), FSDP2's (``FullyShardSteps``), ``sequence_parallel`` (``TensorParallelSteps``; not
    with ``cp``: the sequence is split there already), ``cp_impl``, ``cp_layout``, ``cp_block_kernel``
    (``ContextParallelSteps``) and ``dispatch`` (``ExpertParallelSteps``).
    """

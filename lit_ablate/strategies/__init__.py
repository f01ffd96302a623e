"""Strategies: one mesh strategy and its presets, the pipeline strategy, and the data-parallel baselines.

``MeshParallelStrategy`` applies data, expert, context and tensor parallelism on one N-D device mesh
(each step on when its size is above 1); ``FSDP2Strategy``, ``HSDPStrategy``, ``TensorParallelStrategy``,
``ContextParallelStrategy``, ``ExpertParallelStrategy`` and the pairs are its presets, each accepting
only its own dimensions. ``PipelineParallelStrategy`` is it with the pipeline step: layers split into
stages, every other dimension applied to each stage. ``DDPStrategy``, ``ZeRO1Strategy`` and
``FSDP1Strategy`` are the data-parallel baselines, ``DeepSpeedStrategy`` DeepSpeed's ZeRO beside them.
Every one answers ``StrategyInterface`` (what modules and callbacks may ask a strategy).

Configs select them by ``class_path`` (``lit_ablate.strategies.FSDP2Strategy``); research code
subclasses one and overrides one ``apply_*`` step.
"""

from lit_ablate.mesh_sizes import MESH_DIMS, MeshSizes, resolve_mesh_sizes
from lit_ablate.strategies.ddp import DDPStrategy
from lit_ablate.strategies.deepspeed import DeepSpeedStrategy
from lit_ablate.strategies.fsdp1 import FSDP1Strategy
from lit_ablate.strategies.interface import StrategyInterface, interface_of
from lit_ablate.strategies.mesh import MeshStrategy, decoder_layers
from lit_ablate.strategies.mesh_parallel import MeshParallelStrategy
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
from lit_ablate.strategies.presets import (
    ContextParallelStrategy,
    ExpertContextParallelStrategy,
    ExpertParallelStrategy,
    ExpertTensorParallelStrategy,
    FSDP2Strategy,
    HSDPStrategy,
    TensorContextParallelStrategy,
    TensorParallelStrategy,
)
from lit_ablate.strategies.zero1 import ZeRO1Strategy

__all__ = [
    "MESH_DIMS",
    "ContextParallelStrategy",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "ExpertContextParallelStrategy",
    "ExpertParallelStrategy",
    "ExpertTensorParallelStrategy",
    "FSDP1Strategy",
    "FSDP2Strategy",
    "HSDPStrategy",
    "MeshParallelStrategy",
    "MeshSizes",
    "MeshStrategy",
    "PipelineParallelStrategy",
    "StrategyInterface",
    "TensorContextParallelStrategy",
    "TensorParallelStrategy",
    "ZeRO1Strategy",
    "decoder_layers",
    "interface_of",
    "resolve_mesh_sizes",
]

"""Strategies over one N-D device mesh (FSDP2, HSDP, expert, context, tensor and pipeline parallelism) and the
data-parallel baselines (DDP, ZeRO-1, FSDP1).

Configs select them by ``class_path`` (``lit_ablate.strategies.FSDP2Strategy``); research code
subclasses ``MeshStrategy``/``FSDP2Strategy`` and overrides one ``apply_*`` step.
"""

from lit_ablate.strategies.context_parallel import ContextParallelStrategy
from lit_ablate.strategies.ddp import DDPStrategy
from lit_ablate.strategies.expert_context_parallel import ExpertContextParallelStrategy
from lit_ablate.strategies.expert_parallel import ExpertParallelStrategy
from lit_ablate.strategies.expert_tensor_parallel import ExpertTensorParallelStrategy
from lit_ablate.strategies.fsdp1 import FSDP1Strategy
from lit_ablate.strategies.fsdp2 import FSDP2Strategy
from lit_ablate.strategies.hsdp import HSDPStrategy
from lit_ablate.strategies.mesh import MESH_DIMS, MeshStrategy, decoder_layers, resolve_mesh_sizes
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
from lit_ablate.strategies.tensor_context_parallel import TensorContextParallelStrategy
from lit_ablate.strategies.tensor_parallel import TensorParallelStrategy
from lit_ablate.strategies.zero1 import ZeRO1Strategy

__all__ = [
    "ContextParallelStrategy",
    "DDPStrategy",
    "ExpertContextParallelStrategy",
    "ExpertParallelStrategy",
    "ExpertTensorParallelStrategy",
    "FSDP1Strategy",
    "FSDP2Strategy",
    "HSDPStrategy",
    "MESH_DIMS",
    "MeshStrategy",
    "PipelineParallelStrategy",
    "TensorContextParallelStrategy",
    "TensorParallelStrategy",
    "ZeRO1Strategy",
    "decoder_layers",
    "resolve_mesh_sizes",
]

"""What a mesh strategy does differently when its process plays one rank of a larger job (``SimulatedRank``).

The process joins torch's fake process group (``start_fake_process_group``) before Lightning sets up,
so Lightning finds ``torch.distributed`` initialised and only learns its ranks from
``SimulatedRankEnvironment``: world size ``num_nodes`` (one device per "node"), this process the chosen
rank, no process launched. The mesh strategies then build the mesh of the whole job and apply every
step to this rank's share of the model, as on a real rank. Three things differ, because no other
rank exists to provide them:

- Weights: a real run builds the whole model on rank 0 and sends every rank its shards. A simulated
  rank builds on ``meta`` like every other rank and draws its own shards (``fill_shards``), so the
  whole model never exists in this process (a Qwen3-8B-shaped model would not fit host memory).
- Sizes a collective would tell: expert parallelism's token counts assume balanced routing (each
  rank receives as many token copies per expert as it sends: ``models.moe.dispatch``), and a pipeline's
  first stage takes the gradient metadata of its outputs from its own outputs
  (``mirror_next_stage_metadata``); a rank of a later stage would need its inputs' from a stage no
  process runs, so a simulated pipeline rank holds the first stage.
- Lightning's object broadcasts return this rank's own object (``MeshStrategy.broadcast``).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from torch import nn

from lit_ablate.simulated_rank import FAKE_BACKEND, SimulatedRank, current_simulation


class SimulatedRankEnvironment(ClusterEnvironment):
    """Lightning's view of a simulated job: ``num_nodes`` nodes of one device, this process rank ``rank``
    (its "node"), every other rank imaginary: nothing is launched, no address is needed."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._world_size = 1

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"  # never dialled: the fake process group needs no rendezvous

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False  # only ever passed as a plugin

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        self._world_size = size

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self._rank:
            raise RuntimeError(f"a simulated rank {self._rank} was given rank {rank}: build the trainer with devices=1")

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self._rank


def start_fake_process_group(simulation: SimulatedRank) -> None:
    """Join torch's fake process group as ``simulation.rank`` of ``simulation.world_size`` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the backend

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=simulation.rank, world_size=simulation.world_size)
    mirror_next_stage_metadata()


def simulated_trainer_arguments(simulation: SimulatedRank) -> dict[str, Any]:
    """The ``Trainer`` arguments that make it rank ``simulation.rank`` of the simulated job: one device per
    node, as many nodes as ranks, and the environment that says which. A simulated run trains only: its
    weights and losses are not a model's, so it validates nothing and saves no checkpoint."""
    return {
        "num_nodes": simulation.world_size,
        "devices": 1,
        "plugins": [SimulatedRankEnvironment(simulation.rank)],
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
    }


MATRIX_STD = 0.02
"""The standard deviation drawn shards of matrices get (transformers' ``initializer_range`` default)."""


@torch.no_grad()
def fill_shards(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's parameters and buffers (built on ``meta``) on ``device`` and draw them: matrices
    from N(0, 0.02), biases 0, other vectors (norm weights) 1, buffers 0 (rotary frequencies 0: positions
    do not rotate, which changes no tensor's size). Only the local shard of a DTensor is touched."""
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        model.to_empty(device=device)
    for name, parameter in model.named_parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if not local.is_floating_point():
            continue
        if parameter.dim() >= 2:
            local.normal_(0.0, MATRIX_STD)
        else:
            local.fill_(0.0 if name.endswith("bias") else 1.0)
    for buffer in model.buffers():
        buffer.zero_()


def mirror_next_stage_metadata() -> None:
    """Let a simulated pipeline stage take the gradient metadata the next stage would send it from its own
    outputs (an output's gradient has its shape and dtype). torch 2.13's ``PipelineStage`` receives it as a
    pickled object whose length a fake receive leaves unset (earlier versions derive it locally and need
    nothing here). Installed on torch's class once, by ``start_fake_process_group``: outside a simulation the
    stage receives as torch does, so a later real run in the same process is untouched."""
    from torch.distributed.pipelining.stage import PipelineStage

    received = getattr(PipelineStage, "_recv_meta", None)
    if received is None or getattr(received, "mirrors_in_simulation", False):
        return
    from torch.distributed.pipelining._utils import _StageBackwardMeta

    def receive(stage: Any, source_stage: int) -> Any:
        if current_simulation() is None:
            return received(stage, source_stage)
        if source_stage != stage.stage_index + 1:  # a later stage's inputs come from a stage no process runs
            raise RuntimeError(
                f"a simulated pipeline rank holds the first stage only (stage {stage.stage_index} "
                f"waits for stage {source_stage}'s outputs)"
            )
        return _StageBackwardMeta(backward_metas=stage._stage_meta.outputs)

    receive.mirrors_in_simulation = True
    PipelineStage._recv_meta = receive

"""Tied embeddings under pipeline parallelism: one matrix, held as two copies that stay equal.

A model with ``tie_word_embeddings`` uses one ``[vocab, hidden]`` matrix twice: as the input
embedding (the first stage's) and as the LM head (the last stage's). The stages live on different
ranks, so each holds its own copy (Megatron's layout): both copies start from rank 0's one matrix
(``PipelineParallelStrategy.materialize`` fills the head's copy from the embedding's values), and
after each batch's schedule their gradients are summed between the two stages, so both copies take
one process's gradient (the lookup's plus the head's) and the same update. The sum runs over the
*embedding group* of each pipeline: its first and its last stage at the same ``(dp_replicate,
dp_shard, ep, cp, tp)`` coordinate, whose copies hold the same slice of the matrix (FSDP's shard over
the same ranks, TP's same vocabulary rows: the embedding's ``RowwiseParallel`` and the head's
``ColwiseParallel`` both shard the weight ``Shard(0)``), which ``StageCopy.check_matches`` verifies
once. It runs beside the replicas' average and after FSDP's reduce-scatter, before the step objective
rescales, clipping and the optimizer step. Clipping counts the matrix once: the last stage's copy is
scaled with the rest but left out of the norm (``StageCopy.counted``).

When one rank holds both the first and the last stage (``pp = 1``), the model keeps its one shared
parameter and autograd adds the two gradients itself: nothing here applies.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss


@dataclass(frozen=True)
class TiedNames:
    """The names (in the ``CausalLMWithLoss``) of the one matrix a tied model uses twice."""

    embedding: str
    """The input embedding's weight: the first stage's copy."""
    head: str
    """The LM head's weight: the last stage's copy."""


def tied_names(model: CausalLMWithLoss) -> TiedNames | None:
    """The tied matrix's two names, read on the whole model before the split (None: untied)."""
    embedding, head = model.lm.get_input_embeddings(), model.lm.get_output_embeddings()
    if embedding is None or head is None or head.weight is not embedding.weight:
        return None
    modules = {id(module): name for name, module in model.named_modules()}
    return TiedNames(f"{modules[id(embedding)]}.weight", f"{modules[id(head)]}.weight")


@dataclass(frozen=True)
class StageCopy:
    """This rank's copy of the tied matrix (the embedding on a first stage, the LM head on a last one)
    and the group whose copies it is summed with.

    ``counted``: whether gradient clipping counts this copy in the global norm (the first stage's);
    the last stage's is the same matrix again, scaled but not counted."""

    parameter: nn.Parameter
    group: ProcessGroup
    counted: bool

    @property
    def repeated(self) -> list[nn.Parameter]:
        """What gradient clipping scales but does not count (``MeshStrategy.repeated_parameters``): the
        last stage's copy."""
        return [] if self.counted else [self.parameter]

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Sum this batch's gradients of the two copies (on both): each then holds the lookup's gradient
        plus the head's, as the one matrix of one process does. FSDP-sharded copies sum their shards."""
        if not self.parameter.requires_grad:  # a frozen base (adapters): neither copy trains
            return
        grad = self.parameter.grad  # FSDP's shard (rows of dim 0) or TP's rows: contiguous, summed in place
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)

    def check_matches(self) -> None:
        """Both copies must hold the same slice of the matrix: the same global and local shapes, the same
        placements on meshes of the same shape (each stage's DTensors live on its own sub-mesh)."""
        p = self.parameter
        layout = (
            (tuple(p.shape), tuple(p.to_local().shape), tuple(p.placements), tuple(p.device_mesh.shape))
            if isinstance(p, DTensor)
            else (tuple(p.shape), tuple(p.shape), (), ())
        )
        signature = torch.tensor([zlib.crc32(repr(layout).encode())], dtype=torch.int64, device=p.device)
        highest, lowest = signature.clone(), signature.clone()
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self.group)
        if not torch.equal(highest, lowest):
            raise RuntimeError(
                f"the tied embedding's copies on the first and last stage are laid out differently "
                f"(this rank's: {layout}); their gradients cannot be summed shard by shard"
            )


def stage_copy(model: CausalLMWithLoss, names: TiedNames, mesh: DeviceMesh) -> StageCopy | None:
    """This rank's ``StageCopy`` under a pipeline of ``mesh["pp"]`` stages, ``pp`` outermost (every rank
    calls it: the embedding groups are made together); None on a rank holding neither end."""
    firsts, lasts = mesh.mesh[0].flatten().tolist(), mesh.mesh[-1].flatten().tolist()
    pairs = [[first, last] for first, last in zip(firsts, lasts, strict=True)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    parameters = dict(model.named_parameters())
    held = [(parameters[name], name == names.embedding) for name in (names.embedding, names.head) if name in parameters]
    if group is None or not held:
        return None
    ((parameter, first),) = held
    copy = StageCopy(parameter, group, counted=first)
    copy.check_matches()
    return copy

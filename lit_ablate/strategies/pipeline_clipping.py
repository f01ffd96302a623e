"""Gradient clipping by the norm of the whole model's gradient when its stages live on different ranks.

Each rank holds one pipeline stage (or a few), so torch's ``clip_grad_norm_`` would clip every stage
by the norm of its own piece: a different, larger scale per stage than one process's. Here each rank
sums its gradients' squares (a sharded gradient's over the ranks that hold its other shards), the
stages add theirs over the pipeline group, and every stage scales by the one global norm, as torch
scales (``max_norm / (norm + 1e-6)`` when below 1).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_over_stages(parameters: Iterable[Tensor], max_norm: float, stage_group: ProcessGroup) -> Tensor:
    """Clip the gradients of every stage by their global L2 norm; returns that pre-clip norm (fp32, on CPU)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    # Sums of local squares per (mesh, placements): one all-reduce per kind of shard, not per gradient.
    kinds: dict[tuple, list[Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else (None, ())
        kinds.setdefault(key, []).append(grad)
    square = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, placements), same in kinds.items():
        square = square + _squared_norm(same, mesh, placements).to(device)
    dist.all_reduce(square, group=stage_group)
    total = square.sqrt().cpu()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for grad in grads:
            grad.mul_(coef)
    return total


def _squared_norm(grads: list[Tensor], mesh: DeviceMesh | None, placements: tuple) -> Tensor:
    """The squared norm of the whole gradients of which this rank holds pieces, the same on each holder.

    DTensors sharded over some mesh dimensions (FSDP's ``dp_shard``, a tensor-parallel shard) sum their
    local squares over those dimensions' groups, whose ranks all hold the same stage; partial ones
    (unreduced sums) take DTensor's own norm."""
    if mesh is None:
        return torch.stack([g.detach().float().square().sum() for g in grads]).sum()
    if any(placement.is_partial() for placement in placements):
        return torch.stack([torch.linalg.vector_norm(g.detach().float()).full_tensor().square() for g in grads]).sum()
    square = torch.stack([g.to_local().detach().float().square().sum() for g in grads]).sum()
    for dim, placement in enumerate(placements):
        if not placement.is_replicate():  # Shard, or FSDP's _StridedShard
            dist.all_reduce(square, group=mesh.get_group(dim))
    return square

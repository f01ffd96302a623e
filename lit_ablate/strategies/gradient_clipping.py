"""Gradient clipping by the norm of the whole model's gradient, wherever its pieces live.

torch's ``clip_grad_norm_`` takes the norm of the gradients it is given: under a mesh strategy those
are DTensors on several meshes (tensor-parallel weights on ``(dp, tp)``, the rest on ``dp``; experts
sharded over ``ep`` and then by FSDP over ``cp``, a mesh ``(cp, ep)`` against the root mesh's order,
which DTensor's redistribution refuses), and under a pipeline each rank holds only its stages, so it
would clip every stage by its own, larger scale. Here each rank sums its gradients' local squares
per kind of shard (mesh and placements), over the mesh dimensions each kind is sharded on; the
kinds add up, the stages add theirs over the pipeline group, and every rank scales by the one global
norm as torch scales (``max_norm / (norm + 1e-6)``, clamped at 1, on the device: no host read). A matrix two stages hold
(tied embeddings: ``pipeline_tied_embeddings``) is counted once: its second copy is scaled, not counted.
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
def clip_grad_norm_across_meshes(
    parameters: Iterable[Tensor],
    max_norm: float,
    stage_group: ProcessGroup | None = None,
    repeated: Iterable[Tensor] = (),
) -> Tensor:
    """Clip the gradients by their global L2 norm over every mesh they are sharded on and, with
    ``stage_group``, over the pipeline stages (every stage calls it, one without gradients too).
    ``repeated``: parameters among them whose gradient another stage holds too (counted there), which
    are scaled but not counted. Returns that pre-clip norm (fp32, on the gradients' device).

    Nothing is read back to the host: the scale ``min(1, max_norm / (norm + 1e-6))`` stays a device
    tensor and every gradient is multiplied by it, as torch's ``clip_grad_norm_`` does (by 1 when the
    norm is below ``max_norm``), so clipping never makes the host wait for the device."""
    kinds: dict[tuple, list[Tensor]] = {}  # one all-reduce per kind of shard, not per gradient
    uncounted = {id(p) for p in repeated}
    scaled_only = []
    for p in parameters:
        if p.grad is not None and id(p) in uncounted:
            scaled_only.append(p.grad)
        elif p.grad is not None:
            key = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else (None, ())
            kinds.setdefault(key, []).append(p.grad)
    device = next(iter(kinds.values()))[0].device if kinds else torch.device("cpu")
    squares = [_squared_norm(grads, mesh, placements).to(device) for (mesh, placements), grads in kinds.items()]
    square = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if stage_group is not None:
        dist.all_reduce(square, group=stage_group)
    total = square.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grads in [*kinds.values(), *([grad] for grad in scaled_only)]:
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]  # a plain scale on the shards
        torch._foreach_mul_(local, coef.to(local[0].device))
    return total


def _squared_norm(grads: list[Tensor], mesh: DeviceMesh | None, placements: tuple) -> Tensor:
    """The squared norm of the whole gradients of which this rank holds pieces, the same on each holder.

    DTensors sharded over some mesh dimensions (FSDP's shards, a tensor-parallel shard, an expert
    shard) sum their local squares over those dimensions' groups; partial ones (unreduced sums) are
    no sums of local squares and take DTensor's own norm."""
    if mesh is not None and any(placement.is_partial() for placement in placements):
        return torch.nn.utils.get_total_norm(grads).full_tensor().float().square()
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    square = torch.stack([t.detach().float().square().sum() for t in local]).sum()
    for dim, placement in enumerate(placements):
        if not placement.is_replicate():  # Shard, or FSDP's _StridedShard (which is_shard() does not count)
            dist.all_reduce(square, group=mesh.get_group(dim))
    return square

"""Whole tensors put together from the ranks' shards in the test process, without a collective.

``DTensor.full_tensor()`` on every weight of a model under a 2- or 3-dimensional mesh plans each
redistribution with a graph search (FSDP over tensor parallelism shards with ``_StridedShard``), once per
shape and mesh: about a third of a rank's time in ``test_mesh_triples.py``. A DTensor's local part sits at
a global offset its placements decide (``compute_local_shape_and_global_offset``, what
``torch.distributed.checkpoint`` saves by), so each rank returns its parts and the test process puts them
together; replicas must hold the same values where their parts overlap (bit for bit: they apply the
same reduced update).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_parts(state: dict[str, Tensor]) -> dict[str, tuple[Tensor, tuple[int, ...], tuple[int, ...]]]:
    """Each tensor's local part (a copy), with the global shape and the offset where it sits."""
    parts = {}
    for name, value in state.items():
        if isinstance(value, DTensor):
            _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            parts[name] = (value.to_local().detach().clone(), tuple(value.shape), tuple(offset))
        else:
            parts[name] = (value.detach().clone(), tuple(value.shape), (0,) * value.dim())
    return parts


def whole_weights(ranks: list[dict[str, Any]], key: str = "weights") -> list[dict[str, Any]]:
    """``ranks`` (each with ``key`` as ``local_parts``) with ``key`` holding whole tensors instead: every rank
    the tensors it holds a part of, put together from the parts of all ranks. Raises when two ranks' parts
    of one region differ (replicas drifted apart), or a region has no part (a shard lost)."""
    whole: dict[str, Tensor] = {}
    filled: dict[str, Tensor] = {}
    for rank in ranks:
        for name, (part, shape, offset) in rank[key].items():
            tensor = whole.setdefault(name, torch.zeros(shape, dtype=part.dtype))
            held = filled.setdefault(name, torch.zeros(shape, dtype=torch.bool))
            region = tuple(slice(start, start + size) for start, size in zip(offset, part.shape))
            if held[region].any():
                torch.testing.assert_close(tensor[region], part, rtol=0, atol=0, msg=f"replicas of {name} differ")
            tensor[region], held[region] = part, True
    for name, held in filled.items():
        assert held.all(), f"{name}: part of it is on no rank"
    return [{**rank, key: {name: whole[name] for name in rank[key]}} for rank in ranks]

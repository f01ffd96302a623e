"""What differs between the torch releases lit-ablate supports, named once.

The supported range starts at torch 2.11 (the GPU machines' build) and is developed on 2.13: where
the two disagree on a name or a behaviour the code needs, the difference lives here, so a call site
reads as on the newest torch and the oldest one still runs it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.torch_version import TorchVersion

FSDP2_SHARDS_INTEGER_WEIGHTS: bool = TorchVersion(torch.__version__) >= (2, 12)
"""Whether ``fully_shard`` can hold a frozen integer parameter (QLoRA's packed ``uint8`` 4-bit weights).
torch 2.11 builds each shard as a parameter that requires grad, then turns it off: an integer tensor
refuses the first step ("only Tensors of floating point dtype can require gradients")."""

DTENSOR_FLATTENS_SHARDED_SEQUENCES: bool = TorchVersion(torch.__version__) >= (2, 12)
"""Whether a linear layer takes a ``[B, T, D]`` DTensor sharded along ``T`` (it flattens ``B`` and ``T``):
what LoRA's ``lora_B`` gets under sequence parallelism. torch 2.11 refuses ("Attempted to flatten
multiple dimensions, with dimension 1 being sharded")."""


def all_gather_into(output: Tensor, input: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's ``input`` concatenated along dim 0 into ``output``: ``all_gather_single`` from torch
    2.13 on (which deprecates ``all_gather_into_tensor``), ``all_gather_into_tensor`` before (2.11 has
    no ``all_gather_single``)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def all_gather_autograd(x: Tensor, gather_dim: int, group: dist.ProcessGroup) -> Tensor:
    """``all_gather_into``'s autograd-aware, functional form (its backward reduce-scatters the gradient):
    ``all_gather_single_autograd`` from 2.13 on, ``all_gather_tensor_autograd`` (deprecated there) before."""
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(x, gather_dim=gather_dim, group=group)

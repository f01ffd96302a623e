"""``lit_ablate.torch_versions`` tells the truth about the torch it runs on.

CI runs torch 2.13; the GPU machines run 2.11, where the suite is run too (docs/platform.md, "The
oldest supported versions"). Seen there before these names existed: context parallelism and the
all-reduce expert dispatcher called ``dist.all_gather_single``, which 2.11 lacks (every CP run
failed on its first mask); FSDP2 over QLoRA's uint8 weights failed in ``fully_shard``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lit_ablate.torch_versions import DTENSOR_FLATTENS_SHARDED_SEQUENCES, FSDP2_SHARDS_INTEGER_WEIGHTS, all_gather_into


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_all_gather_into_gathers_with_this_torch_s_collective(one_rank_group):
    out = torch.empty(3, dtype=torch.int64)
    all_gather_into(out, torch.tensor([4, 5, 6]))
    assert out.tolist() == [4, 5, 6]


def test_fsdp2_holds_integer_weights_exactly_where_the_flag_says(one_rank_group):
    """A flag set for the wrong releases fails here: on 2.11 ``fully_shard`` raises where the flag
    says it holds the weights; on 2.13 it holds them where the flag says it cannot."""
    from torch.distributed.fsdp import fully_shard

    layer = nn.Linear(4, 4)
    layer.packed = nn.Parameter(torch.zeros(8, dtype=torch.uint8), requires_grad=False)
    mesh = init_device_mesh("cpu", (1,))
    if FSDP2_SHARDS_INTEGER_WEIGHTS:
        fully_shard(layer, mesh=mesh)
        assert layer.packed.dtype == torch.uint8 and not layer.packed.requires_grad
    else:
        with pytest.raises(RuntimeError, match="only Tensors of floating point dtype can require gradients"):
            fully_shard(layer, mesh=mesh)


def test_dtensor_flattens_a_sequence_sharded_input_exactly_where_the_flag_says(one_rank_group):
    """What LoRA's ``lora_B`` computes under sequence parallelism: a linear layer on ``[B, T, D]``
    sharded along ``T`` (refused on 2.11 whatever the mesh's size)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.randn(2, 4, 3), mesh, [Shard(1)])
    weight = distribute_tensor(torch.randn(5, 3), mesh, [Replicate()])
    if DTENSOR_FLATTENS_SHARDED_SEQUENCES:
        out = torch.nn.functional.linear(x, weight)
        torch.testing.assert_close(out.full_tensor(), x.full_tensor() @ weight.full_tensor().T)
    else:
        with pytest.raises(RuntimeError, match="Attempted to flatten multiple dimensions"):
            torch.nn.functional.linear(x, weight)

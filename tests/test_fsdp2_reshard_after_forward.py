"""``FSDP2Strategy(reshard_after_forward=...)`` reaches ``fully_shard``: what each decoder layer holds
between its forward and its backward.

FSDP2 registers a unit's parameters as sharded DTensors while it is sharded and as plain (whole)
tensors while it is gathered. So after the forward of the tiny Llama on 2 gloo ranks, before
backward: with ``reshard_after_forward: true`` (ZeRO-3) every decoder layer's parameters are
shards again; with ``false`` (ZeRO-2-like) they are still whole, and freed only after backward.
The numerics are the same either way (``test_strategies_equivalence.py`` trains both), and the
memory estimate's tolerance absorbs the difference, so nothing else notices if the option is lost.

Seen failing (by hand, once): ``FSDP2Strategy.fsdp_kwargs`` passing ``reshard_after_forward=True``
whatever the option: the ``false`` case finds all 4 layers sharded after forward.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import DTensor

from lit_ablate.models.causal_lm_with_loss import decoder_layers
from lit_ablate.strategies import FSDP2Strategy
from tests.distributed import run_ranks
from tests.test_strategies_equivalence import build_model, fixed_batch, rows_of


def _layer_states(rank: int, world_size: int, reshard_after_forward: bool) -> dict[str, list[bool]]:
    """Per decoder layer: are its parameters sharded DTensors after forward, and after backward?"""
    strategy = FSDP2Strategy(reshard_after_forward=reshard_after_forward)
    strategy.build_mesh("cpu", world_size)
    model = build_model(meta=rank != 0)
    layers = decoder_layers(model)  # before wrapping: fully_shard renames their classes (FSDPLlamaDecoderLayer)
    model = strategy.parallelize(model)

    def sharded() -> list[bool]:
        states = [{isinstance(p, DTensor) for p in layer.parameters()} for layer in layers]
        assert all(len(s) == 1 for s in states), "a layer with both sharded and whole parameters"
        return [s.pop() for s in states]

    before = sharded()
    loss_sum, useful = model(rows_of(fixed_batch(), rank, world_size))
    after_forward = sharded()
    (loss_sum / useful).backward()
    return {"before": before, "after_forward": after_forward, "after_backward": sharded()}


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_layers_are_sharded_after_forward_exactly_when_asked(reshard_after_forward):
    for states in run_ranks(_layer_states, 2, reshard_after_forward):
        layers = len(states["before"])
        assert layers == 4
        assert states["before"] == [True] * layers  # fully_shard leaves every unit sharded
        assert states["after_forward"] == [reshard_after_forward] * layers
        assert states["after_backward"] == [True] * layers  # backward frees the gathered parameters

"""``ZeRO1Strategy``: DDP whose optimizer states are sharded (torch's ``ZeroRedundancyOptimizer``)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from lightning.pytorch import Trainer
from torch.optim import Optimizer

from lit_ablate.strategies.ddp import DDPStrategy
from lit_ablate.strategies.state_sharding import StateSharding

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


class ZeRO1Strategy(DDPStrategy):
    """ZeRO stage 1: full replicas and all-reduced gradients, but each rank keeps the optimizer
    states of only its share of the parameters, updates that share, and broadcasts it.

    Choose it to see what sharding only the optimizer states saves over ``DDPStrategy``
    (Adam's two moments are 2/3 of fp32 training state): same numerics, one extra broadcast of
    the updated parameters per step. The LightningModule's optimizer (any ``torch.optim`` class
    and its parameter groups) is rebuilt as a ``ZeroRedundancyOptimizer`` after
    ``configure_optimizers``, and its learning-rate schedulers are pointed at the new one.
    Takes the ``DDPStrategy`` arguments (bucket size, comm hooks, ...).
    """

    def state_sharding(self, world_size: int) -> StateSharding:
        return StateSharding(optimizer=world_size)

    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        sharded = [shard_optimizer_states(optimizer) for optimizer in self.optimizers]
        for config in self.lr_scheduler_configs:
            config.scheduler.optimizer = sharded[self.optimizers.index(config.scheduler.optimizer)]
        self.optimizers = sharded


def shard_optimizer_states(optimizer: Optimizer) -> ZeroRedundancyOptimizer:
    """The same optimizer (class, hyper-parameters, groups incl. scheduler keys) with sharded states.
    ``torch.distributed.optim`` is imported here, not with the strategies: ~0.3 s of every run's start-up."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    # ``defaults`` can hold keys the class sets itself (AdamW: decoupled_weight_decay): pass only its arguments.
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)

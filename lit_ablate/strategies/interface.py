"""``StrategyInterface``: everything lit-ablate's modules and callbacks may ask a training strategy.

Declared once, instead of probing a strategy's attributes. lit-ablate's strategies inherit it and
override what differs from a plain data-parallel strategy; Lightning's own strategies (baselines
named by alias or ``class_path``: ``ddp``, ``FSDPStrategy``, ``DeepSpeedStrategy``, a single device)
are answered by ``LightningStrategyAnswers``, which knows them by type. Ask ``interface_of(strategy)``.

A custom strategy implements this interface by inheriting it next to its Lightning base
(``examples/custom_strategy.py``) and overriding the answers that change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy, ParallelStrategy, Strategy
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import ConfigError
from lit_ablate.strategies.state_sharding import REPLICATED, StateSharding, lightning_state_sharding

UnitLoss = Callable[[tuple[Tensor, ...], dict[str, Any]], Tensor]
"""A micro-batch's loss from the model's outputs for it (``StrategyInterface.forward_backward``)."""

if TYPE_CHECKING:
    from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss


class ObjectiveScale(Protocol):
    """What a strategy that runs forward and backward itself reads and fixes of the step objective
    (``StepObjective``, which asks this interface for the gradient group, so it is named here by what
    ``forward_backward`` uses of it): the run constant ``c`` and whether the step has begun."""

    scale: float | None

    @property
    def step_started(self) -> bool: ...

    def agree_scale(self, local_units: int, device: torch.device, group: dist.ProcessGroup | None) -> None: ...


class StrategyInterface:
    """The answers of a strategy, with a plain data-parallel strategy's as defaults.

    ``strategy`` is the Lightning strategy the answers are about: the object itself for
    lit-ablate's strategies (which inherit this class), the wrapped one in ``LightningStrategyAnswers``.
    """

    @property
    def strategy(self) -> Strategy | None:
        return self  # type: ignore[return-value]  (lit-ablate's strategies are Lightning strategies)

    @property
    def gradient_mean_group(self) -> tuple[dist.ProcessGroup | None, int]:
        """The ranks whose gradients the strategy averages, and how many: the step objective sums each
        step's useful tokens over them (``StepObjective``) and undoes the average's division once."""
        strategy = self.strategy
        size = strategy.world_size if strategy is not None else 1
        if size > 1 and dist.is_available() and dist.is_initialized():
            return dist.group.WORLD, size
        return None, 1

    @property
    def batch_replicas(self) -> int:
        """Ranks that process the very same tokens (tensor-parallel peers, the stages of one pipeline):
        throughput and MFU count their tokens once, so a ``pp x tp`` group counts the model once."""
        return 1

    @property
    def flops_share(self) -> float:
        """This rank's share of the model FLOPs of the batch it reads, before ``batch_replicas`` divides it
        (``MFUMonitor``: ``flops_share / batch_replicas``); 1 unless ranks that read one batch split
        its work otherwise (context parallelism: ``1 / cp``). A pipeline's stages count ``1 / pp`` each
        through ``batch_replicas``, whatever their split."""
        return 1.0

    @property
    def sampler_replicas(self) -> dict[str, int]:
        """``{"num_replicas", "rank"}``: how many different batches a step reads, and this rank's."""
        strategy = self.strategy
        if isinstance(strategy, ParallelStrategy):
            return dict(strategy.distributed_sampler_kwargs)
        return {"num_replicas": 1, "rank": 0}

    @property
    def sequence_multiple(self) -> int:
        """What every row's length must be a multiple of for a forward to run (1: any length); a forward of
        the callbacks' own (greedy generation) pads its rows to it."""
        return 1

    @property
    def has_compile_step(self) -> bool:
        """Whether the strategy compiles layers in its own pipeline step (then the module must not)."""
        return False

    @property
    def runs_forward_backward(self) -> bool:
        """Whether ``forward_backward`` runs each training step (a pipeline runs forward and backward
        of its stages inside one schedule); otherwise the module runs forward and Lightning backward."""
        return False

    def forward_backward(
        self,
        model: CausalLMWithLoss,
        batch: dict[str, Any],
        objective: ObjectiveScale,
        unit_loss: UnitLoss | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(loss_sum, useful_tokens)`` of the batch after its forward and backward (see ``runs_forward_backward``).

        ``unit_loss(outputs, micro_batch)``: for a loss that is not the model's own token loss (DPO's
        pair losses), a vector whose first entry is the loss sum of a micro-batch's units, computed from
        the model's outputs for it (``head_outputs``); the rest are sums to report. The step's units
        are then the batch's pairs and ``loss_sum`` the summed vector."""
        raise NotImplementedError(f"{type(self).__name__} leaves forward and backward to the module and Lightning")

    def schedule_timing(self) -> tuple[float, float] | None:
        """``(schedule seconds, this rank's compute seconds)`` of the last step, for a strategy whose step
        is a schedule with idle time (``PipelineBubbleMonitor``); None otherwise."""
        return None

    @property
    def fallbacks(self) -> list[str]:
        """What ran instead of what the strategy's config named, in words (the run record's ``fallbacks``)."""
        return []

    @property
    def schedule_bubble(self) -> float | None:
        """The idle share the step's schedule has by itself, with equal stages and free communication; None
        for a strategy whose step has no schedule."""
        return None

    def state_sharding(self, world_size: int) -> StateSharding:
        """How the strategy divides training state over ``world_size`` ranks (the memory estimate)."""
        return REPLICATED

    def ends_optimizer_step(self) -> bool:
        """Whether the backward just run was its optimizer step's last. Lightning calls the optimizer step
        once per step, except for a strategy that accumulates micro-batches itself (DeepSpeed), which it
        calls after every micro-batch: that one answers for each."""
        return True

    @torch.no_grad()
    def scale_gradients(self, parameters: Iterable[nn.Parameter], factor: Tensor) -> None:
        """Multiply the step's gradients by ``factor`` (the step objective's, a device scalar) before clipping
        and the optimizer: on ``param.grad`` (a DTensor's local shard), where they live by default."""
        grads, trainable = [], False
        for p in parameters:
            trainable |= p.requires_grad
            if p.grad is not None:
                grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        if trainable and not grads:
            raise ConfigError(
                TRAINER_STRATEGY_KEY,
                type(self.strategy).__name__,
                "lit-ablate rescales each step's gradients to the global token mean after backward, and this "
                "strategy keeps them outside param.grad without saying how to scale them (StrategyInterface."
                "scale_gradients); use a lit-ablate strategy (lit_ablate.strategies.DeepSpeedStrategy for DeepSpeed)",
            )
        groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for grad in grads:
            groups.setdefault((grad.dtype, grad.device), []).append(grad)
        for same_kind in groups.values():
            torch._foreach_mul_(same_kind, factor.to(same_kind[0].device))

    def held_tensors(self) -> dict[str, list[Tensor]]:
        """What the strategy keeps for training besides the module's parameters, their ``.grad`` and the
        optimizer's state, by memory category (``params``, ``grads``, ``optimizer``): the tensors
        ``MemoryMonitor`` counts there. None by default; DeepSpeed's partitions."""
        return {}

    def gradients_in_full(self) -> AbstractContextManager:
        """A context in which every parameter's ``.grad`` is its whole gradient, or a DTensor of it (whose
        reductions span its shards), on every rank that holds the parameter (``GradientFingerprint``):
        nothing to do where gradients live on the parameters (the default); FSDP1's flat parameters are
        gathered for the while. Every rank enters it."""
        return nullcontext()


def flat_parameter_gradients_in_full(root: nn.Module) -> AbstractContextManager:
    """FSDP1's ``gradients_in_full``: its original parameters (``use_orig_params``) hold views of this
    rank's flat shard only; gathered whole, gradients included, and not written back (the whole model on
    every rank for the while: twice its size in memory)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(root, writeback=False, with_grads=True)


class LightningStrategyAnswers(StrategyInterface):
    """The answers for one of Lightning's own strategies (or none: a module outside a trainer)."""

    def __init__(self, strategy: Strategy | None) -> None:
        self._strategy = strategy

    @property
    def strategy(self) -> Strategy | None:
        return self._strategy

    def state_sharding(self, world_size: int) -> StateSharding:
        return lightning_state_sharding(self._strategy, world_size) if self._strategy is not None else REPLICATED

    def gradients_in_full(self) -> AbstractContextManager:
        if isinstance(self._strategy, FSDPStrategy):
            return flat_parameter_gradients_in_full(self._strategy.model)
        return nullcontext()


def interface_of(strategy: Strategy | None) -> StrategyInterface:
    """What to ask ``strategy``: itself when it is a lit-ablate strategy, else Lightning's defaults."""
    return strategy if isinstance(strategy, StrategyInterface) else LightningStrategyAnswers(strategy)


def state_sharding_of(strategy: Strategy | str, world_size: int) -> StateSharding:
    """The sharding of a configured strategy: a lit-ablate strategy, a Lightning strategy, or its name."""
    if isinstance(strategy, str):
        return lightning_state_sharding(strategy, world_size)
    return interface_of(strategy).state_sharding(world_size)

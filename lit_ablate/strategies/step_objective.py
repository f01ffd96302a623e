"""``StepObjective``: every optimizer step trains the *global* mean over the step's loss units.

The objective of one optimizer step is the sum of per-unit losses (token losses for language
modelling, pair losses for DPO) over all micro-batches and data-parallel (and context-parallel)
ranks of the step, divided by the number of those units. Dividing each micro-batch by its own
count, as Lightning's accumulation and DDP/FSDP's gradient averaging then average again, trains a
*mean of means*: a different model whenever counts differ between micro-batches or ranks (SFT,
packing, DPO). transformers fixed the same bug with ``num_items_in_batch``; torchtitan fetches a
step's micro-batches first and all-reduces their count.

lit-ablate works on any data module (streaming ones included), so it cannot read ahead. Instead
each micro-batch backpropagates its loss *sum* divided by a run constant ``c``; after the step's
last backward, one all-reduce sums the step's units ``N`` over the ranks whose gradients the
strategy averages (``W`` of them), and the gradients are multiplied by ``W * A * c / N``, which
undoes Lightning's division by ``accumulate_grad_batches`` (``A``) and the strategy's division
by ``W`` exactly once. This happens inside the optimizer closure, so gradient clipping, every
``on_before_optimizer_step`` hook and the optimizer see the gradient of the true objective.

``c`` is a power of two near the units of one micro-batch (agreed by all ranks on the first
step): dividing by a power of two is exact in floating point, so the result does not depend on
it, while the backpropagated loss keeps the magnitude of a per-unit mean (fp16 loss scaling
behaves as usual).

Extra per-micro-batch losses (MoE router losses) are weighted by their micro-batch's units, like
the unit losses: the step's objective is ``sum_mb(loss_sum_mb + units_mb * extra_mb) / N``, which
is the plain mean of the extras when micro-batches hold equal counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from torch.distributed import ProcessGroup

from lit_ablate.strategies.interface import interface_of


class StepObjective:
    """Accumulates one optimizer step's loss units and rescales its gradients to the global mean.

    Use: ``loss = objective.backward_loss(loss_sum, units, extra, strategy)`` in ``training_step`` (return
    it as the loss), and ``objective.normalize_gradients(...)`` after the step's last backward
    (``CausalLM.optimizer_step`` wraps the optimizer closure for this).
    """

    def __init__(self) -> None:
        self.scale: float | None = None
        self._units: Tensor | None = None
        self._loss_sum: Tensor | None = None
        self.last_step_loss: Tensor | None = None
        """The finished step's exact loss (sum over ranks / units over ranks), for logging."""

    def backward_loss(
        self, loss_sum: Tensor, units: Tensor, extra: Tensor | float, strategy: Strategy | None
    ) -> Tensor:
        """The loss to backpropagate for one micro-batch: ``(loss_sum + units * extra) / c``.

        ``units`` is this micro-batch's count (a tensor: it stays on the device, no host sync).
        """
        if self.scale is None:
            self.agree_scale(int(units), loss_sum.device, interface_of(strategy).gradient_mean_group[0])
        self._units = units.detach() if self._units is None else self._units + units.detach()
        detached = loss_sum.detach().float()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        if isinstance(extra, float) and extra == 0.0:  # no extra losses (a dense model): two operators fewer
            return loss_sum / self.scale
        return (loss_sum + units * extra) / self.scale

    @property
    def step_started(self) -> bool:
        """Whether earlier micro-batches of this optimizer step were counted (accumulation): the gradients
        on the parameters are then this step's, not the previous one's."""
        return self._units is not None

    def agree_scale(self, local_units: int, device: torch.device, group: ProcessGroup | None) -> None:
        """Fix ``c`` once per fit: the largest first-micro-batch unit count over ``group``, rounded to a
        power of two (>= 1). Every rank must use the same constant, or the strategy's gradient average
        would weigh the ranks differently (a pipeline strategy calls it with its data-parallel group)."""
        if group is not None:
            value = torch.tensor([float(local_units)], device=device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
            local_units = int(value.item())
        self.scale = float(2 ** round(math.log2(max(local_units, 1))))

    @torch.no_grad()
    def normalize_gradients(
        self, parameters: Iterable[torch.nn.Parameter], strategy: Strategy, accumulate_grad_batches: int
    ) -> None:
        """Multiply the step's gradients by ``W * A * c / N`` (see the module docstring) and reset."""
        answers = interface_of(strategy)
        if self._units is None or not answers.ends_optimizer_step():
            return  # the step backpropagated nothing (training_step returned None), or is still accumulating
        group, size = answers.gradient_mean_group
        # float64: exact unit counts far beyond the 2^24 tokens per step where float32 would round.
        totals = torch.stack([self._units.double(), self._loss_sum.double()])
        if group is not None:
            dist.all_reduce(totals, group=group)
        units, loss_sum = totals[0], totals[1]
        factor = ((size * accumulate_grad_batches * self.scale) / units.clamp(min=1)).float()
        answers.scale_gradients(parameters, factor)
        self.last_step_loss = loss_sum / units.clamp(min=1)
        self._units = self._loss_sum = None

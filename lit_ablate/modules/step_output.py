"""What a LightningModule's ``training_step`` returns: the interface measurement callbacks read.

Modules never time anything; they say what they processed. Callbacks receive this dict as
``outputs`` in ``on_train_batch_end`` (one per micro-batch; they sum over gradient accumulation).
A custom module that returns these keys gets every lit-ablate callback for free.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from torch import Tensor


class StepOutput(TypedDict):
    loss: Tensor
    """The loss backpropagated (``StepObjective.backward_loss``): this micro-batch's share of the
    step's objective, up to a constant that the gradient rescaling at the step's end removes."""
    loss_sum: Tensor
    """Detached sum of the token losses (exact loss averaging across micro-batches and ranks)."""
    tokens: int
    """Every position in the batch, padding included: what the hardware processed."""
    useful_tokens: Tensor
    """Positions whose label counts in the loss: what training learned from."""
    loss_units: NotRequired[Tensor]
    """What ``loss_sum`` averages over when it is not ``useful_tokens`` (DPO: preference pairs)."""
    flops: float
    """Analytic training FLOPs of this micro-batch's real tokens (``estimate.batch_model_flops``:
    padding excluded, each document at its own context)."""

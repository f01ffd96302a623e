"""Parts with a bug or a failure planted on purpose, for tests that must see a study's checks fail or a
study's run die.

A study names one by ``class_path`` (``tests.planted_bugs.FirstExpertGradientScaled``): its runs are
``lit-ablate fit`` processes, so the repository root must be on their ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import signal

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from lit_ablate.models.moe.blocks import moe_blocks
from lit_ablate.strategies import FSDP2Strategy

FIRST_EXPERT_SCALE = 1.01


class FirstExpertGradientScaled(FSDP2Strategy):
    """FSDP2 whose backward leaves expert 0's gate/up gradient in every MoE layer scaled by 1.01: a bug the
    loss of a few AdamW steps cannot show (Adam divides a gradient's scale out) and one step's gradient
    norms do (docs/moe.md#studies)."""

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        for block in moe_blocks(self.lightning_module):
            grad = block.experts.gate_up_proj.grad
            assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), grad  # FSDP2 shards experts on dim 0
            if self.global_rank == 0:  # rank 0's shard starts at expert 0
                grad.to_local()[0].mul_(FIRST_EXPERT_SCALE)


class PreemptedAfterStep(Callback):
    """Kills the run's whole process group (every rank, at once, as a pre-empted node) when optimizer step
    ``step`` ends, unless the fit resumed from a checkpoint: the same config then trains to its end."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        if trainer.global_step == self.step and trainer.ckpt_path is None:
            os.killpg(os.getpgrp(), signal.SIGKILL)

"""A custom metric: the gradient norm before clipping, a per-step series of every run record.

Subclass ``StepMonitor``, compute in a Lightning hook, ``record()`` once per optimizer step in
``measure()``. Use it from YAML without touching lit-ablate:

    trainer:
      callbacks:
        - class_path: examples.custom_metric.GradNormMonitor   # run from the repository root

or on the command line, from the repository root (``lit-ablate`` puts the working directory on the
Python path, as ``python -m`` does; from elsewhere, put the folder holding ``examples/`` on
``PYTHONPATH``):

    lit-ablate fit --config configs/quickstart.yaml --trainer.callbacks+=examples.custom_metric.GradNormMonitor

Each step of the run record (``run.json``, ``steps[].grad_norm``) then carries it, in a study's runs too.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer

from lit_ablate.callbacks import StepMonitor


class GradNormMonitor(StepMonitor):
    """Global L2 norm of the gradients before clipping (a sign of instability when it spikes)."""

    def __init__(self, warmup_steps: int | None = None) -> None:
        super().__init__(warmup_steps=warmup_steps)
        self._norm: float | None = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        grads = [p.grad.detach().float() for p in pl_module.parameters() if p.grad is not None]
        self._norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        self.record("grad_norm", step, self._norm)

"""Every rank's gradient of one step is one process's gradient, under the replicating strategies.

``test_step_objective.py`` compares weights after 5 AdamW steps with clipping. A bug that scales
each rank's whole gradient by a constant of its own survives that under DDP, ZeRO-1, HSDP (over
``dp_replicate``) and DDP with accumulation: each rank keeps a full replica, clipping brings every
rank's gradient back to norm 1, and Adam divides the scale out again. Such a bug is normalising by
the rank's *local* useful tokens instead of the step's global count (``StepObjective`` skipping the
all-reduce of the unit count). So this test reads the gradients where that scale is still visible:
in ``on_before_optimizer_step``, after ``StepObjective`` normalised them and before clipping and the
optimizer, on every rank, after ONE step of ``test_step_objective``'s data (rank 0 reads the long
rows, rank 1 the short: 53 against 2 useful tokens on step 1; ``ddp_accumulate`` splits rank 0's
rows into micro-batches of 28 and 25).

Seen failing (by hand, once): ``StepObjective.normalize_gradients`` dividing by the rank's own
units (``factor = W * A * c / self._units``, the loss still summed over ranks for logging) fails
all four variants: rank 0's gradients off by 8.7e-3 (x 55/53), rank 1's by 6.1 (x 55/2), while the
two-rank ddp, zero1, hsdp and ddp_accumulate tests of ``test_step_objective.py`` pass under it.
Measured without the bug: at most 3e-8 (summation order).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import DDPStrategy, HSDPStrategy, ZeRO1Strategy, interface_of
from tests.distributed import run_ranks
from tests.test_step_objective import micro_batches

GRAD_ATOL = 1e-6
"""Same token losses summed in another order: measured <= 3e-8 on gradient entries up to 0.23."""
STRATEGIES = {
    "ddp": DDPStrategy,
    "zero1": ZeRO1Strategy,
    "hsdp": lambda: HSDPStrategy(dp_replicate=2, dp_shard=1),
    "ddp_accumulate": DDPStrategy,
}


class FirstStepGradients(Callback):
    """The whole gradient of every parameter on the first optimizer step, as clipping would see it."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0 and interface_of(trainer.strategy).ends_optimizer_step():
            with interface_of(trainer.strategy).gradients_in_full():
                self.grads = {
                    name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                    for name, p in pl_module.model.named_parameters()
                }


def first_step_gradients(
    variant: str, strategy="auto", devices: int = 1, rank: int = 0, accelerator: str = "cpu"
) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    module = CausalLM(ModelFactory(preset="tiny-llama"), learning_rate=1e-2, warmup_steps=0, weight_decay=0.1)
    grads = FirstStepGradients()
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=1,
        accumulate_grad_batches=2 if variant == "ddp_accumulate" else 1,
        callbacks=[grads],
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(micro_batches(variant, rank), batch_size=None))
    return grads.grads


def _two_rank_gradients(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: first_step_gradients("ddp_accumulate" if name == "ddp_accumulate" else "ranks", make(), 2, rank)
        for name, make in STRATEGIES.items()
    }


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """One process, the step's four rows in one micro-batch: its mean is the step's global token mean."""
    return first_step_gradients("reference")


@pytest.fixture(scope="module")
def two_rank_gradients() -> list[dict]:
    return run_ranks(_two_rank_gradients, 2, init_process_group=False, timeout_s=300)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_rank_s_first_gradient_equals_one_process_s(reference, two_rank_gradients, name):
    assert sorted(reference) == sorted(two_rank_gradients[0][name])
    assert max(g.abs().max() for g in reference.values()) > 0.1, "gradients too small to show a scale"
    for rank, run in enumerate(two_rank_gradients):
        for param, grad in reference.items():
            torch.testing.assert_close(
                run[name][param],
                grad,
                rtol=0,
                atol=GRAD_ATOL,
                msg=lambda m, p=param, r=rank: f"rank {r}, gradient of {p}: {m}",
            )

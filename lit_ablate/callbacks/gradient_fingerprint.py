"""``GradientFingerprint``: every parameter's gradient norm at one optimizer step, whatever the layout."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lit_ablate.callbacks.record_section import RecordSection
from lit_ablate.errors import ConfigError
from lit_ablate.models.moe.experts import RoutedExperts
from lit_ablate.record import GRADIENTS_SECTION
from lit_ablate.strategies.interface import interface_of

WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Name segments that sharding, activation checkpointing and compile wrappers insert: left out, so that a
parameter has one name in every layout."""


class GradientFingerprint(RecordSection):
    """Records each trainable parameter's gradient L2 norm at optimizer step ``step`` into the run record
    (``run.json["gradients"]``: ``{"step", "norms": {name: [norm, ...]}}``), so that runs of the same model
    under different layouts can be compared tensor by tensor (a study's ``expect_equal_gradients``).

    Read where the optimizer would read them: after the step objective rescaled the step's gradients to
    its global token mean and before gradient clipping (Lightning calls ``on_before_optimizer_step`` between
    the two). A parameter is named by its name in the model, without the wrappers' segments
    (``WRAPPER_SEGMENTS``), and its norm is that of its whole gradient: a DTensor's norm is reduced over
    every mesh it is sharded on (FSDP2, tensor and expert parallelism), FSDP1's flat parameters are
    unsharded for the while (``StrategyInterface.gradients_in_full``), plain gradients are whole on every
    data-parallel rank, and each pipeline stage adds the parameters it holds to rank 0's record. Stacked
    expert weights (``[experts, ...]``) get one norm per expert, so a bug in one expert's gradient shows at its
    own size and names its expert, not diluted in the norm of all of them.

    Norms are computed in float64 from one parameter's gradient at a time: the record's own rounding stays
    far below float32's (about 1e-7 of a norm), which two layouts of one model differ by.

    Args:
        step: the optimizer step (1-based) whose gradients are recorded. Step 1 compares layouts before any
            update: from step 2 on a float32 MoE's top-k routing may split near-ties differently per layout.
    """

    def __init__(self, step: int = 1) -> None:
        super().__init__(GRADIENTS_SECTION)
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ConfigError("trainer.callbacks[GradientFingerprint].init_args.step", step, "use 1 or more")
        self.step = step
        self._norms: dict[str, list[float]] | None = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        if trainer.global_step + 1 != self.step or self._norms is not None:
            return
        with interface_of(trainer.strategy).gradients_in_full():
            norms = gradient_norms(pl_module)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[dict[str, list[float]] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, norms)
            norms = {}
            for rank_norms in gathered:  # a pipeline's stages hold different parameters; the first holder names it
                for name, values in rank_norms.items():
                    norms.setdefault(name, values)
        self._norms = dict(sorted(norms.items()))

    def record_section(self) -> dict[str, Any] | None:
        if self._norms is None:
            return None
        return {"step": self.step, "norms": self._norms}


@torch.no_grad()
def gradient_norms(module: torch.nn.Module) -> dict[str, list[float]]:
    """``{name: [norm]}`` of every parameter of ``module`` that has a gradient, ``[norm per expert]`` for
    stacked expert weights; every rank that holds a parameter gets its whole gradient's norms."""
    experts = {
        id(getattr(owner, name))
        for m in module.modules()
        if isinstance(m, RoutedExperts)
        for owner, name in m.expert_dim_parameters()
    }
    norms = {}
    for name, param in module.named_parameters():
        if param.grad is not None:
            norms[parameter_name(name)] = _norms(param.grad, per_row=id(param) in experts)
    return norms


def _norms(grad: Tensor, per_row: bool) -> list[float]:
    squares = grad.detach().to(torch.float64).square()
    if not per_row:
        squares = squares.sum().reshape(1)
    elif grad.dim() > 1:
        squares = squares.sum(dim=tuple(range(1, grad.dim())))
    if isinstance(squares, DTensor):
        squares = squares.full_tensor()  # the sum over every shard of the gradient
    return squares.sqrt().tolist()


def parameter_name(name: str) -> str:
    """``name`` without the segments wrappers insert (``WRAPPER_SEGMENTS``)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)

"""``LossChoice``: a configured loss backend (``model.init_args.loss`` and ``loss_options``), judged in one place.

The module builds its loss from it, the tensor-parallel step asks it whether the backend computes
on a vocabulary-sharded LM head, and the rules ask it whether the backend runs here,
so what a loss name means is decided here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.cross_entropy import (
    LOSS_BACKENDS,
    LOSS_KEY,
    LOSS_OPTIONS_KEY,
    LossBackend,
    check_loss_backend,
    loss_backend,
    named_class,
)

VOCABULARY_PARALLEL_LOSSES = ("torch", "chunked")
"""The backends that compute on an LM head whose vocabulary rows are split over ranks (``tp > 1``)."""


@dataclass(frozen=True)
class LossChoice:
    """A loss backend's name and its options, as a config gives them."""

    name: str = "torch"
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of_backend(cls, backend: LossBackend) -> LossChoice:
        """What a built backend was chosen as: its name in ``LOSS_BACKENDS`` (its class name when none
        registers it) and its ``z_loss_weight``, the option tensor parallelism judges."""
        names = {backend_class: name for name, backend_class in LOSS_BACKENDS.items()}
        name = names.get(type(backend), type(backend).__name__)
        return cls(name, {"z_loss_weight": getattr(backend, "z_loss_weight", 0.0)})

    @property
    def registered(self) -> bool:
        """Whether the name is one of ``LOSS_BACKENDS`` (an unknown one is the run's own error)."""
        return self.name in LOSS_BACKENDS

    @property
    def z_loss_weight(self) -> float:
        return float(self.options.get("z_loss_weight") or 0.0)

    def check_named(self) -> None:
        """Raise ``ConfigError`` for a name no backend has, or an option the backend does not take (what
        ``build`` refuses, without building it: a study checks every variant before the first runs)."""
        named_class(LOSS_BACKENDS, self.name, dict(self.options), key=LOSS_KEY, options_key=LOSS_OPTIONS_KEY)

    def build(self) -> LossBackend:
        """The backend (``loss_backend``): unknown names, options or values raise ``ConfigError``."""
        return loss_backend(self.name, **self.options)

    def check_runs_here(self, compute_dtype: str | None = None) -> None:
        """Raise ``ConfigError`` when the backend cannot run here at ``compute_dtype`` (``check_loss_backend``)."""
        check_loss_backend(self.name, compute_dtype=compute_dtype, **self.options)

    def check_tensor_parallel(self) -> None:
        """Raise ``ConfigError`` when the backend cannot compute on a vocabulary-sharded LM head."""
        check_tensor_parallel_loss(self.name, self.z_loss_weight)


def check_tensor_parallel_loss(loss: str, z_loss_weight: float = 0.0) -> None:
    """Only ``torch`` (without z-loss) and ``chunked`` compute on a vocabulary-sharded LM head. Raises
    ``ConfigError`` naming the key (the tensor-parallel step's check and the ablation runner's up-front one)."""
    if loss not in VOCABULARY_PARALLEL_LOSSES:
        raise ConfigError(
            LOSS_KEY,
            loss,
            "tensor parallelism computes the loss on a vocabulary-sharded LM head, "
            "which only the 'torch' and 'chunked' backends do; use loss: chunked or loss: torch",
        )
    if loss == "torch" and z_loss_weight:
        raise ConfigError(
            f"{LOSS_OPTIONS_KEY}.z_loss_weight",
            z_loss_weight,
            "z-loss needs the log-sum-exp over the whole vocabulary, which the 'torch' backend's "
            "loss_parallel never gathers; use loss: chunked (it all-reduces it) or 0",
        )

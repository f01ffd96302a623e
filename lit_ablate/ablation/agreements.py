"""A study's checks that its variants train the same model: ``expect_equal_loss`` and ``expect_equal_gradients``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from lit_ablate.ablation.launch import mapping_at
from lit_ablate.errors import ConfigError


@dataclass(frozen=True)
class LossAgreement:
    """``expect_equal_loss``: variants' loss series must match a reference's over the first ``steps``.

    Passes at a step when ``|loss - reference_loss| <= atol + rtol * |reference_loss|``. The
    reference is the baseline, or with ``across: AXIS_KEY`` (grids) the variant that differs only
    in that axis and holds the baseline's value of it: in a loss-backend × dtype grid,
    ``across: model.init_args.loss`` compares backends within each dtype, since a dtype is
    expected to change the loss. ``approximate`` names variants that approximate the reference by
    design (compressed gradient communication): their Δ loss is shown and not checked, so one study
    asserts the exact variants and shows how far the approximate ones go.
    """

    rtol: float = 1e-4
    atol: float = 1e-5
    steps: int | None = None
    across: str | None = None
    approximate: tuple[str, ...] = ()


@dataclass(frozen=True)
class GradientAgreement:
    """``expect_equal_gradients``: at optimizer step ``step``, every parameter's gradient norm (one per expert
    for stacked expert weights) must match the baseline's, seed by seed (``GradientFingerprint`` records them).

    Passes when every ``|norm - baseline_norm| <= rtol * largest``, ``largest`` being the tensor's largest
    norm in the baseline (its largest expert's, for stacked experts). Gradients before any update compare the
    layouts of one model where a loss curve cannot: a float32 MoE's top-k routing may split near-ties
    differently per layout once the weights have moved, after which no loss tolerance tells rounding from a
    bug, and Adam hides a gradient's scale from the loss (docs/moe.md#studies).
    """

    rtol: float = 1e-5
    step: int = 1
    approximate: tuple[str, ...] = ()
    """As ``LossAgreement.approximate``: variants whose gradients differ by design, shown, not checked."""


_Agreement = TypeVar("_Agreement", LossAgreement, GradientAgreement)


def loss_agreement(
    raw: Any, axes: Mapping[str, list[Any]], steps: int | None, variants: Sequence[str]
) -> LossAgreement | None:
    agreement = _agreement(raw, "expect_equal_loss", LossAgreement, ("rtol", "atol"), variants)
    if agreement is None:
        return None
    if agreement.steps is not None and not positive_int(agreement.steps):
        raise ConfigError(
            "expect_equal_loss.steps", agreement.steps, "give a positive integer (or leave it out: all steps)"
        )
    check_within_steps(agreement, steps)
    if agreement.across is not None and agreement.across not in axes:
        raise ConfigError(
            "expect_equal_loss.across",
            agreement.across,
            f"name one of the study's axes {list(axes)} (it needs axes:, not variants:)",
        )
    return agreement


def gradient_agreement(raw: Any, steps: int | None, variants: Sequence[str]) -> GradientAgreement | None:
    agreement = _agreement(raw, "expect_equal_gradients", GradientAgreement, ("rtol",), variants)
    if agreement is None:
        return None
    if not positive_int(agreement.step):
        raise ConfigError(
            "expect_equal_gradients.step",
            agreement.step,
            "give the optimizer step whose gradients are compared: a positive integer",
        )
    check_within_steps(agreement, steps)
    return agreement


def check_within_steps(agreement: LossAgreement | GradientAgreement, steps: int | None) -> None:
    """Refuse a check of more steps than the runs train (``steps``; None: not known yet): it would run every
    variant and then report the steps that never came as a difference."""
    if steps is None:
        return
    if isinstance(agreement, LossAgreement) and agreement.steps is not None and agreement.steps > steps:
        raise ConfigError(
            "expect_equal_loss.steps",
            agreement.steps,
            f"the runs train {steps} steps; compare at most {steps} (or leave it out: all steps)",
        )
    if isinstance(agreement, GradientAgreement) and agreement.step > steps:
        raise ConfigError(
            "expect_equal_gradients.step",
            agreement.step,
            f"give the optimizer step whose gradients are compared: a positive integer of at most steps ({steps})",
        )


def _agreement(
    raw: Any, key: str, kind: type[_Agreement], tolerances: tuple[str, ...], variants: Sequence[str]
) -> _Agreement | None:
    """A study's ``expect_equal_*`` block as its dataclass: only its own keys, tolerances non-negative numbers,
    ``approximate`` some of the study's ``variants``."""
    if raw is None:
        return None
    raw = mapping_at(raw, key)
    known = {f.name for f in fields(kind)}
    for name, value in raw.items():
        if name not in known:
            raise ConfigError(f"{key}.{name}", value, f"the keys are {sorted(known)}")
    agreement = kind(**raw)
    for name in tolerances:
        value = getattr(agreement, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{key}.{name}", value, "give a non-negative number")
    approximate = agreement.approximate
    if not isinstance(approximate, (list, tuple)) or not set(approximate) <= set(variants):
        raise ConfigError(f"{key}.approximate", approximate, f"give a list of the study's variants: {list(variants)}")
    return replace(agreement, approximate=tuple(approximate))


def planned(agreement: LossAgreement | GradientAgreement | None) -> dict[str, Any] | None:
    """A check as a study's plan records it: its keys, ``approximate`` only when it names variants (a plan
    written before it existed reads the same)."""
    if agreement is None:
        return None
    keys = vars(agreement)
    return keys if agreement.approximate else {k: v for k, v in keys.items() if k != "approximate"}


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

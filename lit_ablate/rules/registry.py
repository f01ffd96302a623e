"""The one registry of rules: every check of a run, each declaring on its decorator what it needs to judge.

A rule is a function of the run's ``RunConfig`` (or, in ``Scope.BUILT_PARTS``, of the built module and
strategy) that returns a ``Refusal`` (key, value, fix) or None. ``@rule`` registers it where it is
defined; the commands ask for the scopes they can judge: ``fit`` the config and this machine (then the
built parts), a study's planner the config and this machine or its cluster's nodes, ``estimate`` the
config alone. The rules of ``lit_ablate.rules`` are found by walking the package, and a rule defined
anywhere else is registered when its module is imported (as a ``class_path`` imports it).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.run_config import RunConfig


class Scope(Enum):
    """What a rule needs to judge a run."""

    CONFIG = "the config alone"
    MACHINE = "this machine: its devices, cores, packages and files"
    CLUSTER = "the nodes a study's cluster declares"
    BUILT_PARTS = "the built module and strategy"


@dataclass(frozen=True)
class Rule:
    """A registered rule: the function, what it needs, and what its refusal does to a study's variant."""

    judge: Callable[..., Refusal | None]
    scopes: frozenset[Scope]
    skips_variant: bool
    """True: the parts cannot run (together, or where the run goes), so a study skips the variant and runs
    the others; False: a mistake in the config, so a study that sets it is refused before any run."""

    @property
    def name(self) -> str:
        return self.judge.__name__


RULES: dict[str, Rule] = {}
"""Every registered rule by its function's name, in the order they were registered."""


def rule(*scopes: Scope, skips_variant: bool = False) -> Callable[[Callable[..., Refusal | None]], Callable]:
    """Register the decorated function as a rule judged in ``scopes``. A rule of the config judges a
    ``RunConfig``, or the view of a plain config mapping it is given (a test, a script)."""
    if not scopes:
        raise TypeError("a rule names at least one Scope")

    def register(judge: Callable[..., Refusal | None]) -> Callable[..., Refusal | None]:
        called = judge
        if Scope.BUILT_PARTS not in scopes:

            @functools.wraps(judge)
            def called(run: RunConfig | Mapping[str, Any]) -> Refusal | None:
                return judge(RunConfig.of(run))

        RULES[judge.__name__] = Rule(called, frozenset(scopes), skips_variant)
        return called

    return register


def rules_for(*scopes: Scope) -> list[Rule]:
    """The registered rules judged in any of ``scopes``: mistakes first, then what skips a variant, each in
    the order of registration."""
    _import_rule_modules()
    judged = [registered for registered in RULES.values() if registered.scopes & set(scopes)]
    return sorted(judged, key=lambda registered: registered.skips_variant)


def first_refusal(
    run: RunConfig | Mapping[str, Any], *scopes: Scope, skips_variant: bool | None = None
) -> Refusal | None:
    """The first refusal of the rules of ``scopes`` (only those whose ``skips_variant`` is the one given,
    when given), or None when they all pass. The run's view is built once."""
    run = RunConfig.of(run)
    for registered in rules_for(*scopes):
        if skips_variant is None or registered.skips_variant == skips_variant:
            refusal = registered.judge(run)
            if refusal:
                return refusal
    return None


def check(run: RunConfig | Mapping[str, Any], *scopes: Scope) -> None:
    """Raise the first refusal of the rules of ``scopes`` as a ``ConfigError``."""
    refusal = first_refusal(run, *scopes)
    if refusal:
        raise refusal.error()


def check_run(config: RunConfig | Mapping[str, Any], subcommand: str = "fit") -> None:
    """Raise what ``lit-ablate fit`` (``validate``, ``test``) refuses before anything is built or any rank
    starts: the first refusal of the rules of the config and of this machine."""
    check(RunConfig.of(config, subcommand=subcommand), Scope.CONFIG, Scope.MACHINE)


def check_parts(module: object, strategy: object) -> None:
    """Raise the first refusal of the built parts' rules (``Scope.BUILT_PARTS``): what ``lit-ablate fit``
    checks before the strategy starts any rank, and a run started from Python may call."""
    for registered in rules_for(Scope.BUILT_PARTS):
        refusal = registered.judge(module, strategy)
        if refusal:
            raise refusal.error()


def refusal_of(check: Callable[..., Any], *args: Any, **kwargs: Any) -> Refusal | None:
    """A part's own check raises ``ConfigError`` (key, value, fix) when it cannot run: as a rule's refusal."""
    try:
        check(*args, **kwargs)
    except ConfigError as err:
        return err.refusal
    return None


_imported = False


def _import_rule_modules() -> None:
    """Import every module of ``lit_ablate.rules`` once: their ``@rule`` functions register themselves."""
    global _imported
    if _imported:
        return
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{module.name}")
    _imported = True

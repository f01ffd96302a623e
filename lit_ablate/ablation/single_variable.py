"""The single-variable check: variants may differ only in the keys the study declares.

An ablation is only worth its table if "only one variable changes" is enforced rather than
hoped for: a variant that silently also changes the micro-batch, or a default that one strategy
resolves differently, makes the comparison meaningless. So the runner resolves every variant's
config exactly as ``fit`` would and diffs them leaf by leaf.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lit_ablate.config_keys import flatten, is_under
from lit_ablate.errors import ConfigError

_MISSING = "<absent>"


def undeclared_differences(
    resolved: Mapping[str, Mapping[str, Any]], variables: Iterable[str], ignored: Iterable[str] = ()
) -> dict[str, dict[str, Any]]:
    """``{dotted key: {variant: value}}`` for every key that differs and is under no declared prefix."""
    prefixes = [*variables, *ignored]
    flat = {name: flatten(config) for name, config in resolved.items()}
    keys = sorted({k for f in flat.values() for k in f})
    differences = {}
    for key in keys:
        if any(is_under(key, p) for p in prefixes):
            continue
        values = {name: f.get(key, _MISSING) for name, f in flat.items()}
        if len({repr(v) for v in values.values()}) > 1:
            differences[key] = values
    return differences


def check_single_variable(
    resolved: Mapping[str, Mapping[str, Any]], variables: Iterable[str], ignored: Iterable[str] = ()
) -> None:
    """Refuse (``ConfigError`` naming the first key) a study whose variants differ in an undeclared key."""
    variables = list(variables)
    differences = undeclared_differences(resolved, variables, ignored)
    if differences:
        key, values = next(iter(differences.items()))
        others = f" (and {len(differences) - 1} more: {sorted(differences)[1:4]})" if len(differences) > 1 else ""
        raise ConfigError(
            key,
            values,
            f"the variants differ in this key{others}, which the study does not declare as a variable "
            f"(declared: {variables}); make it equal across variants or declare it (axes: / vary:)",
        )

"""A strategy option is declared once: as a keyword of the ``__init__`` of the step it belongs to, with its
type and default (``cp_layout`` in ``ContextParallelSteps``). What a strategy that takes a subset of the
steps' options accepts (a preset's ``**kwargs``, which jsonargparse reads as its schema) is read from there."""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping
from typing import Any, TypedDict, get_type_hints

from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY


def keyword_options(step: type, only: Collection[str] | None = None, leave_out: Collection[str] = ()) -> dict[str, Any]:
    """``{name: type}`` of the keyword arguments the ``__init__`` of ``step`` itself declares (``only`` those, if
    given; not those in ``leave_out``)."""
    init = vars(step)["__init__"]
    hints = get_type_hints(init)
    return {
        name: hints[name]
        for name, parameter in inspect.signature(init).parameters.items()
        if name != "self"
        and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        and (only is None or name in only)
        and name not in leave_out
    }


def options_type(name: str, *options: dict[str, Any]) -> type:
    """A ``TypedDict`` of every option in ``options`` (all optional), what ``**kwargs: Unpack[...]`` takes."""
    return TypedDict(name, {key: kind for group in options for key, kind in group.items()}, total=False)


def check_options(strategy: str, options: type, given: Mapping[str, Any]) -> None:
    """Refuse, naming the key, an option in ``given`` that the ``TypedDict`` ``options`` does not list (what
    jsonargparse refuses when it parses; this, when a strategy is made from Python)."""
    for key, value in given.items():
        if key not in options.__optional_keys__:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.{key}",
                value,
                f"{strategy} does not take {key}; use a strategy that does (MeshParallelStrategy takes every option)",
            )

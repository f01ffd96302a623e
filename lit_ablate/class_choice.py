"""``ClassChoice``: a config's ``class_path``/``init_args`` section, read as the class it names and the
arguments it gives, each argument the config leaves out read as the class's own default (``class_default``).

What ``RunConfig`` reads every class-valued key of a run config with (the module, the data module, the
strategy, the loss, a model's parts); the class is imported on first use, and a path that does not
import reads as no class.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from lit_ablate.class_paths import import_class

MISSING: Any = object()
"""An argument that neither the config nor the class gives a value."""


def class_default(cls: type, name: str) -> Any:
    """The default ``cls(...)`` takes for argument ``name``: that of the first ``__init__`` in its MRO that
    names it (a preset passes what it does not name on to its base), or ``MISSING``."""
    for klass in getattr(cls, "__mro__", ()):
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            parameter = inspect.signature(init).parameters.get(name)
        except (TypeError, ValueError):  # a builtin's __init__ without a signature
            continue
        if parameter is not None and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            return MISSING if parameter.default is inspect.Parameter.empty else parameter.default
    return MISSING


@dataclass(frozen=True)
class ClassChoice:
    """A ``class_path``/``init_args`` section: the class a config names and the arguments it gives it."""

    class_path: str
    init_args: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, section: Any) -> ClassChoice | None:
        """The section as a choice; None when it is not a ``class_path`` mapping."""
        if not isinstance(section, Mapping) or not isinstance(section.get("class_path"), str):
            return None
        return cls(section["class_path"], dict(section.get("init_args") or {}))

    @property
    def name(self) -> str:
        """The class's own name (the last segment of its path)."""
        return self.class_path.rsplit(".", 1)[-1]

    @property
    def section(self) -> dict[str, Any]:
        """The ``class_path``/``init_args`` mapping it was read from."""
        return {"class_path": self.class_path, "init_args": dict(self.init_args)}

    @cached_property
    def cls(self) -> Any:
        """What ``class_path`` names, or None when it does not import."""
        try:
            return import_class(self.class_path)
        except ImportError:
            return None

    def is_a(self, base: type) -> bool:
        """Whether the class is ``base`` or a subclass of it (research code's subclasses included)."""
        return isinstance(self.cls, type) and issubclass(self.cls, base)

    def option(self, name: str, default: Any = None) -> Any:
        """Argument ``name``: as ``init_args`` gives it, else the class's default, else ``default``."""
        if name in self.init_args:
            return self.init_args[name]
        value = class_default(self.cls, name) if isinstance(self.cls, type) else MISSING
        return default if value is MISSING else value

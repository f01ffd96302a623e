"""The one exception type for bad user input, and the refusal it is made of.

Raised at construction or set-up time, before any training work, with a message that names the
config key, the offending value and the fix, so a user never has to read a torch stack trace to
find a typo in their YAML. A rule (``lit_ablate.rules``) that judges a config without raising returns the
same three parts as a ``Refusal``: a study shows it as the variant's skip reason, ``lit-ablate fit``
raises it as a ``ConfigError``, and neither reads the other's text back.
"""

from __future__ import annotations

from collections import deque
from typing import Any


def _line(key: str, value: object, fix: str) -> str:
    return f"{key}={value!r}: {fix}"


class Refusal(str):
    """Why a run cannot run: the config ``key``, its ``value`` and the ``fix``, as data.

    It is also the one line a study shows for it (a ``str``: ``key=value: fix``, with ``value`` as
    ``repr`` prints it, or as ``shown`` when the line names it otherwise, e.g. an unquoted name).
    ``error()`` is the ``ConfigError`` that ``lit-ablate fit`` raises for it. Immutable, like the
    string it is.
    """

    key: str
    value: Any
    fix: str
    shown: str | None

    def __new__(cls, key: str, value: Any, fix: str, shown: str | None = None) -> Refusal:
        line = _line(key, value, fix) if shown is None else f"{key}={shown}: {fix}"
        refusal = super().__new__(cls, line)
        for name, part in (("key", key), ("value", value), ("fix", fix), ("shown", shown)):
            object.__setattr__(refusal, name, part)
        return refusal

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Refusal is immutable: cannot set {name}")

    def __reduce__(self) -> tuple[type[Refusal], tuple[str, Any, str, str | None]]:
        return type(self), (self.key, self.value, self.fix, self.shown)

    def error(self) -> ConfigError:
        """The ``ConfigError`` naming the same key, value and fix."""
        return ConfigError(self.key, self.value, self.fix)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and the fix."""

    def __init__(self, key: str, value: object, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        super().__init__(_line(key, value, fix))
        _RECENT.append(self)

    @property
    def refusal(self) -> Refusal:
        """The same key, value and fix as a ``Refusal`` (what a rule returns)."""
        return Refusal(self.key, self.value, self.fix)


_RECENT: deque[ConfigError] = deque(maxlen=32)
"""The last refusals made in this process, newest last (see ``quoted_refusal``)."""


def quoted_refusal(message: str) -> ConfigError | None:
    """The refusal whose line ``message`` quotes, or None.

    jsonargparse tries each alternative of a Union (a strategy under ``trainer.strategy``) and, when a
    class refused its arguments, raises a text listing every alternative's failure without chaining the
    exception. The refusal itself was made in this process a moment before: it is found here by its
    exact line, so its text is never parsed back."""
    return next((error for error in reversed(_RECENT) if str(error) in message), None)

"""``StrategyChoice``: ``trainer.strategy`` as a config gives it (a Lightning registry name, a class path, a
lit-ablate strategy's short name or a ``class_path`` section), read as the class, its options and its mesh.

Lightning takes a string only as a registry name; ``strategy_class_path`` turns a path or a lit-ablate name into
the ``class_path`` the CLI builds, and refuses a string that names no strategy with the closest name.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from lit_ablate.class_choice import MISSING, ClassChoice, class_default
from lit_ablate.class_paths import import_class
from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import MESH_DIMS, MeshSizes

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

STRATEGIES_PACKAGE = "lit_ablate.strategies"


def lit_ablate_strategy_names() -> list[str]:
    """The strategies ``lit_ablate.strategies`` exports, by their own names (``FSDP2Strategy``)."""
    from lightning.pytorch.strategies import Strategy

    package = importlib.import_module(STRATEGIES_PACKAGE)
    return [
        name
        for name in package.__all__
        if isinstance(getattr(package, name), type) and issubclass(getattr(package, name), Strategy)
    ]


def lightning_strategy_names() -> list[str]:
    """The names Lightning's ``Trainer(strategy=...)`` resolves itself: ``auto`` and its registry."""
    from lightning.pytorch.strategies import StrategyRegistry

    return ["auto", *StrategyRegistry.available_strategies()]


def strategy_class_path(name: str) -> str | None:
    """The class a ``trainer.strategy`` string names, as a ``class_path`` (a dotted path to a Lightning
    ``Strategy`` class, or a lit-ablate strategy's short name: Lightning takes a string only as a registry
    name, so the CLI builds the class from this path); None for a name Lightning resolves itself (``auto``,
    ``ddp``, case-insensitively). Raises ``ConfigError`` with the closest name, or both lists."""
    from lightning.pytorch.strategies import Strategy

    if name.lower() in lightning_strategy_names():
        return None
    ours = lit_ablate_strategy_names()
    path = f"{STRATEGIES_PACKAGE}.{name}" if name in ours else name
    try:
        named = import_class(path)
    except ImportError:
        named = None
    if isinstance(named, type) and issubclass(named, Strategy):
        return path
    short = name.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(short, ours, n=1) or difflib.get_close_matches(
        name.lower(), lightning_strategy_names(), n=1
    )
    if close:
        raise ConfigError(TRAINER_STRATEGY_KEY, name, f"not a strategy; did you mean {close[0]}?")
    raise ConfigError(
        TRAINER_STRATEGY_KEY,
        name,
        f"not a strategy; give a lit-ablate strategy {ours} (or its lit_ablate.strategies.<Name> path), a "
        "class_path, or a name Lightning knows (lightning.pytorch.strategies.StrategyRegistry: ddp, fsdp, ...)",
    )


@dataclass(frozen=True)
class StrategyChoice:
    """``trainer.strategy``: a Lightning registry name (``auto``, ``ddp``, ``fsdp``) or a class, as a
    ``class_path``/``init_args`` section or by its path or lit-ablate name (``strategy_class_path``)."""

    configured: Any = "auto"
    """As the config gives it: the name or path, or the ``class_path``/``init_args`` mapping."""

    @cached_property
    def section(self) -> ClassChoice | None:
        """The ``class_path`` section (a class named by a string: with no ``init_args``); None for a
        registry name, or a string that names no strategy (``named_class_path`` raises for it)."""
        if isinstance(self.configured, str):
            try:
                path = strategy_class_path(self.configured)
            except ConfigError:
                return None
            return None if path is None else ClassChoice(path)
        return ClassChoice.of(self.configured)

    @property
    def names_a_class(self) -> bool:
        """Whether the config names the class by a string (a path or a lit-ablate name), which Lightning
        would take for a registry name: the CLI replaces it by its ``class_path`` section."""
        return isinstance(self.configured, str) and self.section is not None

    def check_name(self) -> None:
        """Raise ``ConfigError`` for a string that is neither a Lightning name nor a strategy class."""
        if isinstance(self.configured, str):
            strategy_class_path(self.configured)

    @property
    def name(self) -> str:
        """The registry name or the ``class_path``."""
        section = self.section
        return section.class_path if section else str(self.configured)

    @property
    def short_name(self) -> str:
        """The registry name or the class's own name (how a table names the strategy)."""
        section = self.section
        return section.name if section else str(self.configured)

    @property
    def options(self) -> Mapping[str, Any]:
        """``init_args`` as the config gives them (empty for a name)."""
        section = self.section
        return section.init_args if section else {}

    @cached_property
    def cls(self) -> type | None:
        """The strategy class: a section's ``class_path`` or a registered name's class (None for ``auto``,
        an unknown name or a path that does not import: the run reports those itself)."""
        section = self.section
        if section is not None:
            return section.cls if isinstance(section.cls, type) else None
        from lightning.pytorch.strategies import StrategyRegistry

        name = str(self.configured).lower()
        return StrategyRegistry[name]["strategy"] if name in StrategyRegistry else None

    def is_a(self, base: type) -> bool:
        return isinstance(self.cls, type) and issubclass(self.cls, base)

    def option(self, name: str, default: Any = None) -> Any:
        """Option ``name``: as ``init_args`` gives it, else the class's default, else ``default``."""
        section = self.section
        return section.option(name, default) if section else default

    @cached_property
    def requested_mesh_sizes(self) -> MeshSizes | None:
        """The mesh sizes a mesh strategy is built with (what its ``requested_mesh_sizes`` will be: each
        given in ``init_args``, else the class's default, else 1); None for a strategy without a mesh.
        Raises ``ConfigError`` for sizes no mesh takes (0, two ``-1``)."""
        from lit_ablate.strategies.mesh import MeshStrategy

        if not self.is_a(MeshStrategy):
            return None
        sizes = {}
        for dim in MESH_DIMS:
            size = self.options.get(dim)
            if size is None:
                size = class_default(self.cls, dim)
            sizes[dim] = 1 if size is MISSING else size
        return MeshSizes(**sizes)

    def mesh_size(self, dim: str, world_size: int) -> int:
        """The size of mesh dimension ``dim`` on ``world_size`` ranks (a ``-1`` resolved as the strategy
        resolves it); 1 for a dimension the strategy leaves at 1 or a strategy without a mesh."""
        sizes = self.requested_mesh_sizes
        if sizes is None or sizes[dim] == 1:
            return 1
        return sizes.resolved(world_size)[dim]

    def build(self) -> Strategy | str:
        """The strategy a ``Trainer`` would get: a section instantiated (which validates its options), a name as is."""
        if self.section is None:
            return self.configured
        from lightning.pytorch.cli import instantiate_class

        return instantiate_class((), self.section.section)

"""``MeshSizes``: the six sizes of the device mesh as one frozen value.

A mesh strategy is built from it (``MeshStrategy.requested_mesh_sizes``), resolves it against the
world size when its ranks start (``mesh_sizes``), and the estimator and the rules read
it from a config (``lit_ablate.run_config``) without building a strategy. It needs nothing but
``ConfigError``, so reading a config's sizes imports no strategy. It reads as a mapping
``{dim: size}`` over ``MESH_DIMS`` too, outermost first, which is how a mesh is laid out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields

from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import ConfigError

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
"""The mesh dimensions, outermost first."""
STRATEGY_OPTIONS_KEY = f"{TRAINER_STRATEGY_KEY}.init_args"
"""Where a config sets a strategy's options, the mesh sizes among them."""


@dataclass(frozen=True, eq=False)
class MeshSizes(Mapping[str, int]):
    """Ranks per mesh dimension (``MESH_DIMS``); each a positive integer, or ``-1`` for one of them:
    the ranks the others leave, known once ``resolved`` against a world size.

    Refuses, naming the key, a size that is neither, or more than one ``-1``. Equal to any mapping
    with the same sizes, so ``sizes == {"pp": 1, ...}`` holds.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for dim, size in self.items():
            if not isinstance(size, int) or (size < 1 and size != -1):
                raise ConfigError(
                    f"{STRATEGY_OPTIONS_KEY}.{dim}", size, "use a positive integer, or -1 for 'the rest of the ranks'"
                )
        if sum(size == -1 for size in self.values()) > 1:
            raise ConfigError(
                STRATEGY_OPTIONS_KEY,
                self.shown,
                "at most one mesh size may be -1 (the rest); give the others explicitly",
            )

    @classmethod
    def of(cls, sizes: Mapping[str, int]) -> MeshSizes:
        """The sizes ``sizes`` names (a ``MeshSizes`` or a mapping of some dimensions; the others are 1)."""
        return sizes if isinstance(sizes, MeshSizes) else cls(**{dim: sizes[dim] for dim in MESH_DIMS if dim in sizes})

    def __getitem__(self, dim: str) -> int:
        if dim not in MESH_DIMS:
            raise KeyError(dim)
        return getattr(self, dim)

    def __iter__(self) -> Iterator[str]:
        return iter(MESH_DIMS)

    def __len__(self) -> int:
        return len(MESH_DIMS)

    def __hash__(self) -> int:
        return hash(tuple(self.values()))

    def __repr__(self) -> str:
        return f"MeshSizes({', '.join(f'{f.name}={getattr(self, f.name)}' for f in fields(self))})"

    @property
    def on(self) -> tuple[str, ...]:
        """The dimensions not of size 1, outermost first (a ``-1`` counts: it asks for the rest of the ranks)."""
        return tuple(dim for dim, size in self.items() if size != 1)

    @property
    def shown(self) -> dict[str, int]:
        """``{dim: size}`` of the dimensions that are on: how a message names the sizes."""
        return {dim: self[dim] for dim in self.on}

    @property
    def world_size(self) -> int:
        """The ranks the sizes lay out (their product); resolve a ``-1`` first."""
        if -1 in self.values():
            raise ValueError(f"{self!r} has a -1 size: resolve it against a world size first")
        return math.prod(self.values())

    def resolved(self, world_size: int) -> MeshSizes:
        """The sizes with ``-1`` replaced by the rest, multiplying to ``world_size``.

        Raises ``ConfigError`` naming a size larger than the world size, or the sizes and the world
        size when they cannot multiply to it.
        """
        for dim, size in self.items():  # named on its own: "the sizes multiply to 8" hides which one is wrong
            if size > world_size:
                raise ConfigError(
                    f"{STRATEGY_OPTIONS_KEY}.{dim}",
                    size,
                    f"{dim} cannot exceed the world size ({world_size} ranks = "
                    f"devices x nodes); use {dim} <= {world_size}, or -1 for the ranks the others leave",
                )
        known = math.prod(size for size in self.values() if size != -1)
        rest = [dim for dim, size in self.items() if size == -1]
        resolved = dict(self)
        if rest:
            if world_size % known:
                raise ConfigError(
                    f"{STRATEGY_OPTIONS_KEY}.{rest[0]}",
                    -1,
                    f"the other mesh sizes {self.shown} multiply to {known}, which does not divide the world size "
                    f"{world_size}; change them or the number of devices",
                )
            resolved[rest[0]] = world_size // known
        sizes = MeshSizes(**resolved)
        if sizes.world_size != world_size:
            raise ConfigError(
                STRATEGY_OPTIONS_KEY,
                sizes.shown,
                f"the mesh sizes multiply to {sizes.world_size} but the world size (devices x nodes) is "
                f"{world_size}; make them multiply to {world_size}, or set one of them to -1",
            )
        return sizes


def resolve_mesh_sizes(sizes: Mapping[str, int], world_size: int) -> MeshSizes:
    """``MeshSizes.of(sizes).resolved(world_size)``: every dimension's size on ``world_size`` ranks
    (those ``sizes`` leaves out are 1)."""
    return MeshSizes.of(sizes).resolved(world_size)

"""Dotted keys over a nested config: how studies name one setting (``model.init_args.loss``).

A study's overrides, axes and ``vary`` prefixes are dotted keys into a LightningCLI config, the
same spelling as a ``fit`` command-line flag without the dashes. A segment that is an integer
indexes a list (``trainer.callbacks.0.init_args.x``). ``PairedKey``: a key that only acts together
with another's value, refused where it would be ignored.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lit_ablate.errors import Refusal

TRAINER_STRATEGY_KEY = "trainer.strategy"
"""The run's strategy: a Lightning registry name (``ddp``) or a ``class_path``/``init_args`` mapping.
Errors about the strategy as a whole name it; only ``lit_ablate.run_config`` reads it from a config."""


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` in ``tree`` in place, creating the mappings on the way; the value is copied.

    A class given by its path string (``trainer.strategy: lit_ablate.strategies.FSDP2Strategy``) that the
    key goes on into by ``init_args`` becomes its ``class_path`` section, as jsonargparse reads
    ``--trainer.strategy X --trainer.strategy.init_args.dp_shard 2``: the class is kept, not replaced."""
    *parents, leaf = key.split(".")
    node: Any = tree
    for index, segment in enumerate(parents):
        if isinstance(node, list):
            node = node[_index(node, segment, key)]
            continue
        below = [*parents, leaf][index + 1]
        if isinstance(node.get(segment), str) and below == "init_args":
            node[segment] = {"class_path": node[segment]}
        elif not isinstance(node.get(segment), (dict, list)):
            node[segment] = {}
        node = node[segment]
    if isinstance(node, list):
        node[_index(node, leaf, key)] = copy.deepcopy(value)
    else:
        node[leaf] = copy.deepcopy(value)


def get_dotted(tree: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The value at ``key``, or ``default`` when any segment is missing."""
    node: Any = tree
    for segment in key.split("."):
        if isinstance(node, Mapping) and segment in node:
            node = node[segment]
        elif isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
            node = node[int(segment)]
        else:
            return default
    return node


def with_overrides(tree: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``tree`` with each dotted override applied in order."""
    merged = copy.deepcopy(dict(tree))
    for key, value in overrides.items():
        set_dotted(merged, key, value)
    return merged


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf as ``{dotted key: value}``; mappings and lists are walked, empty ones are leaves."""
    if isinstance(tree, Mapping) and tree:
        items = ((str(k), v) for k, v in tree.items())
    elif isinstance(tree, list) and tree:
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for segment, value in items:
        flat.update(flatten(value, f"{prefix}.{segment}" if prefix else segment))
    return flat


def is_under(key: str, prefix: str) -> bool:
    """True when ``key`` is ``prefix`` or lies inside it (segment-wise, so ``a.b`` is not under ``a.bc``)."""
    return key == prefix or key.startswith(prefix + ".")


def _index(node: list[Any], segment: str, key: str) -> int:
    if not segment.isdigit() or int(segment) >= len(node):
        raise KeyError(f"{key}: segment {segment!r} does not index a list of length {len(node)}")
    return int(segment)


NOT_GIVEN: Any = object()
"""What a lookup answers for a key the config leaves at its default (``PairedKey``)."""


@dataclass(frozen=True)
class PairedKey:
    """A key that only acts together with another key's value: ``cp_layout`` with ``cp`` above 1,
    ``launch.slurm`` with ``launch.executor: slurm``. Given while its partner does not make it act, it
    would be ignored without a word (a study meant for the cluster ran locally), so it is refused,
    naming both keys (``ignored_key``)."""

    key: str
    partner: str
    acts: Callable[[Any], bool]
    """Whether the partner's value makes ``key`` act."""
    acts_when: str
    """The partner's values that make it act, in words (``above 1``, ``slurm``)."""

    def refusal(self, value: Any, partner_value: Any) -> Refusal:
        name = self.key.rsplit(".", 1)[-1]
        return Refusal(
            self.key,
            value,
            f"{name} acts only when {self.partner} is {self.acts_when} (here "
            f"{partner_value!r}) and would be ignored; change {self.partner}, or leave {name} out",
        )


def ignored_key(pairs: Iterable[PairedKey], given: Callable[[str], Any], value: Callable[[str], Any]) -> Refusal | None:
    """The refusal of the first pair whose key is given (``given(key)`` is not ``NOT_GIVEN``) while its
    partner's value (``value(partner)``) does not make it act; None when every given key acts. One
    mechanism for a study file's keys and a run config's: each supplies its own lookups."""
    for pair in pairs:
        mine = given(pair.key)
        if mine is NOT_GIVEN:
            continue
        partner = value(pair.partner)
        if not pair.acts(partner):
            return pair.refusal(mine, partner)
    return None

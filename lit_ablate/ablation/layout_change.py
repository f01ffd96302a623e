"""A study started again on another layout keeps what it trained.

A study stopped mid-run (Ctrl-C, SIGTERM, a pre-empted or killed runner) and started again, maybe on
fewer ranks (pre-empted on 8, rescheduled on 4), should lose nothing that was finished or checkpointed.
What a run trains is its config less its layout: the ranks and nodes, the mesh sizes, and how the global
batch is cut into micro-batches (``LAYOUT_KEYS``). Any layout reads a mesh strategy's checkpoint back
(``strategies/whole_checkpoint.py``) and continues the data from the same item
(``data/resume_position.py``), so a run whose config changed only there, with the same global batch, is
the same run: its finished record is kept, and an interrupted one resumes from its newest complete
checkpoint. Any other change, a new global batch included (other steps on other data), starts it over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_ablate.ablation.single_variable import undeclared_differences
from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import MESH_DIMS, STRATEGY_OPTIONS_KEY
from lit_ablate.run_config import RunConfig

LAYOUT_KEYS: tuple[str, ...] = (
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.accumulate_grad_batches",
    "data.init_args.batch_size",
    *(f"{STRATEGY_OPTIONS_KEY}.{dim}" for dim in MESH_DIMS),
)
"""Where a run's layout is set: changing only these (and keeping the global batch) trains the same run."""


def trains_the_same(before: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether a run config ``before`` trains what ``now`` does: equal but for ``LAYOUT_KEYS``, with the
    same global batch (items per optimizer step over every data-parallel rank)."""
    if undeclared_differences({"before": before, "now": now}, LAYOUT_KEYS):
        return False
    batch = global_batch(now)
    return batch is not None and global_batch(before) == batch


def global_batch(config: Mapping[str, Any]) -> int | None:
    """The items per optimizer step ``config`` trains on (None when its layout cannot be read from it)."""
    from lit_ablate.rules.resume_layout import data_layout  # reads the strategy's mesh: imports torch

    try:
        return data_layout(RunConfig.of(config)).global_batch
    except (ConfigError, TypeError, ValueError, AttributeError):  # no batch size, a mesh that does not fit
        return None


def ranks(record: Mapping[str, Any]) -> int | None:
    """The ranks a run record was measured on: its job's world size (a simulated rank's job's)."""
    simulated = record.get("simulated") or {}
    return simulated.get("world_size") or (record.get("environment") or {}).get("world_size")

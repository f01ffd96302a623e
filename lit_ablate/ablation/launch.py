"""A study's ``launch:`` block: how each run is started (ranks, nodes, accelerator, a simulated rank, its time
limit and executor). The first five are run-config keys (``LAUNCH_CONFIG_KEYS``): they land in the run's config,
which is where the planner and the rules read them, once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lit_ablate.ablation.slurm_settings import SlurmSettings
from lit_ablate.config_keys import PairedKey
from lit_ablate.errors import ConfigError
from lit_ablate.run_config import EXECUTORS
from lit_ablate.simulated_rank import SIMULATE_KEY, SIMULATE_RANK_KEY

DEFAULT_TIMEOUT_S = 3600.0
LAUNCH_CONFIG_KEYS = {
    "devices": "trainer.devices",
    "num_nodes": "trainer.num_nodes",
    "accelerator": "trainer.accelerator",
    SIMULATE_KEY: SIMULATE_KEY,
    SIMULATE_RANK_KEY: SIMULATE_RANK_KEY,
}
"""``launch`` fields that are run-config keys (so they land in the run's config and are diffed): the trainer's
ranks, nodes and accelerator, and a simulated rank's job (``lit-ablate fit --simulate``)."""
SLURM_BLOCK = PairedKey("launch.slurm", "launch.executor", lambda executor: executor == "slurm", "'slurm'")
"""A ``launch.slurm`` block describes the cluster the runs are submitted to: without ``executor: slurm``
the study ran locally and ignored it without a word."""


@dataclass(frozen=True)
class Launch:
    """How one run is started: ranks per node, nodes, accelerator, its wall-clock limit, and where.

    ``None`` leaves the base config's trainer value; ``timeout_s`` bounds a run so one hung
    variant cannot stall the study (on SLURM it is the job's time limit). ``executor: slurm``
    submits each run as a job with the ``slurm`` settings (a variant's ``launch.slurm`` keys
    override the study's, key by key). ``simulate: W`` runs one process that plays rank
    ``simulate_rank`` (default 0) of the configured mesh on W ranks over a fake process group: a layout
    larger than this machine, measured per rank (docs/simulation.md).
    """

    devices: int | None = None
    num_nodes: int | None = None
    accelerator: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    executor: str = EXECUTORS[0]
    slurm: SlurmSettings | None = None
    simulate: int | None = None
    simulate_rank: int | None = None

    def config_overrides(self) -> dict[str, Any]:
        """The dotted config keys this launch sets."""
        return {LAUNCH_CONFIG_KEYS[f]: getattr(self, f) for f in LAUNCH_CONFIG_KEYS if getattr(self, f) is not None}

    def updated(self, values: Mapping[str, Any], key: str) -> Launch:
        """This launch with ``values`` (a ``launch:`` mapping found at study key ``key``) applied."""
        known = {f.name for f in fields(self)}
        for name, value in values.items():
            if name not in known:
                raise ConfigError(f"{key}.{name}", value, f"launch keys are {sorted(known)}")
        devices, nodes = values.get("devices", self.devices), values.get("num_nodes", self.num_nodes)
        simulate = values.get(SIMULATE_KEY, self.simulate)
        simulate_rank = values.get(SIMULATE_RANK_KEY, self.simulate_rank)
        for name, value, least in (
            ("devices", devices, 1),
            ("num_nodes", nodes, 1),
            (SIMULATE_KEY, simulate, 2),
            (SIMULATE_RANK_KEY, simulate_rank, 0),
        ):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ConfigError(
                    f"{key}.{name}",
                    value,
                    "give a positive integer" if least == 1 else f"give an integer of {least} or more",
                )
        timeout = values.get("timeout_s", self.timeout_s)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigError(f"{key}.timeout_s", timeout, "give a positive number of seconds")
        accelerator = values.get("accelerator", self.accelerator)
        if accelerator is not None and not isinstance(accelerator, str):
            raise ConfigError(
                f"{key}.accelerator", accelerator, "give a Lightning accelerator name: cpu, gpu, cuda, auto"
            )
        executor = values.get("executor", self.executor)
        if executor not in EXECUTORS:
            raise ConfigError(f"{key}.executor", executor, f"give one of {list(EXECUTORS)}")
        slurm = self.slurm
        if "slurm" in values:
            slurm = (slurm or SlurmSettings()).updated(mapping_at(values["slurm"], f"{key}.slurm"), f"{key}.slurm")
        if executor == "slurm" and slurm is None:
            slurm = SlurmSettings()
        return Launch(devices, nodes, accelerator, float(timeout), executor, slurm, simulate, simulate_rank)


def mapping_at(value: Any, key: str) -> dict[str, Any]:
    """``value`` as the mapping study key ``key`` must hold."""
    if not isinstance(value, Mapping):
        raise ConfigError(key, value, "give a mapping")
    return dict(value)

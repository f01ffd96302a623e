"""``launch.slurm``: what a study asks of a SLURM cluster, validated before anything is submitted.

Plain data (no ``submitit`` import), so a study file is checked on any machine. What a job
requests per node follows from the run itself: ``trainer.num_nodes`` nodes, one task per rank
(``trainer.devices`` tasks per node, which Lightning's SLURM environment turns into ranks) and,
on GPUs, ``trainer.devices`` GPUs per node. The fields here say what the cluster offers and how
to submit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lit_ablate.errors import ConfigError

CLUSTERS = ("slurm", "local")
"""``slurm``: sbatch on the cluster this runner is on; ``local``: submitit's local executor, the same
submission, tracking and resume path run on this machine (to try a study before queueing it)."""


@dataclass(frozen=True)
class SlurmSettings:
    """How runs are submitted, and what the partition offers (checked against every variant).

    ``gpus_per_node`` / ``max_nodes`` describe the partition: a variant asking for more GPUs per
    node or more nodes is refused before any job is submitted. ``max_jobs`` bounds the jobs in the
    queue or running at once; the runner submits more as they finish. ``sbatch`` holds extra
    ``#SBATCH`` options (``{qos: high, constraint: h100}``), ``setup`` shell lines run before the
    job's tasks start (``module load ...``, activating the environment).
    """

    cluster: str = CLUSTERS[0]
    partition: str | None = None
    account: str | None = None
    gpus_per_node: int | None = None
    max_nodes: int | None = None
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    max_jobs: int = 16
    poll_s: float = 30.0
    sbatch: dict[str, Any] = field(default_factory=dict)
    setup: tuple[str, ...] = ()

    def updated(self, values: Mapping[str, Any], key: str) -> SlurmSettings:
        """These settings with ``values`` (a ``launch.slurm`` mapping at study key ``key``) applied."""
        known = [f.name for f in fields(self)]
        for name, value in values.items():
            if name not in known:
                raise ConfigError(f"{key}.{name}", value, f"launch.slurm keys are {known}")
        merged = {**{f.name: getattr(self, f.name) for f in fields(self)}, **values}
        if merged["cluster"] not in CLUSTERS:
            raise ConfigError(f"{key}.cluster", merged["cluster"], f"give one of {list(CLUSTERS)}")
        for name in ("partition", "account"):
            if merged[name] is not None and not isinstance(merged[name], str):
                raise ConfigError(f"{key}.{name}", merged[name], "give a name (a string)")
        for name in ("gpus_per_node", "max_nodes", "cpus_per_task"):
            if merged[name] is not None and not _positive_int(merged[name]):
                raise ConfigError(f"{key}.{name}", merged[name], "give a positive integer")
        if not _positive_int(merged["max_jobs"]):
            raise ConfigError(
                f"{key}.max_jobs", merged["max_jobs"], "give a positive integer (jobs queued or running at once)"
            )
        for name in ("mem_gb", "poll_s"):
            value = merged[name]
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{key}.{name}", value, "give a positive number")
        if not isinstance(merged["sbatch"], Mapping):
            raise ConfigError(f"{key}.sbatch", merged["sbatch"], "give a mapping of sbatch options: {qos: high}")
        setup = merged["setup"]
        if isinstance(setup, str) or not all(isinstance(line, str) for line in setup):
            raise ConfigError(f"{key}.setup", setup, "give a list of shell lines")
        merged["sbatch"] = {**self.sbatch, **dict(merged["sbatch"])} if "sbatch" in values else dict(self.sbatch)
        merged["setup"] = tuple(setup)
        return replace(self, **merged)

    def partition_refusal(self, devices: int | None, num_nodes: int | None, on_gpu: bool) -> str | None:
        """Why a run with ``devices`` ranks per node on ``num_nodes`` nodes does not fit the partition."""
        if on_gpu and self.gpus_per_node is not None and (devices or 1) > self.gpus_per_node:
            return (
                f"asks for {devices} GPUs per node; the partition's nodes have {self.gpus_per_node} "
                "(launch.slurm.gpus_per_node)"
            )
        if self.max_nodes is not None and (num_nodes or 1) > self.max_nodes:
            return f"asks for {num_nodes} nodes; the partition offers {self.max_nodes} (launch.slurm.max_nodes)"
        return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

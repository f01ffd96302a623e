"""``SimulatedRank``: one process playing one rank of a larger job over a fake process group.

torch's fake process group (backend ``fake``) returns from every collective at once without moving
data, so one process can hold what one rank of a 64-rank mesh holds (its shards, its experts, its
stage), run that rank's forward and backward and measure its memory and its compute time
(``lit-ablate fit --simulate 64``, docs/simulation.md). A run knows it is simulated from its process
group alone (``current_simulation``), so no part needs to be told.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_ablate.errors import ConfigError

SIMULATE_KEY = "simulate"
"""The fit config's key (and ``lit-ablate fit`` option) giving the simulated job's world size."""
SIMULATE_RANK_KEY = "simulate_rank"
"""The fit config's key giving which of its ranks this process plays."""
FAKE_BACKEND = "fake"
"""torch's process-group backend whose collectives move nothing."""
NOT_SIMULATED = ("loss", "tokens_per_sec", "useful_tokens_per_sec")
"""Figures a simulated rank does not measure, recorded as null and never printed: the loss (collectives
moved no data, so its numbers are no model's) and the job's tokens/s (no other rank's tokens were
counted). Per-device throughput, step time, MFU and memory are this rank's own."""


@dataclass(frozen=True)
class SimulatedRank:
    """Rank ``rank`` of a job of ``world_size`` ranks, played by this one process."""

    world_size: int
    rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 2:
            raise ConfigError(SIMULATE_KEY, self.world_size, "give the simulated job's world size, 2 or more ranks")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.world_size:
            raise ConfigError(SIMULATE_RANK_KEY, self.rank, f"give a rank from 0 to {self.world_size - 1}")

    @property
    def first_line(self) -> str:
        """What a simulated run prints first, before any figure."""
        return (
            f"simulated: this process plays rank {self.rank} of a {self.world_size}-rank job over a fake process "
            "group (collectives move no data); its memory, step time, per-device tokens/s and MFU are that "
            f"rank's, and it measures no {', no '.join(NOT_SIMULATED)} (docs/simulation.md)"
        )

    @property
    def section(self) -> dict[str, int]:
        """What the run record keeps under ``simulated``."""
        return {"world_size": self.world_size, "rank": self.rank}


def current_simulation() -> SimulatedRank | None:
    """The rank this process plays when its default process group is the fake one; None in a real run."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != FAKE_BACKEND:
        return None
    return SimulatedRank(dist.get_world_size(), dist.get_rank())

"""How a study's speed is measured: its variants in turns, block by block, or one whole run each.

``steps`` (``turns``): the runs of a seed live together and take turns, so load that comes and goes
falls on every variant alike; every variant of a seed is resident at once, so they must fit in this
machine's memory together. ``runs``: one run after another, one block per run, the seeds as rounds:
what a SLURM study gets (the scheduler starts its jobs when and where it likes), a study whose runs
do not fit together, and a study on an accelerator (resident variants would share its memory) unless
it asks for ``steps``. The plan (``--dry-run``) and the report say which, and why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lit_ablate.ablation.plan import PlannedRun
from lit_ablate.ablation.speed_verdict import SpeedDesign, min_pairs
from lit_ablate.callbacks.step_monitor import DEFAULT_WARMUP_STEPS

RANK_BYTES = 1 << 30
"""What one CPU rank of a study's run holds resident, at most, for the tiny models CPU studies train:
the Python runtime with torch, Lightning and transformers (~0.75 GB measured for a quickstart run) and
its tensors."""
MEMORY_SHARE = 0.7
"""The share of this machine's available memory the resident runs of one seed may take."""
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Interleaving:
    """The design a study's runs are measured under."""

    mode: str
    """``steps`` or ``runs``."""
    reason: str
    rounds: int
    """Blocks per run under ``steps``; under ``runs``, how many seeds pair up."""
    needed_pairs: int
    """Paired blocks a verdict needs at the study's confidence."""
    measured_steps: int | None = None
    """Steps after warm-up per run (None: not known before the runs)."""

    def describe(self) -> str:
        if self.mode == "steps":
            blocks = self.rounds if self.measured_steps is None else min(self.rounds, self.measured_steps)
            what = f"the variants of each seed take turns, {blocks} blocks of steps each"
        else:
            blocks = self.rounds
            what = f"one block per run, paired by seed ({self.rounds} seed(s))"
        line = f"speed: {what} ({self.reason}); a verdict needs {self.needed_pairs} paired blocks"
        if blocks < self.needed_pairs:
            fix = "more steps" if self.mode == "steps" else "more seeds, or speed.interleave: steps"
            line += f": too few here, every speed verdict will be inconclusive ({fix} would give one)"
        return line


def interleaving(design: SpeedDesign, runs: Sequence[PlannedRun]) -> Interleaving:
    """The design ``runs`` are measured under, from the study's ``speed.interleave`` and this machine."""
    seeds = sorted({run.seed for run in runs})
    needed = min_pairs(design.confidence)
    measured = min((m for m in map(_measured_steps, runs) if m is not None), default=None)
    as_runs = Interleaving("runs", "", len(seeds), needed, measured)
    if design.interleave == "runs":
        return _with(as_runs, "speed.interleave: runs")
    if any(run.launch.executor == "slurm" for run in runs):
        return _with(as_runs, "SLURM jobs start when and where the scheduler places them")
    launched = [run for run in runs if not run.skip_reason and not run.invalid]
    resident = max((sum(_processes(run) for run in launched if run.seed == seed) for seed in seeds), default=0)
    as_steps = Interleaving("steps", "", design.rounds, needed, measured)
    if design.interleave == "steps":
        return _with(as_steps, f"speed.interleave: steps; {resident} processes resident at once")
    if any(run.view.trainer.device_type != "cpu" for run in runs):
        return _with(
            as_runs,
            "variants on an accelerator would share its memory while they wait; set speed.interleave: steps "
            "when they fit on it together",
        )
    available = _available_bytes()
    need = resident * RANK_BYTES
    if available is not None and need > MEMORY_SHARE * available:
        return _with(
            as_runs,
            f"the {resident} processes of a seed would need ~{need / 2**30:.0f} GiB resident together, more "
            f"than {MEMORY_SHARE:.0%} of this machine's {available / 2**30:.0f} GiB available",
        )
    return _with(as_steps, f"{resident} processes resident at once, ~{math.ceil(need / 2**30)} GiB")


def _with(design: Interleaving, reason: str) -> Interleaving:
    return replace(design, reason=reason)


def _measured_steps(run: PlannedRun) -> int | None:
    """The run's steps after warm-up, from its config (None without a step limit)."""
    steps = (run.config.get("trainer") or {}).get("max_steps")
    warmup = (run.config.get("recorder") or {}).get("warmup_steps", DEFAULT_WARMUP_STEPS)
    return steps - warmup if isinstance(steps, int) and steps > 0 and isinstance(warmup, int) else None


def _processes(run: PlannedRun) -> int:
    return (run.view.devices_started or 1) * run.view.nodes_started


def _available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo``, or None where there is none."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None

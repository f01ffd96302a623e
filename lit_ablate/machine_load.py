"""Other processes' load on this machine: the CPU time they took while something was measured.

A speed measured while another job ran is that job's effect as much as the code's. Linux counts, in
``/proc/stat``, the CPU time every core spent busy (steal time of a virtual machine's host included),
and in ``/proc/<pid>/stat`` each process's own (all its threads) and its reaped children's. Busy time
minus the measured processes' own, over the wall time between two samples, is the other processes'
load in cores. The watcher (the study's runner) counts itself too: a run that exits between two
samples moves its time into its parent's children's time, so it is counted once either way. A watched
process whose parent is not watched, or ended too, may take its time out of the count when it ends: a
rank still running when its run's first rank exits is re-parented and reaped by init, and its whole
life's CPU time would read as other processes' load (seen: 20.8 "cores" on a 2-core machine, in the last
block of a run). The load of such an interval is unknown.
Elsewhere (no ``/proc``) the load is unknown: ``sample`` returns None and nothing is excluded for it.

Linux counts in clock ticks (10 ms): the difference of every CPU's count and of every process's may be
off by up to one tick, so an interval shorter than those ticks over ``RESOLUTION_CORES`` is too short
to tell, and its load is unknown too (a 25 ms step of a tiny CPU model would read anywhere from 0 to
2 cores).
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_CPUS = os.cpu_count() or 1
RESOLUTION_CORES = 0.125
"""The coarsest load reading kept: an interval must be long enough for its ticks' error to stay under it.
Half a study's default ``load_tolerance`` (0.25 cores), so that two readings' errors cannot add up to a
difference that leaves a pair out."""
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""user, nice, system, irq, softirq, steal of ``/proc/stat``'s ``cpu`` line (idle and iowait are not busy)."""


@dataclass(frozen=True)
class CpuSample:
    """The machine's busy CPU seconds and the watched processes' own, at one moment."""

    at: float
    busy_s: float
    own_s: float
    own_ticks: dict[int, int] = field(default_factory=dict)
    """Each watched process's CPU ticks: only those that changed between two samples carry a tick's error."""
    parents: dict[int, int] = field(default_factory=dict)
    """Each watched process's parent: a process that ended is counted in its parent's time only if the
    parent reaped it, that is, if the parent is watched and still alive (not a zombie)."""
    living: frozenset[int] = frozenset()
    """The watched processes that are running (a zombie's children may have gone to init)."""


def sample(process_groups: Collection[int] = (), pids: Collection[int] = ()) -> CpuSample | None:
    """Busy CPU seconds of the machine, and CPU seconds of every process in ``process_groups`` or ``pids``."""
    try:
        fields = (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    busy = sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields)) / _TICKS
    ticks, parents, living = _own_ticks(set(process_groups), set(pids))
    return CpuSample(time.monotonic(), busy, sum(ticks.values()) / _TICKS, ticks, parents, frozenset(living))


def _own_ticks(groups: set[int], pids: set[int]) -> tuple[dict[int, int], dict[int, int], set[int]]:
    """Each watched process's CPU ticks and parent, and which of them are not zombies."""
    ticks: dict[int, int] = {}
    parents: dict[int, int] = {}
    living: set[int] = set()
    if not groups and not pids:
        return ticks, parents, living
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # the process ended meanwhile
            continue
        after_name = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
        pid, parent, group = int(entry.name), int(after_name[1]), int(after_name[2])
        if group in groups or pid in pids:
            ticks[pid] = sum(int(x) for x in after_name[11:15])  # utime, stime and the reaped children's
            parents[pid] = parent
            if after_name[0] != "Z":
                living.add(pid)
    return ticks, parents, living


def foreign_cores(start: CpuSample | None, end: CpuSample | None) -> float | None:
    """Other processes' load between two samples, in cores (None when unknown or too short to tell)."""
    if start is None or end is None or end.at - start.at <= 0:
        return None
    ended = set(start.own_ticks) - set(end.own_ticks)
    if any(start.parents.get(pid) not in end.living for pid in ended):  # its time may have left the count
        return None
    changed = sum(start.own_ticks.get(pid) != end.own_ticks.get(pid) for pid in {*start.own_ticks, *end.own_ticks})
    if (_CPUS + changed) / _TICKS / (end.at - start.at) > RESOLUTION_CORES:  # each difference off by under a tick
        return None
    foreign = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return max(0.0, foreign / (end.at - start.at))

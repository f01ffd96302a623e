"""``storage: auto``: where a data set's examples live, decided by the size of what the source reads.

``memory`` costs about 28 GiB of RSS per GiB of text in every rank of every run (each example a
Python-held tensor; measured by ``benchmarks/data_setup.py``), the token cache a few MiB whatever
the corpus. So a source that reads stored data (files, a hub download) of ``AUTO_CACHE_BYTES`` or
more goes to the cache; smaller ones, and rows generated in code, stay in memory, where set-up
needs no disk and the tests and CPU studies are as fast as before. A stored source that cannot
tell its size goes to the cache: a wrong guess there costs a few seconds of writing, the other
way the machine's memory.
"""

from __future__ import annotations

from typing import Literal

from lit_ablate.data.sources import DataSource

AUTO_CACHE_BYTES = 16 * 2**20
"""``storage: auto`` caches a source of this many stored bytes or more (in memory: ~450 MiB of RSS per rank)."""


def choose_storage(source: DataSource) -> tuple[Literal["memory", "cache"], str]:
    """``(storage, why)`` for ``storage: auto``; ``why`` is one sentence for the run record."""
    name, size = type(source).__name__, source.stored_bytes()
    if size is None:
        return "cache", f"{name} cannot tell its size: the token cache, to be safe"
    if size == 0:
        return "memory", f"{name} generates its rows in code (no stored data): memory"
    mib, limit = size / 2**20, AUTO_CACHE_BYTES / 2**20
    if size >= AUTO_CACHE_BYTES:
        return "cache", f"{name} reads {mib:,.1f} MiB, at least the {limit:g} MiB of AUTO_CACHE_BYTES: the token cache"
    return "memory", f"{name} reads {mib:,.1f} MiB, under the {limit:g} MiB of AUTO_CACHE_BYTES: memory"

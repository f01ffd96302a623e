"""Host synchronisations: where a step makes the host wait for the device, counted from a profile.

A GPU runs as fast as its kernels only while the host stays ahead of it, queueing work; every read of a
device value into Python (and every operator whose output size depends on device data) makes the host
wait until the device has caught up, and the device then idles while the host queues the next work.
On CUDA such waits show as runtime calls (``cudaStreamSynchronize``...); the operators that cause them
show on every device, by name, so a CPU run counts the stalls the same step would have on a GPU:

- ``aten::_local_scalar_dense``: a value read into Python: ``.item()``, ``int()``, ``float()``,
  ``bool()``, an ``if`` on a tensor (labelled by the operator that asked: ``aten::item``,
  ``aten::is_nonzero``, ``aten::repeat_interleave`` without ``output_size``...);
- ``aten::nonzero`` (``nonzero``, boolean indexing: labelled ``aten::index``, ``torch.where(cond)``),
  ``aten::masked_select``, ``aten::_unique2``, ``aten::unique_consecutive``, ``aten::unique_dim``: an
  output size only the device's data decides;
- ``aten::equal``: ``torch.equal`` answers in Python;
- ``.tolist()`` and ``.numpy()``: on a CPU tensor they run no operator but ``aten::resolve_conj``
  (labelled ``Tensor.tolist/numpy`` when no operator called it).

What a CPU cannot see: an explicit ``.cpu()`` or ``.to("cpu")`` of a device tensor, and a copy onto
the device from pageable memory without ``non_blocking`` (``torch.tensor(x, device=...)``): both are
no-ops or plain copies on a CPU; on a GPU the runtime calls count them.

Not counted: operators whose CPU kernel reads a value that the CUDA kernel keeps on the device
(``DEVICE_SIDE_ON_CUDA``), operators inside a data loader's fetch (host batches, before they move to
the device), and the work of a compile (a recompile is counted as one, by ``KernelProfile``).

Reads a step needs on purpose are declared where they happen (``with host_read("what"):``, a profiler
range): they are counted apart, by that name, once per entry, so each is named and its rate pinned.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

HOST_READ_PREFIX = "lit_ablate host read: "
SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::unique_dim",
        "aten::equal",
    }
)
"""Operators that make the host wait for the device on CUDA (see the module docstring)."""
READ_INTO_PYTHON = "aten::resolve_conj"
"""What ``.tolist()``/``.numpy()`` of a CPU tensor leave in a profile, with no operator above it."""
TOLIST = "Tensor.tolist/numpy"
DEVICE_SIDE_ON_CUDA = frozenset(
    {"aten::_assert_async", "aten::_grouped_mm", "aten::_fused_adamw_", "aten::_fused_adam_"}
)
"""Operators whose CPU kernel reads a value (``.item()`` inside) while the CUDA kernel does not:
``_assert_async`` checks on the device, ``_grouped_mm`` takes its group offsets on the device, fused
Adam(W) its step counts."""
DATA_LOADER = "enumerate(DataLoader)"
"""The profiler range of a ``DataLoader`` fetch (torch names it ``enumerate(DataLoader)#...``)."""
COMPILE_WORK = "(dynamo_timed)"
"""In the profiler ranges torch.compile opens while it compiles."""


def host_read(name: str) -> torch.profiler.record_function:
    """Declare a deliberate read of device values by the host (a profiler range): counted under
    ``name`` in ``KernelProfile``'s ``host_reads_per_step``, not as a stall."""
    return torch.profiler.record_function(HOST_READ_PREFIX + name)


@dataclass
class HostSyncs:
    """What a profile's events hold: stalls by operator, and declared reads by name (counts)."""

    by_operator: collections.Counter[str] = field(default_factory=collections.Counter)
    declared: collections.Counter[str] = field(default_factory=collections.Counter)
    runtime_waits: collections.Counter[str] = field(default_factory=collections.Counter)
    """CUDA runtime calls that waited, outside declared reads (``runtime_calls`` asked for)."""


def count_host_syncs(events: Iterable[Any], runtime_calls: Iterable[str] = ()) -> HostSyncs:
    """Count ``events`` (a profile's ``FunctionEvent``s, with their ``cpu_parent`` links): every
    operator that forces a sync, outside declared reads, under the outermost operator that called
    it; every declared read once per entry; and the CUDA ``runtime_calls`` outside declared reads."""
    counts = HostSyncs()
    runtime = frozenset(runtime_calls)
    for event in events:
        name = event.name
        if name.startswith(HOST_READ_PREFIX):
            counts.declared[name.removeprefix(HOST_READ_PREFIX)] += 1
            continue
        forces = name in SYNC_OPS or name in runtime or (name == READ_INTO_PYTHON and not _is_op(event.cpu_parent))
        if not forces:
            continue
        ancestors = list(_ancestors(event))
        if any(_excluded(a.name) for a in ancestors):
            continue
        if name in runtime:
            counts.runtime_waits[name] += 1
        elif not any(a.name in SYNC_OPS for a in ancestors):  # nested: counted once, at the outer one
            counts.by_operator[TOLIST if name == READ_INTO_PYTHON else _caller(event)] += 1
    return counts


def _excluded(name: str) -> bool:
    return (
        name.startswith(HOST_READ_PREFIX)
        or name in DEVICE_SIDE_ON_CUDA
        or name.startswith(DATA_LOADER)
        or COMPILE_WORK in name
    )


def _is_op(event: Any) -> bool:
    return event is not None and event.name.startswith("aten::")


def _ancestors(event: Any) -> Iterator[Any]:
    while (event := event.cpu_parent) is not None:
        yield event


def _caller(event: Any) -> str:
    """The outermost operator of the chain of operators that ends in ``event`` (``aten::item`` for
    ``.item()``, ``aten::index`` for boolean indexing)."""
    while _is_op(event.cpu_parent):
        event = event.cpu_parent
    return event.name

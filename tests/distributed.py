"""Run a function on N real ranks from a test: forked processes, a gloo process group, results back.

Forking from the test process (which has already imported torch, transformers and lightning)
starts a 2-rank group in well under a second, where ``torchrun`` pays ~10 s of imports per
launch (PLATFORM_NOTES). Usage::

    from tests.distributed import run_ranks

    def _all_reduce_sum(rank: int, world_size: int, value: float) -> float:
        t = torch.tensor([value * (rank + 1)])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_ranks(_all_reduce_sum, 2, 1.5) == [4.5, 4.5]

``fn(rank, world_size, *args)`` runs on every rank; whatever it returns comes back in rank order.
Return values travel through ``torch.save``/``torch.load(weights_only=True)``, so keep them to
tensors, numbers, strings, and lists/tuples/dicts of those. An exception on any rank fails the
test with that rank's traceback; a rank that hangs is killed after ``timeout_s``.

For a Lightning ``Trainer`` inside the ranks, pass ``init_process_group=False``: the rendezvous
environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``NODE_RANK``) is set either way, so Lightning sees an externally launched job (as under
torchrun) and creates the process group itself.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (each test gets its own rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    init_process_group: bool = True,
    timeout_s: float = 120.0,
) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each on its own rank."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as out:
        context = mp.start_processes(
            _rank_main,
            args=(fn, world_size, port, out, init_process_group, args),
            nprocs=world_size,
            start_method="fork",
            join=False,
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout_s:.0f} s")
        return [torch.load(Path(out) / f"{rank}.pt", weights_only=True) for rank in range(world_size)]


def _rank_main(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, out: str, init_process_group: bool, args: tuple
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    torch.set_num_threads(1)  # the ranks share two cores; oversubscription only slows them down
    if init_process_group:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, Path(out) / f"{rank}.pt")

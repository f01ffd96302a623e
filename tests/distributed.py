"""Run a function on N real ranks from a test: a gloo process group, results back, hangs fail fast.

Ranks start from a *forkserver*, never by forking the test process. The test process may already
have run ``torch.compile`` (single-process compile tests run in it) or started threads (OpenMP,
inductor's compile pool); a child forked from it inherits inductor's async-compile state but not
its worker threads, and its first compile waits forever on a Future
(docs/platform.md#forking-after-inductor-compiled-deadlocks). The
forkserver is a fresh interpreter, started once per test session, that imports torch, lightning,
transformers and lit_ablate and never computes anything, so every rank forked from it is clean
and still starts in about a second (``spawn`` would pay ~8 s of imports per rank). So ``fn`` and
``args`` must be picklable: a module-level function and plain values. The ranks see the test
process's environment as of the call, not its in-memory state (seeds, monkeypatches). Usage::

    from tests.distributed import run_ranks

    def _all_reduce_sum(rank: int, world_size: int, value: float) -> float:
        t = torch.tensor([value * (rank + 1)])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_ranks(_all_reduce_sum, 2, 1.5) == [4.5, 4.5]

``fn(rank, world_size, *args)`` runs on every rank; whatever it returns comes back in rank order.
Return values travel through ``torch.save``/``torch.load(weights_only=True)``, so keep them to
tensors, numbers, strings, and lists/tuples/dicts of those.

Failures surface at once, with every rank's Python stack, instead of at pytest's timeout: a rank
that raises or dies fails the call as soon as it exits (its traceback, or the stack
``faulthandler`` wrote on a fatal signal); on ``timeout_s`` the helper has each live rank dump its
stack (``faulthandler`` on SIGUSR1), kills the ranks and raises ``TimeoutError`` with the stacks.

For a Lightning ``Trainer`` inside the ranks, pass ``init_process_group=False``: the rendezvous
environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``NODE_RANK``) is set either way, so Lightning sees an externally launched job (as under
torchrun) and creates the process group itself. Use strategy ``ddp``, never ``ddp_fork``/
``ddp_spawn``, which would start processes from the test process itself.

The rendezvous store is this process's, bound before any rank starts, as torchrun's agent hosts it: a
port chosen free and bound later by rank 0 could be taken by another process in between (``EADDRINUSE``,
seen in CI between two fits of one test). Every process group a rank creates, a second fit's included,
rendezvous there under a prefix of its own (``_rendezvous_in``): a group made again after
``destroy_process_group`` gets the group names of the first, whose addresses would still be in the store.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing import forkserver
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import _rendezvous_handlers

from lit_ablate.models.presets import PRESETS

# Imported once by the forkserver, so a rank pays only for what its test module adds (measured on 2
# loaded cores: a 2-rank call takes ~5 s if its ranks import transformers' models and pytest
# themselves, ~0.4 s with this list, as fast as forking the test process).
PRELOAD = [
    "pytest",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "lightning.pytorch",
    "transformers.modeling_utils",
    *sorted({f"transformers.models.{c['model_type']}.modeling_{c['model_type']}" for c in PRESETS.values()}),
    "lit_ablate.cli",
    "lit_ablate.callbacks",
    "lit_ablate.data",
    "lit_ablate.modules",
    "lit_ablate.strategies",
    # imported by the code ranks run, not at lit_ablate's import: each rank paid ~1-2 s of CPU for them
    "peft",
    "torch.distributed.pipelining",
    "torch.distributed.optim",
    "torch.distributed.checkpoint.state_dict",
]
STACK_SIGNAL = signal.SIGUSR1
STACK_WAIT_S = 5.0  # a rank writes its stack within milliseconds of the signal unless it is stopped


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    init_process_group: bool = True,
    timeout_s: float = 120.0,
) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each on its own rank."""
    context = _forkserver()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # bound here, before any rank
    port = store.port
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        out = Path(tmp)
        processes = [
            context.Process(
                target=_rank_main,
                name=f"rank {rank}",
                daemon=True,
                args=(rank, fn, world_size, port, tmp, init_process_group, args, dict(os.environ)),
            )
            for rank in range(world_size)
        ]
        try:
            for process in processes:
                _start(process, fn)
            _wait(processes, fn, out, timeout_s)
        finally:
            for process in processes:
                if process.pid is not None and process.exitcode is None:
                    process.kill()
                    process.join()
        return [torch.load(out / f"{rank}.pt", weights_only=True) for rank in range(world_size)]


def _forkserver() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server (started by the first call) importing from this process's
    ``sys.path``: Python 3.11's forkserver ignores it, and would import lit_ablate from wherever it
    is installed rather than from the checkout under test."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, sys.path))):
        forkserver.ensure_running()
    return context


def _start(process: BaseProcess, fn: Callable[..., Any]) -> None:
    try:
        process.start()
    except (AttributeError, TypeError, pickle.PicklingError) as error:  # a local function, a lambda, an open file
        raise TypeError(
            f"run_ranks({fn.__qualname__}, ...) could not send the function or its arguments to the ranks ({error}); "
            "ranks start from a forkserver: pass a module-level function and picklable arguments"
        ) from error


def _wait(processes: list[BaseProcess], fn: Callable[..., Any], out: Path, timeout_s: float) -> None:
    """Return when every rank exited cleanly; raise with every rank's story at the first failure or the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        failed = [rank for rank, process in enumerate(processes) if process.exitcode not in (None, 0)]
        if failed:
            ranks = ", ".join(map(str, failed))
            raise RuntimeError(_report(f"{fn.__qualname__} failed on rank {ranks}", processes, out))
        running = [process for process in processes if process.exitcode is None]
        if not running:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(_report(f"{fn.__qualname__} did not finish in {timeout_s:g} s", processes, out))
        wait([process.sentinel for process in running], timeout=remaining)


def _report(headline: str, processes: list[BaseProcess], out: Path) -> str:
    """One section per rank: its traceback, its fatal-signal stack, or (still running) its stack now."""
    running = [rank for rank, process in enumerate(processes) if process.exitcode is None]
    for rank in running:
        with contextlib.suppress(ProcessLookupError):  # it may have exited since
            os.kill(processes[rank].pid, STACK_SIGNAL)
    stacks = {rank: _read_when_written(out / f"{rank}.stack", processes[rank]) for rank in running}
    for rank in running:
        processes[rank].kill()
        processes[rank].join()
    sections = [f"{headline} ({len(processes)} ranks)"]
    for rank, process in enumerate(processes):
        error_file, stack_file = out / f"{rank}.error", out / f"{rank}.stack"
        if error_file.exists():
            sections.append(f"--- rank {rank}: raised\n{error_file.read_text()}")
        elif stacks.get(rank):
            sections.append(f"--- rank {rank}: still running (killed); its stack:\n{stacks[rank]}")
        elif process.exitcode == 0:
            sections.append(f"--- rank {rank}: finished")
        else:
            code = process.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            stack = stack_file.read_text() if stack_file.exists() else ""
            sections.append(f"--- rank {rank}: {how}\n{stack or '(no stack written)'}")
    return "\n".join(sections)


def _read_when_written(path: Path, process: BaseProcess) -> str:
    """The stack a rank writes on ``STACK_SIGNAL``, once its size stops changing (or the rank exited)."""
    deadline, size = time.monotonic() + STACK_WAIT_S, -1
    while time.monotonic() < deadline and process.exitcode is None:
        current = path.stat().st_size if path.exists() else 0
        if current and current == size:
            break
        size = current
        time.sleep(0.05)
    return path.read_text() if path.exists() else ""


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    out: str,
    init_process_group: bool,
    args: tuple,
    environ: dict[str, str],
) -> None:
    stack_file = open(Path(out) / f"{rank}.stack", "w")  # noqa: SIM115 (faulthandler writes to it until exit)
    faulthandler.enable(stack_file, all_threads=True)
    faulthandler.register(STACK_SIGNAL, stack_file, all_threads=True)
    os.environ.clear()
    os.environ.update(environ)
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
    _rendezvous_handlers["env"] = functools.partial(_rendezvous_in, port, itertools.count())
    try:
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
    except BaseException:
        (Path(out) / f"{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, Path(out) / f"{rank}.pt")


def _rendezvous_in(
    port: int, groups: Iterator[int], url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any
) -> Iterator[tuple[dist.Store, int, int]]:
    """torch's ``env://`` rendezvous through the test process's store (``run_ranks``), each process group
    under a prefix of its own: every rank counts its groups alike, so they agree on it. (torch registers
    one handler per scheme and has no public way to replace one: its handler table is set directly.)"""
    query = dict(parse_qsl(urlparse(url).query))
    rank = int(query.get("rank", os.environ["RANK"]))
    world_size = int(query.get("world_size", os.environ["WORLD_SIZE"]))
    client = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    yield dist.PrefixStore(f"group{next(groups)}/", client), rank, world_size
    raise RuntimeError("a rendezvous of run_ranks is not made again: start another run_ranks call")

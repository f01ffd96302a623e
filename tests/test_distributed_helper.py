"""``tests.distributed.run_ranks`` fails fast: a hang or a crash on one rank is an error naming it, in seconds.

Without this, a deadlocked rank (a fork after inductor compiled: docs/platform.md) holds the suite
until pytest's timeout and says nothing about where it stopped. The timeouts below are seconds; the
assertions check the error's text, never how long it took (the machine is shared).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks


def _rank_sum(rank: int, world_size: int, value: float) -> float:
    t = torch.tensor([value * (rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _sleep_forever_on_rank_1() -> None:
    while True:
        time.sleep(0.1)


def _one_rank_sleeps(rank: int, world_size: int) -> None:
    if rank == 1:
        _sleep_forever_on_rank_1()
    dist.barrier()  # rank 0 waits here for a rank that never comes


def _one_rank_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses this batch")
    dist.barrier()


def _one_rank_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def _port_taken(rank: int, world_size: int) -> bool:
    """Whether the rendezvous port is already bound as the ranks start (before any process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


GROUPS_MADE_AGAIN = 8


def _process_groups_made_again(rank: int, world_size: int) -> list[float]:
    """A process group, destroyed, then another in the same ranks (as two CLI fits in one rank make), and
    again: a stale address is read only when a rank comes first to a key the other has not yet rewritten."""
    sums = []
    for value in range(1, GROUPS_MADE_AGAIN + 1):
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        t = torch.tensor([value * (rank + 1)])
        dist.all_reduce(t)
        sums.append(t.item())
        dist.destroy_process_group()
    return sums


def _compiled_square(rank: int, world_size: int, salt: int) -> float:
    return torch.compile(lambda x: x * x + salt)(torch.tensor([rank + 2.0])).item()


def test_results_come_back_in_rank_order():
    assert run_ranks(_rank_sum, 2, 1.5) == [4.5, 4.5]


def test_the_rendezvous_port_is_held_before_any_rank_starts():
    """The port the ranks rendezvous on is bound by the test process before they start, so no other
    process can take it in between (``EADDRINUSE``, seen in CI). Seen failing with the port chosen free and
    left for rank 0 to bind (the ranks found it free)."""
    assert run_ranks(_port_taken, 2, init_process_group=False) == [True, True]


def test_a_process_group_made_again_in_the_same_ranks_rendezvous_afresh():
    """Each process group a rank makes rendezvous under a prefix of its own in the one store: a group made
    again after ``destroy_process_group`` takes the first one's names. Seen failing with one prefix for
    every group (a later group read an earlier one's addresses, ``Connection refused``: 7 calls of this
    test in 8; with the prefixes, none in 8)."""
    sums = [3.0 * value for value in range(1, GROUPS_MADE_AGAIN + 1)]
    assert run_ranks(_process_groups_made_again, 2, init_process_group=False, timeout_s=120) == [sums, sums]


def test_a_hanging_rank_times_out_with_every_rank_stack():
    with pytest.raises(TimeoutError, match="did not finish in 3 s") as error:
        run_ranks(_one_rank_sleeps, 2, timeout_s=3)
    rank_0, rank_1 = str(error.value).split("--- rank 1")
    assert "_sleep_forever_on_rank_1" in rank_1 and "still running" in rank_1
    assert "--- rank 0: still running" in rank_0 and "barrier" in rank_0


def test_a_raising_rank_fails_at_once_with_its_traceback():
    with pytest.raises(RuntimeError, match="failed on rank") as error:  # rank 0 may fail too, once rank 1 is gone
        run_ranks(_one_rank_raises, 2, timeout_s=60)
    rank_1 = str(error.value).split("--- rank 1: raised")[1]
    assert "_one_rank_raises" in rank_1 and "ValueError: rank 1 refuses this batch" in rank_1


def test_a_rank_killed_by_a_signal_fails_with_its_fatal_stack():
    with pytest.raises(RuntimeError, match="failed on rank") as error:
        run_ranks(_one_rank_dies, 2, timeout_s=60)
    rank_1 = str(error.value).split("--- rank 1: killed by SIGSEGV")[1]
    assert "Segmentation fault" in rank_1 and "_one_rank_dies" in rank_1


def test_a_local_function_is_refused_with_the_reason():
    def local(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(local, 2)


@pytest.mark.slow  # three inductor compiles: ~10-40 s on 2 shared cores
def test_ranks_compile_after_the_test_process_compiled():
    """Ranks forked from a process that compiled would wait forever in their first compile.

    Every function compiled here bakes in a constant new to this run (``salt``), so the test process
    and both ranks really compile: a kernel found in inductor's cache would be loaded without ever
    reaching the async-compile pool that a forked child inherits without its threads. (A fresh cache
    folder did the same at three times the cost: each process then also rebuilt inductor's probes of
    the CPU's vector instructions.) With ``fork`` instead of the forkserver this test times out (rank
    stacks in ``Future.result``)."""
    salt = time.time_ns() % 1_000_000
    assert torch.compile(lambda x: x + salt)(torch.tensor([1.0])).item() == 1.0 + salt
    assert run_ranks(_compiled_square, 2, salt, init_process_group=False, timeout_s=240) == [4.0 + salt, 9.0 + salt]

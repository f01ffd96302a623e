"""``benchmarks/overhead.py`` and ``benchmarks/mfu.py`` run their sides in lockstep
(``benchmarks/lockstep.py``): one step each, in strict turns, each side's clock counting its own turns
only. A paired ratio of two sides' steps is only their own work's
ratio if no side's clock ever counts another side's step, which is what these tests pin."""

from __future__ import annotations

import itertools
import threading

import pytest

from benchmarks.lockstep import Lockstep, run_in_turns, turn_order

WORK = {"hand": 1.0, "lit": 10.0, "trainer": 100.0}
"""Each side's step, in seconds of a fake clock that only the side holding the turn advances."""


def test_each_side_s_clock_counts_its_own_steps_only_and_the_sides_take_strict_turns() -> None:
    """Seen failing with ``mark`` returning the shared clock (hand's last mark read 444 after its four
    steps of 1: every side's steps)."""
    now = [0.0]
    lockstep = Lockstep(list(WORK), clock=lambda: now[0])
    marks: dict[str, list[float]] = {}
    turns: list[str] = []

    def side(name: str) -> None:
        lockstep.begin()
        marks[name] = []
        for _ in range(4):
            marks[name].append(lockstep.mark())
            turns.append(name)
            now[0] += WORK[name]  # only the side holding the turn runs
        marks[name].append(lockstep.mark())  # the last step's end, as the hand-written loop marks it
        lockstep.leave()

    threads = [threading.Thread(target=side, args=(name,), name=name, daemon=True) for name in WORK]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "the lockstep deadlocked"
    assert marks == {name: [step * work for step in range(5)] for name, work in WORK.items()}
    assert turns == list(WORK) * 4


def test_every_side_follows_every_other_side_equally_often() -> None:
    """A side's step starts with the caches full of the previous side's data: over two rounds, each
    ordered pair (predecessor, side) occurs once. Seen failing with a plain rotation (each side's
    predecessor never changes)."""
    names = list(WORK)
    follows = []
    for round_ in range(2):
        order = turn_order(names, round_)
        assert sorted(order) == sorted(names)
        follows += [(order[i - 1], order[i]) for i in range(len(order))]
    assert sorted(follows) == sorted(itertools.permutations(names, 2))


def test_a_side_that_fails_while_setting_up_leaves_the_others_to_finish() -> None:
    """A side that raises before its first step hands its turn on: the others finish their runs and
    ``run_in_turns`` raises naming it, instead of waiting forever for its turn. Seen failing (deadlocked)
    with ``leave`` passing on only a turn that had started."""
    lockstep = Lockstep(["hand", "lit", "trainer"], clock=lambda: 0.0)

    def fails() -> int:
        raise ValueError("set-up failed")

    def runs() -> int:
        for _ in range(3):
            lockstep.mark()
        return 3

    done: list[BaseException] = []

    def round_() -> None:
        try:
            run_in_turns(lockstep, {"hand": fails, "lit": runs, "trainer": runs})
        except BaseException as error:
            done.append(error)

    thread = threading.Thread(target=round_, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the lockstep deadlocked on the failed side"
    with pytest.raises(RuntimeError, match="hand failed"):
        raise done[0]
    assert isinstance(done[0].__cause__, ValueError)


def test_a_serving_side_stops_when_the_sides_it_serves_have_left() -> None:
    """A side that only serves the others (``mfu.py``'s ceiling probe) takes turns while another side runs
    and stops after the last one left, having taken one turn per step of the longest side. Seen failing with
    ``others_running`` counting the caller (the probe went on taking turns alone, never returning)."""
    lockstep = Lockstep(["hand", "lit", "probe"], clock=lambda: 0.0)
    steps = {"hand": 2, "lit": 4}

    def side(name: str):
        def run() -> int:
            for _ in range(steps[name]):
                lockstep.mark()
            return steps[name]

        return run

    def probe() -> int:
        turns = 0
        while lockstep.others_running():
            lockstep.mark()
            turns += 1
        return turns

    results: dict[str, int] = {}
    sides = {"hand": side("hand"), "lit": side("lit"), "probe": probe}
    thread = threading.Thread(target=lambda: results.update(run_in_turns(lockstep, sides)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the serving side never stopped"
    assert results == {"hand": 2, "lit": 4, "probe": 4}

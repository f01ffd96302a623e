"""Side-by-side timing in lockstep: each side of a comparison in a thread of its own, one step at a time in turn.

On a shared VM the same loop's step moved by 30 % between runs a minute apart, more than most differences a
benchmark is after; runs one after the other (or alternating, best of each) cannot separate them. In
lockstep, step k of every side runs within seconds of the others', so a drift of the machine's speed hits
all sides alike, and the ratio of their step k is a fair pair (``lit_ablate.ablation.speed_verdict``'s sign
test gives the median pair an interval). ``benchmarks/overhead.py`` and ``benchmarks/mfu.py`` measure so.

A side calls ``mark`` at each step start: that ends its turn, waits for its next one and returns its own
time, the sum of its turns, so the time the other sides ran is never counted. A side whose steps are timed
by its own clock (lit-ablate's ``StepClock``) pauses that clock around ``mark`` instead. Its first turn is
its set-up, alone: seeding draws from one global random generator, and concurrent set-ups built different
models.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Lockstep:
    """Runs the sides one step at a time, in turn, each in a thread named after it. ``mark`` is their
    clock: at a step start it ends the caller's turn, waits for its next one and returns the caller's
    own time, the sum of its turns."""

    def __init__(self, order: list[str], clock: Callable[[], float]) -> None:
        self.order, self.clock = list(order), clock
        self.turn = self.order[0]
        self.own = dict.fromkeys(order, 0.0)
        self.since: dict[str, float] = {}  # the side holding the turn: its clock when the turn began
        self.condition = threading.Condition()

    def begin(self) -> None:
        """Wait for the caller's first turn: it sets up (seeds, builds its model) with no other side running,
        which would draw from the same global random generator; its clock starts at its first step."""
        side = threading.current_thread().name
        with self.condition:
            self.condition.wait_for(lambda: self.turn == side)

    def mark(self) -> float:
        side = threading.current_thread().name
        with self.condition:
            self._end_turn(side)
            self.condition.wait_for(lambda: self.turn == side)
            self.since[side] = self.clock()
            return self.own[side]

    def leave(self) -> None:
        """The caller's run ended (or failed): its last turn ends and the others go on without it."""
        side = threading.current_thread().name
        with self.condition:
            if side not in self.since and self.turn == side:  # it failed before its first step
                self._pass(side)
            self._end_turn(side)
            self.order.remove(side)

    def others_running(self) -> bool:
        """Whether a side besides the caller has not left yet (a side that only serves the others, like a
        ceiling probe, stops when they have)."""
        with self.condition:
            return any(name != threading.current_thread().name for name in self.order)

    def _end_turn(self, side: str) -> None:
        if side in self.since:
            self.own[side] += self.clock() - self.since.pop(side)
            self._pass(side)

    def _pass(self, side: str) -> None:
        self.turn = self.order[(self.order.index(side) + 1) % len(self.order)]
        self.condition.notify_all()


def turn_order(names: list[str], round_: int) -> list[str]:
    """The order of the turns in round ``round_``: forwards and backwards in alternate rounds, so that each side
    follows each other side (whose step leaves the caches full of its own data) equally often, and starting
    from the next side every second round."""
    ordered = names if round_ % 2 == 0 else names[::-1]
    first = (round_ // 2) % len(names)
    return ordered[first:] + ordered[:first]


def run_in_turns(lockstep: Lockstep, sides: dict[str, Callable[[], T]]) -> dict[str, T]:
    """Each side's function in a thread named after it, in ``lockstep``'s turns (from its first turn, its
    set-up; it leaves when it returns or raises): their results by name. A side that fails hands its turns
    on, and once the others finished this raises naming it."""
    results: dict[str, T] = {}
    failures: dict[str, BaseException] = {}

    def side(name: str) -> None:
        try:
            lockstep.begin()
            results[name] = sides[name]()
        except BaseException as failure:  # re-raised in the calling thread below
            failures[name] = failure
        finally:
            lockstep.leave()

    threads = [threading.Thread(target=side, args=(name,), name=name, daemon=True) for name in lockstep.order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, failure in failures.items():
        raise RuntimeError(f"{name} failed") from failure
    return results

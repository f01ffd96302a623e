"""Interleaved measurement: the runs of one seed take turns, one block of steps each per round.

Run one variant after another and a burst of load from another job lands on one variant whole, and
is read as its speed. Here the runs of one seed start together, and the runner lets them train in
turns over a local socket (``TurnServer``; each run's ``TurnTaking`` callback waits for its go):

1. every run starts (imports, data, model) at once, then waits at fit start;
2. one run at a time goes through its set-up turn: the matmul ceiling, the warm-up steps (so the
   ceiling and warm-up are measured on a machine no sibling loads);
3. ``rounds`` rounds: in each, every run trains one block of its measured steps while the others
   wait, in an order rotated every round (no variant is always first after a pause); the last block
   runs to the end of training and its process exits before the next run's turn.

Each block is recorded in the run's record (``speed_blocks``): its steps, how long the run waited for
it, its wall seconds and the CPU load other processes put on the machine meanwhile (``machine_load``);
``speed_verdict`` pairs the blocks of a round. A run's time limit counts only its own time, not its waits for a turn.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_ablate import machine_load
from lit_ablate.ablation.live_run import LiveRun
from lit_ablate.ablation.plan import PlannedRun
from lit_ablate.ablation.run_folder import prepare
from lit_ablate.ablation.run_folder_lock import run_lock
from lit_ablate.callbacks.turn_taking import TURNS_ENV

POLL_S = 0.05
"""How often the runner looks at its runs while it waits for an arrival (their exit, their time limit)."""


def block_ends(max_steps: int | None, warmup_steps: int, rounds: int) -> list[int | None]:
    """The step each gate's turn ends at (None: the end of training), gate 0 (set-up and warm-up) first.

    The measured steps (after warm-up) are cut into ``rounds`` blocks of nearly equal length (fewer
    when there are fewer steps); a run without a step limit has its set-up turn only."""
    measured = (max_steps or 0) - warmup_steps
    if max_steps is None or max_steps <= 0 or measured < 1:
        return [None]
    count = min(rounds, measured)
    return [warmup_steps] + [warmup_steps + k * measured // count for k in range(1, count)] + [None]


@dataclass
class _Client:
    run: str
    rank: int
    connection: socket.socket
    buffer: bytes = b""


class TurnServer:
    """Listens on a loopback port for the runs' ranks; knows which gate each rank last reached."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._clients: dict[socket.socket, _Client | None] = {}
        self.arrivals: dict[str, dict[int, dict[str, Any]]] = {}

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def pump(self, timeout: float) -> None:
        """Accept connections and read arrivals for up to ``timeout`` seconds."""
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._listener:
                connection, _ = self._listener.accept()
                connection.setblocking(False)
                self._clients[connection] = None
                self._selector.register(connection, selectors.EVENT_READ)
            else:
                self._read(key.fileobj)  # type: ignore[arg-type]

    def _read(self, connection: socket.socket) -> None:
        try:
            data = connection.recv(65536)
        except OSError:
            data = b""
        if not data:  # the rank is gone (its run ended)
            self._selector.unregister(connection)
            self._clients.pop(connection, None)
            connection.close()
            return
        client = self._clients.get(connection)
        buffer = (client.buffer if client else b"") + data
        *lines, rest = buffer.split(b"\n")
        for line in lines:
            arrival = json.loads(line)
            arrival["seen_at"] = time.monotonic()
            client = _Client(arrival["run"], arrival["rank"], connection)
            self.arrivals.setdefault(client.run, {})[client.rank] = arrival
        if client is not None:
            client.buffer = rest
            self._clients[connection] = client

    def at_gate(self, run: str, gate: int) -> dict[str, Any] | None:
        """Rank 0's arrival when every rank of ``run`` reached ``gate``, else None."""
        ranks = self.arrivals.get(run, {})
        if not ranks or len(ranks) < next(iter(ranks.values()))["processes"]:
            return None
        if any(arrival["gate"] != gate for arrival in ranks.values()):
            return None
        return ranks.get(0, next(iter(ranks.values())))

    def go(self, run: str, until: int | None) -> None:
        """Let every rank of ``run`` train until global step ``until`` (None: to the end)."""
        message = (json.dumps({"until": until}) + "\n").encode()
        for client in self._clients.values():
            if client is not None and client.run == run:
                with contextlib.suppress(OSError):  # a rank that died meanwhile: its exit is seen next
                    client.connection.sendall(message)

    def close(self) -> None:
        for connection in list(self._clients):
            connection.close()
        self._selector.close()
        self._listener.close()


@dataclass
class _Turns:
    """One run's place in the schedule."""

    live: LiveRun
    gate: int = 0
    ends: list[int | None] = field(default_factory=lambda: [None])
    max_steps: int | None = None
    waited_s: float = 0.0
    blocks: list[dict[str, Any]] = field(default_factory=list)
    status: str | None = None
    message: str | None = None

    @property
    def label(self) -> str:
        return self.live.run.label

    def active_seconds(self, waiting_since: float | None) -> float:
        """Seconds since start, less the time spent waiting for a turn."""
        now = time.monotonic()
        return now - self.live.started - self.waited_s - (now - waiting_since if waiting_since is not None else 0.0)


def run_in_turns(
    runs: Sequence[PlannedRun],
    fit_command: Sequence[str],
    rounds: int,
    group: str,
    on_turn: Callable[[PlannedRun], None] | None = None,
    watch: Callable[[dict[str, Any] | None], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``runs`` (the runs of one seed) in turns; returns their final records, in ``runs``' order."""
    records: dict[str, dict[str, Any]] = {}
    server = TurnServer()
    with contextlib.ExitStack() as locks:
        schedule: list[_Turns] = []
        try:
            for run in runs:
                lock = locks.enter_context(run_lock(run.run_dir))
                unrunnable = prepare(run)
                if unrunnable is not None:
                    records[run.label] = unrunnable
                    continue
                environment = {TURNS_ENV: f"{server.address} {run.label}"}
                schedule.append(_Turns(LiveRun(run, fit_command, lock, environment)))
            _Schedule(server, schedule, rounds, group, on_turn, watch).run()
        except BaseException:
            for entry in schedule:
                entry.live.stop()
                records[entry.label] = entry.live.finish("interrupted", "stopped by Ctrl-C / SIGTERM; redone on resume")
            raise
        finally:
            server.close()
        for entry in schedule:
            blocks = {"design": "steps", "group": group, "blocks": entry.blocks}
            records[entry.label] = entry.live.finish(entry.status, entry.message, blocks)
    return [records[run.label] for run in runs]


class _Schedule:
    def __init__(
        self,
        server: TurnServer,
        schedule: list[_Turns],
        rounds: int,
        group: str,
        on_turn: Callable[[PlannedRun], None] | None,
        watch: Callable[[dict[str, Any] | None], None] | None,
    ) -> None:
        self.server, self.schedule, self.rounds, self.group = server, schedule, rounds, group
        self.on_turn, self.watch = on_turn, watch
        self.waiting_since: dict[str, float] = {}

    def run(self) -> None:
        for entry in self.schedule:  # everyone starts at once and waits at fit start
            self._wait(lambda entry=entry: self._done_or_at_gate(entry), active=self.schedule)
        for entry in self.schedule:  # set-up turns: ceiling and warm-up, one run at a time
            if self._waiting(entry):
                hello = self.server.at_gate(entry.label, 0)
                entry.max_steps = hello["max_steps"] if hello["max_steps"] and hello["max_steps"] > 0 else None
                entry.ends = block_ends(entry.max_steps, hello["warmup_steps"] or 0, self.rounds)
                self._turn(entry)
        for round_ in range(1, self.rounds + 1):
            offset = (round_ - 1) % max(1, len(self.schedule))
            for entry in self.schedule[offset:] + self.schedule[:offset]:
                if self._waiting(entry) and entry.gate < len(entry.ends):
                    block = self._turn(entry)
                    entry.blocks.append({"round": round_, **block})

    def _turn(self, entry: _Turns) -> dict[str, Any]:
        """Let ``entry`` train to its next gate (or its end); the block's steps, seconds and load."""
        groups = [e.live.process.pid for e in self.schedule]
        arrival = self.server.at_gate(entry.label, entry.gate)
        until = entry.ends[entry.gate]
        if self.on_turn:
            self.on_turn(entry.live.run)
        waited = time.monotonic() - self.waiting_since.pop(entry.label, time.monotonic())
        entry.waited_s += waited
        start = machine_load.sample(process_groups=groups, pids=[os.getpid()])
        self.server.go(entry.label, until)
        entry.gate += 1
        self._wait(lambda: self._done_or_at_gate(entry), active=[entry])
        end = machine_load.sample(process_groups=groups, pids=[os.getpid()])
        after = self.server.at_gate(entry.label, entry.gate)
        last = after["step"] if after else until if until is not None else entry.max_steps
        return {
            "first_step": arrival["step"] + 1,
            "waited_s": waited,
            "last_step": last,
            "seconds": end.at - start.at if start and end else None,
            "foreign_cores": machine_load.foreign_cores(start, end),
        }

    def _waiting(self, entry: _Turns) -> bool:
        return entry.live.poll() is None and entry.status is None

    def _done_or_at_gate(self, entry: _Turns) -> bool:
        if entry.live.poll() is not None or entry.status is not None:
            return True
        arrival = self.server.at_gate(entry.label, entry.gate)
        if arrival is not None:
            latest = max(a["seen_at"] for a in self.server.arrivals[entry.label].values())
            self.waiting_since.setdefault(entry.label, latest)
            return True
        return False

    def _wait(self, done: Callable[[], bool], active: Sequence[_Turns]) -> None:
        """Serve the socket until ``done()``; meanwhile stop any ``active`` run past its time limit."""
        while not done():
            self.server.pump(POLL_S)
            for entry in active:
                limit = entry.live.run.launch.timeout_s
                waiting = self.waiting_since.get(entry.label)
                if entry.status is None and entry.live.poll() is None and entry.active_seconds(waiting) > limit:
                    entry.live.stop()
                    entry.status, entry.message = "timeout", f"exceeded launch.timeout_s={limit:g}"
            if self.watch and len(active) == 1:
                self.watch(active[0].live.progress())

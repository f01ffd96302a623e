"""``TurnTaking``: a study's run waits for its turn, so that its variants are measured block by block.

A study that compares speeds starts the runs of one seed together and lets them take turns
(``lit_ablate.ablation.turns``): one run trains a block of steps while the others wait, then the
next. Load that comes and goes on a shared machine then falls on every variant's blocks alike
instead of on whichever variant ran at the time. The runner sets ``LIT_ABLATE_TURNS`` (its address
and the run's name); the fit CLI then puts this callback first, and every rank:

- at fit start (model built, before the matmul ceiling is measured and the first step), says it
  arrived and waits: the runner lets one run at a time through its set-up and warm-up steps;
- at the start of the optimizer step the runner named in its last answer, says so and waits again.

Waiting is a blocking read on a socket: no CPU time, and out of the step clock (paused like a
validation run), so no step's time includes it. If the runner goes away the run trains on.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lit_ablate.callbacks.run_recorder import RunRecorder
from lit_ablate.callbacks.step_clock import RUNNING_CLOCKS
from lit_ablate.simulated_rank import current_simulation

TURNS_ENV = "LIT_ABLATE_TURNS"
"""``HOST:PORT RUN``: where the study's runner listens, and the name this run answers to."""


class TurnTaking(Callback):
    """Waits for the runner's go at fit start and at the step boundaries it names.

    Args:
        address: the runner's ``host:port``.
        run: this run's name in the runner's schedule.
    """

    def __init__(self, address: str, run: str) -> None:
        host, port = address.rsplit(":", 1)
        self.address = (host, int(port))
        self.run = run
        self._socket: socket.socket | None = None
        self._reader: Any = None
        self._until: int | None = None
        self._gate = 0

    @classmethod
    def from_environment(cls) -> TurnTaking | None:
        """The callback a study's run gets (``LIT_ABLATE_TURNS`` set), or None."""
        value = os.environ.get(TURNS_ENV)
        if not value:
            return None
        address, run = value.split(" ", 1)
        return cls(address, run)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._socket = socket.create_connection(self.address)
        self._reader = self._socket.makefile("r")
        self._until = self._arrive(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._until is None or trainer.global_step < self._until:
            return
        clock = RUNNING_CLOCKS.get(trainer)
        if clock is not None:
            clock.pause()  # the wait is no step's time
        self._until = self._arrive(trainer)
        if clock is not None:
            clock.resume()

    def _arrive(self, trainer: Trainer) -> int | None:
        """Say which gate this rank reached and wait for the go: the step to come back at (None: the end)."""
        if self._socket is None:
            return None
        arrival = {
            "run": self.run,
            "rank": trainer.global_rank,
            "processes": 1 if current_simulation() is not None else trainer.world_size,
            "gate": self._gate,
            "step": trainer.global_step,
            "max_steps": trainer.max_steps,
            "warmup_steps": next((c.warmup_steps for c in trainer.callbacks if isinstance(c, RunRecorder)), None),
        }
        self._gate += 1
        try:
            self._socket.sendall((json.dumps(arrival) + "\n").encode())
            answer = self._reader.readline()
        except OSError:
            answer = ""
        if not answer:  # the runner is gone: train on without turns
            self._close()
            return None
        return json.loads(answer).get("until")

    def _close(self) -> None:
        if self._socket is not None:
            self._reader.close()
            self._socket.close()
            self._socket = self._reader = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()

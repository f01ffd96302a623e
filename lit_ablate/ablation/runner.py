"""Running a planned study: one ``lit-ablate fit`` process per variant × seed, resumable.

Each run gets ``<output_dir>/runs/<variant>/seed<k>/`` with ``config.yaml`` (what it ran),
``stdout.log``/``stderr.log`` and ``run.json`` (its record, written by the run's ``RunRecorder``
and finalised by ``run_folder``, as for a run on SLURM). A run that crashes, runs out of memory or
passes ``timeout_s`` is recorded with that status and the tail of its stderr, and the study goes on.
A run is its own process group, so a timeout, Ctrl-C, SIGTERM or SIGHUP stops it with every rank
Lightning's launcher started, and it never outlives the runner, even a SIGKILLed one
(``run_folder_lock``); an interrupted run is recorded as ``interrupted`` and continued by the next
invocation from its newest checkpoint (from its first step if it wrote none; runs measured in turns
start their seed's turns over), while finished records are never touched again (unless their config
changed other than in its layout, ``layout_change``, or ``retry_failed``).
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from lit_ablate import machine_load
from lit_ablate.ablation.interleaving import Interleaving
from lit_ablate.ablation.live_run import LiveRun
from lit_ablate.ablation.plan import PlannedRun
from lit_ablate.ablation.run_folder import checkpoint_to_resume, is_kept, prepare, previous_record
from lit_ablate.ablation.run_folder_lock import run_lock
from lit_ablate.ablation.slurm import run_on_cluster
from lit_ablate.ablation.turns import run_in_turns

POLL_S = 0.5
"""How often the runner reads the run in flight's progress file (and checks its time limit)."""
Watch = Callable[[dict[str, Any] | None], None]
"""Called about every ``POLL_S`` while a run is in flight, with its latest progress (None before its first step)."""


def default_fit_command() -> list[str]:
    """``python -m lit_ablate.cli fit``: the same interpreter and package as this runner."""
    return [sys.executable, "-m", "lit_ablate.cli", "fit"]


def run_runs(
    runs: Sequence[PlannedRun],
    fit_command: Sequence[str] | None = None,
    retry_failed: bool = False,
    console: Console | None = None,
    wait: bool = True,
    interleave: Interleaving | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) every planned run; returns their records, in ``runs``' order.

    One run after another, or with ``interleave`` in mode ``steps`` the runs of each seed together,
    taking turns block by block (``turns``). Raises ``KeyboardInterrupt`` after stopping the runs in
    flight, recording them as ``interrupted``. Runs with ``launch.executor: slurm`` go to the
    scheduler instead (``slurm.run_on_cluster``; ``wait=False`` submits and returns).
    """
    fit_command = list(fit_command or default_fit_command())
    console = console or Console(stderr=True)
    if any(run.launch.executor == "slurm" for run in runs):
        with _sigterm_as_interrupt():
            return run_on_cluster(runs, fit_command, retry_failed, wait, console)
    records: dict[str, dict[str, Any]] = {}
    pending = []
    for run in runs:
        previous = previous_record(run)
        if previous is not None and is_kept(previous, run, retry_failed):
            records[run.label] = previous
        else:
            pending.append(run)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with _sigterm_as_interrupt(), Progress(*columns, console=console, transient=False) as progress:
        lines = LiveLines(progress, len(runs))
        for run in runs:
            if run.label in records:
                _print_outcome(console, run, records[run.label], f"kept ({records[run.label]['summary']['status']})")
                lines.advance()
        if interleave is not None and interleave.mode == "steps":
            stamp = time.strftime("%Y%m%dT%H%M%S")
            for seed in dict.fromkeys(run.seed for run in pending):
                group = [run for run in pending if run.seed == seed]
                started = time.monotonic()
                for run, record in zip(
                    group,
                    run_in_turns(group, fit_command, interleave.rounds, f"{stamp}-seed{seed}", lines.turn, lines.watch),
                ):
                    records[run.label] = record
                    _print_outcome(console, run, record, f"{record['summary']['status']} (in turns)")
                    lines.advance()
                lines.finished((time.monotonic() - started) / len(group))
        else:
            for run in pending:
                started = time.monotonic()
                checkpoint = checkpoint_to_resume(run)
                if checkpoint is not None:
                    console.print(f"{run.label}: resumes from {checkpoint}", markup=False)
                lines.start(run, runs.index(run))
                records[run.label] = execute(run, fit_command, watch=lines.watch)
                lines.finished(time.monotonic() - started)
                outcome = f"{records[run.label]['summary']['status']} in {time.monotonic() - started:.1f}s"
                _print_outcome(console, run, records[run.label], outcome)
                lines.advance()
    return [records[run.label] for run in runs]


def _print_outcome(console: Console, run: PlannedRun, record: dict[str, Any], outcome: str) -> None:
    message = record["summary"].get("message")
    # markup off: a run's error text is no rich markup (gloo's "[/__w/pytorch/...pair.cc:553]" is a closing tag)
    console.print(
        f"{run.label}: {outcome}" + (f" — {message}" if message and outcome[:2] != "ok" else ""), markup=False
    )


class LiveLines:
    """Two live lines under the finished runs: the study (runs done, ETA) and the run in flight
    (step of max_steps, loss, tokens/s, its ETA), from the run's progress file (``ProgressFile``).

    The study's ETA is the run in flight's plus, for each run after it, the mean duration of the
    runs this invocation executed (the run in flight's own estimate until one finished)."""

    def __init__(self, progress: Progress, total: int) -> None:
        self.progress = progress
        self.study: TaskID = progress.add_task("study", total=total)
        self.run: TaskID | None = None
        self.total, self.index, self.label = total, 0, ""
        self.durations: list[float] = []

    def start(self, run: PlannedRun, index: int) -> None:
        self.index, self.label = index, run.label
        if self.run is None:
            self.run = self.progress.add_task(run.label, total=None)
        self.progress.reset(self.run, description=f"  {run.label}: starting", total=None)
        self.progress.update(self.study, description=f"study: run {index + 1} of {self.total}")

    def watch(self, progress: dict[str, Any] | None) -> None:
        if progress is None or self.run is None:
            return
        self.progress.update(
            self.run,
            description=f"  {self.label}: {run_line(progress)}",
            total=progress.get("max_steps"),
            completed=progress["step"],
        )
        if progress.get("eta_s") is not None:
            per_run = statistics.mean(self.durations) if self.durations else progress["elapsed_s"] + progress["eta_s"]
            left = progress["eta_s"] + per_run * (self.total - self.index - 1)
            self.progress.update(
                self.study, description=f"study: run {self.index + 1} of {self.total}, ETA {duration(left)}"
            )

    def turn(self, run: PlannedRun) -> None:
        """``run`` trains its next block (a study in turns)."""
        if self.run is None:
            self.run = self.progress.add_task(run.label, total=None)
        self.label = run.label
        self.progress.update(self.run, description=f"  {run.label}: its turn")
        self.progress.update(self.study, description="study: runs in turns")

    def finished(self, seconds: float) -> None:
        self.durations.append(seconds)

    def advance(self) -> None:
        self.progress.advance(self.study)


def run_line(progress: dict[str, Any]) -> str:
    """``step 12/60, loss 4.213, 5.1k tokens/s, ETA 25s`` from a run's progress file."""
    limit = progress.get("max_steps")
    parts = [f"step {progress['step']}" + (f"/{limit}" if limit else "")]
    if progress.get("loss") is not None:
        parts.append(f"loss {progress['loss']:.4g}")
    if progress.get("tokens_per_sec") is not None:
        parts.append(f"{_thousands(progress['tokens_per_sec'])} tokens/s")
    if progress.get("eta_s") is not None:
        parts.append(f"ETA {duration(progress['eta_s'])}")
    return ", ".join(parts)


def duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h07m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _thousands(x: float) -> str:
    return f"{x / 1e6:.3g}M" if x >= 1e6 else f"{x / 1e3:.3g}k" if x >= 1e3 else f"{x:.3g}"


def execute(run: PlannedRun, fit_command: Sequence[str], watch: Watch | None = None) -> dict[str, Any]:
    """Run one variant × seed to its final record (skipped and invalid runs are recorded, not run);
    ``watch`` sees its progress while it runs. The run is its seed's one block of speed
    (``interleave: runs``), with the load other processes put on the machine meanwhile.

    A run an earlier invocation left unfinished continues from its newest checkpoint, on this
    invocation's layout (``layout_change``). Everything happens under the run folder's lock
    (``single_writer``): no other runner, and no leftover process of an earlier run, writes into the
    folder meanwhile.
    """
    with run_lock(run.run_dir) as lock:
        resume_from = None if run.skip_reason or run.invalid else checkpoint_to_resume(run)
        unrunnable = prepare(run, resume_from)
        if unrunnable is not None:
            return unrunnable
        live = LiveRun(run, fit_command, lock, resume_from=resume_from)
        start = live.cpu_sample()
        try:
            _wait(live.process, run.launch.timeout_s, lambda: watch(live.progress()) if watch else None)
        except subprocess.TimeoutExpired:
            live.stop()
            return live.finish("timeout", f"exceeded launch.timeout_s={run.launch.timeout_s:g}")
        except KeyboardInterrupt:
            live.stop()
            live.finish("interrupted", "stopped by Ctrl-C / SIGTERM; continued on resume")
            raise
        end = live.cpu_sample()
        block = {
            "round": run.seed,
            "first_step": None,
            "last_step": None,
            "seconds": end.at - start.at if start and end else None,
            "foreign_cores": machine_load.foreign_cores(start, end),
        }
        return live.finish(speed_blocks={"design": "runs", "group": "runs", "blocks": [block]})


def _wait(process: subprocess.Popen, timeout_s: float, tick: Callable[[], None]) -> int:
    """``process.wait(timeout_s)``, calling ``tick`` every ``POLL_S`` meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return process.wait(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
            tick()


class _sigterm_as_interrupt:
    """While a study runs, SIGTERM or SIGHUP (terminal closed) to the runner stops it like Ctrl-C
    (runs stopped, records kept). A signal ignored on entry stays ignored (``nohup``)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> None:
        watched = [sig for sig in self.SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
        self._previous = {sig: signal.signal(sig, self._raise) for sig in watched}

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

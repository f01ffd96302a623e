"""Running a planned study: one ``lit-ablate fit`` process per variant × seed, resumable.

Each run gets ``<output_dir>/runs/<variant>/seed<k>/`` with ``config.yaml`` (what it ran),
``stdout.log``/``stderr.log`` and ``run.json`` (its record, written by the run's ``RunRecorder``
and finalised by ``run_folder``, as for a run on SLURM). A run that crashes, runs out of memory or
passes ``timeout_s`` is recorded with that status and the tail of its stderr, and the study goes on.
A run is its own process group, so a timeout, Ctrl-C, SIGTERM or SIGHUP stops it with every rank
Lightning's launcher started, and it never outlives the runner, even a SIGKILLed one
(``run_folder_lock``); an interrupted run is recorded as ``interrupted`` and redone by the next
invocation, while finished records are never touched again (unless their config changed, or
``retry_failed``).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from lit_ablate.ablation.plan import PlannedRun
from lit_ablate.ablation.run_folder import (
    finalise,
    fit_arguments,
    is_kept,
    prepare,
    previous_record,
    run_environment,
    stderr_tail,
)
from lit_ablate.ablation.run_folder_lock import GroupReaper, RunLock, die_with_runner, run_lock
from lit_ablate.ablation.slurm import run_on_cluster
from lit_ablate.callbacks.progress_file import PROGRESS_PATH_ENV, read_progress

STOP_GRACE_S = 10.0
POLL_S = 0.5
"""How often the runner reads the run in flight's progress file (and checks its time limit)."""
PROGRESS_FILENAME = "progress.json"
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
) -> list[dict[str, Any]]:
    """Run (or resume) every planned run in order; returns their records.

    Raises ``KeyboardInterrupt`` after stopping the current run, recording it as ``interrupted``.
    Runs with ``launch.executor: slurm`` go to the scheduler instead (``slurm.run_on_cluster``;
    ``wait=False`` submits and returns).
    """
    fit_command = list(fit_command or default_fit_command())
    console = console or Console(stderr=True)
    if any(run.launch.executor == "slurm" for run in runs):
        with _sigterm_as_interrupt():
            return run_on_cluster(runs, fit_command, retry_failed, wait, console)
    records = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with _sigterm_as_interrupt(), Progress(*columns, console=console, transient=False) as progress:
        lines = LiveLines(progress, len(runs))
        for index, run in enumerate(runs):
            previous = previous_record(run)
            if previous is not None and is_kept(previous, run, retry_failed):
                outcome = f"kept ({previous['summary']['status']})"
                records.append(previous)
            else:
                started = time.monotonic()
                lines.start(run, index)
                records.append(execute(run, fit_command, watch=lines.watch))
                lines.finished(time.monotonic() - started)
                outcome = f"{records[-1]['summary']['status']} in {time.monotonic() - started:.1f}s"
            message = records[-1]["summary"].get("message")
            # markup off: a run's error text is no rich markup (gloo's "[/__w/pytorch/...pair.cc:553]" is a closing tag)
            console.print(
                f"{run.label}: {outcome}" + (f" — {message}" if message and outcome[:2] != "ok" else ""), markup=False
            )
            lines.advance()
    return records


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
    ``watch`` sees its progress while it runs.

    Everything happens under the run folder's lock (``single_writer``): no other runner, and no
    leftover process of an earlier run, writes into the folder meanwhile.
    """
    with run_lock(run.run_dir) as lock:
        return _execute_locked(run, fit_command, lock, watch)


def _execute_locked(run: PlannedRun, fit_command: Sequence[str], lock: RunLock, watch: Watch | None) -> dict[str, Any]:
    unrunnable = prepare(run)
    if unrunnable is not None:
        return unrunnable
    progress = run.run_dir / PROGRESS_FILENAME
    progress.unlink(missing_ok=True)
    env = {**os.environ, **run_environment(run), PROGRESS_PATH_ENV: str(progress)}
    command = fit_arguments(run, fit_command)
    with open(run.run_dir / "stdout.log", "w") as out, open(run.run_dir / "stderr.log", "w") as err:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
            process_group=0,
            preexec_fn=die_with_runner(),
        )
        lock.started(process.pid)  # its own process group: pgid == pid
        reaper = GroupReaper(process.pid)
        try:
            returncode = _wait(process, run.launch.timeout_s, lambda: watch(read_progress(progress)) if watch else None)
        except subprocess.TimeoutExpired:
            _stop(process)
            return finalise(
                run, None, "timeout", f"exceeded launch.timeout_s={run.launch.timeout_s:g}", stderr_tail(run)
            )
        except KeyboardInterrupt:
            _stop(process)
            finalise(run, None, "interrupted", "stopped by Ctrl-C / SIGTERM; redone on resume", stderr_tail(run))
            raise
        finally:
            reaper.done()
    return finalise(run, returncode, None, None, stderr_tail(run))


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


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the run's process group (all its ranks), then SIGKILL what is left after a grace period."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


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

"""Running a planned study: one ``lit-ablate fit`` process per variant × seed, resumable.

Each run gets ``<output_dir>/runs/<variant>/seed<k>/`` with ``config.yaml`` (what it ran),
``stdout.log``/``stderr.log`` and ``run.json`` (its record, written by the run's ``RunRecorder``
and finalised by ``run_folder``, as for a run on SLURM). A run that crashes, runs out of memory or passes ``timeout_s`` is recorded
with that status and the tail of its stderr, and the study goes on. A run is its own process
group, so a timeout, Ctrl-C, SIGTERM or SIGHUP stops it with every rank Lightning's launcher
started, and it never outlives the runner, even a SIGKILLed one (``run_folder_lock``); an
interrupted run is recorded as ``interrupted`` and redone by the next invocation, while finished
records are never touched again (unless their config changed, or ``retry_failed``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lit_ablate.ablation.plan import PlannedRun
from lit_ablate.ablation.run_folder import (
    finalise,
    fit_arguments,
    is_kept,
    prepare,
    previous_record,
    run_environment,
    stderr_tail,
)  # fmt: skip
from lit_ablate.ablation.run_folder_lock import GroupReaper, RunLock, die_with_runner, run_lock
from lit_ablate.ablation.slurm import run_on_cluster

STOP_GRACE_S = 10.0


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
        task = progress.add_task("study", total=len(runs))
        for run in runs:
            progress.update(task, description=run.label)
            previous = previous_record(run)
            if previous is not None and is_kept(previous, run, retry_failed):
                outcome = f"kept ({previous['summary']['status']})"
                records.append(previous)
            else:
                started = time.monotonic()
                records.append(execute(run, fit_command))
                outcome = f"{records[-1]['summary']['status']} in {time.monotonic() - started:.1f}s"
            message = records[-1]["summary"].get("message")
            console.print(f"{run.label}: {outcome}" + (f" — {message}" if message and outcome[:2] != "ok" else ""))
            progress.advance(task)
    return records


def execute(run: PlannedRun, fit_command: Sequence[str]) -> dict[str, Any]:
    """Run one variant × seed to its final record (skipped and invalid runs are recorded, not run).

    Everything happens under the run folder's lock (``single_writer``): no other runner, and no
    leftover process of an earlier run, writes into the folder meanwhile.
    """
    with run_lock(run.run_dir) as lock:
        return _execute_locked(run, fit_command, lock)


def _execute_locked(run: PlannedRun, fit_command: Sequence[str], lock: RunLock) -> dict[str, Any]:
    unrunnable = prepare(run)
    if unrunnable is not None:
        return unrunnable
    env = {**os.environ, **run_environment(run)}
    command = fit_arguments(run, fit_command)
    with open(run.run_dir / "stdout.log", "w") as out, open(run.run_dir / "stderr.log", "w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                   process_group=0, preexec_fn=die_with_runner())  # fmt: skip
        lock.started(process.pid)  # its own process group: pgid == pid
        reaper = GroupReaper(process.pid)
        try:
            returncode = process.wait(timeout=run.launch.timeout_s)
        except subprocess.TimeoutExpired:
            _stop(process)
            return finalise(run, None, "timeout", f"exceeded launch.timeout_s={run.launch.timeout_s:g}", stderr_tail(run))
        except KeyboardInterrupt:
            _stop(process)
            finalise(run, None, "interrupted", "stopped by Ctrl-C / SIGTERM; redone on resume", stderr_tail(run))
            raise
        finally:
            reaper.done()
    return finalise(run, returncode, None, None, stderr_tail(run))


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

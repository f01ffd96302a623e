"""Running a planned study: one ``lit-ablate fit`` process per variant × seed, resumable.

Each run gets ``<output_dir>/runs/<variant>/seed<k>/`` with ``config.yaml`` (what it ran),
``stdout.log``/``stderr.log`` and ``run.json`` (its record, written by the run's ``RunRecorder``
and finalised here). A run that crashes, runs out of memory or passes ``timeout_s`` is recorded
with that status and the tail of its stderr, and the study goes on. A run is its own process
group, so a timeout, Ctrl-C, SIGTERM or SIGHUP stops it with every rank Lightning's launcher
started, and it never outlives the runner, even a SIGKILLed one (``single_writer``); an
interrupted run is recorded as ``interrupted`` and redone by the next invocation, while finished
records are never touched again (unless their config changed, or ``retry_failed``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import lit_ablate
from lit_ablate import record as run_record
from lit_ablate.ablation.plan import PlannedRun, config_text, write_config
from lit_ablate.ablation.run_folder_lock import GroupReaper, RunLock, die_with_runner, run_lock

DONE_STATUSES = ("ok", "error", "oom", "timeout")
"""A run with one of these is not launched again on resume."""
FAILED_STATUSES = ("error", "oom", "timeout")
"""Redone on resume only with ``retry_failed``."""
RUNNER_STATUSES = ("timeout", "skipped", "interrupted", "preempted")
"""Statuses only the runner writes (a run cannot know it was skipped, timed out, interrupted or
pre-empted by a scheduler). ``interrupted`` and ``preempted`` runs are redone on resume."""
OOM_PATTERN = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|HIP out of memory")
STDERR_TAIL_LINES = 40
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
        from lit_ablate.ablation.slurm import run_on_cluster

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


def prepare(run: PlannedRun) -> dict[str, Any] | None:
    """Clear what an earlier attempt left and write the run's config; a run that cannot start
    (skipped or invalid) gets its final record here, which is returned."""
    _clear(run)
    write_config(run.run_dir / "config.yaml", run.config)
    if run.skip_reason or run.invalid:
        (run.run_dir / "stderr.log").write_text((run.invalid or "") + "\n")
        status, message = ("skipped", run.skip_reason) if run.skip_reason else ("error", run.invalid)
        return finalise(run, None, status, message, run.invalid or "")
    return None


def run_environment(run: PlannedRun) -> dict[str, str]:
    """What the run's fit process gets on top of the runner's environment (where it records, as
    which variant, and this runner's ``lit_ablate`` package first on its path)."""
    return {
        run_record.RECORD_PATH_ENV: str(run.run_dir / run_record.RECORD_FILENAME),
        run_record.VARIANT_ENV: run.variant.name,
        "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }


def fit_arguments(run: PlannedRun, fit_command: Sequence[str]) -> list[str]:
    return [*fit_command, "--config", str(run.run_dir / "config.yaml")]


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


def finalise(
    run: PlannedRun, returncode: int | None, status: str | None, message: str | None, tail: str
) -> dict[str, Any]:
    """The run's final record: the run's own, completed with what only the runner knows.

    ``status`` given: the runner decided it (skipped/timeout/interrupted/invalid). Otherwise the
    exit code and the run's record decide: exit 0 with an ``ok`` record is ``ok``; ``oom`` when
    the record or stderr shows an out-of-memory error; ``interrupted`` (redone on resume) when a
    signal from outside killed the run before it recorded an outcome; else ``error``.
    """
    own = _read(run.run_dir / run_record.RECORD_FILENAME)
    record = own or {
        "schema_version": run_record.SCHEMA_VERSION, "config": run.config, "environment": {},
        "warmup_steps": 0, "fallbacks": [], "steps": [],
        "summary": {**run_record.summarize_steps([], 0), "memory_method": None},
    }  # fmt: skip
    summary = record["summary"]
    if status is None:
        recorded = summary.get("status")
        if returncode == 0 and recorded == "ok":
            status = "ok"
        elif recorded == "oom" or OOM_PATTERN.search(tail):
            status = "oom"
        elif returncode is not None and returncode < 0 and recorded in (None, "running"):
            status, message = "interrupted", f"killed by {signal.Signals(-returncode).name}; redone on resume"
        else:
            status = "error"
        if status in ("error", "oom"):
            message = (recorded in FAILED_STATUSES and summary.get("message")) or _last_line(tail)
            if returncode == 0:
                message = f"exited 0 without finishing its run record ({message})"
            message = message or f"exit code {returncode}"
    record.update(variant=run.variant.name, seed=run.seed)
    summary.update(status=status, message=message, returncode=returncode,
                   stderr_tail=None if status == "ok" else tail)  # fmt: skip
    run_record.write_record(run.run_dir / run_record.RECORD_FILENAME, record)
    return record


def previous_record(run: PlannedRun) -> dict[str, Any] | None:
    """The record of an earlier invocation of this exact run (same config), if there is one."""
    config = run.run_dir / "config.yaml"
    if not config.is_file() or config.read_text() != config_text(run.config):
        return None
    return _read(run.run_dir / run_record.RECORD_FILENAME)


def is_kept(record: dict[str, Any], run: PlannedRun, retry_failed: bool) -> bool:
    """Finished records stay, except failures asked to be retried or that a rule now explains (skipped)."""
    status = record.get("summary", {}).get("status")
    if status in FAILED_STATUSES and (retry_failed or run.skip_reason):
        return False
    return status in DONE_STATUSES


def _clear(run: PlannedRun) -> None:
    """Remove what an earlier attempt of this run left, so its record cannot be mistaken for this one's."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / run_record.RECORD_FILENAME).unlink(missing_ok=True)
    trainer_dir = Path(run.config.get("trainer", {}).get("default_root_dir", run.run_dir / "trainer"))
    if trainer_dir.is_dir() and trainer_dir.resolve().is_relative_to(run.run_dir.resolve()):
        shutil.rmtree(trainer_dir)


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


def _read(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return run_record.read_record(path)
    except ValueError:  # a truncated or foreign file: treated as no record (json errors are ValueErrors)
        return None


def stderr_tail(run: PlannedRun) -> str:
    path = run.run_dir / "stderr.log"
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(lines[-STDERR_TAIL_LINES:])


def _last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:2000] if lines else None


def _package_root() -> str:
    """The folder holding the ``lit_ablate`` package this runner imported (the child imports the same)."""
    return str(Path(lit_ablate.__file__).resolve().parent.parent)


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

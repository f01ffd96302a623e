"""``LiveRun``: one run's ``lit-ablate fit`` process in flight, from its start to its final record.

The process is its own process group (its ranks with it), dies with the runner (``die_with_runner``,
``GroupReaper``) and writes into a folder whose lock the caller holds (``run_folder_lock.run_lock``).
The runner drives one at a time; a study that interleaves its variants (``turns``) drives several.
Each also knows the CPU time other processes took while it ran (``machine_load``), what a study
needs to tell its speed from the machine's load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_ablate import machine_load
from lit_ablate.ablation.plan import PlannedRun
from lit_ablate.ablation.run_folder import finalise, fit_arguments, run_environment, stderr_tail
from lit_ablate.ablation.run_folder_lock import GroupReaper, RunLock, die_with_runner
from lit_ablate.callbacks.progress_file import PROGRESS_PATH_ENV, read_progress

STOP_GRACE_S = 10.0
PROGRESS_FILENAME = "progress.json"


class LiveRun:
    """Starts ``run``'s fit process (``run`` prepared, its folder's ``lock`` held) with ``environment`` added;
    from its checkpoint ``resume_from``, appending to the earlier attempt's logs."""

    def __init__(
        self,
        run: PlannedRun,
        fit_command: Sequence[str],
        lock: RunLock,
        environment: Mapping[str, str] | None = None,
        resume_from: Path | None = None,
    ) -> None:
        self.run = run
        self.progress_path = run.run_dir / PROGRESS_FILENAME
        self.progress_path.unlink(missing_ok=True)
        env = {**os.environ, **run_environment(run), PROGRESS_PATH_ENV: str(self.progress_path), **(environment or {})}
        self.started = time.monotonic()
        mode = "w" if resume_from is None else "a"
        with open(run.run_dir / "stdout.log", mode) as out, open(run.run_dir / "stderr.log", mode) as err:
            if resume_from is not None:
                for log in (out, err):
                    log.write(f"--- resuming from {resume_from} ---\n")
                    log.flush()
            self.process = subprocess.Popen(  # the child holds its own copies of the logs
                fit_arguments(run, fit_command, resume_from),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
                process_group=0,
                preexec_fn=die_with_runner(),
            )
        lock.started(self.process.pid)  # its own process group: pgid == pid
        self._reaper = GroupReaper(self.process.pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the process ended, else None."""
        if self.returncode is None:
            self.returncode = self.process.poll()
        return self.returncode

    def progress(self) -> dict[str, Any] | None:
        return read_progress(self.progress_path)

    def cpu_sample(self) -> machine_load.CpuSample | None:
        """The machine's busy time and this run's own (its process group, and the runner that reaps it)."""
        return machine_load.sample(process_groups=[self.process.pid], pids=[os.getpid()])

    def stop(self) -> None:
        """SIGTERM the run's process group (all its ranks), then SIGKILL what is left after a grace period."""
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.poll()

    def finish(
        self, status: str | None = None, message: str | None = None, speed_blocks: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The run's final record (``run_folder.finalise``), once its process ended or was stopped."""
        self._reaper.done()
        return finalise(self.run, self.poll(), status, message, stderr_tail(self.run), speed_blocks)

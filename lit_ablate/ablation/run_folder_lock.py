"""One writer per run folder: a run never outlives its runner, and a resumed study never starts a
second writer beside a live one.

Three parts, because each covers a way the others can miss:

- ``die_with_runner`` (Linux): the fit process asks the kernel for SIGKILL when the runner dies
  (``prctl(PR_SET_PDEATHSIG)``), so even a SIGKILLed runner takes its direct child down at once.
- ``GroupReaper``: the ranks Lightning's launcher starts are the fit's children, not the
  runner's, so the death signal does not reach them. A tiny watcher process, outside the runner's
  process group (a Ctrl-C or ``kill -- -PGID`` of the runner's group leaves it alone), waits on a
  pipe only the runner writes; when the pipe closes without the runner saying "done", the runner
  is gone and the watcher stops the run's whole process group (SIGTERM, then SIGKILL).
- ``RunLock``: ``run.lock`` in the run folder, ``flock``-ed by the runner while it works on the run
  and naming the run's process group. A second runner on the same run is refused at once; a
  resumed runner that finds processes of an earlier run's group still alive waits
  ``LOCK_WAIT_S`` for them (the reaper's grace) and then refuses, naming them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from lit_ablate.errors import ConfigError

LOCK_FILENAME = "run.lock"
LOCK_WAIT_S = 20.0
"""How long a resumed runner waits for an earlier run's processes to die (> the reaper's grace)."""
REAPER_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_REAPER = r"""
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
if sys.stdin.buffer.read() != b"done":
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)  # zombies count: while one exists the group id cannot be reused
            except ProcessLookupError:
                sys.exit(0)
            time.sleep(0.05)
"""


class RunFolderBusy(ConfigError):
    """Another writer is (or may still be) at work in this run folder; reported like a refused config."""


def die_with_runner() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die (SIGKILL) with the runner; None off Linux.

    The death signal follows the *thread* that forked the child: the runner starts runs from the
    thread that waits for them. libc is loaded here, before the fork, not in the child.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    runner = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != runner:  # the runner died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class GroupReaper:
    """Stops process group ``pgid`` if the runner dies before calling ``done()``."""

    def __init__(self, pgid: int, grace_s: float = REAPER_GRACE_S) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, str(pgid), str(grace_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def done(self) -> None:
        """The run is over (reaped by the runner): the watcher exits without touching anything."""
        assert self._process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self._process.stdin.write(b"done")
            self._process.stdin.close()
        self._process.wait()


class RunLock:
    """``run.lock`` of one run folder, held (``flock``) while this runner works on the run."""

    def __init__(self, file: IO[str], path: Path) -> None:
        self._file, self.path = file, path

    def started(self, pgid: int) -> None:
        """Name the run's process group, so a later runner can tell whether it still lives."""
        self._write({"runner_pid": os.getpid(), "process_group": pgid})

    def _write(self, content: dict[str, int | None]) -> None:
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(content) + "\n")
        self._file.flush()


@contextlib.contextmanager
def run_lock(run_dir: Path, wait_s: float | None = None) -> Iterator[RunLock]:
    """Hold ``run_dir/run.lock`` for as long as the block runs; raises ``RunFolderBusy`` when a
    live runner holds it, or when an earlier run's process group is still alive after ``wait_s``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILENAME
    with open(path, "a+") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderBusy(
                str(path),
                _read(file).get("runner_pid"),
                "another `lit-ablate ablate` (this pid) is running this run now; "
                "let it finish or stop it, then run the same command again",
            ) from None
        previous = _read(file).get("process_group")
        if isinstance(previous, int):
            _wait_for_group(previous, path, LOCK_WAIT_S if wait_s is None else wait_s)
        lock = RunLock(file, path)
        lock._write({"runner_pid": os.getpid(), "process_group": None})
        yield lock


def _read(file: IO[str]) -> dict[str, int | None]:
    file.seek(0)
    with contextlib.suppress(ValueError):
        content = json.loads(file.read() or "{}")
        if isinstance(content, dict):
            return content
    return {}


def _wait_for_group(pgid: int, path: Path, wait_s: float) -> None:
    """Return once no process of group ``pgid`` lives (our own group never counts); else refuse."""
    if pgid == os.getpgrp():
        return
    deadline = time.monotonic() + wait_s
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            raise RunFolderBusy(
                str(path),
                group_members(pgid) or pgid,
                f"processes of an earlier run of this folder (process group {pgid}) are still "
                f"alive and may write into it; stop them (kill -- -{pgid}) or wait for them, "
                "then run the same command again",
            )
        time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, already dead, do not count)."""
    if Path("/proc/self/stat").is_file():
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


def group_members(pgid: int) -> list[int]:
    """Pids of the running (not zombie) processes in group ``pgid``, from /proc (empty without it)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]  # after "pid (comm)"
            if int(group) == pgid and state != "Z":
                members.append(int(stat.parent.name))
    return sorted(members)

"""Ending a process that ran collectives without the interpreter's finalization.

A run's process groups outlive ``destroy_process_group``: torch holds them from C++ (the model's FSDP
and mesh state, compiled frames' guards) and gloo's worker threads are joined only when those objects
are destroyed, which then happens while the interpreter shuts down. There, a thread that needs the GIL
cannot get it and the process aborts ("terminate called without an active exception", exit code -6)
after its run finished and its record and checkpoints were written: seen on one rank of a two-node
FSDP2 job, intermittently, and on CPU runs before each rank left its process group. So such a process
does what a normal exit does that matters to the user, and no more: non-daemon threads finish, the
``atexit`` handlers run (loggers' and trackers' final flush and upload, ``logging.shutdown``), the
standard streams are flushed, and it exits with its status without tearing the interpreter down.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_without_finalization(status: int) -> NoReturn:
    """Exit with ``status`` after what a normal exit runs first (threads, ``atexit``, stream flushes)."""
    threading._shutdown()  # as the interpreter's exit: threading's exit hooks (idle pool workers leave), then joins
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or gone: nothing left to flush
            stream.flush()
    os._exit(status)

"""``exit_without_finalization``: how a fit process that ran collectives ends (``lit_ablate.process_exit``)."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = """
import atexit, concurrent.futures, threading, time
from lit_ablate.process_exit import exit_without_finalization
atexit.register(lambda: print("atexit handler ran", flush=False))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished", flush=False))).start()
pool = concurrent.futures.ThreadPoolExecutor(1)  # its idle worker leaves only when told, at exit
pool.submit(print, "pool task ran", flush=False).result()
print("buffered output", end="")
exit_without_finalization(3)
print("never printed")
"""


def test_it_exits_with_the_status_after_threads_atexit_handlers_and_buffered_output():
    """What a normal exit does that a user relies on still happens: non-daemon threads finish (an idle
    thread pool's worker is told to leave first, as at a normal exit), ``atexit`` handlers run (a
    tracker's final upload), buffered output reaches the file; then the status. Seen failing with a bare
    ``os._exit`` (neither the thread's nor the handler's line, nor the buffered text), and hanging with
    every non-daemon thread joined before threading's exit hooks (the pool's worker never left)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # its output stays in the buffer
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 3, done.stderr
    assert "buffered output" in done.stdout and "thread finished" in done.stdout
    assert "atexit handler ran" in done.stdout and "never printed" not in done.stdout

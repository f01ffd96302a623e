"""Runs benchmark scripts at smoke size in ONE process, so torch, Lightning and transformers are imported
once rather than once per script (each import costs ~8 s on 2 cores); ``tests/test_benchmarks.py`` starts it.

    python tests/benchmark_smoke.py OUT_JSON SCRIPT_JSON

``SCRIPT_JSON``: ``{"mfu.py": ["--steps", "3"], ...}``; a key ``script.py:mode`` runs the script once more
with other arguments (``overhead.py:count``). Each script runs as ``__main__`` with its own
``sys.argv`` (``benchmarks/`` on ``sys.path``, as when it is run by hand), its output captured; one
failing script does not stop the others. ``OUT_JSON`` gets per script its exit status, seconds, the
``RESULT`` lines parsed and the tail of its output.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import sys
import time
import traceback
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULT_LINE = re.compile(r"^RESULT (\S+?)=(.*)$", re.MULTILINE)


def run(case: str, argv: list[str]) -> dict:
    script = case.split(":", 1)[0]
    out = io.StringIO()
    started, status = time.perf_counter(), 0
    sys.argv = [str(BENCHMARKS / script), *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if status:
                print(f"SystemExit: {exit_.code}")
        except BaseException:  # reported, not hidden: the test fails on it
            status = 1
            traceback.print_exc()
    text = out.getvalue()
    return {
        "status": status,
        "seconds": round(time.perf_counter() - started, 1),
        "results": dict(RESULT_LINE.findall(text)),
        "tail": text[-4000:],
    }


def main() -> None:
    out, scripts = Path(sys.argv[1]), json.loads(sys.argv[2])
    sys.path.insert(0, str(BENCHMARKS))
    results = {case: run(case, argv) for case, argv in scripts.items()}
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

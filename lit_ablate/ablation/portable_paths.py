"""A study folder that travels: no path of the machine that made it, so it can be moved, copied, mailed
or committed and still be read (``lit-ablate report``) and resumed (``lit-ablate ablate``) elsewhere.

A run's files hold the paths its process saw: its trainer folder inside the study folder, the cache under
the home folder, and in its logs the files of Python packages that warned. When the runner finalises a
run, every path inside the study folder becomes relative to it, and the home folder, Python's environment
and the lit-ablate checkout become ``~``, ``<python-env>`` and ``<lit-ablate>``. A path the user gave as
absolute outside those (a data set on a shared drive) stays as given, and the record lists where
(``absolute_paths``): that is where a copy on another machine needs the same file.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lit_ablate


def _prefixes(study_dir: Path) -> list[tuple[str, str]]:
    """``(absolute prefix, its portable form)``, the longest first (the study folder may lie in the checkout)."""
    checkout = Path(lit_ablate.__file__).resolve().parent.parent
    pairs = [(str(study_dir.resolve()), "."), (sys.prefix, "<python-env>"), (str(checkout), "<lit-ablate>"),
             (str(Path.home()), "~")]  # fmt: skip
    return sorted(((p, r) for p, r in pairs if p not in ("", os.sep)), key=lambda pr: -len(pr[0]))


def portable_text(text: str, study_dir: Path) -> str:
    """``text`` (a log, a message) with the machine's paths in their portable forms."""
    for prefix, replacement in _prefixes(study_dir):
        inside = "" if replacement == "." else replacement + "/"
        text = re.sub(re.escape(prefix) + r"/", inside, text)
        text = re.sub(re.escape(prefix) + r"(?![\w.-])", replacement, text)  # the folder itself, not /rootfs
    return text


def portable(value: Any, study_dir: Path) -> Any:
    """``value`` (a record, a plan) with every string made portable (``portable_text``)."""
    if isinstance(value, str):
        return portable_text(value, study_dir)
    if isinstance(value, dict):
        return {key: portable(item, study_dir) for key, item in value.items()}
    if isinstance(value, list):
        return [portable(item, study_dir) for item in value]
    return value


def absolute_paths(value: Any, key: str = "") -> Iterator[str]:
    """The dotted keys of ``value`` whose strings are still absolute paths (given so by the user)."""
    if isinstance(value, str) and os.path.isabs(value):
        yield key
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from absolute_paths(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from absolute_paths(item, f"{key}[{index}]")


def make_logs_portable(run_dir: Path, study_dir: Path) -> None:
    """Rewrite the run's logs (``*.log``) with the machine's paths in their portable forms."""
    for log in run_dir.glob("*.log"):
        text = log.read_text(errors="replace")
        portable_log = portable_text(text, study_dir)
        if portable_log != text:
            log.write_text(portable_log)

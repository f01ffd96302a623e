"""lit-ablate's per-machine cache: what is measured or built once per machine and reused by every run."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "LIT_ABLATE_CACHE_DIR"
"""Directory of lit-ablate's per-machine cache (default ``$XDG_CACHE_HOME/lit-ablate``, else
``~/.cache/lit-ablate``)."""


def machine_cache(folder: str) -> Path:
    """``folder`` of the per-machine cache (``matmul_ceiling``, ``torch_extensions``); not created here."""
    root = (
        os.environ.get(CACHE_DIR_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lit-ablate"
    )
    return Path(root) / folder

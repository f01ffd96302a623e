"""``RecordSection``: a callback that adds one named section to the run record."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

RESERVED = (
    "schema_version",
    "variant",
    "seed",
    "config",
    "environment",
    "model",
    "warmup_steps",
    "fallbacks",
    "started_at",
    "finished_at",
    "resumed_from",
    "steps_before_resume",
    "data",
    "steps",
    "summary",
    "job",
)
"""The record's own top-level keys (``lit_ablate.record``), which no section may take."""


class RecordSection(Callback):
    """Subclass it for what a run measures once rather than per step (a profile, a one-off
    evaluation): ``RunRecorder`` writes ``record_section()`` under ``run.json[section]`` each time it
    writes the record (rank 0's; null until there is something to say).

    Args:
        section: the top-level key of ``run.json``; not one of the record's own (``RESERVED``).
    """

    def __init__(self, section: str) -> None:
        if section in RESERVED:
            raise ValueError(f"{type(self).__name__}: section {section!r} is one of the run record's own keys")
        self.section = section

    def record_section(self) -> dict[str, Any] | None:
        """What goes under ``run.json[self.section]`` (plain JSON values)."""
        return None

"""A run that starts more than once: a SLURM job requeued (pre-empted, ``scontrol requeue``, a
node failure) runs its batch script again, so the same ``lit-ablate fit`` starts again in the
same run folder.

The next attempt resumes from the newest checkpoint under the run's trainer folder (whatever
``ModelCheckpoint`` or Lightning's own SLURM auto-requeue saved there), appends to the logs, and
keeps the earlier attempt's record in ``attempts/``. The run's final record is the last
attempt's, with one loss curve: the losses the checkpoint carried for the steps before it
(``RunRecorder``'s ``steps_before_resume``), then the steps the last attempt ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lit_ablate import record as run_record

ATTEMPTS_DIRNAME = "attempts"
DCP_METADATA = ".metadata"
"""What torch.distributed.checkpoint writes last into a sharded checkpoint folder: without it the
folder is a save that was cut short."""


def keep_attempt(run_dir: Path) -> int:
    """Move the earlier attempt's record to ``attempts/run.<k>.json`` (``{}`` for an attempt stopped
    before its fit wrote one); returns how many attempts are kept."""
    folder = run_dir / ATTEMPTS_DIRNAME
    folder.mkdir(exist_ok=True)
    kept = folder / f"run.{len(list(folder.glob('run.*.json')))}.json"
    record = run_dir / run_record.RECORD_FILENAME
    if record.is_file():
        record.rename(kept)
    else:
        kept.write_text("{}\n")
    return len(list(folder.glob("run.*.json")))


def restarts(run_dir: Path) -> int:
    """How many times the run started again (the attempts kept before its last one)."""
    folder = run_dir / ATTEMPTS_DIRNAME
    return len(list(folder.glob("run.*.json"))) if folder.is_dir() else 0


def newest_checkpoint(folder: Path) -> Path | None:
    """The most recently written complete checkpoint under ``folder`` (a ``.ckpt`` file, or a sharded
    ``.ckpt`` folder with its metadata), or None. Newest by time, as Lightning's ``ckpt_path="last"``."""
    if not folder.is_dir():
        return None
    found = [p for p in folder.rglob("*.ckpt") if p.is_file() or (p / DCP_METADATA).is_file()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def stitched_steps(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's loss curve across attempts: the steps the resumed checkpoint carried, then its own."""
    earlier = record.get("steps_before_resume") or []
    first = min((step["step"] for step in record.get("steps", [])), default=None)
    return [s for s in earlier if first is None or s["step"] < first] + list(record.get("steps", []))

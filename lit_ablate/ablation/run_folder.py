"""A run's folder, whoever runs it (this machine's runner or a scheduler's job): what is written
before the run starts (its config; the record of a run that cannot start), what its ``lit-ablate
fit`` process gets, and the final record after it ends.

A run's own ``RunRecorder`` writes ``run.json`` while it runs; ``finalise`` completes it with what
only a launcher knows (exit code, timeout, skip, the stderr tail) and decides the status from the
exit code and the record, the same way for every executor, so the report cannot tell where a run ran.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

import lit_ablate
from lit_ablate import record as run_record
from lit_ablate.ablation.attempts import ATTEMPTS_DIRNAME, keep_attempt, newest_checkpoint, stitched_steps
from lit_ablate.ablation.layout_change import trains_the_same
from lit_ablate.ablation.plan import PlannedRun, config_text, trainer_root, write_config
from lit_ablate.ablation.portable_paths import absolute_paths, make_logs_portable, portable
from lit_ablate.trackers import TRACKERS_BY_RUNNER_ENV

DONE_STATUSES = ("ok", "error", "oom", "timeout")
"""A run with one of these is not launched again on resume."""
FAILED_STATUSES = ("error", "oom", "timeout")
"""Redone on resume only with ``retry_failed``."""
RUNNER_STATUSES = ("timeout", "skipped", "interrupted", "preempted")
"""Statuses only the runner writes (a run cannot know it was skipped, timed out, interrupted or
pre-empted by a scheduler). ``interrupted`` and ``preempted`` runs are redone on resume."""
UNFINISHED_STATUSES = ("interrupted", "preempted", "running")
"""A run stopped before its end (``running``: its runner died with it): the next invocation continues it
from its newest checkpoint, if it wrote one."""
OOM_PATTERN = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|HIP out of memory")
STDERR_TAIL_LINES = 40


def prepare(run: PlannedRun, resume_from: Path | None = None) -> dict[str, Any] | None:
    """Clear what an earlier attempt left (or, for a run resuming from its checkpoint ``resume_from``,
    keep its checkpoints and the attempt's record, ``attempts``) and write the run's config; a run that
    cannot start (skipped or invalid) gets its final record here, which is returned."""
    if resume_from is None:
        _clear(run)
    else:
        keep_attempt(run.run_dir)
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
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root(), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        TRACKERS_BY_RUNNER_ENV: "1",  # the runner sends the study's runs to their trackers, with the verdicts
    }


def fit_arguments(run: PlannedRun, fit_command: Sequence[str], resume_from: Path | None = None) -> list[str]:
    """The fit command of ``run``: its ``config.yaml``, whose trainer root is relative to the study folder
    (the folder can move), made absolute for the process wherever it starts; ``resume_from`` its checkpoint."""
    return [
        *fit_command,
        "--config",
        str(run.run_dir / "config.yaml"),
        "--trainer.default_root_dir",
        str(trainer_dir(run)),
        *(["--ckpt_path", str(resume_from)] if resume_from is not None else []),
    ]


def finalise(
    run: PlannedRun,
    returncode: int | None,
    status: str | None,
    message: str | None,
    tail: str,
    speed_blocks: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's final record: the run's own, completed with what only the runner knows (and, from a
    local runner, ``speed_blocks``: the blocks its speed was measured in, ``speed_verdict``), its paths and
    logs made portable (``portable_paths``: the study folder can move).

    A run resumed from a checkpoint gets one loss curve: the steps its checkpoint carried, then its own
    (``attempts.stitched_steps``).

    ``status`` given: the runner decided it (skipped/timeout/interrupted/invalid). Otherwise the
    exit code and the run's record decide: exit 0 with an ``ok`` record is ``ok``; ``oom`` when
    the record or stderr shows an out-of-memory error; ``interrupted`` (redone on resume) when a
    signal from outside killed the run before it recorded an outcome; else ``error``.
    """
    own = _read(run.run_dir / run_record.RECORD_FILENAME)
    record = own or {
        "schema_version": run_record.SCHEMA_VERSION,
        "config": run.config,
        "environment": {},
        "warmup_steps": 0,
        "fallbacks": [],
        "steps": [],
        "summary": {**run_record.summarize_steps([], 0), "memory_method": None},
    }
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
            message = (recorded in FAILED_STATUSES and summary.get("message")) or last_line(tail)
            if returncode == 0:
                message = f"exited 0 without finishing its run record ({message})"
            message = message or f"exit code {returncode}"
    record.update(variant=run.variant.name, seed=run.seed, steps=stitched_steps(record))
    if speed_blocks is not None:
        record["speed_blocks"] = dict(speed_blocks)
    summary.update(status=status, message=message, returncode=returncode, stderr_tail=None if status == "ok" else tail)
    study_dir = run.run_dir.parents[2]  # <study>/runs/<variant>/seed<k>
    record = portable(record, study_dir)
    record["absolute_paths"] = list(absolute_paths(record.get("config") or {}))
    make_logs_portable(run.run_dir, study_dir)
    run_record.write_record(run.run_dir / run_record.RECORD_FILENAME, record)
    return record


def previous_record(run: PlannedRun) -> dict[str, Any] | None:
    """The record of an earlier invocation of this run, if there is one: of the same config, or of one that
    trains the same on another layout (``layout_change``: a study started again on fewer ranks)."""
    config = run.run_dir / "config.yaml"
    if not config.is_file():
        return None
    text = config.read_text()
    if text != config_text(run.config) and not trains_the_same(yaml.safe_load(text) or {}, run.config):
        return None
    return _read(run.run_dir / run_record.RECORD_FILENAME)


def checkpoint_to_resume(run: PlannedRun) -> Path | None:
    """The newest complete checkpoint of an earlier invocation of ``run`` that stopped before its end, to
    continue from on this invocation's layout; None: the run starts from its first step."""
    previous = previous_record(run)
    if previous is None or previous.get("summary", {}).get("status") not in UNFINISHED_STATUSES:
        return None
    return newest_checkpoint(trainer_dir(run))


def is_kept(record: dict[str, Any], run: PlannedRun, retry_failed: bool) -> bool:
    """Finished records stay, except failures asked to be retried or that a rule now explains (skipped)."""
    status = record.get("summary", {}).get("status")
    if status in FAILED_STATUSES and (retry_failed or run.skip_reason):
        return False
    return status in DONE_STATUSES


def trainer_dir(run: PlannedRun) -> Path:
    """The run's ``trainer.default_root_dir``: its logs and checkpoints."""
    return trainer_root(run.run_dir)


def _clear(run: PlannedRun) -> None:
    """Remove what an earlier invocation of this run left (its record, the records of its earlier
    attempts, its checkpoints), so none of it can be mistaken for this run's."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / run_record.RECORD_FILENAME).unlink(missing_ok=True)
    for folder in (trainer_dir(run), run.run_dir / ATTEMPTS_DIRNAME):
        if folder.is_dir() and folder.resolve().is_relative_to(run.run_dir.resolve()):
            shutil.rmtree(folder)


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


def last_line(text: str) -> str | None:
    """The last non-blank line, stripped (a failure's one-line reason)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:2000] if lines else None


def package_root() -> str:
    """The folder holding the ``lit_ablate`` package this runner imported (the child imports the same)."""
    return str(Path(lit_ablate.__file__).resolve().parent.parent)

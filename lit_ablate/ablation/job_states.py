"""What the scheduler says about a study's jobs: ``sacct`` where SLURM keeps accounting, ``scontrol``
for what ``sacct`` cannot tell.

A cluster without SLURM's accounting daemon answers every ``sacct`` with "Slurm accounting storage
is disabled": submitit's watcher then reports ``UNKNOWN`` for ever, and a study waited for ever on
jobs that had long finished, or died before writing a result (docs/platform.md#slurm-clusters). The
controller itself (``scontrol``) knows every job it holds, until ``MinJobAge`` (300 s by default)
after the job ends. A job that neither knows while the controller answers has left the scheduler:
``GONE``, a final state that the job's own files decide (its result, or the lack of one).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence

GONE = "GONE"
"""Neither sacct nor the controller knows the job any more (it ended; its files tell how)."""
UNKNOWN = "UNKNOWN"
"""Not yet known (sacct lags behind a submission), or the scheduler did not answer: asked again later."""
QUERY_TIMEOUT_S = 60
_SCONTROL_JOB = re.compile(r"\bJobId=(\S+)\b.*?\bJobState=(\S+)")


def job_states(job_ids: Sequence[str]) -> dict[str, str]:
    """Each job's state (``COMPLETED``, ``RUNNING``, ``CANCELLED by 0``, ..., ``UNKNOWN`` or ``GONE``)."""
    ids = [str(job_id) for job_id in job_ids]
    if not ids:
        return {}
    from_sacct = _sacct(ids)
    states = dict(from_sacct or {})
    missing = [job_id for job_id in ids if job_id not in states]
    if missing:
        held = _scontrol()
        for job_id in missing:
            if held is not None and job_id in held:
                states[job_id] = held[job_id]
            else:  # sacct without accounting knows nothing: a job the answering controller lost is gone
                states[job_id] = GONE if from_sacct is None and held is not None else UNKNOWN
    return states


def _run(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _sacct(ids: list[str]) -> dict[str, str] | None:
    """The jobs' states from accounting; None where accounting does not answer."""
    out = _run(["sacct", "-o", "JobID,State", "--parsable2", *(a for job_id in ids for a in ("-j", job_id))])
    if out is None:
        return None
    lines = [line.split("|") for line in out.splitlines() if line.strip()]
    if not lines or "JobID" not in lines[0] or "State" not in lines[0]:
        return None
    column, state = lines[0].index("JobID"), lines[0].index("State")
    return {row[column]: row[state] for row in lines[1:] if len(row) > max(column, state) and "." not in row[column]}


def _scontrol() -> dict[str, str] | None:
    """Every job the controller holds, with its state; None where it does not answer."""
    out = _run(["scontrol", "-o", "show", "job"])
    if out is None:
        return None
    return {match[1]: match[2] for match in map(_SCONTROL_JOB.search, out.splitlines()) if match}

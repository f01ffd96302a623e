"""What each task of a study's SLURM job runs: ``FitTask``, pickled by submitit into the job.

Kept apart from the runner (``slurm``), which plans, submits and collects with the whole of
lit-ablate, Lightning and torch imported: a task only starts the run's ``lit-ablate fit`` process
and writes its logs, so unpickling it imports nothing heavy (seconds less per rank and per restart
before the fit itself starts).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lit_ablate.ablation.attempts import keep_attempt, newest_checkpoint

SUBMITIT_DIRNAME = "submitit"
"""The run folder's subfolder for the scheduler's own logs and each rank's placement."""


@dataclass(frozen=True)
class FitTask:
    """What each task of a run's job executes: the run's ``lit-ablate fit`` command, logging into
    the run folder (submitit pickles this object into the job).

    When SLURM runs the job again (``SLURM_RESTART_COUNT``: pre-empted, requeued), every task resumes
    from the newest checkpoint under ``trainer_dir`` and appends to its logs, and rank 0 keeps the
    earlier attempt's record (``attempts``).
    """

    command: tuple[str, ...]
    env: Mapping[str, str]
    run_dir: str
    trainer_dir: str

    def __call__(self) -> int:
        import submitit  # only inside the job (the slurm extra)

        job = submitit.JobEnvironment()
        rank = job.global_rank
        suffix = "" if rank == 0 else f".rank{rank}"
        folder, command, note = Path(self.run_dir), list(self.command), ""
        placement = {
            "rank": rank,
            "node_rank": job.node,
            "local_rank": job.local_rank,
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        }
        (folder / SUBMITIT_DIRNAME / f"rank{rank}.json").write_text(json.dumps(placement))
        restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        if restart:
            checkpoint = newest_checkpoint(Path(self.trainer_dir))
            command += ["--ckpt_path", str(checkpoint)] if checkpoint else []
            if rank == 0:
                keep_attempt(folder)
            note = (
                f"--- restart {restart} of job {os.environ.get('SLURM_JOB_ID')}: "
                f"{f'resuming from {checkpoint}' if checkpoint else 'no checkpoint, starting from step 0'} ---\n"
            )
        mode = "a" if restart else "w"
        with open(folder / f"stdout{suffix}.log", mode) as out, open(folder / f"stderr{suffix}.log", mode) as err:
            for log in (out, err):
                log.write(note)
                log.flush()
            returncode = subprocess.run(
                command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env={**os.environ, **self.env}
            ).returncode
        if returncode != 0:
            raise FitExited(f"lit-ablate fit exited with code {returncode}")
        return returncode


class FitExited(RuntimeError):
    """A task whose fit failed fails its job step, so that srun (``--kill-on-bad-exit``) stops the
    job's other ranks at once instead of leaving them in a collective until the time limit."""


FIT_EXITED = re.compile(r"FitExited: lit-ablate fit exited with code (-?\d+)")
"""How ``_collect`` reads a failed fit's exit code back from the task's pickled traceback."""

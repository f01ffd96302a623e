"""Running a study's runs as SLURM jobs through submitit (``launch.executor: slurm``).

Each run (variant × seed) is one job: ``trainer.num_nodes`` nodes with one task per rank, each
task starting the same ``lit-ablate fit`` process a local run starts, inside the job's SLURM
environment, which Lightning turns into ranks (so a multi-node variant needs nothing else). The
run folder is the local one: ``config.yaml``, ``stdout.log``/``stderr.log`` (rank 0; other ranks
``stdout.rank<k>.log``), ``run.json``, plus ``job.json`` (the job id) and ``submitit/`` (the
scheduler's own logs, and where each rank ran), so the report does not care where a run ran; the
record adds ``job``: its id, final state, nodes, each rank's node, and how often it restarted.

A job SLURM runs again (pre-empted, ``scontrol requeue``) resumes from its newest checkpoint and
appends to its logs (``attempts``). A job's state comes from ``sacct``, or from the controller
where there is no accounting (``job_states``): a job that died without a result is a failed run,
never a wait. One failed rank ends the whole job (``srun --kill-on-bad-exit``).

The runner keeps at most ``launch.slurm.max_jobs`` jobs queued or running, submits more as they
finish, and shows queued / running / done / failed. Every invocation first collects what the
scheduler finished since the last one: a rerun never submits a run whose job is still queued or
running, keeps finished runs, resubmits pre-empted ones at once and cancelled ones on the next
invocation (failures with ``--retry-failed``). With ``--no-wait`` it submits and returns; the same
command collects later.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lit_ablate import record as run_record
from lit_ablate.ablation.attempts import restarts
from lit_ablate.ablation.job_states import GONE, job_states
from lit_ablate.ablation.plan import PlannedRun, config_text
from lit_ablate.ablation.run_folder import (
    FAILED_STATUSES,
    finalise,
    fit_arguments,
    is_kept,
    last_line,
    package_root,
    prepare,
    previous_record,
    run_environment,
    stderr_tail,
    trainer_dir,
)
from lit_ablate.ablation.run_folder_lock import run_lock
from lit_ablate.ablation.slurm_settings import SlurmSettings
from lit_ablate.ablation.slurm_task import FIT_EXITED, SUBMITIT_DIRNAME, FitTask
from lit_ablate.errors import ConfigError
from lit_ablate.extras import require
from lit_ablate.run_config import GPU_ACCELERATORS

JOB_FILENAME = "job.json"
QUEUED_STATES = (
    "PENDING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "CONFIGURING",
    "RESIZING",
    "SUSPENDED",
    "UNKNOWN",
)
"""Scheduler states of a job that has not started (``UNKNOWN``: sacct has not seen it yet)."""
RUNNING_STATES = ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "STOPPED")
SCHEDULER_STATUSES = {
    "TIMEOUT": "timeout",
    "DEADLINE": "timeout",
    "PREEMPTED": "preempted",
    "CANCELLED": "interrupted",
    "INTERRUPTED": "interrupted",
    "NODE_FAIL": "error",
    "BOOT_FAIL": "error",
    "OUT_OF_MEMORY": "oom",
}
"""Final states the scheduler decided, as run statuses. Any other final state (``COMPLETED``,
``FAILED``, the local executor's ``FINISHED``) leaves the decision to the run's exit code and record."""


def on_gpu(run: PlannedRun) -> bool:
    """Whether the run's job gets GPUs: a GPU accelerator, or ``auto`` on a partition with GPUs."""
    settings = run.launch.slurm or SlurmSettings()
    accelerator = run.view.trainer.accelerator_name
    return accelerator in GPU_ACCELERATORS or (accelerator == "auto" and bool(settings.gpus_per_node))


def sbatch_parameters(run: PlannedRun) -> dict[str, Any]:
    """The job a run asks for, as submitit's ``SlurmExecutor`` parameters (what becomes ``#SBATCH``).

    One task per rank (Lightning's SLURM environment requires ``ntasks-per-node == devices``),
    ``devices`` GPUs per node on GPUs, the run's ``timeout_s`` as the time limit.
    """
    settings = run.launch.slurm or SlurmSettings()
    devices, nodes = run.view.devices_started or 1, run.view.nodes_started
    parameters: dict[str, Any] = {
        "job_name": f"lit-ablate.{run.variant.name}.seed{run.seed}",
        "time": max(1, math.ceil(run.launch.timeout_s / 60)),
        "nodes": nodes,
        "ntasks_per_node": devices,
        "setup": [_same_package(), *settings.setup],
        "srun_args": ["--kill-on-bad-exit=1"],  # one failed rank ends the job (FitExited)
        "additional_parameters": dict(settings.sbatch),
    }
    if on_gpu(run):
        parameters["gpus_per_node"] = devices
    optional = {
        "partition": settings.partition,
        "account": settings.account,
        "cpus_per_task": settings.cpus_per_task,
        "mem": settings.mem_gb,
    }
    parameters.update({k: v for k, v in optional.items() if v is not None})
    return parameters


def _same_package() -> str:
    """The job's first setup line: its tasks unpickle ``FitTask`` from this runner's ``lit_ablate``
    (as the fit process does, ``run_environment``), not from whatever the job's environment imports
    first (another install, an older checkout)."""
    return f"export PYTHONPATH={shlex.quote(package_root())}${{PYTHONPATH:+:$PYTHONPATH}}"


def check_cluster_runs(runs: Sequence[PlannedRun]) -> None:
    """Refuse, before anything is submitted, a variant the partition cannot hold or that the local
    cluster cannot start, and a study that mixes executors or clusters."""
    executors = {run.launch.executor for run in runs}
    clusters = {(run.launch.slurm or SlurmSettings()).cluster for run in runs}
    if len(executors) > 1 or len(clusters) > 1:
        raise ConfigError(
            "launch.executor",
            sorted(executors | clusters),
            "every variant of a study runs through one executor and cluster; set them at study level",
        )
    for run in runs:
        if run.skip_reason or run.invalid:
            continue
        settings = run.launch.slurm or SlurmSettings()
        devices, nodes = run.view.devices_started, run.view.nodes_started
        reason = settings.partition_refusal(devices, nodes, on_gpu(run))
        if reason is None and settings.cluster == "local" and nodes > 1:
            reason = "asks for several nodes; launch.slurm.cluster=local runs on this one machine"
        if reason:
            raise ConfigError(
                f"variants.{run.variant.name}.launch",
                {"devices": devices, "num_nodes": nodes},
                f"{reason}; nothing was submitted",
            )


def run_on_cluster(
    runs: Sequence[PlannedRun],
    fit_command: Sequence[str],
    retry_failed: bool = False,
    wait: bool = True,
    console: Console | None = None,
) -> list[dict[str, Any]]:
    """Submit (or collect, or resume) every planned run; returns the records of finished runs.

    Raises ``KeyboardInterrupt`` after asking (on a terminal) whether to cancel submitted jobs.
    """
    check_cluster_runs(runs)
    console = console or Console(stderr=True)
    queue = _ClusterQueue(list(runs), list(fit_command), console)
    queue.collect_previous(retry_failed)
    if queue.waiting and queue.settings.cluster == "local" and not wait:
        raise ConfigError(
            "--no-wait", True, "jobs of launch.slurm.cluster=local end with this command; run without --no-wait"
        )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("study", total=len(runs), completed=len(queue.records))
            while True:
                queue.collect_finished()
                queue.submit_up_to(queue.settings.max_jobs)
                progress.update(task, description=queue.describe(), completed=len(queue.records))
                if not wait or (not queue.active and not queue.waiting):
                    break
                time.sleep(queue.settings.poll_s)
    except KeyboardInterrupt:
        queue.interrupted()
        raise
    if queue.active or queue.waiting:
        console.print(f"{queue.describe()}: run the same command again to collect them (nothing is submitted twice)")
    return [queue.records[run.run_dir] for run in runs if run.run_dir in queue.records]


class _ClusterQueue:
    """The study's runs on their way through the scheduler: waiting to be submitted, active
    (queued or running), or finished (recorded)."""

    def __init__(self, runs: list[PlannedRun], fit_command: list[str], console: Console) -> None:
        self.runs, self.fit_command, self.console = runs, fit_command, console
        self.settings = runs[0].launch.slurm or SlurmSettings()
        self.records: dict[Path, dict[str, Any]] = {}
        self.active: dict[Path, tuple[PlannedRun, Any]] = {}
        self.waiting: list[PlannedRun] = []
        self.states: dict[Path, str] = {}

    def collect_previous(self, retry_failed: bool) -> None:
        """Sort runs by what an earlier invocation left: a kept record, a job still in the
        scheduler (never submitted twice), a finished job to collect, or nothing yet."""
        for run in self.runs:
            previous = previous_record(run)
            if previous is not None and is_kept(previous, run, retry_failed):
                self.records[run.run_dir] = previous
                continue
            job = self._earlier_job(run)
            if job is not None:
                self.active[run.run_dir] = (run, job)
            else:
                self.waiting.append(run)

    def _earlier_job(self, run: PlannedRun) -> Any:
        """The scheduler job an earlier invocation submitted for this run and config, if the
        scheduler still knows it; a job of a changed config is cancelled."""
        path = run.run_dir / JOB_FILENAME
        if not path.is_file() or self.settings.cluster != "slurm":
            return None  # the local cluster's jobs end with the command that started them
        noted = json.loads(path.read_text())
        job = _submitit().SlurmJob(folder=run.run_dir / SUBMITIT_DIRNAME, job_id=noted["job_id"])
        if noted.get("config") != config_text(run.config):
            if _phase(job_states([job.job_id])[str(job.job_id)]) != "final":
                job.cancel(check=False)
                self.console.print(f"{run.label}: its config changed; cancelled its earlier job {noted['job_id']}")
            return None
        collected = (previous_record(run) or {}).get("summary", {}).get("status") not in (None, "running")
        return None if collected else job  # a collected job's run is redone (pre-empted, or --retry-failed)

    def submit_up_to(self, limit: int) -> None:
        while self.waiting and len(self.active) < limit:
            run = self.waiting.pop(0)
            with run_lock(run.run_dir):
                unrunnable = prepare(run)
                if unrunnable is not None:
                    self.records[run.run_dir] = unrunnable
                    continue
                executor = self._executor(run)
                task = FitTask(
                    tuple(fit_arguments(run, self.fit_command)),
                    run_environment(run),
                    str(run.run_dir),
                    str(trainer_dir(run)),
                )
                job = _submitted(executor, task, run)
                (run.run_dir / JOB_FILENAME).write_text(
                    json.dumps(
                        {"job_id": job.job_id, "cluster": self.settings.cluster, "config": config_text(run.config)}
                    )
                )
            self.active[run.run_dir] = (run, job)

    def _executor(self, run: PlannedRun) -> Any:
        submitit = _submitit()
        folder = run.run_dir / SUBMITIT_DIRNAME
        if self.settings.cluster == "local":
            # One machine: one task, and Lightning's own launcher starts the ranks, as for a local run.
            executor = submitit.LocalExecutor(folder)
            executor.update_parameters(
                timeout_min=run.launch.timeout_s / 60, tasks_per_node=1, setup=[_same_package(), *self.settings.setup]
            )
            return executor
        try:
            executor = submitit.SlurmExecutor(folder)
        except RuntimeError as err:  # no srun here
            raise ConfigError(
                "launch.slurm.cluster",
                "slurm",
                f"{err}: run the study from a SLURM login node, "
                "or set launch.slurm.cluster: local to try it on this machine",
            ) from err
        executor.update_parameters(**sbatch_parameters(run))
        return executor

    def _refresh_states(self) -> None:
        """Every active job's scheduler state, from one query for all of them on SLURM (``job_states``)."""
        jobs = {run_dir: job for run_dir, (_, job) in self.active.items()}
        if self.settings.cluster == "slurm" and jobs:
            states = job_states([job.job_id for job in jobs.values()])
            self.states.update({d: states[str(job.job_id)] for d, job in jobs.items()})
        else:
            self.states.update({d: str(job.state) for d, job in jobs.items()})

    def collect_finished(self) -> None:
        self._refresh_states()
        for run_dir, (run, job) in list(self.active.items()):
            state = self.states[run_dir]
            if _phase(state) == "final":
                del self.active[run_dir]
                with run_lock(run.run_dir):
                    self.records[run_dir] = _collect(run, job, state)
                record = self.records[run_dir]["summary"]
                message = f" — {record['message']}" if record["status"] != "ok" and record.get("message") else ""
                restarted = self.records[run_dir]["job"]["restarts"]
                again = f", restarted {restarted}x" if restarted else ""
                self.console.print(f"{run.label}: {record['status']} (job {job.job_id}{again}){message}", markup=False)
                if record["status"] == "preempted":  # the scheduler took the nodes back: the run goes back in line
                    job.cancel(check=False)  # never two jobs for one run, should the scheduler requeue it too
                    del self.records[run_dir]
                    self.waiting.append(run)

    def describe(self) -> str:
        phases = [_phase(self.states.get(d, "UNKNOWN")) for d in self.active]
        failed = sum(
            r["summary"]["status"] in (*FAILED_STATUSES, "preempted", "interrupted") for r in self.records.values()
        )
        return (
            f"queued {phases.count('queued') + len(self.waiting)} · running {phases.count('running')} · "
            f"done {len(self.records) - failed} · failed {failed}"
        )

    def interrupted(self) -> None:
        """Ctrl-C: cancel the submitted jobs, or leave them queued/running for a later invocation."""
        if not self.active:
            return
        cancel = self.settings.cluster == "local"
        if not cancel and sys.stdin.isatty():
            answer = self.console.input(f"cancel the {len(self.active)} submitted jobs? [y/N] ")
            cancel = answer.strip().lower() in ("y", "yes")
        for run, job in self.active.values():
            if cancel:
                job.cancel(check=False)
                with run_lock(run.run_dir):
                    finalise(run, None, "interrupted", "job cancelled by Ctrl-C; redone on resume", stderr_tail(run))
        self.console.print(f"{'cancelled' if cancel else 'left queued or running'}: {len(self.active)} jobs")


def _phase(state: str) -> str:
    name = state.split()[0] if state.strip() else "UNKNOWN"  # "CANCELLED by 1234"
    if name in QUEUED_STATES:
        return "queued"
    if name in RUNNING_STATES:
        return "running"
    return "final"


def _collect(run: PlannedRun, job: Any, state: str) -> dict[str, Any]:
    """A finished job's final record: the scheduler's verdict when it ended the job, otherwise the
    run's exit code and record (as for a local run); a job that ended without rank 0's result
    (killed, or its batch script failed before the fit started) is an error saying so."""
    name = state.split()[0]
    returncode, detail = None, ""
    if job.paths.result_pickle.exists():  # rank 0's task ended (job.result() would wait for every task, and
        outcome, result = _submitit().core.utils.pickle_load(job.paths.result_pickle)  # for ever on a dead one)
        exited = FIT_EXITED.search(str(result)) if outcome == "error" else None
        if outcome == "success" or exited:
            returncode = int(exited[1]) if exited else result
        else:  # the task raised around the fit process: submitit's reason
            detail = " ".join(str(result).split())[-600:]
    else:
        detail = " ".join((job.stderr() or "").split())[-600:]
    tail = _rank_tails(run)
    status = SCHEDULER_STATUSES.get(name)
    message = None
    if status is not None:
        message = f"scheduler: {state}" + ("; redone on resume" if status in ("preempted", "interrupted") else "")
        if status == "timeout":
            message += f" (launch.timeout_s={run.launch.timeout_s:g})"
    elif returncode is None:
        ended = "the scheduler no longer knows the job" if name == GONE else f"scheduler: {state}"
        own = (previous_record(run) or {}).get("summary", {})
        reason = (own.get("status") in FAILED_STATUSES and own.get("message")) or last_line(tail) or detail
        status, message = "error", f"{ended}: {reason or 'it ended without its result'}"
    record = finalise(run, returncode, status, message, tail or detail)
    ranks = sorted(
        (json.loads(p.read_text()) for p in (run.run_dir / SUBMITIT_DIRNAME).glob("rank*.json")),
        key=lambda placement: placement["rank"],
    )
    record["job"] = {
        "id": str(job.job_id),
        "state": state,
        "cluster": (run.launch.slurm or SlurmSettings()).cluster,
        "restarts": restarts(run.run_dir),
        "nodes": sorted({r["node"] for r in ranks}),
        "ranks": ranks,
    }
    run_record.write_record(run.run_dir / run_record.RECORD_FILENAME, record)
    return record


def _rank_tails(run: PlannedRun) -> str:
    """Rank 0's stderr tail, then the last line of every other rank that printed one (a rank that
    failed alone says why there, while rank 0 only waited)."""
    others = sorted(run.run_dir.glob("stderr.rank*.log"), key=lambda p: int(p.stem.rpartition("rank")[2] or 0))
    lines = [
        f"{p.stem.partition('.')[2]}: {line}" for p in others if (line := last_line(p.read_text(errors="replace")))
    ]
    return "\n".join(filter(None, [stderr_tail(run), *lines]))


def _submitit() -> Any:
    require_submitit()
    import submitit

    return submitit


def require_submitit() -> None:
    """``launch.executor: slurm`` submits through submitit (the ``slurm`` extra); checked before the study starts."""
    require("submitit", "launch.executor", "slurm", "a study on SLURM")


def _submitted(executor: Any, task: FitTask, run: PlannedRun) -> Any:
    """``executor.submit(task)``; sbatch's refusal (a partition, account or limit the cluster does not
    have) as one line naming ``launch.slurm`` with sbatch's own words, not submitit's traceback."""
    submitit = _submitit()
    try:
        return executor.submit(task)
    except submitit.core.utils.FailedJobError as err:
        said = [line.strip() for line in str(err).splitlines() if "error" in line.lower() and line.strip()]
        reason = said[-1] if said else " ".join(str(err).split())[:300]
        settings = run.launch.slurm or SlurmSettings()
        raise ConfigError(
            "launch.slurm",
            {"partition": settings.partition, "account": settings.account, **settings.sbatch},
            f"sbatch refused {run.label}'s job ({reason}); fix the partition, account or limits "
            "there (sinfo and sacctmgr show what this cluster has)",
        ) from err

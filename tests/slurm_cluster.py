"""A real two-node SLURM cluster on this one machine, for the ``slurm``-marked tests.

Debian's ``slurm-wlm`` and ``munge`` (installed here when missing, as root through apt) run as
one controller and two compute daemons, ``slurmd -N n1`` and ``slurmd -N n2``, on loopback ports
picked free at start, with every file (config, state, spool, logs, munge's socket) in a temporary
folder: nothing of the host's own SLURM or munge is used or touched, and no systemd is needed.
Every daemon is started here as a child in its own session, and stopped by its PID.

Clients find the cluster through ``SLURM_CONF`` (``SlurmCluster.env``), which jobs inherit from
``sbatch``. Each node offers 2 CPUs and 4000 MB, whatever the machine has: the tests' jobs are
tiny and the scheduler only needs to place them.

There is no accounting daemon, so ``sacct`` knows no job: the ablation runner must learn a job's
state from ``scontrol`` (submitit waited forever on a job that died early:
docs/platform.md#slurm-clusters).

Usage::

    cluster = start_cluster(folder)      # raises ClusterUnavailable(reason) where it cannot run
    os.environ.update(cluster.env)
    ...
    cluster.stop()

``HoldFirstAttempt`` is a callback for the jobs' fits (this folder is on their ``PYTHONPATH``):
it holds a job's first attempt at a given step, so that a test requeues it mid-run every time.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

REQUIRE_ENV = "LIT_ABLATE_REQUIRE_SLURM"
"""Set to 1 (CI does) to fail, not skip, the cluster tests where the cluster cannot start."""
PACKAGES = ("slurm-wlm", "munge")
DAEMONS = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
NODES = ("n1", "n2")
CPUS_PER_NODE = 2
MUNGE_KEY = Path("/etc/munge/munge.key")  # made by the munge package's post-install
START_TIMEOUT_S = 60.0
HOLDING = "HoldFirstAttempt: holding before step"


class ClusterUnavailable(RuntimeError):
    """The cluster cannot run on this machine; the message says why (a test skips with it)."""


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    munge_dir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, scontrol, submitit) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True) -> str:
        """A SLURM client command against this cluster; its stdout."""
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, env={**os.environ, **self.env})
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, NodeList, ...); {} for a job it no longer knows."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def requeue(self, job_id: str, timeout_s: float = 60.0) -> None:
        """Requeue a running job as pre-emption does (its tasks get SIGTERM, then SIGKILL), and let it
        start again at once rather than after the ~30 s a requeued job waits
        (docs/platform.md#slurm-clusters)."""
        self.run("scontrol", "requeue", str(job_id))
        deadline = time.monotonic() + timeout_s
        while self.job(job_id).get("JobState") != "PENDING":
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not go back to PENDING: {self.job(job_id)}")
            time.sleep(0.1)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until both nodes take jobs; raises with the daemons' logs if they do not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.node_states() == {node: "idle" for node in NODES}:
                return
            dead = [name for name, p in self.processes.items() if p.poll() is not None]
            if dead:
                break
            time.sleep(0.2)
        raise ClusterUnavailable(f"the nodes did not become idle ({self.node_states()}); logs:\n{self.logs()}")

    def logs(self) -> str:
        logs = [*sorted(self.root.glob("*.log")), *sorted(self.munge_dir.glob("*.log"))]
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)

    def stop(self) -> None:
        """Cancel every job, then stop the daemons by PID (SIGTERM, SIGKILL after 10 s)."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--quiet", "--user", "root", check=False)
            deadline = time.monotonic() + 15
            while self.run("squeue", "-h", "-o", "%i", check=False).strip() and time.monotonic() < deadline:
                time.sleep(0.3)
        for name in reversed(list(self.processes)):  # slurmds, the controller, then munged
            process = self.processes[name]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()
        shutil.rmtree(self.munge_dir, ignore_errors=True)


def missing_software() -> list[str]:
    return [name for name in (*DAEMONS.values(), *CLIENTS) if shutil.which(name) is None] + (
        [] if MUNGE_KEY.is_file() else [str(MUNGE_KEY)]
    )


def ensure_installed() -> None:
    """Install slurm-wlm and munge through apt when any of their programs is missing (as CI does)."""
    if not missing_software():
        return
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable(
            f"no apt-get to install {' '.join(PACKAGES)} (missing: {', '.join(missing_software())})"
        )
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        if done.returncode != 0:
            raise ClusterUnavailable(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
    if missing_software():
        raise ClusterUnavailable(f"still missing after apt-get install: {', '.join(missing_software())}")


def start_cluster(root: Path) -> SlurmCluster:
    """Install if needed, start munged, slurmctld and two slurmd, and wait until both nodes are idle."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise ClusterUnavailable("starting SLURM's daemons needs root (slurmd runs jobs as their user)")
    ensure_installed()
    root.mkdir(parents=True, exist_ok=True)
    # munged runs as the munge user, who cannot enter pytest's temp folders (0700, root's): its own
    # folder lies directly in the system's temp folder, writable by it alone (munged checks that)
    munge_dir = Path(tempfile.mkdtemp(prefix="lit-ablate-munge-"))
    os.chmod(munge_dir, 0o755)
    shutil.chown(munge_dir, "munge", "munge")
    conf = root / "slurm.conf"
    ports = _free_ports(1 + len(NODES))
    conf.write_text(_slurm_conf(root, munge_dir / "munge.socket", ports))
    for node in NODES:
        (root / "spool" / node).mkdir(parents=True)  # both slurmds at once would race to create them
    (root / "state").mkdir()
    cluster = SlurmCluster(root, conf, munge_dir)
    try:
        cluster.processes["munged"] = _start(
            root / "munged.log",
            [
                DAEMONS["munged"],
                "--foreground",
                f"--socket={munge_dir / 'munge.socket'}",
                f"--key-file={MUNGE_KEY}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
                f"--log-file={munge_dir / 'munged.file.log'}",
            ],
            user="munge",
        )
        _wait_for(lambda: (munge_dir / "munge.socket").exists(), "munged's socket", cluster)
        cluster.processes["slurmctld"] = _start(root / "slurmctld.log", [DAEMONS["slurmctld"], "-D", "-f", str(conf)])
        for node in NODES:
            cluster.processes[f"slurmd.{node}"] = _start(
                root / f"slurmd.{node}.log", [DAEMONS["slurmd"], "-D", "-N", node, "-f", str(conf)]
            )
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start(log: Path, command: list[str], user: str | None = None) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            user=user,
            group=user,
        )


def _wait_for(ready, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline or any(p.poll() is not None for p in cluster.processes.values()):
            raise ClusterUnavailable(f"{what} did not come up; logs:\n{cluster.logs()}")
        time.sleep(0.1)


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (held open together so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _slurm_conf(root: Path, munge_socket: Path, ports: list[int]) -> str:
    """Two nodes on this host, no accounting, no cgroups: only what a scheduler needs to place and
    signal jobs. ``cred_expire=30`` and ``bf_interval=5`` let a requeued job start again after
    ~30 s instead of ~120 s (docs/platform.md#slurm-clusters)."""
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={CPUS_PER_NODE} RealMemory=4000 State=UNKNOWN"
        for node, port in zip(NODES, ports[1:])
    )
    return f"""ClusterName=litablate
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=30
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}/%n
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.%n.pid"}
SlurmctldLogFile={root / "slurmctld.file.log"}
SlurmdLogFile={root / "slurmd.%n.file.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
SchedulerParameters=bf_interval=5
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=5
MinJobAge=300
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class HoldFirstAttempt(Callback):
    """Holds every rank of a job's first attempt before optimizer step ``step`` for up to ``seconds``,
    after rank 0 touches ``marker``; later attempts (``SLURM_RESTART_COUNT`` set) run through. The
    checkpoints of the steps before are written by then, so a requeue during the hold lands mid-run."""

    def __init__(self, step: int, marker: str, seconds: float = 120.0) -> None:
        self.step, self.marker, self.seconds = step, marker, seconds

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step - 1 and not int(os.environ.get("SLURM_RESTART_COUNT") or 0):
            if trainer.is_global_zero:
                print(f"{HOLDING} {self.step}", file=sys.stderr, flush=True)
                Path(self.marker).write_text(str(self.step))
            time.sleep(self.seconds)

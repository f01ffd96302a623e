"""Whether the ranks can start where the run goes: its accelerator and devices, the CPU cores its ranks share,
its nodes, and the strategy (and strategy options) on that kind of device."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import GPU_ACCELERATORS, RunConfig, TrainerSettings

CPU_REFUSING_STRATEGIES = ("fsdp", "lightning.pytorch.strategies.FSDPStrategy", "FSDPStrategy")
"""Lightning's FSDP1 strategy raises on CPU; a CPU FSDP1 baseline passes ``device_id`` itself (docs/platform.md)."""
CPU_RANKS_PER_CORE = 4
"""Most CPU ranks per usable core a run may start. A rank is a process that imports torch, Lightning and
transformers (~5 s of CPU and ~0.4 GB resident before its first step), so 64 ranks on 2 cores spend minutes
importing, need ~25 GB and then wait on each other in every collective. 4 per core leaves 2x headroom over
the densest shipped study (HSDP 2x2: 4 ranks on 2 cores) and still refuses such a request."""
NODE_LAUNCH_ENV = (
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "LSB_JOBID",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
)
"""What a launcher sets in each node's process (by hand, Lightning's ``NODE_RANK`` and ``MASTER_ADDR``;
torchrun, SLURM, LSF, MPI): one of them tells a process which node it is and where node 0 waits."""


@rule(Scope.MACHINE, skips_variant=True)
def accelerator_present(run: RunConfig) -> Refusal | None:
    """A GPU accelerator needs a visible CUDA device, and another of Lightning's (``mps``, ``tpu``) its device."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    accelerator = run.trainer.accelerator
    if accelerator in GPU_ACCELERATORS and not torch.cuda.is_available():
        return Refusal(
            "trainer.accelerator",
            accelerator,
            "no CUDA device is visible here (torch.cuda.is_available() is False); use cpu or auto",
        )
    if accelerator in AcceleratorRegistry and not AcceleratorRegistry[accelerator]["accelerator"].is_available():
        return Refusal("trainer.accelerator", accelerator, f"no {accelerator} device here; use cpu or auto")
    return None


@rule(Scope.MACHINE, skips_variant=True)
def enough_devices(run: RunConfig) -> Refusal | None:
    """GPU runs need as many devices per node as they ask for (CPU ranks: ``cpu_ranks_fit``)."""
    devices = run.trainer.devices_per_node
    if run.simulation is None and run.trainer.device_type == "cuda" and devices and devices > torch.cuda.device_count():
        return Refusal(
            "trainer.devices", devices, f"needs {devices} GPUs per node, {torch.cuda.device_count()} visible"
        )
    return None


def usable_cpu_cores() -> int:
    """The cores this process may run on (a taskset or cgroup cpuset narrows ``os.cpu_count()``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@rule(Scope.MACHINE, skips_variant=True)
def cpu_ranks_fit(run: RunConfig) -> Refusal | None:
    """A CPU run with at most ``CPU_RANKS_PER_CORE`` x the usable cores ranks per node (a simulated rank is
    one process). On CPU Lightning starts one process per ``trainer.devices``, whatever the core count, and
    every rank must join every collective: far too many do not fail, they hang until a timeout."""
    return None if run.simulation is not None else refusal_of(check_cpu_ranks, run.trainer)


def check_cpu_ranks(trainer: TrainerSettings | Mapping[str, Any], cores: int | None = None) -> None:
    """Raise ``ConfigError`` naming ``trainer.devices``, the ranks, the cores and the limit when a CPU run asks
    for more ranks per node than ``CPU_RANKS_PER_CORE`` x ``cores`` (default: the usable cores).
    ``trainer``: the run's ``TrainerSettings`` or its ``trainer`` section."""
    trainer = trainer if isinstance(trainer, TrainerSettings) else TrainerSettings.of(trainer)
    devices = trainer.devices_per_node
    if trainer.device_type != "cpu" or devices is None:
        return  # GPUs are counted by enough_devices; a malformed value is Lightning's own error
    cores = cores or usable_cpu_cores()
    limit = CPU_RANKS_PER_CORE * cores
    if devices > limit:
        raise ConfigError(
            "trainer.devices",
            devices,
            f"on CPU every rank is a process; {devices} ranks on {cores} usable cores is more than the limit of "
            f"{limit} ({CPU_RANKS_PER_CORE} per core), past which the run waits (rank start-up, every collective) "
            f"until it times out; use at most {limit} devices",
        )


@rule(Scope.MACHINE, skips_variant=True)
def nodes_are_launched(run: RunConfig) -> Refusal | None:
    """``num_nodes`` above 1 needs a process started on each node: a study's local runner starts one node, and
    a process no launcher started waited for nodes that never came, silently, until killed (a study on SLURM
    starts every node's process itself; a simulated rank is one process, whatever the nodes)."""
    nodes = run.trainer.nodes
    if nodes <= 1 or run.simulation is not None:
        return None
    if run.executor == "local":
        return Refusal(
            "trainer.num_nodes", nodes, "the study runner launches a single node; run each node with torchrun"
        )
    if run.executor is None and not any(os.environ.get(name) for name in NODE_LAUNCH_ENV):
        return Refusal(
            "trainer.num_nodes",
            run.trainer.num_nodes,
            "no launcher started this process on one of the nodes (no NODE_RANK/MASTER_ADDR, torchrun, "
            "SLURM, LSF or MPI variables), so it would wait for the other nodes forever; run it under "
            "srun or torchrun --nnodes on each node, a study with launch.executor: slurm, or use 1",
        )
    return None


@rule(Scope.MACHINE, Scope.CLUSTER, skips_variant=True)
def strategy_accepts_cpu(run: RunConfig) -> Refusal | None:
    """Lightning's ``FSDPStrategy`` (FSDP1) refuses the CPU accelerator."""
    strategy = run.trainer.strategy
    if strategy.name in CPU_REFUSING_STRATEGIES and run.trainer.device_type != "cuda":
        return Refusal(
            TRAINER_STRATEGY_KEY,
            strategy.configured,
            "Lightning's FSDP1 refuses CPU; use FSDP2Strategy or run on GPU",
            shown=strategy.name,
        )
    return None


@rule(Scope.MACHINE, Scope.CLUSTER, skips_variant=True)
def strategy_options_run_here(run: RunConfig) -> Refusal | None:
    """GPU-only strategy options (CPU offload, bf16 gradient compression) need a GPU."""
    from lit_ablate.strategies.gpu_only import check_gpu_only_options

    strategy = run.trainer.strategy
    if strategy.section is None:
        return None
    return refusal_of(check_gpu_only_options, strategy.options, run.trainer.device_type)

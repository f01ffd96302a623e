"""Checks of a parsed ``fit``/``validate``/``test`` config that need nothing built: trainer values
Lightning accepts but cannot run (or runs as nothing), and the paths the run will read or write.

``LitAblateCLI`` calls ``check_ckpt_path`` before it reads the checkpoint and ``check_run_config``
before it instantiates any class, so these mistakes cost a second and one line naming the key, not
a model build followed by a stack trace.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule

from lit_ablate import record as run_record
from lit_ablate.compatibility import GPU_ACCELERATORS, RULES, check_keys_act_together, refusal_of
from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.data.token_cache import CACHE_DIR_ENV as DATA_CACHE_ENV
from lit_ablate.data.token_cache import cache_root
from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import STRATEGY_KEY
from lit_ablate.path_checks import checkpoint_path, saved_file, writable_dir, writable_file
from lit_ablate.run_config import RunConfig, TrainerSettings
from lit_ablate.simulated_rank import SIMULATE_KEY, SIMULATE_RANK_KEY, SimulatedRank

LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")
"""``--ckpt_path`` values Lightning resolves to a file itself (with ``registry...``)."""


def check_run_config(subcommand: str, config: RunConfig | Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` for the first value of ``config`` (one subcommand's namespace, or its view)
    that cannot run: ``check_config``, a GPU accelerator without a GPU and, for ``fit``, the parts'
    compatibility rules and the folders it will write."""
    run = RunConfig.of(config)
    check_accelerator(run.trainer)
    check_config(run, fitting=subcommand == "fit")
    if run.simulation is None:  # a simulated rank is one process, whatever the nodes
        check_launched_nodes(run.trainer)
    if subcommand == "fit":  # validate and test write nothing (lit_ablate.terminal)
        check_parts_compatible(run)
        if run.trainer.default_root_dir:
            writable_dir("trainer.default_root_dir", run.trainer.default_root_dir)
        if run.record_path:
            writable_file("recorder.path", run.record_path)
        elif os.environ.get(run_record.RECORD_PATH_ENV):
            writable_file(run_record.RECORD_PATH_ENV, os.environ[run_record.RECORD_PATH_ENV])


def check_config(config: RunConfig | Mapping[str, Any], fitting: bool = True) -> None:
    """Raise ``ConfigError`` for a value of the run's config that cannot run on any machine: a
    ``trainer.strategy`` string that names no strategy, ``check_trainer``'s values, an option its partner
    turns off (``check_keys_act_together``), ``check_mesh``, a loss backend's name and options, and the paths
    the run will read or write (``check_paths``).
    ``lit-ablate fit`` calls it (``check_run_config``), and a study's planner on every variant before
    the first one starts (a variant it refuses is a bad variant, not one that cannot run here)."""
    run = RunConfig.of(config)
    run.trainer.strategy.check_name()
    check_trainer(run.trainer, fitting=fitting)
    check_keys_act_together(run)
    check_paths(run)
    check_mesh(run.trainer, run.simulation)
    if run.model.module.init_args.get("loss") is not None:
        run.model.loss.check_named()


def check_paths(config: RunConfig | Mapping[str, Any]) -> None:
    """The files and folders the run will read or write once it runs, checked before any rank starts: the
    token cache's folder (under a regular file it failed with ``NotADirectoryError`` at data set-up), DPO's
    reference cache (a corrupt one reached the user as torch's ``UnpicklingError``), and a checkpoint's
    layout against the strategy that reads it (a sharded folder resumed on one device was opened as a file:
    ``IsADirectoryError``)."""
    run = RunConfig.of(config)
    data = run.data.module
    if data is not None and data.is_a(LightningDataModule):
        storage, given = data.option("storage", "auto"), data.option("cache_dir")
        from_env = os.environ.get(DATA_CACHE_ENV)
        if storage == "cache" or (storage == "auto" and (given or from_env)):
            writable_dir("data.init_args.cache_dir" if given or not from_env else DATA_CACHE_ENV, cache_root(given))
    reference_cache = run.model.option("reference_cache")
    if reference_cache and run.model.option("reference") == "precomputed":
        saved_file(
            "model.init_args.reference_cache",
            reference_cache,
            ("pairs_sha256", "logps"),
            "delete it (the run computes the log-probs again and rewrites it), or give another path",
        )
    check_checkpoint_layout(run)


def check_checkpoint_layout(run: RunConfig) -> None:
    """``--ckpt_path`` in a layout the run's strategy reads: every strategy reads a sharded folder (mesh
    strategies their shards of it, the others the folder whole: ``WholeCheckpointIO``), and the pipeline
    strategy, whose ranks each load their stages, resumes from such a folder only."""
    from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy

    path = run.ckpt_path
    if not path or path in LIGHTNING_CKPT_NAMES or path.startswith("registry"):
        return
    if not Path(path).expanduser().is_dir() and run.trainer.strategy.is_a(PipelineParallelStrategy):
        raise ConfigError(
            "--ckpt_path",
            path,
            "a pipeline-parallel run resumes from the sharded checkpoint folder such a run saves; give that folder",
        )


FIT_RULES: tuple[str, ...] = (
    "strategy_accepts_cpu",
    "strategy_options_run_here",
    "optimizer_runs_here",
    "quantization_runs_under_strategy",
    "loss_backend_available",
    "attention_backend_available",
    "cp_block_kernel_runs_here",
    "fp8_runs_here",
    "preference_parts_fit",
    "pipeline_stages_split_the_model",
    "pipeline_stages_train_the_objective",
    "tensor_parallel_loss_fits",
    "experts_split_over_ep",
    "tensor_parallel_splits_the_model",
    "sequence_parallel_rows_split",
    "sequence_parallel_adapters_run_here",
    "pipeline_stages_fit",
    "context_parallel_attends",
)
"""The study compatibility rules (``lit_ablate.compatibility.RULES``) about one run's own parts, the
model's shape against the mesh among them (ep dividing the experts, tp the heads, the pipeline's stages
and micro-batches, the batches' lengths): refused here before any rank starts, where the ranks found
out after their start-up or at the first batch. The others are about launching a study (devices,
nodes). The loss and attention backends' rules are here too, though their construction checks the
same: a refusal from the model's construction comes once the trainer exists and leaves a run record
behind, and the loss rule also knows what other parts refuse a backend (CCE's compiled backward under
MemoryMonitor's tensor tracker)."""


def check_parts_compatible(config: RunConfig | Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` when a part cannot run with another or here: an optimizer the strategy's
    parameters or the memory tracker refuse, a quantised base the strategy cannot shard, a strategy or
    strategy option this device lacks. The same rules skip such variants in studies; here they stop
    ``fit`` before any rank starts or any model is built, in one line, instead of at step 1. Each
    rule's refusal names its key, value and fix, and is raised as it is."""
    from types import SimpleNamespace

    launch = SimpleNamespace(devices=None, num_nodes=None, accelerator=None)  # the config's own trainer values
    refusal = refusal_of(config, launch, {name: RULES[name] for name in FIT_RULES})
    if refusal:
        raise refusal.error()


def check_mesh(trainer: TrainerSettings | Mapping[str, Any], simulation: SimulatedRank | None = None) -> None:
    """A mesh strategy's sizes must make the world size (devices x nodes, or a simulated job's). Checked
    here, before Lightning starts the ranks: the strategy itself can only check once every rank runs.
    ``trainer``: the run's ``TrainerSettings`` or its ``trainer`` section."""
    trainer = trainer if isinstance(trainer, TrainerSettings) else TrainerSettings.of(trainer)
    sizes, devices = trainer.strategy.requested_mesh_sizes, trainer.devices_per_node
    if sizes is not None and simulation is not None:
        sizes.resolved(simulation.world_size)
    elif (
        sizes is not None and devices is not None
    ):  # not: a strategy without a mesh, or devices Lightning counts ("auto")
        sizes.resolved(devices * trainer.nodes)


def check_simulation(
    subcommand: str, config: RunConfig | Mapping[str, Any], ckpt_path: str | os.PathLike | None = None
) -> None:
    """Refuse a simulated rank (``simulate``: one process playing one rank of a larger job over a fake
    process group) where it cannot mean anything: outside ``fit`` (its weights are drawn, not trained),
    resuming (nothing real was saved), under a strategy the fake process group cannot run (torch's DDP
    waits on the result of its gradient all-reduce, which a fake one never gives), with a quantised base
    (its quantisation state is made from real weights on rank 0), or playing a pipeline rank past the first
    stage (its inputs' shapes would come from a stage no process runs). The mesh must lay out on the
    simulated world size (``check_mesh``)."""
    run = RunConfig.of(config)
    simulation = run.simulation
    if simulation is None:
        return
    if subcommand != "fit":
        raise ConfigError(
            SIMULATE_KEY, simulation.world_size, f"a simulated rank only trains; drop --{SIMULATE_KEY} for {subcommand}"
        )
    if ckpt_path:
        raise ConfigError(
            "--ckpt_path",
            str(ckpt_path),
            "a simulated rank draws its own weights and saves nothing to "
            f"resume from; drop --ckpt_path (or --{SIMULATE_KEY})",
        )
    from lit_ablate.strategies.mesh import MeshStrategy
    from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy

    strategy = run.trainer.strategy
    if not strategy.is_a(MeshStrategy):
        raise ConfigError(
            TRAINER_STRATEGY_KEY,
            strategy.short_name,
            "a simulated rank runs lit-ablate's mesh strategies (FSDP2Strategy, HSDPStrategy, "
            "TensorParallelStrategy, ContextParallelStrategy, ExpertParallelStrategy, MeshParallelStrategy, "
            "PipelineParallelStrategy); torch's DDP (ddp, DDPStrategy, ZeRO1Strategy) and FSDP1 wait on "
            "collective results a fake process group never gives",
        )
    if run.model.quantization_section is not None:
        raise ConfigError(
            "model.init_args.model.quantization",
            run.model.quantization_section,
            "a quantised base is made from real weights on rank 0, which a simulated rank does not build; "
            "simulate the unquantised model",
        )
    sizes = strategy.requested_mesh_sizes.resolved(simulation.world_size)
    if sizes.pp > 1 and strategy.is_a(PipelineParallelStrategy):
        per_stage = simulation.world_size // sizes.pp
        if simulation.rank >= per_stage:
            raise ConfigError(
                SIMULATE_RANK_KEY,
                simulation.rank,
                f"a simulated pipeline rank holds the first stage (ranks 0-{per_stage - 1} of {sizes.pp} "
                "stages): a later stage's inputs come from a stage no process runs",
            )
        if strategy.option("schedule") == "interleaved_1f1b":
            raise ConfigError(
                f"{STRATEGY_KEY}.schedule",
                "interleaved_1f1b",
                "an interleaved rank also holds later stages, whose inputs come from stages no process "
                "runs; simulate 1f1b or gpipe",
            )


def check_ckpt_path(ckpt_path: str | os.PathLike | None) -> None:
    """A ``--ckpt_path`` must be a checkpoint Lightning wrote, or one of the names Lightning resolves
    itself (``last``, ``best``, ``hpc``, ``registry...``)."""
    name = str(ckpt_path or "")
    if name and name not in LIGHTNING_CKPT_NAMES and not name.startswith("registry"):
        checkpoint_path("--ckpt_path", name)


def check_accelerator(trainer: TrainerSettings) -> None:
    """A GPU accelerator needs a visible GPU (a study judges it per machine: ``accelerator_present``),
    and another of Lightning's (``mps``, ``tpu``) its device."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    accelerator = trainer.accelerator
    if accelerator in GPU_ACCELERATORS and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.accelerator",
            accelerator,
            "no CUDA device is visible here (torch.cuda.is_available() is False); use cpu or auto",
        )
    if accelerator in AcceleratorRegistry and not AcceleratorRegistry[accelerator]["accelerator"].is_available():
        raise ConfigError("trainer.accelerator", accelerator, f"no {accelerator} device here; use cpu or auto")


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


def check_launched_nodes(trainer: TrainerSettings) -> None:
    """``num_nodes`` above 1 in a process no launcher started: it waited for nodes that never came,
    silently, until killed (a study on SLURM starts every node's process itself)."""
    if trainer.nodes > 1 and not any(os.environ.get(name) for name in NODE_LAUNCH_ENV):
        raise ConfigError(
            "trainer.num_nodes",
            trainer.num_nodes,
            "no launcher started this process on one of the nodes (no NODE_RANK/MASTER_ADDR, torchrun, "
            "SLURM, LSF or MPI variables), so it would wait for the other nodes forever; run it under "
            "srun or torchrun --nnodes on each node, a study with launch.executor: slurm, or use 1",
        )


def check_trainer(trainer: TrainerSettings, fitting: bool) -> None:
    """Trainer values Lightning would refuse with a stack trace once the Trainer is built (an
    accelerator name it does not know, a device or node count below 1), and, when fitting, values
    that fail late or silently: ``accumulate_grad_batches`` below 1 (a division by zero mid-loop),
    ``val_check_interval`` 0 (the same, after the first step), or a run that trains nothing and ends
    "successfully" (``max_steps`` 0, ``max_epochs`` 0, ``limit_train_batches`` 0)."""
    check_placement(trainer)
    if not fitting:
        return
    accumulate = trainer.accumulate_grad_batches
    if isinstance(accumulate, int) and accumulate < 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches", accumulate, "use 1 (no accumulation) or more micro-batches per step"
        )
    max_steps = trainer.max_steps
    if isinstance(max_steps, int) and (max_steps == 0 or max_steps < -1):
        raise ConfigError("trainer.max_steps", max_steps, "train at least 1 step, or -1 to stop by max_epochs")
    if _is_number(trainer.max_epochs) and (trainer.max_epochs == 0 or trainer.max_epochs < -1):
        raise ConfigError(
            "trainer.max_epochs", trainer.max_epochs, "train at least 1 epoch, or -1 to stop by max_steps"
        )
    if _is_number(trainer.limit_train_batches) and trainer.limit_train_batches <= 0:
        raise ConfigError(
            "trainer.limit_train_batches",
            trainer.limit_train_batches,
            "trains nothing; use a positive count of batches, or a fraction of the epoch up to 1.0",
        )
    if _is_number(trainer.gradient_clip_val) and trainer.gradient_clip_val < 0:  # Lightning: no clipping, no word
        raise ConfigError(
            "trainer.gradient_clip_val",
            trainer.gradient_clip_val,
            "use a positive gradient norm to clip at, or 0 / null for no clipping",
        )
    if _is_number(trainer.val_check_interval) and trainer.val_check_interval <= 0:
        raise ConfigError(
            "trainer.val_check_interval",
            trainer.val_check_interval,
            "use a positive count of training batches, or a fraction of the epoch up to 1.0",
        )


def check_placement(trainer: TrainerSettings) -> None:
    """``trainer.accelerator`` names one of Lightning's accelerators (or a class_path), and
    ``devices`` / ``num_nodes`` are counts Lightning can place ranks by."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    accelerator = trainer.accelerator
    names = sorted({*AcceleratorRegistry.available_accelerators(), *GPU_ACCELERATORS, "auto"})
    if isinstance(accelerator, str) and accelerator not in names and "." not in accelerator:
        raise ConfigError("trainer.accelerator", accelerator, f"use one of {', '.join(names)}")
    devices = trainer.devices
    if (
        devices is not None
        and devices not in ("auto", -1, "-1")
        and not _device_ids(devices)
        and (trainer.devices_per_node is None or trainer.devices_per_node < 1)
    ):
        raise ConfigError(
            "trainer.devices",
            devices,
            "use a positive number of devices per node, a list of device ids, -1 (all) or auto",
        )
    nodes = trainer.num_nodes
    if nodes is not None and (not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1):
        raise ConfigError("trainer.num_nodes", nodes, "use a positive number of nodes (1 on one machine)")


def _device_ids(devices: Any) -> bool:
    """A non-empty list of device ids, or their comma-separated string (``"0,1"``)."""
    if isinstance(devices, str) and "," in devices:
        devices = [d.strip() for d in devices.split(",") if d.strip()]
        return bool(devices) and all(d.isdigit() for d in devices)
    return (
        isinstance(devices, list)
        and bool(devices)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

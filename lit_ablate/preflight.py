"""Checks of a parsed ``fit``/``validate``/``test`` config that need nothing built: trainer values
Lightning accepts but cannot run (or runs as nothing), and the paths the run will read or write.

``LitAblateCLI`` calls ``check_ckpt_path`` before it reads the checkpoint and ``check_run_config``
before it instantiates any class, so these mistakes cost a second and one line naming the key, not
a model build followed by a stack trace.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from lit_ablate import record as run_record
from lit_ablate.compatibility import GPU_ACCELERATORS
from lit_ablate.errors import ConfigError
from lit_ablate.path_checks import checkpoint_path, writable_dir, writable_file

LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")
"""``--ckpt_path`` values Lightning resolves to a file itself (with ``registry...``)."""


def check_run_config(subcommand: str, config: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` for the first value of ``config`` (one subcommand's namespace) that
    cannot run: ``check_trainer``, ``check_mesh`` and, for ``fit``, the folders it will write."""
    trainer = config.get("trainer") or {}
    check_trainer(trainer, fitting=subcommand == "fit")
    check_mesh(trainer)
    if subcommand == "fit":  # validate and test write nothing (lit_ablate.terminal)
        check_parts_compatible(config)
        if trainer.get("default_root_dir"):
            writable_dir("trainer.default_root_dir", trainer["default_root_dir"])
        record_path = (config.get("recorder") or {}).get("path")
        if record_path:
            writable_file("recorder.path", record_path)
        elif os.environ.get(run_record.RECORD_PATH_ENV):
            writable_file(run_record.RECORD_PATH_ENV, os.environ[run_record.RECORD_PATH_ENV])


FIT_RULES: dict[str, str | None] = {
    "strategy_accepts_cpu": "trainer.strategy",
    "strategy_options_run_here": "trainer.strategy.init_args",
    "optimizer_runs_here": "model.init_args.optimizer",
    "quantization_runs_under_strategy": "model.init_args.model.quantization",
    "loss_backend_available": "model.init_args.loss",
    "cp_block_kernel_runs_here": "trainer.strategy.init_args.cp_block_kernel",
    "fp8_runs_here": None,
    "preference_parts_fit": None,
    "pipeline_stages_split_the_model": None,
    "pipeline_stages_train_the_objective": None,
}
"""The study compatibility rules (``lit_ablate.compatibility.RULES``) about one run's own parts, and the
key each one names (None: the rule's reason starts with the key it is about, ``key=value: ...``,
as DPO's does for its attention, log-prob backend or data format). The others are about launching a study (devices, nodes) or are checked when the
model is constructed, before any rank starts (attention backends). The loss backend's rule is here
too: besides what its construction checks, it knows what other parts refuse it (CCE's compiled
backward under MemoryMonitor's tensor tracker)."""


def check_parts_compatible(config: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` when a part cannot run with another or here: an optimizer the strategy's
    parameters or the memory tracker refuse, a quantised base the strategy cannot shard, a strategy or
    strategy option this device lacks. The same rules skip such variants in studies; here they stop
    ``fit`` before any rank starts or any model is built, in one line, instead of at step 1."""
    from types import SimpleNamespace

    from lit_ablate.compatibility import RULES
    from lit_ablate.config_keys import get_dotted

    plain = config.as_dict() if hasattr(config, "as_dict") else config
    launch = SimpleNamespace(devices=None, num_nodes=None, accelerator=None)  # the config's own trainer values
    for rule, key in FIT_RULES.items():
        reason = RULES[rule](plain, launch)
        if reason:
            named = key or re.match(r"[\w.]+", reason).group()
            fix = re.sub(rf"^{re.escape(named)}(=[^:]*)?: ", "", reason)  # the rule's own "key=value: " prefix
            raise ConfigError(named, get_dotted(plain, named), fix)


def check_mesh(trainer: Mapping[str, Any]) -> None:
    """A mesh strategy's sizes must make the world size (devices x nodes). Checked here, before
    Lightning starts the ranks: the strategy itself can only check once every rank runs."""
    strategy = trainer.get("strategy")
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    devices = int(devices) if isinstance(devices, str) and devices.isdigit() else devices  # `--trainer.devices 2`
    if not (hasattr(strategy, "get") and strategy.get("class_path")) or not isinstance(devices, int) or isinstance(devices, bool):
        return  # a strategy by name, or devices Lightning counts itself ("auto", a list of ids)
    from lit_ablate.strategies.mesh import MESH_DIMS, MeshStrategy, resolve_mesh_sizes

    module, _, name = strategy["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if not issubclass(cls, MeshStrategy):
        return
    init_args = strategy.get("init_args") or {}
    resolve_mesh_sizes({dim: init_args[dim] for dim in MESH_DIMS if init_args.get(dim) is not None}, devices * nodes)


def check_ckpt_path(ckpt_path: str | os.PathLike | None) -> None:
    """A ``--ckpt_path`` must be a checkpoint Lightning wrote, or one of the names Lightning resolves
    itself (``last``, ``best``, ``hpc``, ``registry...``)."""
    name = str(ckpt_path or "")
    if name and name not in LIGHTNING_CKPT_NAMES and not name.startswith("registry"):
        checkpoint_path("--ckpt_path", name)


def check_trainer(trainer: Mapping[str, Any], fitting: bool) -> None:
    """Trainer values that fail late or silently: no GPU for a GPU accelerator, and (when fitting)
    ``accumulate_grad_batches`` below 1 (a division by zero mid-loop) or ``max_steps`` 0 (a
    "successful" run that trains nothing)."""
    accelerator = trainer.get("accelerator")
    if accelerator in GPU_ACCELERATORS and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator", accelerator,
                          "no CUDA device is visible here (torch.cuda.is_available() is False); use cpu or auto")
    if not fitting:
        return
    accumulate = trainer.get("accumulate_grad_batches")
    if isinstance(accumulate, int) and accumulate < 1:
        raise ConfigError("trainer.accumulate_grad_batches", accumulate, "use 1 (no accumulation) or more micro-batches per step")
    max_steps = trainer.get("max_steps")
    if isinstance(max_steps, int) and (max_steps == 0 or max_steps < -1):
        raise ConfigError("trainer.max_steps", max_steps, "train at least 1 step, or -1 to stop by max_epochs")

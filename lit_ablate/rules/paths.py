"""The files and folders the run will read or write, checked before any rank starts. A study's runs read and
write its folders, which its cluster's nodes share, so these judge a study on SLURM too."""

from __future__ import annotations

import os
from pathlib import Path

from lit_ablate import record as run_record
from lit_ablate.errors import Refusal
from lit_ablate.path_checks import (
    checkpoint_path,
    is_deepspeed_checkpoint,
    saved_file,
    writable_dir,
    writable_file,
)
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import RunConfig

LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")
"""``--ckpt_path`` values Lightning resolves to a file itself (with ``registry...``)."""


@rule(Scope.MACHINE, Scope.CLUSTER)
def outputs_writable(run: RunConfig) -> Refusal | None:
    """``fit``'s folders and files: ``trainer.default_root_dir`` and the run record's path (nothing is created
    to find out). Validate and test write nothing."""
    if not run.fits:
        return None
    if run.trainer.default_root_dir:
        refusal = refusal_of(writable_dir, "trainer.default_root_dir", run.trainer.default_root_dir)
        if refusal:
            return refusal
    if run.record_path:
        return refusal_of(writable_file, "recorder.path", run.record_path)
    if os.environ.get(run_record.RECORD_PATH_ENV):
        return refusal_of(writable_file, run_record.RECORD_PATH_ENV, os.environ[run_record.RECORD_PATH_ENV])
    return None


@rule(Scope.MACHINE, Scope.CLUSTER)
def token_cache_writable(run: RunConfig) -> Refusal | None:
    """The token cache's folder (under a regular file it failed with ``NotADirectoryError`` at data set-up)."""
    from lightning.pytorch import LightningDataModule

    from lit_ablate.data.token_cache import CACHE_DIR_ENV, cache_root

    data = run.data.module
    if data is None or not data.is_a(LightningDataModule):
        return None
    storage, given = data.option("storage", "auto"), data.option("cache_dir")
    from_env = os.environ.get(CACHE_DIR_ENV)
    if storage == "cache" or (storage == "auto" and (given or from_env)):
        key = "data.init_args.cache_dir" if given or not from_env else CACHE_DIR_ENV
        return refusal_of(writable_dir, key, cache_root(given))
    return None


@rule(Scope.MACHINE, Scope.CLUSTER)
def reference_cache_loads(run: RunConfig) -> Refusal | None:
    """DPO's reference cache is a file a run wrote (a corrupt one reached the user as torch's
    ``UnpicklingError``)."""
    reference_cache = run.model.option("reference_cache")
    if not reference_cache or run.model.option("reference") != "precomputed":
        return None
    return refusal_of(
        saved_file,
        "model.init_args.reference_cache",
        reference_cache,
        ("pairs_sha256", "logps"),
        "delete it (the run computes the log-probs again and rewrites it), or give another path",
    )


@rule(Scope.MACHINE, Scope.CLUSTER)
def checkpoint_is_a_checkpoint(run: RunConfig) -> Refusal | None:
    """``--ckpt_path`` is a checkpoint Lightning wrote, or a name Lightning resolves itself (``last``, ``best``,
    ``hpc``, ``registry...``); ``LitAblateCLI`` asks this before it reads the checkpoint's model."""
    from lit_ablate.strategies.deepspeed import DeepSpeedStrategy

    path = run.ckpt_path
    if not path or path in LIGHTNING_CKPT_NAMES or path.startswith("registry"):
        return None
    return refusal_of(checkpoint_path, "--ckpt_path", path, run.trainer.strategy.is_a(DeepSpeedStrategy))


@rule(Scope.MACHINE, Scope.CLUSTER)
def checkpoint_layout_fits_strategy(run: RunConfig) -> Refusal | None:
    """``--ckpt_path`` in a layout the run's strategy reads: every strategy reads a sharded folder (mesh
    strategies their shards of it, the others the folder whole: ``WholeCheckpointIO``), and the pipeline
    strategy, whose ranks each load their stages, resumes from such a folder only; DeepSpeed's engine reads
    only its own folders."""
    from lit_ablate.strategies.deepspeed import DeepSpeedStrategy
    from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy

    path = run.ckpt_path
    if not path or path in LIGHTNING_CKPT_NAMES or path.startswith("registry"):
        return None
    strategy = run.trainer.strategy
    if not Path(path).expanduser().is_dir() and strategy.is_a(PipelineParallelStrategy):
        return Refusal(
            "--ckpt_path",
            path,
            "a pipeline-parallel run resumes from the sharded checkpoint folder such a run saves; give that folder",
        )
    if strategy.is_a(DeepSpeedStrategy) and not is_deepspeed_checkpoint(path):
        return Refusal(
            "--ckpt_path", path, "DeepSpeedStrategy resumes from the DeepSpeed checkpoint folder such a run saves"
        )
    return None

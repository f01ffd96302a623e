"""Whether a checkpoint continues under this run's layout, judged before any rank starts.

A mesh strategy's checkpoint is a DCP folder that any mesh, or one process, reads back resharded
(``strategies/whole_checkpoint.py``), and the data continues from the same item on any number of
data-parallel ranks (``data/resume_position.py``). What cannot continue is refused here, from the
checkpoint's metadata alone, in one line: a global batch other than the checkpoint's (naming the key
and the value that keep it), a stream on other data-parallel ranks, and a quantised base's shards on
another mesh (bitsandbytes packs each weight whole, its quantisation state beside it, and DCP can cut
neither), and a DeepSpeed folder on another number of ranks (its engine reads each rank's own partitions).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from lit_ablate.data.resume_position import DataLayout, check_resumable
from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.path_checks import SHARDED_METADATA_FILENAME, deepspeed_states_file, is_deepspeed_checkpoint
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import RunConfig
from lit_ablate.strategies.mesh import DATA_PARALLEL_DIMS, MESH_LAYOUT_KEY


@rule(Scope.MACHINE, Scope.CLUSTER)
def checkpoint_continues_on_this_layout(run: RunConfig) -> Refusal | None:
    """``--ckpt_path`` continues on this run's layout (``check_resume_layout``): read from the checkpoint's
    metadata on this machine's disk."""
    return refusal_of(check_resume_layout, run.subcommand, run)


def check_resume_layout(subcommand: str, run: RunConfig) -> None:
    """Raise ``ConfigError`` when ``run`` cannot continue its ``--ckpt_path`` on its own layout."""
    metadata = checkpoint_metadata(run.ckpt_path) if run.ckpt_path else None
    if metadata is None:
        return
    saved_ranks = metadata.get(DEEPSPEED_RANKS_KEY)
    if saved_ranks is not None and saved_ranks != run.world_size:
        raise ConfigError(
            "--ckpt_path",
            run.ckpt_path,
            f"DeepSpeed wrote it on {saved_ranks} ranks, each its own partitions, and this run has "
            f"{run.world_size}: resume on {saved_ranks} ranks",
        )
    saved_mesh, mesh = metadata.get(MESH_LAYOUT_KEY), mesh_layout(run)
    if Path(run.ckpt_path).is_dir() and run.model.quantization_section is not None and saved_mesh != mesh:
        raise ConfigError(
            "--ckpt_path",
            run.ckpt_path,
            f"a sharded checkpoint of a quantised base, written on the mesh {saved_mesh}, which this run would "
            f"read on {mesh or 'one whole model'}: its packed weights and their quantisation state do not "
            "reshard; resume on the mesh that wrote it",
        )
    data_class = run.data.module.cls if run.data.module is not None else None
    saved_data = metadata.get(getattr(data_class, "__qualname__", None))
    if subcommand == "fit" and isinstance(saved_data, dict):
        check_resumable(saved_data, data_layout(run), stream=run.data.module.option("storage") == "stream")


DEEPSPEED_RANKS_KEY = "dp_world_size"
"""A DeepSpeed checkpoint's data-parallel ranks (each saved its own partitions)."""


def checkpoint_metadata(ckpt_path: str | Path) -> dict[str, Any] | None:
    """Everything but the tensors of a checkpoint: a sharded folder's ``meta.pt``, or a ``.ckpt`` file (or a
    DeepSpeed folder's states file) mapped into memory (its tensors are not read); None for a name Lightning
    resolves (``last``)."""
    path = Path(ckpt_path)
    if path.is_dir() and is_deepspeed_checkpoint(path):
        path = deepspeed_states_file(path)
    elif path.is_dir():
        return torch.load(path / SHARDED_METADATA_FILENAME, map_location="cpu", weights_only=True)
    if not path.is_file():
        return None
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    tensors = ("state_dict", "optimizer_states", "module", "optimizer")
    return {key: value for key, value in checkpoint.items() if key not in tensors}


def mesh_layout(run: RunConfig) -> dict[str, int] | None:
    """The mesh sizes ``run``'s strategy builds on its ranks; None for a strategy without a mesh."""
    sizes = run.trainer.strategy.requested_mesh_sizes
    return None if sizes is None else dict(sizes.resolved(run.world_size))


def data_layout(run: RunConfig) -> DataLayout:
    """``run``'s data-parallel ranks (a mesh's ``dp_replicate x dp_shard x ep``, else every rank),
    micro-batch and accumulation."""
    mesh = mesh_layout(run)
    ranks = math.prod(mesh[d] for d in DATA_PARALLEL_DIMS) if mesh is not None else run.world_size
    batch_size = run.data.batch_size or run.data.module.option("batch_size")
    return DataLayout(ranks, int(batch_size), run.trainer.accumulation)

"""A sharded checkpoint read whole, in one process: how a strategy that holds whole tensors (one
process, DDP) resumes a mesh strategy's checkpoint, and how ``export`` and ``generate`` read one.

A mesh strategy saves a DCP folder (``torch.distributed.checkpoint``): every rank writes its shards,
and the folder's metadata records each tensor's global shape and where every shard lies, under the
parameter's name. That is what makes a checkpoint independent of the layout that wrote it: a mesh
strategy loading it asks DCP for its own shards (Lightning's loader, ``pipeline_checkpoint``), and one
process asks for the whole tensors, as torch's ``dcp_to_torch_save`` does, with no process group.
The optimizer's state comes back keyed by parameter name (``get_optimizer_state_dict``'s form);
a strategy that loads with ``Optimizer.load_state_dict`` needs it keyed by position in its
optimizer's groups, which only the module that builds the optimizer knows: ``by_position``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_ablate.path_checks import SHARDED_METADATA_FILENAME

MODEL_KEY = "state_dict"
OPTIMIZER_PREFIX = "optimizer_"
"""How Lightning's mesh strategies name the optimizers' entries in a DCP folder (``optimizer_0``, ...)."""


def read_whole(folder: str | Path, weights_only: bool | None = True, optimizer: bool = True) -> dict[str, Any]:
    """The sharded checkpoint ``folder`` as Lightning's single-file checkpoint holds it: ``meta.pt``'s
    entries (loops, schedulers, callbacks, data position, hyper-parameters), the model's whole tensors
    under ``state_dict`` and, unless ``optimizer`` is false (inference), each optimizer's state under
    ``optimizer_states``, keyed by parameter name."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(folder)
    checkpoint = torch.load(folder / SHARDED_METADATA_FILENAME, map_location="cpu", weights_only=weights_only)
    tensors: dict[str, Any] = {}
    # The empty planner reads every entry the metadata lists, at its global shape (torch's own
    # dcp_to_torch_save); torch warns about the missing process group even with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        planner = _EmptyStateDictLoadPlanner(keys=None if optimizer else {MODEL_KEY})
        _load_state_dict(tensors, storage_reader=FileSystemReader(folder), planner=planner, no_dist=True)
    optimizers = sorted((k for k in tensors if k.startswith(OPTIMIZER_PREFIX)), key=lambda k: int(k.split("_")[1]))
    return {**checkpoint, MODEL_KEY: tensors.get(MODEL_KEY, {}), "optimizer_states": [tensors[k] for k in optimizers]}


def keyed_by_name(optimizer_state: dict[str, Any]) -> bool:
    """Whether an optimizer state is in ``get_optimizer_state_dict``'s form (keyed by parameter name)."""
    return any(isinstance(key, str) for key in optimizer_state.get("state", {}))


def by_position(optimizer_state: dict[str, Any], group_names: Sequence[Sequence[str]]) -> dict[str, Any]:
    """A name-keyed optimizer state as ``Optimizer.load_state_dict`` takes it: the parameters of group
    ``g`` are ``group_names[g]`` in the optimizer's order, numbered across groups. The groups' settings
    (learning rate, betas, decay) are the saved ones; under a pipeline DCP kept one stage's copy of the
    groups, whose settings every stage shares, so the parameters' names come from ``group_names``."""
    saved = optimizer_state["param_groups"]
    if len(saved) != len(group_names):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this run's {len(group_names)}")
    numbers = {name: index for index, name in enumerate(n for names in group_names for n in names)}
    missing = [name for name in numbers if name not in optimizer_state["state"]]
    if missing:
        raise KeyError(f"the checkpoint's optimizer holds no state for {missing[0]} ({len(missing)} parameters)")
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [numbers[n] for n in names]}
        for group, names in zip(saved, group_names, strict=True)
    ]
    return {"state": {numbers[name]: optimizer_state["state"][name] for name in numbers}, "param_groups": groups}


class WholeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint files, and sharded folders read whole (``read_whole``): the reader of a
    strategy that holds whole tensors, so that it resumes a mesh strategy's checkpoint. The CLI gives it
    to such a run when ``--ckpt_path`` is a folder; saving is Lightning's, unchanged."""

    def load_checkpoint(self, path: str | Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if Path(path).is_dir():
            weights_only = kwargs.get("weights_only")
            return read_whole(path, weights_only=True if weights_only is None else weights_only)
        return super().load_checkpoint(path, *args, **kwargs)

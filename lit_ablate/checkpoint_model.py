"""Whether a checkpoint's model is the config's model (``--ckpt_path`` with a config).

LightningCLI reads the checkpoint's hyper-parameters and lets them replace the config's model
section without a word: a tiny-llama config resumed from a tiny-qwen3 checkpoint trains
tiny-qwen3, and a changed ``--model.init_args.loss`` is ignored. lit-ablate refuses instead:
both must describe the same model, and a difference is one error line naming every differing
key with both values. Equal up to how a module stores its arguments counts as the same: the
class by what its ``class_path`` imports, and ``null`` the same as an empty mapping (``CausalLM``
stores ``loss_options: null`` as ``{}``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lit_ablate.class_paths import import_class
from lit_ablate.config_keys import flatten
from lit_ablate.errors import ConfigError
from lit_ablate.path_checks import SHARDED_METADATA_FILENAME

DIFFERENCES_SHOWN = 6


def checkpoint_model_section(ckpt_path: str | Path) -> dict[str, Any] | None:
    """The checkpoint's hyper-parameters as a config ``model:`` section, as LightningCLI reads them
    (``_class_path`` -> ``class_path`` + ``dict_kwargs``); from a ``.ckpt`` file or a sharded folder's
    ``meta.pt``. None when there is no such file (``last``, ``best``: Lightning's) or no hyper-parameters."""
    path = Path(ckpt_path)
    file = path / SHARDED_METADATA_FILENAME if path.is_dir() else path
    if not file.is_file():
        return None
    hparams = dict(torch.load(file, weights_only=True, map_location="cpu").get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    if not hparams:
        return None
    if "_class_path" in hparams:
        return {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
    return hparams


def model_differences(
    config_model: Mapping[str, Any], checkpoint_model: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """``{dotted key under model: (config value, checkpoint value)}`` for every leaf that differs."""
    mine, theirs = _normalised(config_model), _normalised(checkpoint_model)
    return {
        key: (mine.get(key), theirs.get(key)) for key in sorted({*mine, *theirs}) if mine.get(key) != theirs.get(key)
    }


def check_same_model(config_model: Mapping[str, Any], checkpoint_model: Mapping[str, Any], ckpt_path: str) -> None:
    """Raise ``ConfigError`` (one line, every differing key) when the checkpoint's model is not the config's."""
    differences = model_differences(config_model, checkpoint_model)
    if not differences:
        return
    shown = [
        f"model.{key} (config {mine!r}, checkpoint {theirs!r})"
        for key, (mine, theirs) in list(differences.items())[:DIFFERENCES_SHOWN]
    ]
    more = f" and {len(differences) - DIFFERENCES_SHOWN} more" if len(differences) > DIFFERENCES_SHOWN else ""
    raise ConfigError(
        "--ckpt_path",
        str(ckpt_path),
        f"the checkpoint's model differs from the config's in {'; '.join(shown)}{more}. Lightning would silently "
        "train the checkpoint's; make the config's model section match the checkpoint's, or drop --ckpt_path",
    )


def _normalised(section: Mapping[str, Any]) -> dict[str, Any]:
    flat = {key: None if value == {} else value for key, value in flatten(dict(section)).items()}
    flat = {key: value for key, value in flat.items() if value is not None}
    for key, value in flat.items():
        if key.endswith("class_path") and isinstance(value, str):
            flat[key] = _imported_name(value)
    return flat


def _imported_name(class_path: str) -> str:
    """``lit_ablate.modules.CausalLM`` and ``lit_ablate.modules.causal_lm.CausalLM`` name one class."""
    try:
        cls = import_class(class_path)
    except ImportError:
        return class_path
    return f"{cls.__module__}.{cls.__qualname__}"

"""Building a Hugging Face causal LM from YAML: a preset, a config mapping, or a checkpoint.

``ModelFactory`` is what a config names under ``model.init_args.model``; it knows nothing of
parallelism. Random initialisation draws from torch's global RNG, which the CLI seeds from
``seed_everything``, so every rank (and every variant of a study) starts from the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import lit_ablate.models.attention  # noqa: F401  (registers sdpa_packed, flex, fa_varlen with transformers)
from lit_ablate.errors import ConfigError
from lit_ablate.models.moe import MoEOptions, apply_moe
from lit_ablate.models.presets import preset_config

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelFactory:
    """Which model to build and how.

    Args:
        preset: a named tiny shape from ``lit_ablate.models.presets`` (e.g. ``tiny-qwen3``).
        config: a Hugging Face config mapping (``model_type`` and sizes); with a preset, its keys
            override the preset's.
        pretrained: a local checkpoint directory (works offline) or a hub name (needs network);
            excludes ``preset``/``config``.
        dtype: parameter dtype: ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: the transformers attention backend name (``sdpa``, ``eager``, or one
            registered by ``lit_ablate.models.attention``: ``sdpa_packed``, ``flex``, ``fa_varlen``).
        moe: for MoE models, the experts implementation and router losses (``MoEOptions``);
            null leaves transformers' own MoE blocks untouched.
    """

    preset: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    moe: MoEOptions | None = None

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from a checkpoint's plain-dict hyperparameters
            self.moe = MoEOptions(**self.moe)
        if self.pretrained and (self.preset or self.config):
            raise ConfigError("model.init_args.model.pretrained", self.pretrained, "give either pretrained or preset/config, not both")
        if not (self.pretrained or self.preset or self.config):
            raise ConfigError("model.init_args.model", None, "set preset, config (with model_type) or pretrained")
        if self.pretrained and _looks_local(self.pretrained) and not Path(self.pretrained).expanduser().is_dir():
            raise ConfigError("model.init_args.model.pretrained", self.pretrained,
                              "no such directory: give a local checkpoint folder (save_pretrained / lit-ablate "
                              "export) or a hub name such as Qwen/Qwen3-0.6B")
        if self.dtype not in DTYPES:
            raise ConfigError("model.init_args.model.dtype", self.dtype, f"choose one of {sorted(DTYPES)}")
        if self.preset is not None:
            preset_config(self.preset)  # fails early on an unknown name
        model_type = self.config.get("model_type") or (preset_config(self.preset)["model_type"] if self.preset else None)
        if not self.pretrained and model_type not in CONFIG_MAPPING:
            raise ConfigError(
                "model.init_args.model.config.model_type", model_type, "use a transformers model type such as llama, qwen3, qwen3_moe, mixtral"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def hf_config(self) -> PretrainedConfig:
        """The transformers config this factory builds, without building weights."""
        if self.pretrained:
            with _pretrained_errors(self.pretrained):
                config = AutoConfig.from_pretrained(self.pretrained)
        else:
            values = {**(preset_config(self.preset) if self.preset else {}), **self.config}
            model_type = values.pop("model_type")
            try:
                config = AutoConfig.for_model(model_type, **values)
            except (TypeError, ValueError) as err:
                raise ConfigError("model.init_args.model.config", values, f"transformers rejected it: {err}") from err
        config._attn_implementation = self.attn_implementation
        return config

    def build(self) -> PreTrainedModel:
        """The model: random init from the current RNG state, or the checkpoint's weights."""
        if self.pretrained:
            with _pretrained_errors(self.pretrained):
                model = AutoModelForCausalLM.from_pretrained(
                    self.pretrained, dtype=self.torch_dtype, attn_implementation=self.attn_implementation
                )
        else:
            model = AutoModelForCausalLM.from_config(self.hf_config(), attn_implementation=self.attn_implementation)
            model = model.to(self.torch_dtype)
        if self.moe is not None:
            apply_moe(model, self.moe)
        return model


def _looks_local(name: str) -> bool:
    """A filesystem path rather than a hub name (``org/name``)."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


@contextmanager
def _pretrained_errors(name: str) -> Iterator[None]:
    """transformers' loading errors (no such hub repo, no network, not a model folder) as one line."""
    try:
        yield
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError("model.init_args.model.pretrained", name,
                          f"transformers could not load it ({first}); check the folder, or the network for a hub name") from err

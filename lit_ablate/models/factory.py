"""Building a Hugging Face causal LM from YAML: a preset, a config mapping, or a checkpoint.

``ModelFactory`` is what a config names under ``model.init_args.model``; it knows nothing of
parallelism. Random initialisation draws from torch's global RNG, which the CLI seeds from
``seed_everything``, so every rank (and every variant of a study) starts from the same weights.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import lit_ablate.models.attention.backends  # noqa: F401  (registers our attention backends with transformers)
from lit_ablate.errors import ConfigError
from lit_ablate.models.adapters.lora import ADAPTER_KEY, AdapterOptions, apply_adapters
from lit_ablate.models.adapters.quantization import QUANTIZATION_KEY, QuantizationOptions, quantize_linears
from lit_ablate.models.fp8.conversion import FP8_KEY, Fp8Options, convert_fp8, resolve_emulation
from lit_ablate.models.moe.blocks import MoEOptions, apply_moe
from lit_ablate.models.presets import preset_config
from lit_ablate.path_checks import looks_local

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONFIG_KEY = "model.init_args.model.config"
SIZE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "max_position_embeddings",
)
"""Config sizes that must be positive integers when given: transformers accepts 0 or negative values
and the model then fails (or trains nothing) deep inside its first step."""


@dataclass
class ModelFactory:
    """Which model to build and how.

    Args:
        preset: a named tiny shape from ``lit_ablate.models.presets`` (e.g. ``tiny-qwen3``).
        config: a Hugging Face config mapping (``model_type`` and sizes); with a preset, its keys
            override the preset's. Or the path of a ``config.json`` (or of a folder holding one, as
            ``save_pretrained`` and hub checkpoints lay it out): that architecture with random weights,
            "bring your own architecture" without pasting it inline.
        pretrained: a local checkpoint directory (works offline) or a hub name (needs network);
            excludes ``preset``/``config``.
        dtype: parameter dtype: ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: the transformers attention backend name (``sdpa``, ``eager``, or one
            registered by ``lit_ablate.models.attention.backends``: ``sdpa_packed``, ``flex``, ``fa_varlen``,
            ``torch_varlen``).
        moe: for MoE models, the experts implementation and router losses (``MoEOptions``);
            null leaves transformers' own MoE blocks untouched.
        adapter: train low-rank adapters (peft LoRA/DoRA/rsLoRA, ``AdapterOptions``) on the frozen
            model instead of the model itself; null trains every weight.
        quantization: store the frozen base's linear layers in bitsandbytes 4-bit or 8-bit
            (``QuantizationOptions``; with an adapter: QLoRA); null keeps ``dtype``. Needs ``adapter``.
        fp8: train the linear layers' matmuls in fp8 (torchao float8 recipes, ``Fp8Options``;
            emulated where no fp8 kernel runs); null computes in ``dtype``.
    """

    preset: str | None = None
    config: dict[str, Any] | str = field(default_factory=dict)
    pretrained: str | None = None
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    moe: MoEOptions | None = None
    adapter: AdapterOptions | None = None
    quantization: QuantizationOptions | None = None
    fp8: Fp8Options | None = None

    def __post_init__(self) -> None:
        # jsonargparse (4.53), for a dataclass inside a class_path's init_args, turns a dotted
        # ``--model.init_args.model.preset null`` into the string "None"; no preset or hub name is
        # called that, so it is read as the null it was.
        self.preset, self.pretrained = (None if v == "None" else v for v in (self.preset, self.pretrained))
        if isinstance(self.moe, dict):  # from a checkpoint's plain-dict hyperparameters
            self.moe = MoEOptions(**self.moe)
        if isinstance(self.adapter, dict):
            self.adapter = AdapterOptions(**self.adapter)
        if isinstance(self.quantization, dict):
            self.quantization = QuantizationOptions(**self.quantization)
        if isinstance(self.fp8, dict):
            self.fp8 = Fp8Options(**self.fp8)
        if self.fp8 is not None and self.fp8.emulate is False and not torch.cuda.is_available():
            resolve_emulation(self.fp8, torch.device("cpu"))  # no fp8 kernel anywhere here: refused before any build
        if self.fp8 is not None and self.quantization is not None:
            raise ConfigError(
                FP8_KEY,
                asdict(self.fp8),
                f"fp8 and {QUANTIZATION_KEY} both replace the base's linear "
                "layers; choose one (fp8 + LoRA trains adapters over an fp8 base)",
            )
        if self.quantization is not None and self.adapter is None:
            raise ConfigError(
                QUANTIZATION_KEY,
                asdict(self.quantization),
                f"quantised weights are frozen and cannot train: add an {ADAPTER_KEY} section (QLoRA), "
                "or drop quantization",
            )
        if self.pretrained and (self.preset or self.config):
            raise ConfigError(
                "model.init_args.model.pretrained", self.pretrained, "give either pretrained or preset/config, not both"
            )
        if not (self.pretrained or self.preset or self.config):
            raise ConfigError("model.init_args.model", None, "set preset, config (with model_type) or pretrained")
        if self.pretrained and looks_local(self.pretrained) and not Path(self.pretrained).expanduser().is_dir():
            raise ConfigError(
                "model.init_args.model.pretrained",
                self.pretrained,
                "no such directory: give a local checkpoint folder (save_pretrained / lit-ablate "
                "export) or a hub name such as Qwen/Qwen3-0.6B",
            )
        if self.dtype not in DTYPES:
            raise ConfigError("model.init_args.model.dtype", self.dtype, f"choose one of {sorted(DTYPES)}")
        if self.preset is not None:
            preset_config(self.preset)  # fails early on an unknown name
        if isinstance(self.config, str) and self.preset is not None:
            raise ConfigError(
                CONFIG_KEY,
                self.config,
                "a config file is a whole architecture, which a preset's keys would not override: set "
                "model.init_args.model.preset: null",
            )
        model_type = self._config_values().get("model_type")
        if not self.pretrained and model_type not in CONFIG_MAPPING:
            raise ConfigError(
                "model.init_args.model.config.model_type",
                model_type,
                "use a transformers model type such as llama, qwen3, qwen3_moe, mixtral",
            )
        if not self.pretrained:
            check_model_shape(model_type, self._config_values())
            self.hf_config()  # what transformers itself rejects, also before any build
        if (self.fp8 is not None or self.adapter is not None) and not self.pretrained:
            # On a meta copy, before any real build or rank: what fp8 cannot convert (sizes, experts),
            # adapter target_modules that match nothing.
            with torch.device("meta"):
                model = self._build_base()
                if self.fp8 is not None:
                    convert_fp8(model, self.fp8, emulate=True)
                if self.adapter is not None:
                    apply_adapters(model, self.adapter)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def hf_config(self) -> PretrainedConfig:
        """The transformers config this factory builds, without building weights."""
        if self.pretrained:
            with _pretrained_errors(self.pretrained):
                config = AutoConfig.from_pretrained(self.pretrained)
        elif isinstance(self.config, str):
            config = config_file(self.config)
        else:
            values = self._config_values()
            model_type = values.pop("model_type")
            try:
                config = AutoConfig.for_model(model_type, **values)
            except (TypeError, ValueError, StrictDataclassError) as err:
                reason = str(err).strip().splitlines()[-1].strip() if str(err).strip() else type(err).__name__
                raise ConfigError(CONFIG_KEY, self.config, f"transformers rejected it: {reason}") from err
            _check_known_keys(config, values)
        config._attn_implementation = self.attn_implementation
        return config

    def _config_values(self) -> dict[str, Any]:
        """The preset's config mapping with ``config`` applied over it, or the config file's."""
        if isinstance(self.config, str):
            return config_file(self.config).to_dict()
        return {**(preset_config(self.preset) if self.preset else {}), **self.config}

    def build(self, with_adapters: bool = True, device: torch.device | None = None) -> PreTrainedModel:
        """The model: random init from the current RNG state, or the checkpoint's weights; then MoE
        blocks, quantised or fp8 linear layers and adapters, in that order (``with_adapters=False``:
        the frozen base alone, for peft's own ``PeftModel`` at export). ``device`` is where the model
        will train: it decides whether fp8 is emulated (default: the current CUDA device, else CPU).

        A quantised model is built with real weights even where a sharding strategy asks for the
        ``meta`` device (ranks other than 0): quantisation must read the weights, and it is done
        once, before sharding. Every rank then holds the same quantised weights (the same seed or
        checkpoint), and the strategy still copies rank 0's state into every shard.
        """
        if self.quantization is None:
            model = self._build_base()
        else:
            with torch.device("cpu"):
                model = self._build_base()
                quantize_linears(model, self.quantization)
        if self.fp8 is not None:
            if device is None:
                device = (
                    torch.device("cuda", torch.cuda.current_device())
                    if torch.cuda.is_available()
                    else torch.device("cpu")
                )
            convert_fp8(model, self.fp8, emulate=resolve_emulation(self.fp8, device)[0])
        if self.adapter is not None and with_adapters:
            apply_adapters(model, self.adapter)
        return model

    def _build_base(self) -> PreTrainedModel:
        # On ``meta`` (a mesh strategy's ranks other than 0, whose shards receive rank 0's loaded
        # weights) only the shapes are built: transformers refuses from_pretrained there.
        # ``use_kernels=False``: from transformers 5.25 a loaded checkpoint on a GPU gets Hub kernels
        # (Liger's RMSNorm, a rotary kernel, inference-only activations, downloaded at load time)
        # swapped in by default: a variant would run kernels its config does not name, and a model
        # built from the same config would not. Kernels are parts a study varies, never added behind it.
        if self.pretrained and torch.get_default_device().type != "meta":
            with _pretrained_errors(self.pretrained):
                model = AutoModelForCausalLM.from_pretrained(
                    self.pretrained,
                    dtype=self.torch_dtype,
                    attn_implementation=self.attn_implementation,
                    use_kernels=False,
                )
        else:
            model = AutoModelForCausalLM.from_config(self.hf_config(), attn_implementation=self.attn_implementation)
            model = model.to(self.torch_dtype)
        if self.moe is not None:
            apply_moe(model, self.moe)
        return model


_SHARED_MODELING = ("transformers.modeling_utils", "transformers.modeling_rope_utils", "transformers.masking_utils")
"""transformers' modules that read a config's keys for every model type (besides the type's own)."""


def _check_known_keys(config: PretrainedConfig, values: Mapping[str, Any]) -> None:
    """A key the config class does not know is kept by transformers as a plain attribute: unless
    model code reads it, a typo (``hidden_sise``) trains the default size, and a study varying it
    measures one model N times. Known: what a default config holds, its aliases, what the class
    consumes into other fields (``rope_theta`` into ``rope_parameters``), and any key the model
    type's modeling code or transformers' shared code reads (Qwen3-MoE reads ``head_dim`` with
    ``getattr``, its config does not declare it)."""
    cls = type(config)
    defaults, held = set(cls().to_dict()), config.to_dict()
    unknown = [k for k in values if k in held and k not in defaults and k not in getattr(cls, "attribute_map", {})]
    if not unknown:
        return
    read = _keys_read_by_model_code(cls)
    for key in unknown:
        if key not in read:
            close = difflib.get_close_matches(key, sorted(defaults), n=1)
            hint = f"did you mean {close[0]}?" if close else f"{cls.__name__}'s keys are {sorted(defaults)}"
            raise ConfigError(
                f"{CONFIG_KEY}.{key}", values[key], f"{cls.__name__} has no such key and no model code reads it; {hint}"
            )


@functools.cache
def _keys_read_by_model_code(config_class: type) -> frozenset[str]:
    """Every ``config.<key>`` and ``getattr(config, "<key>"...)`` in the config class's modeling module
    and transformers' shared modeling code."""
    names = [config_class.__module__.replace(".configuration_", ".modeling_"), *_SHARED_MODELING]
    sources = [inspect.getsource(importlib.import_module(name)) for name in names if importlib.util.find_spec(name)]
    pattern = re.compile(r"config\.(\w+)|getattr\(\s*\w*config\w*\s*,\s*[\"'](\w+)[\"']")
    return frozenset(a or b for source in sources for a, b in pattern.findall(source))


def check_model_shape(model_type: str, values: Mapping[str, Any]) -> None:
    """Sizes that cannot make a model, refused before transformers sees them: non-positive sizes,
    no decoder layer, key/value heads that do not split the query heads, a hidden size the heads
    do not divide (when the model type derives ``head_dim`` from it), more routed experts per
    token than experts."""
    for key in SIZE_KEYS:
        value = values.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            need = "a model needs at least 1 decoder layer" if key == "num_hidden_layers" else "use a positive integer"
            raise ConfigError(f"{CONFIG_KEY}.{key}", value, need)
    heads, kv_heads, hidden = (
        values.get("num_attention_heads"),
        values.get("num_key_value_heads"),
        values.get("hidden_size"),
    )
    if heads and kv_heads and heads % kv_heads:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(
            f"{CONFIG_KEY}.num_key_value_heads",
            kv_heads,
            f"must divide num_attention_heads={heads} (each key/value head serves a group of query heads); "
            f"use one of {divisors}",
        )
    if heads and hidden and hidden % heads and values.get("head_dim") is None and _derives_head_dim(model_type):
        raise ConfigError(
            f"{CONFIG_KEY}.hidden_size",
            hidden,
            f"must be a multiple of num_attention_heads={heads} ({model_type} uses head_dim = hidden_size / "
            f"heads); use {hidden - hidden % heads} or {hidden - hidden % heads + heads}, or set head_dim",
        )
    experts = values.get("num_experts") or values.get("num_local_experts")
    top_k = values.get("num_experts_per_tok")
    if experts and top_k and top_k > experts:
        raise ConfigError(
            f"{CONFIG_KEY}.num_experts_per_tok", top_k, f"route to at most the {experts} experts there are"
        )


def _derives_head_dim(model_type: str) -> bool:
    """Whether ``model_type``'s config computes ``head_dim`` from ``hidden_size`` when it is not given
    (llama, mistral, mixtral: a ``head_dim`` field defaulting to None, or no field at all) rather
    than defaulting it to a number (qwen3: 128)."""
    config_class = CONFIG_MAPPING[model_type]
    if not dataclasses.is_dataclass(config_class):
        return True
    return next((f.default for f in dataclasses.fields(config_class) if f.name == "head_dim"), None) is None


def config_file(path: str) -> PretrainedConfig:
    """The architecture a ``config.json`` file, or a folder holding one, describes (read by transformers'
    ``AutoConfig``, as ``from_pretrained`` reads it); ``ConfigError`` naming ``CONFIG_KEY`` otherwise."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    fix = "give a Hugging Face config.json, or a folder holding one (save_pretrained writes it), or a mapping"
    if not file.is_file():
        raise ConfigError(CONFIG_KEY, path, f"no such file; {fix}")
    try:
        return AutoConfig.from_pretrained(file)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(CONFIG_KEY, path, f"transformers could not read it ({first[:200]}); {fix}") from err


@contextmanager
def _pretrained_errors(name: str) -> Iterator[None]:
    """transformers' loading errors (no such hub repo, no network, not a model folder) as one line."""
    try:
        yield
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            "model.init_args.model.pretrained",
            name,
            f"transformers could not load it ({first}); check the folder, or the network for a hub name",
        ) from err

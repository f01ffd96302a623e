"""A DeepSpeed config beside the run config: one place where the keys both hold are reconciled.

DeepSpeed's JSON files (``ds_z2_config.json`` and the like) hold keys the run config also sets: the
micro-batch, accumulation, clipping, precision, the optimizer and its schedule. A study's variants must
differ only in what they vary, so a JSON value never silently overrides the run config: ``auto`` (the
Hugging Face convention) or an equal value takes the run's, anything else is refused naming both keys.
The engine then gets the JSON's own keys (ZeRO, offload, communication) and Lightning sets the shared
ones from the run, as for every other strategy; the optimizer is the module's (``model.init_args``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY

CONFIG_KEY = f"{STRATEGY_OPTIONS_KEY}.config"
AUTO = "auto"


@dataclass(frozen=True)
class RunValues:
    """What the run config says about the keys a DeepSpeed config also holds (None: not set there)."""

    micro_batch_size: int | None = None
    accumulation: int = 1
    data_parallel_size: int = 1
    gradient_clip_val: float = 0.0
    precision: str = "32-true"
    optimizer: str = "adamw"
    learning_rate: float | None = None
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None


def load_deepspeed_config(config: str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    """The config as a dict: a JSON file read, a mapping copied, None an empty config."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))  # a deep copy: the engine's edits never reach the caller
    path = Path(config).expanduser()
    if not path.is_file():
        raise ConfigError(CONFIG_KEY, str(config), "no such file: give the path of a DeepSpeed JSON config")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(CONFIG_KEY, str(config), f"not valid JSON ({err})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(CONFIG_KEY, str(config), "a DeepSpeed config is a JSON object")
    return loaded


def contradiction(ds: Mapping[str, Any], run: RunValues, source: str = "the DeepSpeed config") -> Refusal | None:
    """The first DeepSpeed value that contradicts the run config, as a refusal naming both keys."""
    precision = "16" if run.precision.startswith("16") else "bf16" if run.precision.startswith("bf16") else "32"
    expected: list[tuple[str, Any, str, Any]] = [
        (
            "train_micro_batch_size_per_gpu",
            ds.get("train_micro_batch_size_per_gpu"),
            "data.init_args.batch_size",
            run.micro_batch_size,
        ),
        (
            "gradient_accumulation_steps",
            ds.get("gradient_accumulation_steps"),
            "trainer.accumulate_grad_batches",
            run.accumulation,
        ),
        (
            "train_batch_size",
            ds.get("train_batch_size"),
            "data.init_args.batch_size x accumulate_grad_batches x ranks",
            None if run.micro_batch_size is None else run.micro_batch_size * run.accumulation * run.data_parallel_size,
        ),
        ("gradient_clipping", ds.get("gradient_clipping"), "trainer.gradient_clip_val", run.gradient_clip_val or 0.0),
        ("fp16.enabled", _enabled(ds, "fp16"), "trainer.precision", precision == "16"),
        ("bf16.enabled", _enabled(ds, "bf16"), "trainer.precision", precision == "bf16"),
    ]
    expected += _optimizer_values(ds.get("optimizer"), run)
    for ds_key, value, run_key, run_value in expected:
        if value is None or value == AUTO or run_value is None or _equal(value, run_value):
            continue
        shown = run.precision if run_key == "trainer.precision" else run_value
        return Refusal(
            CONFIG_KEY,
            f"{source}: {ds_key} {value!r}",
            f'contradicts {run_key} {shown!r}; make them equal, or write "auto" in the JSON to take the run\'s',
            shown=f"{source}: {ds_key} {value!r}",
        )
    scheduler = ds.get("scheduler")
    if isinstance(scheduler, Mapping) and any(v != AUTO for v in (scheduler.get("params") or {}).values()):
        return Refusal(
            CONFIG_KEY,
            f"{source}: scheduler",
            "the learning-rate schedule is the module's (model.init_args.warmup_steps, lr_schedule); remove the "
            'JSON\'s scheduler or set its params to "auto"',
            shown=f"{source}: scheduler {scheduler.get('type')!r}",
        )
    return None


def engine_config(ds: Mapping[str, Any], run: RunValues) -> dict[str, Any]:
    """What the engine gets: the DeepSpeed config without the keys the run sets (Lightning writes
    accumulation, clipping and precision from the trainer; the module builds the optimizer and its
    schedule), the micro-batch the run's, and a torch optimizer allowed under ZeRO and its offload."""
    owned = {
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
        "fp16",
        "bf16",
        "optimizer",
        "scheduler",
        "train_micro_batch_size_per_gpu",
    }
    config = {key: value for key, value in ds.items() if key not in owned}
    config["train_micro_batch_size_per_gpu"] = run.micro_batch_size or 1
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)  # the module's optimizer, offloaded or not
    return config


def config_source(config: Any) -> str:
    """How refusals name a config: its file's name, or ``the DeepSpeed config`` for one given inline."""
    return Path(config).name if isinstance(config, (str, Path)) else "the DeepSpeed config"


def zero_stage(ds: Mapping[str, Any]) -> int:
    """The config's ZeRO stage (0 without ``zero_optimization``)."""
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def _enabled(ds: Mapping[str, Any], key: str) -> bool | str | None:
    section = ds.get(key)
    return section.get("enabled", True) if isinstance(section, Mapping) else None


def _optimizer_values(section: Any, run: RunValues) -> list[tuple[str, Any, str, Any]]:
    if not isinstance(section, Mapping):
        return []
    params = section.get("params") or {}
    kind = str(section.get("type", AUTO))
    same_kind = kind == AUTO or kind.lower() in (run.optimizer.lower(), "adam" if run.optimizer == "adamw" else "")
    return [
        ("optimizer.type", kind, "model.init_args.optimizer", kind if same_kind else run.optimizer),
        ("optimizer.params.lr", params.get("lr"), "model.init_args.learning_rate", run.learning_rate),
        ("optimizer.params.weight_decay", params.get("weight_decay"), "model.init_args.weight_decay", run.weight_decay),
        ("optimizer.params.betas", params.get("betas"), "model.init_args.betas", run.betas),
    ]


def _equal(value: Any, run_value: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(run_value, (list, tuple)):
        return len(value) == len(run_value) and all(_equal(a, b) for a, b in zip(value, run_value))
    if isinstance(value, bool) or isinstance(run_value, bool):
        return bool(value) == bool(run_value)
    if isinstance(value, (int, float)) and isinstance(run_value, (int, float)):
        return float(value) == float(run_value)
    return value == run_value

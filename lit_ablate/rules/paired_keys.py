"""Options that act only together with another key's value (``config_keys.PairedKey``), refused where the
run would ignore them without a word: ``cp_layout`` with ``cp: 1``, ``powersgd_rank`` without
``comm_hook: powersgd``, ``blocksize`` at ``bits: 8``, ``cache_dir`` with ``storage: memory``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_ablate.class_choice import class_default
from lit_ablate.config_keys import NOT_GIVEN, PairedKey, ignored_key
from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.mesh_sizes import MESH_DIMS, STRATEGY_OPTIONS_KEY
from lit_ablate.models.adapters.quantization import QUANTIZATION_KEY, QuantizationOptions
from lit_ablate.rules.batch_rows import DATA_OPTIONS
from lit_ablate.rules.registry import Scope, rule
from lit_ablate.run_config import RunConfig
from lit_ablate.strategies.context_parallel import ContextParallelSteps
from lit_ablate.strategies.expert_parallel import ExpertParallelSteps
from lit_ablate.strategies.fsdp2 import FullyShardSteps
from lit_ablate.strategies.options import keyword_options
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
from lit_ablate.strategies.tensor_parallel import TensorParallelSteps

MESH_OPTIONS = {
    "tp": tuple(keyword_options(TensorParallelSteps)),
    "cp": tuple(keyword_options(ContextParallelSteps)),
    "ep": tuple(keyword_options(ExpertParallelSteps)),
    "pp": tuple(keyword_options(PipelineParallelStrategy, leave_out=(*MESH_DIMS, *keyword_options(FullyShardSteps)))),
}
"""The strategy options of one mesh dimension's step, as its step declares them: it runs only when its size
is not 1."""
PAIRED_OPTIONS: tuple[PairedKey, ...] = (
    *(
        PairedKey(f"{STRATEGY_OPTIONS_KEY}.{name}", f"{STRATEGY_OPTIONS_KEY}.{dim}", lambda size: size != 1, "not 1")
        for dim, names in MESH_OPTIONS.items()
        for name in names
    ),
    PairedKey(
        f"{STRATEGY_OPTIONS_KEY}.checkpoint_every",
        f"{STRATEGY_OPTIONS_KEY}.activation_checkpointing",
        lambda mode: mode not in (None, "none"),
        "full or selective",
    ),
    PairedKey(
        f"{STRATEGY_OPTIONS_KEY}.compile_backend",
        f"{STRATEGY_OPTIONS_KEY}.compile_layers",
        lambda on: on is True,
        "true",
    ),
    *(
        PairedKey(
            f"{STRATEGY_OPTIONS_KEY}.{name}",
            f"{STRATEGY_OPTIONS_KEY}.comm_hook",
            lambda hook: hook == "powersgd",
            "powersgd",
        )
        for name in ("powersgd_rank", "powersgd_start_iter")
    ),
    *(
        PairedKey(f"{QUANTIZATION_KEY}.{name}", f"{QUANTIZATION_KEY}.bits", lambda bits: bits == 4, "4")
        for name in ("quant_type", "double_quant", "blocksize", "compute_dtype", "quant_storage")
    ),
    PairedKey(f"{QUANTIZATION_KEY}.outlier_threshold", f"{QUANTIZATION_KEY}.bits", lambda bits: bits == 8, "8"),
    PairedKey(
        f"{DATA_OPTIONS}.cache_dir",
        f"{DATA_OPTIONS}.storage",
        lambda storage: storage in ("cache", "auto"),
        "cache or auto",
    ),
)
"""A mesh size counts as given as the config asks it: ``-1`` (the ranks left) acts, so a study sweeping the
devices from 1 keeps its options."""


@rule(Scope.CONFIG)
def keys_act_together(run: RunConfig) -> Refusal | None:
    """An option the config gives (other than its class's default) that its partner turns off
    (``PAIRED_OPTIONS``)."""
    return ignored_key(PAIRED_OPTIONS, lambda key: _given_option(run, key), lambda key: _option_value(run, key))


def _option_section(run: RunConfig, key: str) -> tuple[Mapping[str, Any], Any, str]:
    """``(what the config gives, the class whose defaults fill the rest, the option's name)`` for ``key``."""
    section, _, name = key.rpartition(".")
    if section == STRATEGY_OPTIONS_KEY:
        strategy = run.trainer.strategy
        return strategy.options, strategy.cls, name
    if section == DATA_OPTIONS:
        module = run.data.module
        return (module.init_args, module.cls, name) if module is not None else ({}, None, name)
    quantization = run.model.quantization_section
    return (quantization if isinstance(quantization, Mapping) else {}), QuantizationOptions, name


def _given_option(run: RunConfig, key: str) -> Any:
    given, cls, name = _option_section(run, key)
    if name not in given or (isinstance(cls, type) and given[name] == class_default(cls, name)):
        return NOT_GIVEN
    return given[name]


def _option_value(run: RunConfig, key: str) -> Any:
    given, cls, name = _option_section(run, key)
    if name in MESH_DIMS:
        return _requested_size(run, name)
    if name in given:
        return given[name]
    return class_default(cls, name) if isinstance(cls, type) else None


def _requested_size(run: RunConfig, dim: str) -> int:
    """The size the config asks of mesh dimension ``dim`` (``-1`` kept); 1 for a strategy without a mesh, or
    sizes no mesh takes (``mesh_lays_out``'s refusal)."""
    try:
        sizes = run.trainer.strategy.requested_mesh_sizes
    except ConfigError:
        return 1
    return 1 if sizes is None else sizes[dim]

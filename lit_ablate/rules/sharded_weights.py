"""Quantised and fp8 weights against the strategy that shards them: from the config before anything is built,
and from the built module and strategy before the strategy starts any rank (a run started from Python)."""

from __future__ import annotations

import torch

from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.models.adapters.quantization import QUANTIZATION_KEY, QuantizationOptions
from lit_ablate.models.fp8.conversion import FP8_KEY, Fp8Options
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import RunConfig
from lit_ablate.torch_versions import FSDP2_SHARDS_INTEGER_WEIGHTS


@rule(Scope.CONFIG, skips_variant=True)
def quantization_runs_under_strategy(run: RunConfig) -> Refusal | None:
    """Quantised base weights the strategy can shard (``quantization_refusal``)."""
    options = run.model.quantization
    reason = None if options is None else quantization_refusal(options, run.trainer.strategy.cls, run.model.dtype)
    return Refusal(QUANTIZATION_KEY, run.model.quantization_section, reason) if reason else None


@rule(Scope.CONFIG, skips_variant=True)
def fp8_runs_under_strategy(run: RunConfig) -> Refusal | None:
    """fp8 all-gather needs FSDP2 (``fp8_refusal``); tensor parallelism takes ``tensorwise`` scaling only
    (``fp8_tensor_parallel_refusal``)."""
    options = run.model.fp8
    if options is None:
        return None
    reason = fp8_refusal(options, run.trainer.strategy.cls)
    if reason:
        return Refusal(FP8_KEY, run.model.fp8_section, reason)
    reason = fp8_tensor_parallel_refusal(options, run.mesh_size("tp"))
    return Refusal(f"{FP8_KEY}.recipe", options.recipe, reason) if reason else None


@rule(Scope.BUILT_PARTS)
def built_quantization_runs_under_strategy(module: object, strategy: object) -> Refusal | None:
    """``quantization_runs_under_strategy`` for a built ``CausalLM`` and strategy."""
    from lit_ablate.modules.causal_lm import CausalLM

    if not isinstance(module, CausalLM):
        return None
    return refusal_of(check_quantization, module.factory.quantization, strategy, module.factory.dtype)


@rule(Scope.BUILT_PARTS)
def built_fp8_runs_under_strategy(module: object, strategy: object) -> Refusal | None:
    """``fp8_runs_under_strategy`` for a built ``CausalLM`` and strategy."""
    from lit_ablate.modules.causal_lm import CausalLM

    return refusal_of(check_fp8, module.factory.fp8, strategy) if isinstance(module, CausalLM) else None


def quantization_refusal(
    options: QuantizationOptions | None, strategy: object, model_dtype: str = "float32"
) -> str | None:
    """Why quantised weights cannot train under ``strategy`` (an instance or class), or None.

    - FSDP1 flattens each unit's parameters into one tensor of one dtype: it cannot flatten packed
      integer weights ("Cannot flatten integer dtype tensors"), nor a float ``quant_storage`` other
      than the model's ``dtype`` ("Must flatten tensors with uniform dtype"). 4-bit weights stored as
      the model's dtype (the FSDP-QLoRA recipe) shard.
    - 8-bit layers under a DTensor strategy (FSDP2, HSDP, ...): ``Linear8bitLt`` keeps its scales
      outside the parameter and cannot take them back from the copy a strategy loads into each
      rank; 4-bit layers can (``_load_quant_state``).
    - 4-bit weights packed as ``uint8`` under ``fully_shard`` (every mesh strategy) on a torch that
      cannot shard integer parameters (2.11: ``FSDP2_SHARDS_INTEGER_WEIGHTS``); stored as the
      model's dtype they shard on every supported torch.
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from lit_ablate.strategies.fsdp2 import FullyShardSteps

    if options is None or strategy is None:
        return None
    strategy_class = strategy if isinstance(strategy, type) else type(strategy)
    if issubclass(strategy_class, FSDPStrategy) and options.quant_storage != model_dtype:
        return (
            f"{strategy_class.__name__} (FSDP1) flattens each layer's weights into one {model_dtype} tensor, and "
            f"the packed weights are stored as {options.quant_storage}; set quant_storage: {model_dtype} "
            "(bits: 4), or use FSDP2Strategy or DDP"
        )
    if options.bits == 8 and issubclass(strategy_class, ModelParallelStrategy):
        return f"8-bit layers cannot be sharded by {strategy_class.__name__}; use bits: 4 (QLoRA), or DDP"
    if (
        issubclass(strategy_class, FullyShardSteps)
        and options.quant_storage == "uint8"
        and not FSDP2_SHARDS_INTEGER_WEIGHTS
    ):
        return (
            f"{strategy_class.__name__} shards with FSDP2, which in torch {torch.__version__} cannot hold the "
            f"packed uint8 weights (torch >= 2.12 can); set quant_storage: {model_dtype}, or upgrade torch"
        )
    return None


def check_quantization(options: QuantizationOptions | None, strategy: object, model_dtype: str = "float32") -> None:
    """Raise ``ConfigError`` naming ``model.init_args.model.quantization`` when ``quantization_refusal``
    has a reason."""
    reason = quantization_refusal(options, strategy, model_dtype)
    if reason:
        raise ConfigError(QUANTIZATION_KEY, {"bits": options.bits}, reason)


def fp8_refusal(options: Fp8Options | None, strategy: object) -> str | None:
    """Why ``options`` cannot train under ``strategy`` (an instance or class), or None: fp8 all-gather is a
    hook of FSDP2's ``fully_shard`` (the mesh strategies' FSDP step, ``FullyShardSteps``)."""
    from lit_ablate.strategies.fsdp2 import FullyShardSteps

    if options is None or not options.fsdp_all_gather:
        return None
    strategy_class = strategy if isinstance(strategy, type) or strategy is None else type(strategy)
    if strategy_class is None or not issubclass(strategy_class, FullyShardSteps):
        name = strategy_class.__name__ if strategy_class is not None else "no strategy"
        return (
            f"fp8 all-gather happens inside FSDP2's fully_shard; {name} gathers nothing: "
            "use FSDP2Strategy or fsdp_all_gather: false"
        )
    return None


def fp8_tensor_parallel_refusal(options: Fp8Options, tp: int) -> str | None:
    """Why ``options`` cannot train at tensor-parallel size ``tp`` (-1: the ranks left, so above 1), or None:
    torchao's float8 styles (``tensor_parallel_plans``) cast activations and gradients with one scale per
    tensor, so only the ``tensorwise`` recipe."""
    if tp != 1 and options.recipe != "tensorwise":
        return (
            "tp > 1 splits fp8 layers with torchao's float8 styles, which scale one per tensor; "
            "use recipe: tensorwise or tp: 1"
        )
    return None


def check_fp8(options: Fp8Options | None, strategy: object) -> None:
    """Raise ``ConfigError`` naming ``model.init_args.model.fp8`` when ``fp8_refusal`` or
    ``fp8_tensor_parallel_refusal`` has a reason."""
    reason = fp8_refusal(options, strategy)
    if reason:
        raise ConfigError(f"{FP8_KEY}.fsdp_all_gather", True, reason)
    from lit_ablate.strategies.mesh import MeshStrategy

    tp = strategy.requested_mesh_sizes.tp if isinstance(strategy, MeshStrategy) else 1
    reason = fp8_tensor_parallel_refusal(options, tp) if options is not None else None
    if reason:
        raise ConfigError(f"{FP8_KEY}.recipe", options.recipe, reason)

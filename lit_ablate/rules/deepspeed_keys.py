"""DeepSpeed's config against the run config, and DeepSpeed runnable here: judged before any rank starts."""

from __future__ import annotations

from typing import Any

from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.extras import not_installed
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import RunConfig
from lit_ablate.strategies.deepspeed_config import RunValues, config_source, contradiction, load_deepspeed_config
from lit_ablate.strategies.deepspeed_ops import build_op, ops_needed

KEYS = ("stage", "offload_optimizer", "offload_parameters", "communication_data_type", "quantized_gradients")
"""``DeepSpeedStrategy``'s keys that write into its DeepSpeed config."""


def deepspeed_config(run: RunConfig) -> dict[str, Any] | None:
    """The DeepSpeed config a ``DeepSpeedStrategy`` run gets from its JSON and keys (None for another
    strategy); ``ConfigError`` when the file is missing or a key contradicts it."""
    from lit_ablate.strategies.deepspeed import DeepSpeedStrategy, with_keys

    strategy = run.trainer.strategy
    if not strategy.is_a(DeepSpeedStrategy):
        return None
    return with_keys(load_deepspeed_config(strategy.option("config")), **{k: strategy.option(k) for k in KEYS})


@rule(Scope.CONFIG)
def deepspeed_is_lit_ablates(run: RunConfig) -> Refusal | None:
    """Lightning's own DeepSpeed strategy (by ``class_path`` or a ``deepspeed*`` name) keeps gradients outside
    ``param.grad`` without saying how to scale them: every step would stop at its first optimizer step."""
    from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy

    from lit_ablate.strategies.deepspeed import DeepSpeedStrategy

    strategy = run.trainer.strategy
    if not strategy.is_a(LightningDeepSpeedStrategy) or strategy.is_a(DeepSpeedStrategy):
        return None
    return Refusal(
        TRAINER_STRATEGY_KEY,
        strategy.name,
        "Lightning's DeepSpeed strategy cannot train lit-ablate's step objective (its gradients live outside "
        "param.grad); use lit_ablate.strategies.DeepSpeedStrategy (stage, config: the same DeepSpeed options)",
    )


@rule(Scope.CONFIG)
def deepspeed_config_agrees(run: RunConfig) -> Refusal | None:
    """A ``DeepSpeedStrategy``'s JSON file exists, its keys agree with the strategy's own, and the keys it
    shares with the run config (micro-batch, accumulation, clipping, precision, optimizer) agree or are
    ``auto``: a study's variants differ only in what they vary (``deepspeed_config``)."""
    try:
        ds = deepspeed_config(run)
    except ConfigError as err:
        return err.refusal
    if ds is None:
        return None
    model = run.model
    values = RunValues(
        micro_batch_size=run.data.batch_size,
        accumulation=run.trainer.accumulation,
        data_parallel_size=run.world_size,
        gradient_clip_val=float(run.trainer.gradient_clip_val or 0.0),
        precision=run.trainer.precision,
        optimizer=str(model.optimizer or "adamw"),
        learning_rate=model.option("learning_rate"),
        weight_decay=model.option("weight_decay"),
        betas=model.option("betas"),
    )
    return contradiction(ds, values, config_source(run.trainer.strategy.option("config")))


@rule(Scope.MACHINE, Scope.CLUSTER, skips_variant=True)
def deepspeed_runs_here(run: RunConfig) -> Refusal | None:
    """A ``DeepSpeedStrategy`` run needs the ``deepspeed`` package where it runs, and a GPU for what only
    DeepSpeed's CUDA ops do (ZeRO++'s quantised gradients, from its keys or its JSON)."""
    from lit_ablate.strategies.gpu_only import check_gpu_only_options

    try:
        ds = deepspeed_config(run)
    except ConfigError:
        return None  # the config rule's refusal
    if ds is None:
        return None
    missing = not_installed("deepspeed", "DeepSpeedStrategy")
    if missing:
        return Refusal(TRAINER_STRATEGY_KEY, "DeepSpeedStrategy", missing)
    quantized = ds["zero_optimization"].get("zero_quantized_gradients")
    return refusal_of(check_gpu_only_options, {"quantized_gradients": quantized}, run.trainer.device_type)


@rule(Scope.MACHINE, skips_variant=True)
def deepspeed_ops_build_here(run: RunConfig) -> Refusal | None:
    """The C++/CUDA ops the DeepSpeed config needs (ZeRO++'s quantizer, NVMe offload's I/O) build on this
    machine, or are built: once, before any rank starts, into the machine cache the ranks load them from
    (``deepspeed_ops``). Judged after ``deepspeed_runs_here``, so only where the run can go."""
    try:
        ds = deepspeed_config(run)
    except ConfigError:
        return None  # the config rule's refusal
    if ds is None or not_installed("deepspeed", "DeepSpeedStrategy"):
        return None
    for name, need in ops_needed(ds).items():
        error = build_op(name)
        if error:
            return Refusal(
                TRAINER_STRATEGY_KEY,
                "DeepSpeedStrategy",
                f"{need.key} {need.value!r} needs DeepSpeed's {name} op, which does not build on this machine "
                f"({error}); fix what it names (the compiler, the CUDA toolkit, libaio), pre-build the ops "
                f"(docs/deepspeed.md), or {need.instead}",
            )
    return None

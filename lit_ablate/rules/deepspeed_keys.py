"""DeepSpeed's config against the run config, and DeepSpeed itself installed: judged before any rank starts."""

from __future__ import annotations

from pathlib import Path

from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.extras import not_installed
from lit_ablate.rules.registry import Scope, rule
from lit_ablate.run_config import RunConfig
from lit_ablate.strategies.deepspeed_config import RunValues, contradiction, load_deepspeed_config


@rule(Scope.CONFIG)
def deepspeed_config_agrees(run: RunConfig) -> Refusal | None:
    """A ``DeepSpeedStrategy``'s JSON file exists, its keys agree with the strategy's own, and the keys it
    shares with the run config (micro-batch, accumulation, clipping, precision, optimizer) agree or are
    ``auto``: a study's variants differ only in what they vary (``deepspeed_config``)."""
    from lit_ablate.strategies.deepspeed import DeepSpeedStrategy, with_keys

    strategy = run.trainer.strategy
    if not strategy.is_a(DeepSpeedStrategy):
        return None
    option = strategy.option
    config = option("config")
    try:
        ds = with_keys(
            load_deepspeed_config(config),
            option("stage"),
            option("offload_optimizer"),
            option("offload_parameters"),
            option("communication_data_type"),
        )
    except ConfigError as err:
        return err.refusal
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
    return contradiction(ds, values, Path(config).name if isinstance(config, str) else "the DeepSpeed config")


@rule(Scope.MACHINE, Scope.CLUSTER, skips_variant=True)
def deepspeed_installed(run: RunConfig) -> Refusal | None:
    """A ``DeepSpeedStrategy`` run needs the ``deepspeed`` package where it runs."""
    from lit_ablate.strategies.deepspeed import DeepSpeedStrategy

    if not run.trainer.strategy.is_a(DeepSpeedStrategy):
        return None
    missing = not_installed("deepspeed", "DeepSpeedStrategy")
    return Refusal(TRAINER_STRATEGY_KEY, "DeepSpeedStrategy", missing) if missing else None

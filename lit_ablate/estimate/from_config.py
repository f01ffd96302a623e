"""The estimate of a resolved fit config: its model, training shape, sharding and mesh sizes, read from
the run's view (``lit_ablate.run_config.RunConfig``); no strategy is built to learn a size."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from lit_ablate.errors import ConfigError
from lit_ablate.estimate.flops import (
    ParameterCounts,
    count_parameters,
    count_parameters_of_config,
    flops_per_token,
    meta_model,
)
from lit_ablate.estimate.memory import estimate_memory, pipeline_stage_estimates
from lit_ablate.estimate.pipeline import pipeline_time_share
from lit_ablate.estimate.shapes import MemoryEstimate, ModelShape, TrainingShape, model_shape
from lit_ablate.run_config import RunConfig

if TYPE_CHECKING:
    from lit_ablate.strategies.state_sharding import StateSharding

Config = RunConfig | Mapping[str, Any]
"""A resolved fit config, or its view (each function below reads the view, built once)."""

SHARDINGS = ("ddp", "zero1", "zero2", "fsdp2", "fsdp2_no_reshard", "hsdp")
"""The data-parallel layouts ``lit-ablate estimate`` compares: DDP, ZeRO-1/2, FSDP2 resharding after
forward (ZeRO-3), FSDP2 keeping gathered parameters to backward, and HSDP sharding within a node."""
OPTIMIZER_CLASSES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "AdamW8bit": "adamw8bit"}
HALF_PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def canonical_sharding(kind: str, world_size: int, gpus_per_node: int = 8) -> StateSharding:
    """The divisors of one of ``SHARDINGS`` on ``world_size`` ranks (HSDP shards within a node)."""
    import math
    from dataclasses import replace

    from lit_ablate.strategies.state_sharding import StateSharding, deepspeed_sharding

    # FSDP2 (FSDP2Strategy, HSDP) wraps each layer and the root even on one rank: its gathers and gradient
    # copies exist at every count, as in the configured strategy's own answer (``fsdp_units``).
    if kind == "fsdp2_no_reshard":
        return StateSharding(params=world_size, grads=world_size, optimizer=world_size, gathered=1, fsdp_units=True)
    if kind == "hsdp":
        return replace(deepspeed_sharding(3, math.gcd(world_size, gpus_per_node)), fsdp_units=True)
    if kind == "fsdp2":
        return replace(deepspeed_sharding(3, world_size), fsdp_units=True)
    return deepspeed_sharding({"ddp": 0, "zero1": 1, "zero2": 2}[kind], world_size)


def _required(value: Any, key: str, fix: str) -> Any:
    if value is None:
        raise ConfigError(key, None, fix)
    return value


def _wraps_in_ddp(run: RunConfig) -> bool:
    """Whether the configured strategy (a name or a ``class_path`` section) wraps the model in torch's DDP."""
    from lightning.pytorch.strategies import DDPStrategy

    return run.trainer.strategy.is_a(DDPStrategy)


def _optimizer(run: RunConfig) -> str:
    """The estimate's name of the run's optimizer: LightningCLI's ``optimizer:`` section if the config has
    one, else the module's own (``model.init_args.optimizer``, default AdamW)."""
    optimizer = OPTIMIZER_CLASSES.get(
        run.optimizer.name if run.optimizer else "",
        "adamw8bit" if "8bit" in str(run.model.optimizer or "adamw") else "adamw",
    )
    if optimizer == "sgd" and run.optimizer.option("momentum", 0):
        return "sgd_momentum"
    return optimizer


def training_shape_of(config: Config, optimizer: str | None = None, world_size: int | None = None) -> TrainingShape:
    """The ``TrainingShape`` a resolved ``fit`` config trains with (CausalLM + LMDataModule keys) on
    ``world_size`` ranks (default: the config's; a ``cp: -1`` strategy splits sequences over them)."""
    run = RunConfig.of(config)
    precision, dtype, strategy = run.trainer.precision, run.model.dtype, run.trainer.strategy
    half = precision in HALF_PRECISIONS
    loss = run.model.loss
    shape = TrainingShape(
        micro_batch=int(
            _required(run.data.batch_size, "data.init_args.batch_size", "the estimate needs the micro-batch per rank")
        ),
        seq_len=int(_required(run.data.seq_len, "data.init_args.seq_len", "the estimate needs the sequence length")),
        param_bytes=2 if precision.endswith("-true") and half else DTYPE_BYTES.get(dtype, 4),
        activation_bytes=2 if half else DTYPE_BYTES.get(dtype, 4),
        optimizer=optimizer or _optimizer(run),
        checkpointing=strategy.options.get("activation_checkpointing", "none"),
        checkpoint_every=int(strategy.options.get("checkpoint_every", 2)),
        loss=loss.name,
        chunk_tokens=int(loss.options.get("chunk_tokens", 1024)),
        loss_grad_in_forward=bool(loss.options.get("grad_in_forward", True)),
        attention=run.model.attention,
        gradient_as_bucket_view=bool(strategy.options.get("gradient_as_bucket_view", False)),
        ddp=_wraps_in_ddp(run),
        fp8_all_gather=isinstance(run.model.fp8_section, Mapping)
        and bool(run.model.fp8_section.get("fsdp_all_gather")),
        **dict(zip(("context_parallel", "context_parallel_impl"), context_parallel_of(run, world_size))),
        **dict(zip(("tensor_parallel", "sequence_parallel"), tensor_parallel_of(run, world_size))),
        **pipeline_of(run, world_size),
        accumulate_grad_batches=run.trainer.accumulation,
        on_host=run.trainer.device_type == "cpu",
    )
    if run.model.module.class_path.endswith("DPO"):
        shape = replace(shape, **_preference_shape(run, shape.micro_batch, shape.seq_len))
    return shape


def _preference_shape(run: RunConfig, batch_size: int, seq_len: int) -> dict[str, Any]:
    """DPO's ``TrainingShape`` fields: its rows (padded: 2 sequences per pair; packed across the data
    set: ``batch_size`` rows of ``max_tokens``), its log-prob backend and its reference."""
    collator = run.data.collator
    options = collator.init_args if collator else {}
    if run.data.packs_preference_pairs and not options.get("within_batch"):
        rows = {"micro_batch": batch_size, "seq_len": int(options.get("max_tokens") or 2 * seq_len)}
    else:
        rows = {"micro_batch": 2 * batch_size, "seq_len": seq_len}
    backend = str(run.model.option("logprobs") or "torch")
    logprobs_options = run.model.option("logprobs_options") or {}
    if backend == "liger":
        loss = {"loss": "liger_dpo", "chunk_tokens": 2 * int(logprobs_options.get("chunk_pairs", 1)) * seq_len}
    else:  # the chunked log-probs keep only the log-sum-exp and recompute chunks in the backward
        loss = {
            "loss": backend,
            "chunk_tokens": int(logprobs_options.get("chunk_tokens", 1024)),
            "loss_grad_in_forward": False,
        }
    return {**rows, **loss, "reference": str(run.model.option("reference") or "frozen")}


def context_parallel_of(config: Config, world_size: int | None = None) -> tuple[int, str]:
    """``(cp ranks, cp_impl)`` of the config's strategy on ``world_size`` ranks (default: the
    config's; ``(1, "ring")`` for a strategy without context parallelism)."""
    run = RunConfig.of(config)
    strategy = run.trainer.strategy
    sizes = strategy.requested_mesh_sizes
    if sizes is None or sizes.cp == 1:
        return 1, "ring"
    return sizes.resolved(world_size or run.world_size).cp, strategy.option("cp_impl", "ring")


def tensor_parallel_of(config: Config, world_size: int | None = None) -> tuple[int, bool]:
    """``(tp ranks, sequence_parallel)`` of the config's strategy on ``world_size`` ranks (default:
    the config's; ``(1, False)`` for a strategy without tensor parallelism)."""
    run = RunConfig.of(config)
    tp = run.trainer.strategy.mesh_size("tp", world_size or run.world_size)
    return tp, bool(run.trainer.strategy.option("sequence_parallel", False)) and tp > 1


def pipeline_of(config: Config, world_size: int | None = None) -> dict[str, Any]:
    """The ``TrainingShape`` pipeline fields of the config's ``PipelineParallelStrategy`` on ``world_size``
    ranks (default: the config's; ``pp: -1`` takes the ranks the other mesh sizes leave: 2 stages of
    tp 2 on 4 ranks); none for another strategy."""
    from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy

    run = RunConfig.of(config)
    strategy = run.trainer.strategy
    if not strategy.is_a(PipelineParallelStrategy):
        return {}
    sizes = strategy.requested_mesh_sizes
    if sizes.dp_shard > 1 and strategy.option("reshard_after_forward"):
        raise ConfigError(
            "trainer.strategy.init_args.reshard_after_forward",
            True,
            "the estimate models FSDP stages that keep their layers gathered through the step (measured "
            "agreement); with resharding per micro-batch it does not (estimate reshard_after_forward: false)",
        )
    pp = sizes.resolved(world_size or run.world_size).pp  # -1: the ranks the other sizes leave
    points = strategy.option("split_points")
    return {
        "pipeline_parallel": pp,
        "pipeline_schedule": strategy.option("schedule"),
        "pipeline_stages_per_rank": strategy.option("stages_per_rank"),
        "microbatches": strategy.option("microbatches"),
        "split_points": None if points is None else tuple(points),
    }


def world_size_of(config: Config) -> int:
    """Ranks of a resolved ``fit`` config: devices (an int or a list; "auto" counts as 1) x nodes, or the
    simulated job's (``simulate``)."""
    return RunConfig.of(config).world_size


def configured_sharding(config: Config, world_size: int) -> StateSharding:
    """The sharding of the config's own ``trainer.strategy`` (a name or a class_path mapping): the
    strategy's own answer (``state_sharding``), so this one builds it."""
    from lit_ablate.strategies.interface import state_sharding_of

    return state_sharding_of(RunConfig.of(config).trainer.strategy.build(), world_size)


def model_of(config: Config) -> tuple[ParameterCounts, ModelShape]:
    """Counts and shape of the config's ``model.init_args.model`` (a ``ModelFactory``), built on meta."""
    model = RunConfig.of(config).model
    _required(model.factory, "model.init_args.model", "the estimate reads a CausalLM's model: preset/config/pretrained")
    factory = model.build_factory()
    hf_config = factory.hf_config()
    if factory.adapter is None:
        return count_parameters_of_config(hf_config), model_shape(hf_config)
    from lit_ablate.models.adapters.lora import apply_adapters

    lm = meta_model(hf_config)
    with torch.device("meta"):
        if factory.moe is not None:  # expert adapters sit on lit-ablate's experts
            from lit_ablate.models.moe.blocks import apply_moe

            apply_moe(lm, factory.moe)
        apply_adapters(lm, factory.adapter)
    return count_parameters(lm, hf_config, factory.quantization), model_shape(hf_config)


def estimate_for_config(config: Config, world_size: int | None = None, rank: int | None = None) -> MemoryEstimate:
    """Per-rank memory of a resolved ``fit`` config under its own strategy (what the report shows): the
    largest rank's, or with ``rank`` that rank's (under pipeline parallelism its stage's; ``pp`` is the
    outermost mesh dimension, so rank ``r`` holds stage ``r // (world_size / pp)``)."""
    run = RunConfig.of(config)
    world_size = world_size or run.world_size
    training = training_shape_of(run, world_size=world_size)
    counts, shape = model_of(run)
    sharding = configured_sharding(run, world_size)
    if rank is not None and training.pipeline_parallel > 1:
        stages = pipeline_stage_estimates(counts, shape, training, sharding)
        return stages[rank // (world_size // training.pipeline_parallel)]
    return estimate_memory(counts, shape, training, sharding, world_size)


def predicted_step_seconds(config: Config, ceiling_tflops: float, world_size: int | None = None) -> float:
    """One optimizer step of a resolved ``fit`` config if every model FLOP ran at ``ceiling_tflops``
    (the measured matmul ceiling, ``lit_ablate.matmul_ceiling``): a rank's FLOPs per step over it.

    The FLOPs are the ones ``MFUMonitor`` divides (``flops_per_token``; a rank's ``1 / cp`` and
    ``1 / tp`` share; under pipeline parallelism the largest stage's share, stretched by the
    schedule's ideal idle time: ``pipeline_time_share``), for
    ``micro_batch x seq_len x accumulate_grad_batches`` tokens at the full ``seq_len`` context: padded
    or packed data compute less, so for them the prediction is an upper bound. What a measured step
    takes beyond it is not matmul at the ceiling: communication, memory-bound kernels (norms,
    attention softmax, the optimizer), data and framework overhead.
    """
    run = RunConfig.of(config)
    module = run.model.module.class_path
    if not module.endswith("CausalLM"):
        raise ConfigError("model.class_path", module, "step time is predicted for CausalLM runs only")
    world_size = world_size or run.world_size
    training = training_shape_of(run, world_size=world_size)
    counts, shape = model_of(run)
    hf_config = run.model.build_factory().hf_config()
    share = pipeline_time_share(counts, shape, training, training.seq_len, hf_config) / (
        training.context_parallel * run.trainer.strategy.mesh_size("tp", world_size)
    )
    tokens = training.micro_batch * training.seq_len * run.trainer.accumulation
    return flops_per_token(counts, hf_config, training.seq_len) * tokens * share / (ceiling_tflops * 1e12)


def smallest_world_size(fits: Callable[[int], bool], max_ranks: int) -> int | None:
    """The fewest ranks (1..max_ranks) for which ``fits`` holds, or None."""
    return next((n for n in range(1, max_ranks + 1) if fits(n)), None)

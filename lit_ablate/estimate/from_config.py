"""The estimate of a resolved fit config: its model, training shape, sharding and mesh sizes read from the YAML."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from lit_ablate.config_keys import get_dotted
from lit_ablate.estimate.flops import (
    ParameterCounts,
    count_parameters,
    count_parameters_of_config,
    flops_per_token,
    meta_model,
)
from lit_ablate.estimate.memory import estimate_memory
from lit_ablate.estimate.pipeline import pipeline_time_share
from lit_ablate.estimate.shapes import MemoryEstimate, ModelShape, TrainingShape, model_shape

if TYPE_CHECKING:
    from lit_ablate.strategies.state_sharding import StateSharding

SHARDINGS = ("ddp", "zero1", "zero2", "fsdp2", "fsdp2_no_reshard", "hsdp")
"""The data-parallel layouts ``lit-ablate estimate`` compares: DDP, ZeRO-1/2, FSDP2 resharding after
forward (ZeRO-3), FSDP2 keeping gathered parameters to backward, and HSDP sharding within a node."""
OPTIMIZER_CLASSES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "AdamW8bit": "adamw8bit"}
HALF_PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def canonical_sharding(kind: str, world_size: int, gpus_per_node: int = 8) -> StateSharding:
    """The divisors of one of ``SHARDINGS`` on ``world_size`` ranks (HSDP shards within a node)."""
    import math

    from lit_ablate.strategies.state_sharding import StateSharding, deepspeed_sharding

    if kind == "fsdp2_no_reshard":
        return StateSharding(params=world_size, grads=world_size, optimizer=world_size, gathered=1)
    if kind == "hsdp":
        return deepspeed_sharding(3, math.gcd(world_size, gpus_per_node))
    return deepspeed_sharding({"ddp": 0, "zero1": 1, "zero2": 2, "fsdp2": 3}[kind], world_size)


def _required(config: dict, key: str, fix: str) -> object:
    from lit_ablate.errors import ConfigError

    value = get_dotted(config, key)
    if value is None:
        raise ConfigError(key, None, fix)
    return value


def _wraps_in_ddp(strategy: Any) -> bool:
    """Whether a configured strategy (a name or a ``class_path`` mapping) wraps the model in torch's DDP."""
    import importlib

    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    if isinstance(strategy, Mapping):
        module, _, name = str(strategy.get("class_path", "")).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):  # the run itself reports a class_path that does not import
            return False
    else:
        cls = StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None
    return isinstance(cls, type) and issubclass(cls, DDPStrategy)


def training_shape_of(config: dict, optimizer: str | None = None, world_size: int | None = None) -> TrainingShape:
    """The ``TrainingShape`` a resolved ``fit`` config trains with (CausalLM + LMDataModule keys) on
    ``world_size`` ranks (default: the config's; a ``cp: -1`` strategy splits sequences over them)."""
    precision = str(get_dotted(config, "trainer.precision", "32-true"))
    dtype = str(get_dotted(config, "model.init_args.model.dtype", "float32"))
    half = precision in HALF_PRECISIONS
    strategy_args = get_dotted(config, "trainer.strategy.init_args", {}) or {}
    optimizer_class = str(get_dotted(config, "optimizer.class_path", "") or "").rsplit(".", 1)[-1]
    if optimizer is None:
        # CausalLM builds its optimizer itself (model.init_args.optimizer, default AdamW)
        optimizer = OPTIMIZER_CLASSES.get(optimizer_class, "adamw8bit" if "8bit" in str(
            get_dotted(config, "model.init_args.optimizer", "adamw")) else "adamw")  # fmt: skip
        if optimizer == "sgd" and get_dotted(config, "optimizer.init_args.momentum", 0):
            optimizer = "sgd_momentum"
    shape = TrainingShape(
        micro_batch=int(_required(config, "data.init_args.batch_size", "the estimate needs the micro-batch per rank")),
        seq_len=int(_required(config, "data.init_args.seq_len", "the estimate needs the sequence length")),
        param_bytes=2 if precision.endswith("-true") and half else DTYPE_BYTES.get(dtype, 4),
        activation_bytes=2 if half else DTYPE_BYTES.get(dtype, 4),
        optimizer=optimizer,
        checkpointing=strategy_args.get("activation_checkpointing", "none"),
        checkpoint_every=int(strategy_args.get("checkpoint_every", 2)),
        loss=str(get_dotted(config, "model.init_args.loss", "torch")),
        chunk_tokens=int(get_dotted(config, "model.init_args.loss_options.chunk_tokens", 1024)),
        loss_grad_in_forward=bool(get_dotted(config, "model.init_args.loss_options.grad_in_forward", True)),
        attention=str(get_dotted(config, "model.init_args.model.attn_implementation", "sdpa")),
        gradient_as_bucket_view=bool(strategy_args.get("gradient_as_bucket_view", False)),
        ddp=_wraps_in_ddp(get_dotted(config, "trainer.strategy", "auto")),
        fp8_all_gather=bool(get_dotted(config, "model.init_args.model.fp8.fsdp_all_gather", False)),
        **dict(zip(("context_parallel", "context_parallel_impl"), context_parallel_of(config, world_size))),
        **dict(zip(("tensor_parallel", "sequence_parallel"), tensor_parallel_of(config, world_size))),
        **pipeline_of(config, world_size),
        accumulate_grad_batches=int(get_dotted(config, "trainer.accumulate_grad_batches", 1) or 1),
    )
    if str(get_dotted(config, "model.class_path", "")).endswith("DPO"):
        shape = replace(shape, **_preference_shape(config, shape.micro_batch, shape.seq_len))
    return shape


def _preference_shape(config: dict, batch_size: int, seq_len: int) -> dict[str, Any]:
    """DPO's ``TrainingShape`` fields: its rows (padded: 2 sequences per pair; packed across the data
    set: ``batch_size`` rows of ``max_tokens``), its log-prob backend and its reference."""
    collator = get_dotted(config, "data.init_args.collator") or {}
    collator = collator if isinstance(collator, dict) else {}
    options = collator.get("init_args") or {}
    if str(collator.get("class_path", "")).endswith("PreferencePackingCollator") and not options.get("within_batch"):
        rows = {"micro_batch": batch_size, "seq_len": int(options.get("max_tokens") or 2 * seq_len)}
    else:
        rows = {"micro_batch": 2 * batch_size, "seq_len": seq_len}
    backend = str(get_dotted(config, "model.init_args.logprobs", "torch"))
    logprobs_options = get_dotted(config, "model.init_args.logprobs_options") or {}
    if backend == "liger":
        loss = {"loss": "liger_dpo", "chunk_tokens": 2 * int(logprobs_options.get("chunk_pairs", 1)) * seq_len}
    else:  # the chunked log-probs keep only the log-sum-exp and recompute chunks in the backward
        loss = {"loss": backend, "chunk_tokens": int(logprobs_options.get("chunk_tokens", 1024)),
                "loss_grad_in_forward": False}
    return {**rows, **loss, "reference": str(get_dotted(config, "model.init_args.reference", "frozen"))}


def context_parallel_of(config: dict, world_size: int | None = None) -> tuple[int, str]:
    """``(cp ranks, cp_impl)`` of the config's strategy on ``world_size`` ranks (default: the
    config's; ``(1, "ring")`` for a strategy without context parallelism)."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.mesh import resolve_mesh_sizes

    strategy = get_dotted(config, "trainer.strategy", "auto")
    if not isinstance(strategy, dict):
        return 1, "ring"
    instance = instantiate_class((), strategy)
    sizes = getattr(instance, "requested_mesh_sizes", {})
    if sizes.get("cp", 1) == 1:
        return 1, "ring"
    return resolve_mesh_sizes(sizes, world_size or world_size_of(config))["cp"], instance.cp_impl


def tensor_parallel_of(config: dict, world_size: int | None = None) -> tuple[int, bool]:
    """``(tp ranks, sequence_parallel)`` of the config's strategy on ``world_size`` ranks (default:
    the config's; ``(1, False)`` for a strategy without tensor parallelism)."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.mesh import resolve_mesh_sizes

    strategy = get_dotted(config, "trainer.strategy", "auto")
    if not isinstance(strategy, dict):
        return 1, False
    instance = instantiate_class((), strategy)
    sizes = getattr(instance, "requested_mesh_sizes", {})
    if sizes.get("tp", 1) == 1:
        return 1, False
    tp = resolve_mesh_sizes(sizes, world_size or world_size_of(config))["tp"]
    return tp, bool(getattr(instance, "sequence_parallel", False)) and tp > 1


def pipeline_of(config: dict, world_size: int | None = None) -> dict[str, Any]:
    """The ``TrainingShape`` pipeline fields of the config's ``PipelineParallelStrategy`` on ``world_size``
    ranks (default: the config's; ``pp: -1`` takes the ranks the other mesh sizes leave: 2 stages of
    tp 2 on 4 ranks); none for another strategy."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy

    strategy = get_dotted(config, "trainer.strategy", "auto")
    instance = instantiate_class((), strategy) if isinstance(strategy, dict) else strategy
    if not isinstance(instance, PipelineParallelStrategy):
        return {}
    from lit_ablate.errors import ConfigError

    if instance.dp_shard > 1 and instance.reshard_after_forward:
        raise ConfigError("trainer.strategy.init_args.reshard_after_forward", True,
                          "the estimate models FSDP stages that keep their layers gathered through the step (measured "
                          "agreement); with resharding per micro-batch it does not (estimate reshard_after_forward: false)")
    from lit_ablate.strategies.mesh import resolve_mesh_sizes

    world_size = world_size or world_size_of(config)
    pp = resolve_mesh_sizes(instance.requested_mesh_sizes, world_size)["pp"]  # -1: the ranks the other sizes leave
    points = None if instance.split_points is None else tuple(instance.split_points)
    return {"pipeline_parallel": pp, "pipeline_schedule": instance.schedule_name,
            "pipeline_stages_per_rank": instance.stages_per_rank, "microbatches": instance.microbatches,
            "split_points": points}


def world_size_of(config: dict) -> int:
    """Ranks of a resolved ``fit`` config: devices (an int or a list; "auto" counts as 1) x nodes."""
    devices = get_dotted(config, "trainer.devices", 1)
    devices = int(devices) if isinstance(devices, str) and devices.isdigit() else devices  # `--trainer.devices 2`
    devices = len(devices) if isinstance(devices, list) else devices if isinstance(devices, int) else 1
    return devices * int(get_dotted(config, "trainer.num_nodes", 1) or 1)


def configured_sharding(config: dict, world_size: int) -> StateSharding:
    """The sharding of the config's own ``trainer.strategy`` (a name or a class_path mapping)."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.interface import state_sharding_of

    strategy = get_dotted(config, "trainer.strategy", "auto")
    if isinstance(strategy, dict):
        strategy = instantiate_class((), strategy)
    return state_sharding_of(strategy, world_size)


def model_of(config: dict) -> tuple[ParameterCounts, ModelShape]:
    """Counts and shape of the config's ``model.init_args.model`` (a ``ModelFactory``), built on meta."""
    from lit_ablate.models.factory import ModelFactory

    factory = ModelFactory(**_required(config, "model.init_args.model",
                                       "the estimate reads a CausalLM's model: preset/config/pretrained"))  # fmt: skip
    hf_config = factory.hf_config()
    if factory.adapter is None:
        return count_parameters_of_config(hf_config), model_shape(hf_config)
    from lit_ablate.models.adapters.lora import apply_adapters

    model = meta_model(hf_config)
    with torch.device("meta"):
        if factory.moe is not None:  # expert adapters sit on lit-ablate's experts
            from lit_ablate.models.moe.blocks import apply_moe

            apply_moe(model, factory.moe)
        apply_adapters(model, factory.adapter)
    return count_parameters(model, hf_config, factory.quantization), model_shape(hf_config)


def estimate_for_config(config: dict, world_size: int | None = None) -> MemoryEstimate:
    """Per-rank memory of a resolved ``fit`` config under its own strategy (what the report shows)."""
    world_size = world_size or world_size_of(config)
    training = training_shape_of(config, world_size=world_size)
    counts, shape = model_of(config)
    return estimate_memory(counts, shape, training, configured_sharding(config, world_size), world_size)


def predicted_step_seconds(config: dict, ceiling_tflops: float, world_size: int | None = None) -> float:
    """One optimizer step of a resolved ``fit`` config if every model FLOP ran at ``ceiling_tflops``
    (the measured matmul ceiling, ``lit_ablate.matmul_ceiling``): a rank's FLOPs per step over it.

    The FLOPs are the ones ``MFUMonitor`` divides (``flops_per_token``; a rank's ``1 / cp`` and
    ``1 / tp`` share; under pipeline parallelism the largest stage's share, stretched by the
    schedule's ideal idle time: ``pipeline_time_share``), for ``micro_batch x seq_len x accumulate_grad_batches`` tokens at the full
    ``seq_len`` context: padded or packed data compute less, so for them the prediction is an upper
    bound. What a measured step takes beyond it is not matmul at the ceiling: communication,
    memory-bound kernels (norms, attention softmax, the optimizer), data and framework overhead.
    """
    from lit_ablate.errors import ConfigError
    from lit_ablate.models.factory import ModelFactory

    module = str(get_dotted(config, "model.class_path", ""))
    if not module.endswith("CausalLM"):
        raise ConfigError("model.class_path", module, "step time is predicted for CausalLM runs only")
    world_size = world_size or world_size_of(config)
    training = training_shape_of(config, world_size=world_size)
    counts, shape = model_of(config)
    hf_config = ModelFactory(**get_dotted(config, "model.init_args.model")).hf_config()
    accumulate = int(get_dotted(config, "trainer.accumulate_grad_batches", 1) or 1)
    share = pipeline_time_share(counts, shape, training, training.seq_len, hf_config) / (
        training.context_parallel * mesh_size_of(config, "tp", world_size))  # fmt: skip
    tokens = training.micro_batch * training.seq_len * accumulate
    return flops_per_token(counts, hf_config, training.seq_len) * tokens * share / (ceiling_tflops * 1e12)


def mesh_size_of(config: dict, dim: str, world_size: int) -> int:
    """The size of mesh dimension ``dim`` (``tp``, ``cp``, ...) of the config's strategy on
    ``world_size`` ranks; 1 for a strategy without a device mesh."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.mesh import MeshStrategy, resolve_mesh_sizes

    strategy = get_dotted(config, "trainer.strategy", "auto")
    built = instantiate_class((), strategy) if isinstance(strategy, dict) else None
    sizes = built.requested_mesh_sizes if isinstance(built, MeshStrategy) else {}
    return resolve_mesh_sizes(sizes, world_size)[dim] if sizes.get(dim, 1) != 1 else 1


def smallest_world_size(fits: Callable[[int], bool], max_ranks: int) -> int | None:
    """The fewest ranks (1..max_ranks) for which ``fits`` holds, or None."""
    return next((n for n in range(1, max_ranks + 1) if fits(n)), None)



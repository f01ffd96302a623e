"""``DeepSpeedStrategy``: DeepSpeed's ZeRO as a study variant, from its own JSON files or from keys.

Lightning's ``DeepSpeedStrategy`` runs on CUDA only; this subclass also runs on CPU ranks (gloo), so
a study compares DeepSpeed's ZeRO-1/2/3 and its optimizer offload with lit-ablate's strategies on any
machine, and trains lit-ablate's step objective (the token mean over every rank and micro-batch):

- DeepSpeed divides each micro-batch's loss by its accumulation count and averages gradients over the
  data-parallel ranks, and keeps them in its own partitions (not ``param.grad``). Lightning already
  divides by the accumulation count, so the backward here does not divide again, and the step
  objective's factor reaches the partitions through the engine's loss scale at the step's last
  micro-batch: DeepSpeed divides gradients by it before clipping and the optimizer (``scale_gradients``).
- No C++ op is built on CPU: DeepSpeed's shared-memory all-reduce serves inference only, and the
  module's torch optimizer is kept under offload (``zero_force_ds_cpu_optimizer: false``), so a run
  starts in seconds instead of compiling ops for minutes.

The keys DeepSpeed's config shares with the run config are reconciled in ``deepspeed_config``.
"""

from __future__ import annotations

import argparse
import importlib
import os
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy
from torch import Tensor

from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import ConfigError
from lit_ablate.extras import not_installed
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY
from lit_ablate.strategies.deepspeed_config import (
    RunValues,
    config_source,
    contradiction,
    engine_config,
    load_deepspeed_config,
    zero_stage,
)
from lit_ablate.strategies.deepspeed_ops import EXTENSIONS_DIR_ENV, extensions_dir, first_compiler_error
from lit_ablate.strategies.gpu_only import check_gpu_only_options
from lit_ablate.strategies.interface import StrategyInterface
from lit_ablate.strategies.state_sharding import StateSharding, deepspeed_sharding

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

CommunicationDataType = Literal["fp32", "fp16", "bf16"]


class DeepSpeedStrategy(LightningDeepSpeedStrategy, StrategyInterface):
    """DeepSpeed's ZeRO data parallelism: optimizer states (stage 1), gradients (2) and parameters (3)
    partitioned over the ranks, optionally offloaded to host memory.

    Choose it to compare DeepSpeed with ``ZeRO1Strategy`` and ``FSDP2Strategy`` on the same model, or
    to run a study from existing DeepSpeed JSON files. A key given here must agree with the JSON's.

    Args:
        config: a DeepSpeed JSON file (or its dict); the keys it shares with the run config must agree
            with it or be ``"auto"``.
        stage: ZeRO stage 1, 2 or 3 (default: the JSON's, else 2).
        offload_optimizer: keep the optimizer states and step on the host (ZeRO-Offload).
        offload_parameters: keep the parameters on the host (stage 3).
        communication_data_type: the dtype gradients are reduced in (``fp16``/``bf16``: half the bytes).
        quantized_gradients: ZeRO++'s gradients quantised to int4 for their reduce-scatter (stage 3, CUDA).
        process_group_backend: ``gloo``/``nccl``; by default the device's.
        timeout_s: collective timeout.
    """

    def __init__(
        self,
        config: str | dict[str, Any] | None = None,
        stage: int | None = None,
        offload_optimizer: bool | None = None,
        offload_parameters: bool | None = None,
        communication_data_type: CommunicationDataType | None = None,
        quantized_gradients: bool | None = None,
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        missing = not_installed("deepspeed", "DeepSpeedStrategy")
        if missing:
            raise ConfigError(TRAINER_STRATEGY_KEY, "DeepSpeedStrategy", missing)
        keys = {
            "stage": stage,
            "offload_optimizer": offload_optimizer,
            "offload_parameters": offload_parameters,
            "communication_data_type": communication_data_type,
            "quantized_gradients": quantized_gradients,
        }
        ds = with_keys(load_deepspeed_config(config), **keys)
        self.source = config_source(config)
        super().__init__(config=ds, process_group_backend=process_group_backend, timeout=timedelta(seconds=timeout_s))

    # ------------------------------------------------------------------ start-up on any device
    def setup_environment(self) -> None:
        os.environ[EXTENSIONS_DIR_ENV] = extensions_dir()  # where the ops were built before the ranks started
        quantized = (self.config.get("zero_optimization") or {}).get("zero_quantized_gradients")
        check_gpu_only_options({"quantized_gradients": quantized}, self.root_device.type)
        if self.root_device.type == "cuda":
            super().setup_environment()
        else:  # Lightning's check allows CUDA only; the engine runs on DeepSpeed's CPU accelerator
            super(LightningDeepSpeedStrategy, self).setup_environment()

    def setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_distributed()
            return
        reset_seed()  # Lightning's device-index check is for CUDA devices; a CPU device has no index
        self.set_world_ranks()
        with _without_shared_memory_op():
            self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        import deepspeed

        device_rank = self.root_device.index if self.root_device.type == "cuda" else self.local_rank
        try:
            engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=device_rank),
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
        except RuntimeError as err:
            if "Error building extension" not in str(err):
                raise
            raise ConfigError(
                TRAINER_STRATEGY_KEY,
                "DeepSpeedStrategy",
                f"DeepSpeed could not build one of its C++/CUDA ops ({first_compiler_error(str(err))}); fix the "
                f"compiler or CUDA toolkit it names, or pre-build the ops (docs/deepspeed.md)",
            ) from None
        return engine, deepspeed_optimizer

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """The module builds its model whole, as under every other strategy, and ZeRO-3 partitions it when
        the engine starts: built inside ``deepspeed.zero.Init`` (Lightning's way), each parameter is
        partitioned as it is created and Hugging Face's weight initialisation then runs on empty shards."""
        yield

    def _format_config(self) -> None:
        """Reconcile with the trainer's values (the rule registry refused a contradiction before the run
        when the config came through ``lit-ablate``), then keep only DeepSpeed's own keys."""
        run = self.run_values()
        refusal = contradiction(self.config, run, self.source)
        if refusal:
            raise refusal.error()
        self.config = engine_config(self.config, run)
        super()._format_config()

    def run_values(self) -> RunValues:
        """The run's values of the keys a DeepSpeed config shares (from the trainer, module and data)."""
        trainer = self.lightning_module.trainer
        module = self.lightning_module
        datamodule = getattr(trainer, "datamodule", None)
        hparams = getattr(module, "hparams", {})
        return RunValues(
            micro_batch_size=getattr(datamodule, "batch_size", None),
            accumulation=trainer.accumulate_grad_batches,
            data_parallel_size=self.world_size,
            gradient_clip_val=float(trainer.gradient_clip_val or 0.0),
            precision=str(self.precision_plugin.precision),
            optimizer=str(hparams.get("optimizer", "adamw")),
            learning_rate=hparams.get("learning_rate"),
            weight_decay=hparams.get("weight_decay"),
            betas=hparams.get("betas"),
        )

    # ------------------------------------------------------------------ the step objective
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning divided the loss by the accumulation count already; DeepSpeed must not again."""
        return super().backward(closure_loss, optimizer, *args, scale_wrt_gas=False, **kwargs)

    def ends_optimizer_step(self) -> bool:
        # Lightning calls the optimizer step after every micro-batch; the engine steps at the boundary.
        return self.deepspeed_engine.is_gradient_accumulation_boundary()

    def scale_gradients(self, parameters: Iterable[torch.nn.Parameter], factor: Tensor) -> None:
        """The engine divides its partitions by the loss scale before clipping and stepping: a loss scale
        of ``1 / factor`` (one host read of ``factor``) multiplies them by it, and the clipping norm is the
        true gradient's. Back to 1 after the step (``optimizer_step``)."""
        optimizer = self.deepspeed_engine.optimizer
        if not hasattr(optimizer, "override_loss_scale"):
            raise ConfigError(
                "trainer.precision",
                str(self.precision_plugin.precision),
                f"DeepSpeed chose its {type(optimizer).__name__}, which has no loss scale to rescale gradients "
                "to the step's token mean by; train in 32-true, or in bf16 at another ZeRO stage",
            )
        optimizer.override_loss_scale(1.0 / float(factor))

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        engine_optimizer = self.deepspeed_engine.optimizer
        if getattr(engine_optimizer, "custom_loss_scaler", False):
            engine_optimizer.override_loss_scale(1.0)
        return result

    # ------------------------------------------------------------------ answers
    def state_sharding(self, world_size: int) -> StateSharding:
        """ZeRO's divisions, its fp32 master partition beside the optimizer states (on the host when
        offloaded), the module's weights in a mixed run's half dtype and, from stage 2, its reduce bucket
        (``reduce_bucket_size`` elements, 5e8 unless the config says otherwise)."""
        stage, zero = zero_stage(self.config), self.config.get("zero_optimization") or {}
        offloaded = bool(_offloaded(zero.get("offload_optimizer")))
        bucket = int(float(zero.get("reduce_bucket_size", 5e8))) if stage >= 2 else 0
        return replace(
            deepspeed_sharding(stage, world_size),
            master_copy=True,
            optimizer_on_host=offloaded,
            gradient_bucket_elements=bucket,
            half_weights=True,
        )

    def held_tensors(self) -> dict[str, list[Tensor]]:
        """DeepSpeed's partitions by memory category, from its optimizer's attributes (stage 1/2 and 3 name
        them differently): its fp32 master partitions are ``optimizer`` state, its reduced and bucketed
        gradients ``grads``, ZeRO-3's parameter partitions ``params``."""
        optimizer = self.deepspeed_engine.optimizer
        held = {
            category: [t for name in names for t in _tensors_in(getattr(optimizer, name, None))]
            for category, names in HELD_ATTRIBUTES.items()
        }
        held["params"] += [p.ds_tensor for p in self.lightning_module.parameters() if hasattr(p, "ds_tensor")]
        held["grads"] += [t.grad for t in held["optimizer"] if t.grad is not None]
        return held

    @contextmanager
    def gradients_in_full(self) -> Iterator[None]:
        """Each parameter whole, with the step's whole gradient as ``.grad`` (DeepSpeed's
        ``safe_get_full_grad`` divided by the loss scale, as the engine's step divides it: the step
        objective's gradient); ZeRO-3's parameters gathered for the while. Every rank enters it."""
        import deepspeed
        from deepspeed.utils import safe_get_full_grad

        scale = float(getattr(self.deepspeed_engine.optimizer, "loss_scale", 1.0) or 1.0)
        parameters = [p for p in self.lightning_module.parameters() if p.requires_grad]
        grads = [safe_get_full_grad(p) for p in parameters]  # a collective under ZeRO-3: every rank, in order
        saved = [p.grad for p in parameters]
        with deepspeed.zero.GatheredParameters(parameters, enabled=zero_stage(self.config) == 3):
            for p, grad in zip(parameters, grads):
                p.grad = None if grad is None else (grad / scale).to(p.dtype).view(p.shape)
            try:
                yield
            finally:
                for p, grad in zip(parameters, saved):
                    p.grad = grad


HELD_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "params": ("fp16_partitioned_groups_flat",),
    "grads": (
        "averaged_gradients",
        "grads_in_partition",
        "ipg_buffer",
        "accumulated_grads_in_cpu",
        "grad_partitions_flat_buffer",
        "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
    ),
    "optimizer": ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"),
}
"""The attributes of DeepSpeed's ZeRO optimizers (stage 1/2, stage 3) that hold training state."""


def _tensors_in(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    return []


def with_keys(
    ds: dict[str, Any],
    stage: int | None,
    offload_optimizer: bool | None,
    offload_parameters: bool | None,
    communication_data_type: str | None,
    quantized_gradients: bool | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config with the strategy's keys applied; a key that contradicts the JSON is refused."""
    zero = dict(ds.get("zero_optimization") or {})
    given = {
        "stage": (("zero_optimization", "stage"), stage, zero.get("stage")),
        "offload_optimizer": (
            ("zero_optimization", "offload_optimizer"),
            offload_optimizer,
            _offloaded(zero.get("offload_optimizer")),
        ),
        "offload_parameters": (
            ("zero_optimization", "offload_param"),
            offload_parameters,
            _offloaded(zero.get("offload_param")),
        ),
        "communication_data_type": (
            ("communication_data_type",),
            communication_data_type,
            ds.get("communication_data_type"),
        ),
        "quantized_gradients": (
            ("zero_optimization", "zero_quantized_gradients"),
            quantized_gradients,
            zero.get("zero_quantized_gradients"),
        ),
    }
    for name, (path, value, in_json) in given.items():
        if value is not None and in_json is not None and value != in_json:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.{name}",
                value,
                f"contradicts the DeepSpeed config's {'.'.join(path)} {in_json!r}; give it in one place",
            )
    zero["stage"] = stage if stage is not None else zero.get("stage", 2)
    if zero["stage"] not in (1, 2, 3):
        raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.stage", zero["stage"], "use ZeRO stage 1, 2 or 3")
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_parameters:
        if zero["stage"] != 3:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.offload_parameters", True, "DeepSpeed offloads parameters at stage 3 only"
            )
        zero["offload_param"] = {"device": "cpu"}
    if quantized_gradients:
        zero["zero_quantized_gradients"] = True
    if zero.get("zero_quantized_gradients") and zero["stage"] != 3:
        raise ConfigError(
            f"{STRATEGY_OPTIONS_KEY}.quantized_gradients", True, "ZeRO++ quantises gradients at stage 3 only"
        )
    config = {**ds, "zero_optimization": zero}
    if communication_data_type is not None:
        config["communication_data_type"] = communication_data_type
    return config


def _offloaded(section: Any) -> bool | None:
    if section is None:
        return None
    return isinstance(section, dict) and section.get("device", "none") not in ("none", None)


@contextmanager
def _without_shared_memory_op() -> Iterator[None]:
    """DeepSpeed's communication backend builds a shared-memory all-reduce op on CPU when it starts (a C++
    compilation of minutes, once per machine), used by inference's all-reduce only; training's collectives
    are gloo's. Started without it."""
    backend = importlib.import_module("deepspeed.comm.torch")
    build = backend.build_shm_op
    backend.build_shm_op = lambda: None
    try:
        yield
    finally:
        backend.build_shm_op = build

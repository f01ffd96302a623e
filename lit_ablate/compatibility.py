"""Which run configurations cannot run here, decided before anything is launched.

One registry of rules, each ``(run config, launch) -> Refusal | None``: a GPU-only kernel on CPU,
flash-attn not installed, more GPUs than exist or far more CPU ranks than cores, a strategy that
refuses this accelerator. A rule reads the run's typed view (``lit_ablate.run_config.RunConfig``,
built once by ``incompatibility`` or ``lit-ablate fit``'s preflight) and returns a ``Refusal``: the
config key, its value and the fix. The ablation runner marks a variant that breaks a rule
``skipped: <refusal>`` instead of spending minutes on a run that can only crash, and ``fit`` raises
it as a ``ConfigError``; parts themselves never check which other part is active.
Add a rule by writing one function (``@rule``) and listing it in ``RULES``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import ModuleType
from typing import Any, Protocol

import torch

from lit_ablate.config_keys import NOT_GIVEN, TRAINER_STRATEGY_KEY, PairedKey, ignored_key
from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.extras import not_installed
from lit_ablate.models.adapters.quantization import OPTIONS_KEY as QUANTIZATION_KEY
from lit_ablate.models.adapters.quantization import QuantizationOptions
from lit_ablate.models.fp8.conversion import OPTIONS_KEY as FP8_KEY
from lit_ablate.models.fp8.conversion import Fp8Options
from lit_ablate.run_config import RunConfig, TrainerSettings, class_default
from lit_ablate.torch_versions import FSDP2_SHARDS_INTEGER_WEIGHTS

log = logging.getLogger(__name__)

GPU_ACCELERATORS = ("gpu", "cuda")
CPU_REFUSING_STRATEGIES = ("fsdp", "lightning.pytorch.strategies.FSDPStrategy", "FSDPStrategy")
"""Lightning's FSDP1 strategy raises on CPU; a CPU FSDP1 baseline passes ``device_id`` itself (docs/platform.md)."""
CPU_RANKS_PER_CORE = 4
"""Most CPU ranks per usable core a run may start. A rank is a process that imports torch,
Lightning and transformers (measured on the 2-core dev machine: ~5 s of CPU and ~0.4 GB resident
before its first step), so 64 ranks on 2 cores spend minutes importing, need ~25 GB and then wait
on each other in every collective. 4 per core leaves 2x headroom over the densest shipped study
(HSDP 2x2: 4 ranks on 2 cores) and still refuses such a request."""

STRATEGY_OPTIONS = f"{TRAINER_STRATEGY_KEY}.init_args"
DATA_OPTIONS = "data.init_args"
COLLATOR_KEY = f"{DATA_OPTIONS}.collator"
MOE_KEY = "model.init_args.model.moe"


class LaunchLike(Protocol):
    devices: int | None
    num_nodes: int | None
    accelerator: str | None


Rule = Callable[[RunConfig | Mapping[str, Any], LaunchLike], Refusal | None]


def rule(judge: Callable[[RunConfig, LaunchLike], Refusal | None]) -> Rule:
    """A rule judges the run's view; given a plain config (a test, a script) it judges the view of it."""

    @functools.wraps(judge)
    def judged(config: RunConfig | Mapping[str, Any], launch: LaunchLike) -> Refusal | None:
        return judge(RunConfig.of(config), launch)

    return judged


def _on_gpu(run: RunConfig, launch: LaunchLike) -> bool:
    accelerator = launch.accelerator or run.trainer.accelerator_name
    return accelerator in GPU_ACCELERATORS or (accelerator == "auto" and torch.cuda.is_available())


def _device_type(run: RunConfig, launch: LaunchLike) -> str:
    return "cuda" if _on_gpu(run, launch) else "cpu"


def _requested_size(run: RunConfig, dim: str) -> int:
    """The size the config asks of mesh dimension ``dim`` (``-1``: the ranks the others leave); 1 for a
    strategy without a mesh, or for sizes no mesh takes (the run's own error, reported when it builds)."""
    try:
        sizes = run.trainer.strategy.requested_mesh_sizes
    except ConfigError:
        return 1
    return 1 if sizes is None else sizes[dim]


@rule
def accelerator_present(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """A GPU accelerator needs a visible CUDA device."""
    accelerator = launch.accelerator or run.trainer.accelerator_name
    if accelerator in GPU_ACCELERATORS and not torch.cuda.is_available():
        return Refusal("trainer.accelerator", accelerator, "no CUDA device is visible here", shown=accelerator)
    return None


@rule
def enough_devices(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """GPU runs need as many devices per node as they ask for (CPU ranks: ``cpu_ranks_fit``)."""
    if _on_gpu(run, launch) and launch.devices is not None and launch.devices > torch.cuda.device_count():
        return Refusal(
            "trainer.devices",
            launch.devices,
            f"needs {launch.devices} GPUs per node, {torch.cuda.device_count()} visible",
        )
    return None


def usable_cpu_cores() -> int:
    """The cores this process may run on (a taskset or cgroup cpuset narrows ``os.cpu_count()``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_cpu_ranks(trainer: TrainerSettings | Mapping[str, Any], cores: int | None = None) -> None:
    """Refuse a CPU run with more ranks per node than ``CPU_RANKS_PER_CORE`` x the usable cores.

    On CPU Lightning starts one process per ``trainer.devices``, whatever the core count, and
    every rank must join every collective; far too many ranks do not fail, they hang until a
    timeout. Raises ``ConfigError`` naming ``trainer.devices``, the ranks, the cores and the limit.
    ``trainer``: the run's ``TrainerSettings`` or its ``trainer`` section. Used by ``lit-ablate fit``
    before any rank starts and, through ``cpu_ranks_fit``, by studies.
    """
    trainer = trainer if isinstance(trainer, TrainerSettings) else TrainerSettings.of(trainer)
    accelerator, devices = trainer.accelerator_name, trainer.devices_per_node
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if not on_cpu or devices is None:
        return  # GPUs are counted by enough_devices; a malformed value is Lightning's own error
    cores = cores or usable_cpu_cores()
    limit = CPU_RANKS_PER_CORE * cores
    if devices > limit:
        raise ConfigError(
            "trainer.devices",
            devices,
            f"on CPU every rank is a process; {devices} ranks on {cores} usable cores is more than the limit of "
            f"{limit} ({CPU_RANKS_PER_CORE} per core), past which the run waits (rank start-up, every collective) "
            "until it times out; "
            f"use at most {limit} devices",
        )


@rule
def cpu_ranks_fit(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """``check_cpu_ranks`` on the run's trainer settings (launch values win, as in the run's config)."""
    launched = {
        name: value
        for name, value in (("devices", launch.devices), ("accelerator", launch.accelerator))
        if value is not None
    }
    return _refusal(check_cpu_ranks, replace(run.trainer, **launched))


@rule
def single_node(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """The runner starts one node; a multi-node run is launched per node (torchrun) by the user."""
    if launch.num_nodes is not None and launch.num_nodes > 1:
        return Refusal(
            "trainer.num_nodes",
            launch.num_nodes,
            "the study runner launches a single node; run each node with torchrun",
        )
    return None


@rule
def strategy_accepts_cpu(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """Lightning's ``FSDPStrategy`` (FSDP1) refuses the CPU accelerator."""
    strategy = run.trainer.strategy
    if strategy.name in CPU_REFUSING_STRATEGIES and not _on_gpu(run, launch):
        return Refusal(
            TRAINER_STRATEGY_KEY,
            strategy.configured,
            "Lightning's FSDP1 refuses CPU; use FSDP2Strategy or run on GPU",
            shown=strategy.name,
        )
    return None


@rule
def loss_backend_available(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """The loss kernel must run here (liger / cce need CUDA and their package, or the Triton
    interpreter opt-in at fp32/fp16; cce's kernel does not train in float32): ``LossChoice.check_runs_here``.

    An unknown backend name is not an incompatibility of this machine but the run's own error,
    so it is left to the run (recorded as failed with its message).
    """
    loss = run.model.loss
    if not loss.registered:
        return None
    return _refusal(loss.check_runs_here, run.compute_dtype)


@rule
def attention_backend_available(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """The attention backend must train here (flash-attn installed, flex backward needs CUDA).

    As for losses, an unknown name is left to the run's own error.
    """
    attention = _helper_module(
        "lit_ablate.models.attention.backends",
        ("check_attention_backend", "TRANSFORMERS_BACKENDS", "TRANSFORMERS_FLASH_BACKENDS", "BACKENDS"),
    )
    name = run.model.attention
    known = (
        ()
        if attention is None
        else (*attention.TRANSFORMERS_BACKENDS, *attention.TRANSFORMERS_FLASH_BACKENDS, *attention.BACKENDS)
    )
    if name not in known:
        return None
    return _refusal(attention.check_attention_backend, name, training=True)


@rule
def strategy_options_run_here(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """GPU-only strategy options (CPU offload, bf16 gradient compression) need a GPU."""
    from lit_ablate.strategies.gpu_only import check_gpu_only_options

    strategy = run.trainer.strategy
    if strategy.section is None:
        return None
    return _refusal(check_gpu_only_options, strategy.options, _device_type(run, launch))


@rule
def cp_block_kernel_runs_here(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """Context parallelism's block kernel must train here (flash-attn installed, flex on CUDA)."""
    from lit_ablate.models.attention.block_kernels import block_kernel

    if _requested_size(run, "cp") == 1:
        return None
    name = run.trainer.strategy.option("cp_block_kernel", "sdpa")
    return _refusal(block_kernel, name, torch.device(_device_type(run, launch)))


@rule
def optimizer_runs_here(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """The optimizer must update the strategy's parameters on this device (bitsandbytes' 8-bit
    AdamW cannot update FSDP2's DTensors; paged optimizers need CUDA): ``optimizer_refusal``."""
    from lit_ablate.modules.optim import OPTIMIZER_KEY, OPTIMIZERS, optimizer_refusal

    name = run.model.optimizer
    if name not in OPTIMIZERS:  # default AdamW, or an unknown name: the run's own error
        return None
    reason = optimizer_refusal(name, run.trainer.strategy.cls, _device_type(run, launch))
    return Refusal(OPTIMIZER_KEY, name, reason, shown=name) if reason else None


@rule
def quantization_runs_under_strategy(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """Quantised base weights the strategy cannot shard (FSDP1 flat parameters, 8-bit under
    DTensor strategies): ``quantization_refusal``."""
    options = run.model.quantization
    if options is None:
        return None
    reason = quantization_refusal(options, run.trainer.strategy.cls, run.model.dtype)
    return Refusal(QUANTIZATION_KEY, run.model.quantization_section, reason) if reason else None


@rule
def preference_parts_fit(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """DPO's parts must agree: ``DPO`` and its subclasses (known by type, whatever their name) train
    on ``format: preference`` (and only they do), prefix sharing needs an attention backend that
    takes its branch mask (``sdpa``/``eager``: varlen and packed kernels know documents, not
    branches), and ``logprobs: liger`` sums one sequence per padded row (no packed rows)."""
    from lit_ablate.models.attention.prefix_sharing import MASK_BACKENDS
    from lit_ablate.modules.dpo import DPO

    module = run.model.module
    dpo = module.is_a(DPO)  # research subclasses included
    data_format = run.data.format
    if dpo and data_format not in (None, "preference"):
        return Refusal(
            "data.init_args.format",
            data_format,
            "DPO trains on preference pairs; use format: preference",
            shown=data_format,
        )
    if module.cls is not None and not dpo and data_format == "preference":
        return Refusal(
            "data.init_args.format",
            data_format,
            f"{module.class_path} trains on tokens; preference pairs need lit_ablate.modules.DPO or a subclass of it",
            shown=data_format,
        )
    packed = run.data.packs_preference_pairs
    attention = run.model.attention
    if packed and run.data.collator.option("prefix_sharing") and attention not in MASK_BACKENDS:
        return Refusal(
            "model.init_args.model.attn_implementation",
            attention,
            "prefix sharing masks the rejected "
            f"branch off the chosen one, which only {MASK_BACKENDS} take; use one of them or prefix_sharing: "
            "false",
            shown=attention,
        )
    if dpo and packed and run.model.option("logprobs") == "liger":
        return Refusal(
            "model.init_args.logprobs",
            "liger",
            "Liger's fused DPO sums one sequence per padded row; use "
            "PreferencePaddingCollator, or logprobs: chunked for packed rows",
            shown="liger",
        )
    return None


@rule
def fp8_runs_here(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """fp8 needs torchao (the ``fp8`` extra); ``emulate: false`` needs fp8 kernels on this device; fp8
    all-gather needs FSDP2; tensor parallelism takes ``tensorwise`` only: ``resolve_emulation``,
    ``fp8_refusal``, ``fp8_tensor_parallel_refusal``."""
    return _fp8_refusal(run, launch, judge_gpu=True)


@rule
def fp8_fits_cluster_nodes(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """``fp8_runs_here`` for a cluster's declared nodes: a GPU node's fp8 kernels (its compute
    capability) are unknown where the study is planned, so the job's own start-up judges them
    (``lit-ablate fit`` refuses ``emulate: false`` in one line); CPU nodes are judged as here."""
    return _fp8_refusal(run, launch, judge_gpu=False)


def _fp8_refusal(run: RunConfig, launch: LaunchLike, judge_gpu: bool) -> Refusal | None:
    from lit_ablate.models.fp8.conversion import resolve_emulation

    options = run.model.fp8
    if options is None:
        return None
    missing = not_installed("torchao", "fp8 training (torchao float8)") if judge_gpu else None
    if missing:  # this machine's package; a cluster's nodes have their own
        return Refusal(FP8_KEY, run.model.fp8_section, missing)
    on_gpu = _on_gpu(run, launch)
    if judge_gpu or not on_gpu:
        refusal = _refusal(resolve_emulation, options, torch.device("cuda" if on_gpu else "cpu"))
        if refusal:
            return refusal
    reason = fp8_refusal(options, run.trainer.strategy.cls)
    if reason:
        return Refusal(FP8_KEY, run.model.fp8_section, reason)
    reason = fp8_tensor_parallel_refusal(options, _requested_size(run, "tp"))
    return Refusal(f"{FP8_KEY}.recipe", options.recipe, reason) if reason else None


@rule
def pipeline_stages_split_the_model(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """A pipeline splits the model over ranks: its first and last stage (the embeddings, the LM head) are
    on different ranks, rank 0 and rank ``pp - 1`` (interleaved stages loop from one to the other), and
    a tied matrix is held as two copies whose gradients are summed (``pipeline_tied_embeddings``). With
    ``pp`` 1 one rank would hold the first and the last stage, which torch's schedules do not run (tied
    or not): refused, for the mesh strategy that runs a whole model on each rank."""
    from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
    from lit_ablate.strategies.pipeline_split import ONE_STAGE_FIX

    strategy = run.trainer.strategy
    if not strategy.is_a(PipelineParallelStrategy):
        return None
    try:
        pp = strategy.mesh_size("pp", _world_size(run, launch))
    except ConfigError:  # sizes that do not make the world size: check_mesh's refusal
        return None
    return Refusal(f"{STRATEGY_OPTIONS}.pp", pp, ONE_STAGE_FIX) if pp == 1 else None


@rule
def pipeline_stages_train_the_objective(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """Pipeline stages train DPO with a ``precomputed`` or no reference, padded pairs and ``torch`` or
    ``chunked`` log-probs: a ``frozen`` reference is a second model the stages do not hold, an
    ``adapter`` reference runs the policy twice per step (not built under the schedule), Liger's fused
    DPO reads the whole batch's hidden states at once, and packed pairs cannot be cut into micro-batches
    of whole pairs."""
    if _requested_size(run, "pp") == 1 or not run.model.module.class_path.endswith("DPO"):
        return None
    reference = run.model.option("reference")
    if reference in ("frozen", "adapter"):
        return Refusal(
            "model.init_args.reference",
            reference,
            "pipeline stages run one model once per micro-batch; "
            "use reference: precomputed (its log-probs computed once through the stages) or none, or pp: 1",
            shown=reference,
        )
    if run.model.option("logprobs") == "liger":
        return Refusal(
            "model.init_args.logprobs",
            "liger",
            "Liger's fused DPO loss reads the whole batch's hidden "
            "states at once, which the last stage never holds; use logprobs: chunked or torch, or pp: 1",
            shown="liger",
        )
    if run.data.packs_preference_pairs:
        return Refusal(
            "data.init_args.collator",
            run.data.collator.section,
            "packed pairs cannot be cut into "
            "micro-batches of whole pairs; use PreferencePaddingCollator with static_length: true, or pp: 1",
            shown=run.data.collator.name,
        )
    return None


# --- the model's shape and the batches against the mesh: what the ranks would refuse once they run ---------


def _world_size(run: RunConfig, launch: LaunchLike) -> int:
    """The run's ranks: the launch's devices and nodes where a study sets them, else the config's."""
    return (launch.devices or run.trainer.devices_per_node or 1) * (launch.num_nodes or run.trainer.nodes)


def _mesh_size(run: RunConfig, launch: LaunchLike, dim: str) -> int:
    """The size of mesh dimension ``dim`` on the run's ranks (a ``-1`` resolved); 1 for a strategy without a
    mesh, or sizes that do not make the world size (``check_mesh``'s refusal, named there)."""
    try:
        return run.trainer.strategy.mesh_size(dim, _world_size(run, launch))
    except ConfigError:
        return 1


def _model_config(run: RunConfig) -> Any | None:
    """The Hugging Face config of the run's model, as ``ModelFactory`` builds it (from a preset, a config or a
    pretrained folder's ``config.json``, no weights); None for a model section the run itself refuses."""
    try:
        return run.model.build_factory().hf_config()
    except (ConfigError, TypeError, OSError):
        return None


@rule
def experts_split_over_ep(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """Expert parallelism shards lit-ablate's MoE blocks (``moe.experts: grouped`` or ``loop``), each rank
    holding ``experts / ep`` of them: ``ep`` must divide the experts of a layer. The ranks found out after
    their start-up (104 s of it in a study's run)."""
    ep = _mesh_size(run, launch, "ep")
    if ep == 1:
        return None
    try:
        factory = run.model.build_factory()
    except (ConfigError, TypeError):
        return None
    experts = factory.moe.experts if factory.moe is not None else "hf"
    if experts == "hf":
        return Refusal(
            f"{MOE_KEY}.experts",
            experts,
            "expert parallelism shards lit-ablate's MoE blocks; use an MoE "
            "model with moe: {experts: grouped} (or loop)",
        )
    config = _model_config(run)
    count = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if count and count % ep:
        return Refusal(
            f"{STRATEGY_OPTIONS}.ep", ep, f"the model has {count} experts per layer; use an ep that divides {count}"
        )
    return None


@rule
def tensor_parallel_splits_the_model(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """Tensor parallelism splits the attention heads, the key/value heads and the vocabulary over ``tp``
    ranks: ``tp`` must divide each (what the tensor-parallel step checks once the model is built)."""
    tp = _mesh_size(run, launch, "tp")
    config = _model_config(run) if tp != 1 else None
    for name in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value % tp:
            return Refusal(f"{STRATEGY_OPTIONS}.tp", tp, f"the model's {name} is {value}; use a tp that divides it")
    return None


@rule
def sequence_parallel_rows_split(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """Sequence parallelism splits every row's tokens over the ``tp`` ranks: every batch's length must be a
    multiple of ``tp``, which the collator decides (refused at the first batch before)."""
    tp = _mesh_size(run, launch, "tp")
    if tp == 1 or not run.trainer.strategy.option("sequence_parallel", False):
        return None
    return _rows_refusal(run, tp, f"sequence parallelism splits each row over tp={tp} ranks")


@rule
def sequence_parallel_adapters_run_here(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """LoRA adapters under sequence parallelism need a torch whose DTensor computes a linear layer on a
    sequence-sharded input (``sequence_parallel_adapters_refusal``; the plan refuses the same mid-run)."""
    from lit_ablate.strategies.tensor_parallel_plans import sequence_parallel_adapters_refusal

    if (
        _mesh_size(run, launch, "tp") == 1
        or not run.trainer.strategy.option("sequence_parallel", False)
        or run.model.adapter_section is None
    ):
        return None
    reason = sequence_parallel_adapters_refusal()
    return Refusal(f"{STRATEGY_OPTIONS}.sequence_parallel", True, reason) if reason else None


def _rows_refusal(run: RunConfig, multiple: int, why: str) -> Refusal | None:
    """Why a batch's length may not be a multiple of ``multiple`` (its rows are padded to a length the
    collator picks), naming the key that fixes it; None when every batch's is."""
    data, collator = run.data, run.data.collator
    seq_len = data.seq_len if isinstance(data.seq_len, int) else None
    fix = f"{why}, so every batch's length must be a multiple of {multiple}"
    if collator is not None and collator.name == "PackingCollator":
        capacity = collator.option("max_tokens") or seq_len
        if not collator.option("static_shape", False):
            return Refusal(
                f"{COLLATOR_KEY}.init_args.static_shape",
                False,
                f"{fix}, and packed rows are as long as "
                f"their longest; set static_shape: true with max_tokens (or seq_len) a multiple of {multiple}",
            )
        if capacity and capacity % multiple:
            key = "max_tokens" if collator.option("max_tokens") else None
            return Refusal(
                f"{COLLATOR_KEY}.init_args.{key}" if key else "data.init_args.seq_len",
                capacity,
                f"{fix}; use a multiple of {multiple}",
            )
        return None
    if collator is not None and collator.name != "PaddingCollator":
        return None  # a collator of the user's own: the first batch tells
    pad_to = collator.option("pad_to_multiple_of", 1) if collator is not None else 1
    fixed = data.format == "pretrain" or (collator is not None and collator.option("static_length", False))
    if isinstance(pad_to, int) and pad_to % multiple == 0:
        return None
    if fixed and seq_len and -(-seq_len // pad_to) * pad_to % multiple == 0:
        return None  # every row is seq_len long (pretrain windows, or static_length)
    if collator is None:
        return Refusal(
            COLLATOR_KEY,
            None,
            f"{fix}, and the default PaddingCollator pads each batch to its longest "
            f"row; set it to {{class_path: lit_ablate.data.PaddingCollator, init_args: {{pad_to_multiple_of: "
            f"{multiple}}}}}",
        )
    return Refusal(f"{COLLATOR_KEY}.init_args.pad_to_multiple_of", pad_to, f"{fix}; use a multiple of {multiple}")


@rule
def context_parallel_attends(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """Context-parallel attention (ring, all-gather) has no dropout and no sliding window, and shards
    language-model batches, whose loss is a sum over tokens: DPO's per-sequence log-probs would sum each
    rank's part of a sequence. The first forward (or batch) refused them once the ranks ran."""
    from lit_ablate.modules.dpo import DPO

    cp = _mesh_size(run, launch, "cp")
    if cp == 1:
        return None
    if run.model.module.is_a(DPO):
        return Refusal(
            f"{STRATEGY_OPTIONS}.cp",
            cp,
            "context parallelism shards language-model batches; DPO's "
            "per-sequence log-probs would sum each rank's part of a sequence: use cp: 1 for DPO",
        )
    config = _model_config(run)
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        return Refusal(
            "model.init_args.model.config.attention_dropout",
            dropout,
            "context-parallel attention has no dropout; set attention_dropout: 0",
        )
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types or (
        window and not layer_types and getattr(config, "use_sliding_window", True)
    ):
        return Refusal(
            "model.init_args.model.config.sliding_window",
            window,
            "context-parallel attention has no sliding window; use a model without one, or cp: 1",
        )
    return None


@rule
def pipeline_stages_fit(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """What the pipeline strategy refused once its ranks ran: a model type its stages are not built for,
    more stages (``pp`` x ``stages_per_rank``) than decoder layers, split points that do not split the
    layers into them, a schedule's micro-batch count (1f1b fills ``pp`` stages; interleaved runs rounds of
    ``pp``), a batch the micro-batches do not divide, and batches of varying length (torch's stages size
    their hand-off buffers by the first)."""
    from lit_ablate.strategies.pipeline_parallel import SUPPORTED_MODEL_TYPES, PipelineParallelStrategy
    from lit_ablate.strategies.pipeline_split import check_split_points

    strategy = run.trainer.strategy
    pp = _mesh_size(run, launch, "pp")
    if pp == 1 or not strategy.is_a(PipelineParallelStrategy):
        return None
    config = _model_config(run)
    if config is not None and config.model_type not in SUPPORTED_MODEL_TYPES:
        return Refusal(
            "model.init_args.model",
            config.model_type,
            f"pipeline stages are built for {', '.join(SUPPORTED_MODEL_TYPES)} models; use one of them, or pp: 1",
            shown=config.model_type,
        )
    per_rank, layers = strategy.option("stages_per_rank", 1), getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < pp * per_rank:
        key, value = ("pp", pp) if per_rank == 1 else ("stages_per_rank", per_rank)
        return Refusal(
            f"{STRATEGY_OPTIONS}.{key}",
            value,
            f"{pp * per_rank} stages of a model with {layers} decoder "
            f"layers; use at most {layers} stages (pp x stages_per_rank)",
        )
    points = strategy.option("split_points")
    if points is not None and isinstance(layers, int):
        refusal = _refusal(check_split_points, list(points), layers, pp * per_rank)
        if refusal:
            return refusal
    microbatches, schedule = strategy.option("microbatches", 1), strategy.option("schedule", "1f1b")
    if schedule == "1f1b" and microbatches < pp:
        return Refusal(
            f"{STRATEGY_OPTIONS}.microbatches",
            microbatches,
            f"1f1b needs at least pp={pp} micro-batches to fill the pipeline; raise it or use gpipe",
        )
    if schedule == "interleaved_1f1b" and microbatches % max(1, microbatches // pp):
        return Refusal(
            f"{STRATEGY_OPTIONS}.microbatches",
            microbatches,
            f"interleaved_1f1b runs rounds of pp={pp} micro-batches: use a multiple of {pp}, or fewer than {pp}",
        )
    batch_size = run.data.batch_size
    if isinstance(batch_size, int) and batch_size % microbatches:
        return Refusal(
            f"{STRATEGY_OPTIONS}.microbatches",
            microbatches,
            f"data.init_args.batch_size is {batch_size}; use a divisor of the batch size",
        )
    if run.data.format not in (None, "pretrain"):
        return _static_rows_refusal(run)
    return None


def _static_rows_refusal(run: RunConfig) -> Refusal | None:
    """Pipeline stages take every batch in one shape: variable-length rows must be padded to ``seq_len``."""
    collator = run.data.collator
    why = "pipeline stages take every training batch in one shape (torch sizes their hand-off buffers once)"
    if collator is None:
        return Refusal(
            COLLATOR_KEY,
            None,
            f"{why}, and the default collator pads each batch to its longest row; "
            "set it to {class_path: lit_ablate.data.PaddingCollator, init_args: {static_length: true}} "
            "(PreferencePaddingCollator for preference pairs)",
        )
    option = {
        "PaddingCollator": "static_length",
        "PreferencePaddingCollator": "static_length",
        "PackingCollator": "static_shape",
    }.get(collator.name)
    if option and not collator.option(option, False):
        return Refusal(
            f"{COLLATOR_KEY}.init_args.{option}", False, f"{why}; set {option}: true (every batch padded to seq_len)"
        )
    return None


@rule
def tensor_parallel_loss_fits(run: RunConfig, launch: LaunchLike) -> Refusal | None:
    """Tensor parallelism takes the ``torch`` (without z-loss) and ``chunked`` loss backends: those
    compute on a vocabulary-sharded LM head (``LossChoice.check_tensor_parallel``)."""
    if _requested_size(run, "tp") == 1:
        return None
    return _refusal(run.model.loss.check_tensor_parallel)


MESH_OPTIONS = {
    "tp": ("sequence_parallel",),
    "cp": ("cp_impl", "cp_layout", "cp_block_kernel"),
    "ep": ("dispatch",),
    "pp": ("schedule", "microbatches", "split_points", "stages_per_rank"),
}
"""The strategy options of one mesh dimension's step: that step runs only when its size is not 1."""
PAIRED_OPTIONS: tuple[PairedKey, ...] = (
    *(
        PairedKey(f"{STRATEGY_OPTIONS}.{name}", f"{STRATEGY_OPTIONS}.{dim}", lambda size: size != 1, "not 1")
        for dim, names in MESH_OPTIONS.items()
        for name in names
    ),
    PairedKey(
        f"{STRATEGY_OPTIONS}.checkpoint_every",
        f"{STRATEGY_OPTIONS}.activation_checkpointing",
        lambda mode: mode not in (None, "none"),
        "full or selective",
    ),
    PairedKey(
        f"{STRATEGY_OPTIONS}.compile_backend", f"{STRATEGY_OPTIONS}.compile_layers", lambda on: on is True, "true"
    ),
    *(
        PairedKey(
            f"{STRATEGY_OPTIONS}.{name}", f"{STRATEGY_OPTIONS}.comm_hook", lambda hook: hook == "powersgd", "powersgd"
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
"""Options that act only together with another key's value (``config_keys.PairedKey``). A mesh size
counts as given: ``-1`` (the ranks left) acts, so a study sweeping the devices from 1 keeps its options."""


def check_keys_act_together(config: RunConfig | Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` for an option the config gives (other than its class's default) that its
    partner turns off, so the run would ignore it without a word (``PAIRED_OPTIONS``): ``cp_layout`` with
    ``cp: 1``, ``powersgd_rank`` without ``comm_hook: powersgd``, ``blocksize`` at ``bits: 8``, ``cache_dir`` with
    ``storage: memory``."""
    run = RunConfig.of(config)
    refusal = ignored_key(PAIRED_OPTIONS, lambda key: _given_option(run, key), lambda key: _option_value(run, key))
    if refusal:
        raise refusal.error()


def _option_section(run: RunConfig, key: str) -> tuple[Mapping[str, Any], Any, str]:
    """``(what the config gives, the class whose defaults fill the rest, the option's name)`` for ``key``."""
    section, _, name = key.rpartition(".")
    if section == STRATEGY_OPTIONS:
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
    if name in MESH_OPTIONS:
        return _requested_size(run, name)
    if name in given:
        return given[name]
    return class_default(cls, name) if isinstance(cls, type) else None


RULES: dict[str, Rule] = {
    "accelerator_present": accelerator_present,
    "enough_devices": enough_devices,
    "cpu_ranks_fit": cpu_ranks_fit,
    "single_node": single_node,
    "strategy_accepts_cpu": strategy_accepts_cpu,
    "strategy_options_run_here": strategy_options_run_here,
    "loss_backend_available": loss_backend_available,
    "attention_backend_available": attention_backend_available,
    "cp_block_kernel_runs_here": cp_block_kernel_runs_here,
    "optimizer_runs_here": optimizer_runs_here,
    "quantization_runs_under_strategy": quantization_runs_under_strategy,
    "fp8_runs_here": fp8_runs_here,
    "preference_parts_fit": preference_parts_fit,
    "tensor_parallel_loss_fits": tensor_parallel_loss_fits,
    "pipeline_stages_split_the_model": pipeline_stages_split_the_model,
    "pipeline_stages_train_the_objective": pipeline_stages_train_the_objective,
    "experts_split_over_ep": experts_split_over_ep,
    "tensor_parallel_splits_the_model": tensor_parallel_splits_the_model,
    "sequence_parallel_rows_split": sequence_parallel_rows_split,
    "sequence_parallel_adapters_run_here": sequence_parallel_adapters_run_here,
    "pipeline_stages_fit": pipeline_stages_fit,
    "context_parallel_attends": context_parallel_attends,
}


MACHINE_RULES = (
    "accelerator_present",
    "enough_devices",
    "cpu_ranks_fit",
    "single_node",
    "loss_backend_available",
    "attention_backend_available",
    "cp_block_kernel_runs_here",
)
"""Rules that judge this machine (its CUDA devices, cores and packages), not the run. A study
submitted to a cluster skips them (``cluster_rules``): the partition's size is checked instead,
and each job's own start-up judges its node."""


CLUSTER_VERSIONS: dict[str, Rule] = {"fp8_runs_here": fp8_fits_cluster_nodes}
"""Rules that judge a device through this machine's CUDA, in the version that judges a cluster's
declared nodes without it (planning on a login node without CUDA crashed in ``fp8_runs_here``)."""


def cluster_rules() -> dict[str, Rule]:
    """The rules for a study submitted to a cluster: about the run, never about this machine."""
    return {name: CLUSTER_VERSIONS.get(name, judge) for name, judge in RULES.items() if name not in MACHINE_RULES}


def refusal_of(
    config: RunConfig | Mapping[str, Any], launch: LaunchLike, rules: Mapping[str, Rule] = RULES
) -> Refusal | None:
    """The first rule's refusal of this run here, or None when every rule passes (the view is built once)."""
    run = RunConfig.of(config)
    for judge in rules.values():
        refusal = judge(run, launch)
        if refusal:
            return refusal
    return None


def incompatibility(
    config: RunConfig | Mapping[str, Any], launch: LaunchLike, rules: Mapping[str, Rule] = RULES
) -> str | None:
    """The first reason this run cannot run here, as a study's skip reason shows it, or None."""
    refusal = refusal_of(config, launch, rules)
    return None if refusal is None else str(refusal)


def _refusal(check: Callable[..., Any], *args: Any, **kwargs: Any) -> Refusal | None:
    """A part's check raises ``ConfigError`` (key, value, fix) when it cannot run: that is the refusal."""
    try:
        check(*args, **kwargs)
    except ConfigError as err:
        return err.refusal
    return None


_missing_helpers: set[str] = set()


def _helper_module(module: str, names: tuple[str, ...]) -> ModuleType | None:
    """A part's module if it has its own availability checks; one that has none yet is not
    pre-checked, and that is warned once (not a silent pass)."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        found = None
    missing = [n for n in names if not hasattr(found, n)]
    if missing:
        if module not in _missing_helpers:
            _missing_helpers.add(module)
            log.warning("compatibility: %s has no %s; that part is not pre-checked", module, ", ".join(missing))
        return None
    return found


# --- the parts of a built run (``LitAblateCLI.before_fit``; a Python user calls ``check_parts``) -------------


def check_parts(module: object, strategy: object) -> None:
    """Raise ``ConfigError`` for a built module's quantisation or fp8 that ``strategy`` cannot train:
    the same rules the config-level checks above apply, for a run started from Python."""
    from lit_ablate.modules.causal_lm import CausalLM

    if isinstance(module, CausalLM):
        check_quantization(module.factory.quantization, strategy, module.factory.dtype)
        check_fp8(module.factory.fp8, strategy)


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
    """Why ``options`` cannot train under ``strategy`` (an instance or class), or None: fp8
    all-gather is a hook of FSDP2's ``fully_shard`` (the mesh strategies' FSDP step, ``FullyShardSteps``)."""
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
    """Why ``options`` cannot train at tensor-parallel size ``tp`` (-1: the ranks left, so above 1), or
    None: torchao's float8 styles (``tensor_parallel_plans``) cast activations and gradients with one
    scale per tensor, so only the ``tensorwise`` recipe."""
    if tp != 1 and options.recipe != "tensorwise":
        return (
            "tp > 1 splits fp8 layers with torchao's float8 styles, which scale one per tensor; "
            "use recipe: tensorwise or tp: 1"
        )
    return None


def check_fp8(options: Fp8Options | None, strategy: object) -> None:
    """Raise ``ConfigError`` naming ``model.init_args.model.fp8.fsdp_all_gather`` when ``fp8_refusal`` has a reason."""
    reason = fp8_refusal(options, strategy)
    if reason:
        raise ConfigError(f"{FP8_KEY}.fsdp_all_gather", True, reason)
    from lit_ablate.strategies.mesh import MeshStrategy

    tp = strategy.requested_mesh_sizes.tp if isinstance(strategy, MeshStrategy) else 1
    reason = fp8_tensor_parallel_refusal(options, tp) if options is not None else None
    if reason:
        raise ConfigError(f"{FP8_KEY}.recipe", options.recipe, reason)

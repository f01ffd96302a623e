"""The optimizer chosen in YAML (AdamW, 8-bit AdamW of bitsandbytes or torchao), decoupled weight
decay groups, and the learning-rate schedule (warm-up, then linear, cosine, constant or
warm-up-stable-decay).

8-bit AdamW keeps both moments as 8-bit codes with one scale per block (2 bytes per parameter
instead of 8 in fp32); both libraries keep tensors under 4096 elements in fp32 (bitsandbytes'
``min_8bit_size``, torchao's fixed threshold), so small adapters barely shrink. Whether an
optimizer can update the parameters a strategy hands it is decided before the model is built
(``optimizer_refusal``) and by the rule ``optimizer_runs_here``, not discovered at step 1.

torch's AdamW has three implementations of one update: a Python loop over parameters, ``foreach``
(one kernel launch per operation over a list of tensors) and ``fused`` (one kernel for the whole
update). ``adamw_implementation`` picks fused wherever torch has the kernel (CUDA, where it saves
most launches per step and keeps the step counts on the device; the CPU, where it reads and writes
each parameter's states once instead of in about ten passes), unless the parameters rule it out or
``optimizer_options`` choose; the run record names the one that ran.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices, _get_fused_kernels_supported_devices

from lit_ablate.class_paths import import_class
from lit_ablate.errors import ConfigError
from lit_ablate.extras import installed, not_installed

OPTIMIZER_KEY = "model.init_args.optimizer"
OPTIMIZER_OPTIONS_KEY = "model.init_args.optimizer_options"
OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim.AdamW",
    "bnb_adamw8bit": "bitsandbytes.optim.AdamW8bit",
    "bnb_paged_adamw8bit": "bitsandbytes.optim.PagedAdamW8bit",
    "bnb_paged_adamw": "bitsandbytes.optim.PagedAdamW",
    "torchao_adamw8bit": "torchao.optim.AdamW8bit",
}
"""Config name -> optimizer class. All take ``(params, lr, betas, weight_decay, ...)``."""
STATE_BYTES_PER_PARAMETER = {
    "adamw": None,
    "bnb_adamw8bit": 2.0,
    "bnb_paged_adamw8bit": 2.0,
    "bnb_paged_adamw": 8.0,
    "torchao_adamw8bit": 2.0,
}
"""Optimizer-state bytes per (large enough) parameter; None: two moments in the parameter's dtype."""


def optimizer_refusal(name: str, strategy: Strategy | type | None = None, device_type: str | None = None) -> str | None:
    """Why optimizer ``name`` cannot run under ``strategy`` (an instance or class) on ``device_type``, or None
    (what is not given is not checked).

    - bitsandbytes' optimizers index plain tensors: under a strategy whose parameters are
      DTensors (FSDP2, HSDP, expert/context parallel: every ``ModelParallelStrategy``) they fail
      at the first step ("mixed torch.Tensor and DTensor"); torchao's AdamW8bit handles DTensors.
    - Paged optimizers page their states through CUDA unified memory; on CPU bitsandbytes quietly
      runs the unpaged one, which would label a variant with what it did not do.
    - A library that is not installed.
    """
    if name not in OPTIMIZERS:
        return f"choose one of {list(OPTIMIZERS)}"
    library = OPTIMIZERS[name].split(".")[0]
    missing = not_installed(library, f"the {name} optimizer", extra="optim8bit") if library == "torchao" else None
    if missing or not installed(library):  # bitsandbytes is a dependency of lit-ablate itself
        return (
            missing
            or f"{library} is not installed here (a dependency of lit-ablate): "
            f"pip install -e . or pip install {library}"
        )
    strategy_class = strategy if isinstance(strategy, type) or strategy is None else type(strategy)
    if library == "bitsandbytes" and strategy_class is not None and issubclass(strategy_class, ModelParallelStrategy):
        return (
            f"bitsandbytes' optimizers cannot update the DTensor parameters of {strategy_class.__name__} "
            "('mixed torch.Tensor and DTensor'); use torchao_adamw8bit, which shards its states with them"
        )
    if "paged" in name and device_type not in (None, "cuda"):
        return (
            f"paged optimizers need CUDA unified memory; on {device_type} bitsandbytes would run the unpaged one: "
            "use bnb_adamw8bit"
        )
    return None


def check_optimizer(name: str, strategy: Strategy | type | None = None, device_type: str | None = None) -> None:
    """Raise ``ConfigError`` naming ``model.init_args.optimizer`` when ``optimizer_refusal`` has a reason."""
    reason = optimizer_refusal(name, strategy, device_type)
    if reason:
        raise ConfigError(OPTIMIZER_KEY, name, reason)


def module_arguments(module_class: type) -> set[str]:
    """The named arguments of ``module_class``'s ``__init__`` chain (a DPO module's ``beta`` with CausalLM's
    ``learning_rate``): keys a user may have meant when they put them in ``optimizer_options``."""
    names = set()
    for cls in module_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None or cls.__module__.startswith(("lightning", "torch")):
            continue
        names |= {
            k
            for k, p in inspect.signature(init).parameters.items()
            if k != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }
    return names - {"optimizer", "optimizer_options", "model"}


GOVERNED_OPTIONS = {"lr": "learning_rate", "betas": "betas", "weight_decay": "weight_decay"}
"""Optimizer keywords the module sets itself (the learning rate and its schedule, the betas, the decay per
parameter group, which wins over the optimizer's default): an ``optimizer_options`` entry would be refused
by the optimizer (a second value) or ignored, so it is refused naming the module's argument that governs it."""


def check_optimizer_arguments(
    name: str, betas: Sequence[float], options: Mapping[str, Any], module_arguments: Collection[str] = ()
) -> None:
    """``betas`` and ``optimizer_options`` as optimizer ``name``'s class will take them, checked at
    construction (before any rank starts, and for every variant of a study) instead of when the
    optimizer is built after the model: each beta in [0, 1), every option a keyword of the class the
    module does not set itself, and the values the class itself validates (AdamW's ``eps``), tried on a
    one-element parameter. An option that is one of the module's own arguments (``module_arguments``, e.g.
    DPO's ``beta``), or close to one, is refused naming that argument's key."""
    for index, beta in enumerate(betas):
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0 <= beta < 1:
            raise ConfigError(
                "model.init_args.betas",
                list(betas),
                f"each beta must be in [0, 1) (index {index} is not); AdamW's usual are [0.9, 0.95]",
            )
    cls = import_class(OPTIMIZERS[name])
    accepted = [
        k
        for k, p in inspect.signature(cls.__init__).parameters.items()
        if k not in ("self", "params", *GOVERNED_OPTIONS) and p.kind is not p.VAR_KEYWORD
    ]
    own = {argument: argument for argument in module_arguments} | GOVERNED_OPTIONS
    for key in options:
        if key in own:
            raise ConfigError(
                f"{OPTIMIZER_OPTIONS_KEY}.{key}",
                options[key],
                f"{key} is set by the module itself: set model.init_args.{own[key]} instead",
            )
        if key not in accepted:
            close = difflib.get_close_matches(key, [*accepted, *own], n=1)
            where = (
                (f"model.init_args.{own[close[0]]}" if close[0] in own else f"{OPTIMIZER_OPTIONS_KEY}.{close[0]}")
                if close
                else None
            )
            raise ConfigError(
                f"{OPTIMIZER_OPTIONS_KEY}.{key}",
                options[key],
                f"{OPTIMIZERS[name]} takes no {key}; "
                + (f"did you mean {where}?" if where else f"it takes {accepted}"),
            )
    try:
        cls([torch.zeros(1, requires_grad=True)], lr=1e-3, betas=tuple(betas), **options)
    except (TypeError, ValueError) as err:
        raise ConfigError(OPTIMIZER_OPTIONS_KEY, dict(options), f"{OPTIMIZERS[name]} refused them: {err}") from err


def build_optimizer(
    name: str,
    groups: list[dict],
    lr: float,
    betas: tuple[float, float],
    options: dict[str, Any] | None = None,
    not_fused: str | None = None,
) -> tuple[torch.optim.Optimizer, str | None]:
    """Optimizer ``name`` over parameter ``groups`` (their ``weight_decay`` wins over the default),
    and the fallback it took, if any (``adamw_implementation``: warned once, for the run record).

    ``options`` are the class's own extra arguments (e.g. bitsandbytes' ``min_8bit_size``,
    torchao's ``block_size``, AdamW's ``fused``/``foreach``); an unknown one is refused naming
    ``model.init_args.optimizer_options``. ``not_fused``: why the run cannot take a fused AdamW
    (``amp_clipping_rules_out_fused``), or None.
    """
    cls = import_class(OPTIMIZERS[name])
    given = options = dict(options or {})
    fallback = None
    if name == "adamw":
        if not_fused is not None and options.get("fused"):
            raise ConfigError(f"{OPTIMIZER_OPTIONS_KEY}.fused", True, f"{not_fused}: remove it")
        kinds = {parameter_kind(p) for group in groups for p in group["params"]}
        implementation, fallback = adamw_implementation(kinds, options, not_fused)
        options = {"fused": implementation == "fused", "foreach": implementation == "foreach", **options}
        if fallback:
            rank_zero_warn(fallback)
    try:
        return cls(groups, lr=lr, betas=betas, **options), fallback
    except TypeError as err:
        raise ConfigError(OPTIMIZER_OPTIONS_KEY, given, f"{OPTIMIZERS[name]} refused them: {err}") from err


AdamWImplementation = Literal["fused", "foreach", "for-loop"]


@dataclass(frozen=True)
class ParameterKind:
    """What decides which AdamW kernels can update a parameter."""

    tensor: str
    """``tensor`` (a plain tensor or Parameter), ``dtensor`` (a DTensor over a plain tensor: FSDP2, TP),
    or the class name of another tensor subclass (e.g. a float8 weight wrapper)."""
    device: str
    """The device type (``cuda``, ``cpu``)."""
    floating: bool


def parameter_kind(param: torch.Tensor) -> ParameterKind:
    """``param``'s ``ParameterKind``."""
    plain = (torch.Tensor, nn.Parameter)
    if isinstance(param, DTensor):
        tensor = "dtensor" if type(param.to_local()) in plain else type(param.to_local()).__name__
    else:
        tensor = "tensor" if type(param) in plain else type(param).__name__
    return ParameterKind(tensor, param.device.type, param.is_floating_point())


def amp_clipping_rules_out_fused(precision: str, gradient_clip_val: float | None) -> str | None:
    """Why a run at ``precision`` clipping at ``gradient_clip_val`` cannot take a fused AdamW, or None:
    Lightning's mixed-precision plugin (``16-mixed``, ``bf16-mixed``) refuses to clip gradients for an
    optimizer that unscales them itself, which a fused AdamW declares it does, bf16's unscaled gradients
    included ("does not allow for gradient clipping"), at the first step."""
    if precision.endswith("-mixed") and gradient_clip_val:
        return (
            f"trainer.precision {precision} with trainer.gradient_clip_val {gradient_clip_val}: Lightning's "
            "mixed-precision plugin refuses to clip for a fused optimizer"
        )
    return None


def adamw_implementation(
    kinds: Collection[ParameterKind], options: Mapping[str, Any], not_fused: str | None = None
) -> tuple[AdamWImplementation, str | None]:
    """The AdamW implementation to run over parameters of these ``kinds``, and, when the parameters
    ruled out the fused one, why (a fallback), or None.

    - ``fused: true`` / ``foreach: true`` in ``options`` are the user's choice and win (torch checks
      them); ``fused: false`` / ``foreach: false`` rule that one out and the best other one runs;
      ``differentiable: true`` takes the for-loop (torch has neither kernel for it).
    - Else fused where torch has a fused AdamW kernel for the parameters' device (CUDA, and the CPU:
      one pass over each parameter and its states instead of about ten), when every parameter is a
      floating plain tensor or every one a DTensor over one (torch's DTensor shards the fused op like
      any pointwise op); else foreach under the same condition without the dtype, where the device
      has foreach kernels (CUDA); else the for-loop. A mix of DTensors and plain tensors (a parameter a
      sharding strategy left whole) takes the for-loop: one op over a list holding both fails ("mixed
      torch.Tensor and DTensor"), and torch's own default would pick foreach.
    - ``not_fused`` (a reason) rules the fused one out as the parameters can, and is the fallback's why.
    """
    if options.get("fused"):
        return "fused", None
    if options.get("foreach"):
        return "foreach", None
    devices = {k.device for k in kinds}
    if options.get("differentiable") or len(devices) != 1:
        return "for-loop", None
    (device,) = devices
    tensors = {k.tensor for k in kinds}
    one_kind = tensors in ({"tensor"}, {"dtensor"})
    fused_kernel = device in _get_fused_kernels_supported_devices()
    fused_ok = not_fused is None and one_kind and all(k.floating for k in kinds) and fused_kernel
    foreach_ok = one_kind and device in _get_foreach_kernels_supported_devices()
    if fused_ok and options.get("fused") is None:
        return "fused", None
    implementation: AdamWImplementation = "foreach" if foreach_ok and options.get("foreach") is None else "for-loop"
    if options.get("fused") is False or not fused_kernel:
        return implementation, None  # the user's choice, or no fused kernel to fall back from
    why = (
        not_fused
        if not_fused is not None
        else "its parameters mix DTensors and plain tensors"
        if tensors == {"tensor", "dtensor"}
        else f"its parameters include {sorted(tensors - {'tensor', 'dtensor'})}"
        if not one_kind
        else "some parameters are not floating point"
    )
    return implementation, f"AdamW: the {implementation} implementation instead of fused on {device}: {why}"


def implementation_of(optimizer: torch.optim.Optimizer) -> str | None:
    """Which kernels a torch optimizer's update runs (``fused``, ``foreach``, ``for-loop``), read from
    its settings (``ZeroRedundancyOptimizer`` keeps its inner class's); ``torch default`` when it left
    the choice to torch at each step; None for another library's optimizer (its own kernels)."""
    if not type(optimizer).__module__.startswith("torch."):
        return None
    fused, foreach = optimizer.defaults.get("fused"), optimizer.defaults.get("foreach")
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    return "for-loop" if fused is False or foreach is False else "torch default"


def decay_names(model: nn.Module, embedding: nn.Parameter) -> set[str]:
    """Names of the parameters that decay: matrices, except the input embedding. Call it on the
    unwrapped model; sharding wrappers may flatten shapes (DeepSpeed's ZeRO-3 partitions parameters as it
    creates them and keeps their shape as ``ds_shape``)."""
    return {
        name for name, p in model.named_parameters() if len(getattr(p, "ds_shape", p.shape)) >= 2 and p is not embedding
    }


def decay_groups(model: nn.Module, decaying: set[str], weight_decay: float) -> list[dict]:
    """Two parameter groups: matrices decay; norms, biases and the input embedding do not.

    Decaying a norm's gain or a bias only pulls it toward zero without regularising capacity,
    and decaying embeddings penalises rare tokens; this split is the GPT-2/LLaMA convention.
    Names are matched after removing wrapper prefixes (FSDP1, activation checkpointing).
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if _clean(name) in decaying else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


LrSchedule = Literal["linear", "cosine", "constant", "wsd"]
LR_SCHEDULES: tuple[str, ...] = ("linear", "cosine", "constant", "wsd")
DecayShape = Literal["linear", "cosine", "sqrt"]
DECAYS: dict[str, Callable[[float], float]] = {
    "linear": lambda progress: 1 - progress,
    "cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
    "sqrt": lambda progress: 1 - math.sqrt(progress),
}
"""Decay shape -> the share of ``1 - min_lr_ratio`` left at ``progress`` in [0, 1] of the decay
(``sqrt`` is transformers' ``1-sqrt``)."""
WSD_DECAY_FRACTION = 0.1
"""``wsd``'s default share of the run spent decaying (MiniCPM's WSD used about 10%)."""
_KEY = "model.init_args"


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of each optimizer step as a fraction of the peak: the run's schedule keys
    (``model.init_args.lr_schedule``, ``warmup_steps``, ``min_lr_ratio``, ``decay_fraction``,
    ``decay_shape``), checked once when made.

    Every schedule warms up linearly over ``warmup_steps``: step ``s`` uses ``(s + 1) / warmup_steps``
    (the first step already learns; transformers' schedules use ``s / warmup_steps``, a first step
    at LR 0). Then ``constant`` stays at the peak; ``linear`` and ``cosine`` decay from the peak
    to ``min_lr_ratio`` at ``total_steps``; ``wsd`` stays at the peak until the last
    ``decay_fraction`` of ``total_steps`` (fewer steps when the warm-up leaves fewer) and decays
    to ``min_lr_ratio`` over them in ``decay_shape``. Past ``total_steps`` it stays at the end value.
    """

    schedule: str
    warmup_steps: int
    min_lr_ratio: float
    decay_fraction: float | None = None
    decay_shape: str | None = None

    def __post_init__(self) -> None:
        """Refuse, naming the key, what would give a wrong schedule: an unknown name, a final LR
        below 0 or above the peak, a decay fraction outside [0, 1], and wsd's options on another
        schedule (they would be silently ignored)."""
        if self.schedule not in LR_SCHEDULES:
            raise ConfigError(f"{_KEY}.lr_schedule", self.schedule, f"choose one of {list(LR_SCHEDULES)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(
                f"{_KEY}.min_lr_ratio",
                self.min_lr_ratio,
                "the final learning rate as a fraction of learning_rate: use a value in [0, 1]",
            )
        for key, value in (("decay_fraction", self.decay_fraction), ("decay_shape", self.decay_shape)):
            if value is not None and self.schedule != "wsd":
                raise ConfigError(
                    f"{_KEY}.{key}",
                    value,
                    f"only lr_schedule: wsd has a separate decay phase "
                    f"(lr_schedule is {self.schedule}); set lr_schedule: wsd or drop {key}",
                )
        if self.decay_fraction is not None and not 0 <= self.decay_fraction <= 1:
            raise ConfigError(
                f"{_KEY}.decay_fraction",
                self.decay_fraction,
                "the share of the run spent decaying: use a value in [0, 1]",
            )
        if self.decay_shape is not None and self.decay_shape not in DECAYS:
            raise ConfigError(f"{_KEY}.decay_shape", self.decay_shape, f"choose one of {list(DECAYS)}")

    def factor(self, step: int, total_steps: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based) of a run of ``total_steps``, as a fraction
        of the peak."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        if self.schedule == "wsd":
            fraction = WSD_DECAY_FRACTION if self.decay_fraction is None else self.decay_fraction
            decay_steps = min(round(fraction * total_steps), max(0, total_steps - self.warmup_steps))
            decay_start, shape = total_steps - decay_steps, self.decay_shape or "cosine"
            if step < decay_start:
                return 1.0
        else:
            decay_start, decay_steps, shape = self.warmup_steps, total_steps - self.warmup_steps, self.schedule
        progress = min(1.0, (step - decay_start) / max(1, decay_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * DECAYS[shape](progress)

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        """``factor`` as a torch scheduler, stepped once per optimizer step."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.factor(step, total_steps))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the base LR, then cosine decay to ``min_lr_ratio`` of it at ``total_steps``
    (``lr_schedule: cosine``, the default)."""
    return LRSchedule("cosine", warmup_steps, min_lr_ratio).scheduler(optimizer, total_steps)

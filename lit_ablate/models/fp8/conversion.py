"""fp8 training of a model's linear layers with torchao's float8 recipes (dynamic scaling).

``convert_fp8(model, Fp8Options(recipe="rowwise"), emulate)`` swaps the chosen ``nn.Linear``
layers for torchao's ``Float8Linear`` (``convert_to_float8_training``) and gives loop MoE experts the
same fp8 matmul (torchao's ``matmul_with_hp_or_float8_args``, the function ``Float8Linear`` calls);
grouped MoE experts run torchao's rowwise scaled grouped matmul (``fp8_grouped_experts``).
Weights stay in the model's dtype (the master copy the optimizer updates); each matmul casts its
operands to fp8 with a fresh scale (e4m3 inputs/weights; gradients e5m2 under ``tensorwise``,
e4m3 under the rowwise recipes) and returns the high-precision result.

Real or emulated: the fp8 kernels (``torch._scaled_mm``) need a CUDA GPU of compute capability
8.9+ (Ada, Hopper, Blackwell). Elsewhere torchao's ``emulate`` mode quantises exactly as the real
recipe does and multiplies the dequantised operands in fp32: the same numerics up to the matmul's
accumulation order, at no speed or memory gain (docs/platform.md#what-runs-on-a-cpu). Which one ran
is recorded.

What is not converted, and why:
- the LM head (``skip``'s default): the most precision-sensitive matmul, and small next to the
  decoder; MoE routers (a ``gate``/``router`` linear beside ``experts``): routing decisions flip on
  small logit changes;
- layers whose input or output size is not a multiple of 16: ``torch._scaled_mm`` refuses them on
  a GPU, so an emulated run could not be reproduced there (skipped under ``all-linear``, refused
  when named in ``target_modules``). A batch's token count, which each weight gradient contracts
  over, may be any number: real kernels zero-pad it, exactly (``Fp8Options.torchao_config``);
- LoRA adapters: the base is converted before peft injects its layers, so peft wraps the
  ``Float8Linear`` (a ``nn.Linear``) as the frozen base and its ``lora_A``/``lora_B`` stay high precision.

Under FSDP2, ``fsdp_all_gather`` (tensorwise only) gathers the weights already cast to fp8 (half
the bytes of bf16) with scales ``precompute_fp8_scales`` computes for every layer in one
all-reduce after each optimizer step (``FSDP2Strategy`` calls it).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import nn

from lit_ablate.errors import ConfigError
from lit_ablate.extras import require
from lit_ablate.models.fp8.matmul import ALIGNMENT, Fp8Matmul, cast_input_as_autocast

FP8_KEY = "model.init_args.model.fp8"
"""Where ``Fp8Options`` sit in a fit config (named in error messages)."""
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's ``Float8LinearRecipeName`` values."""
MIN_CAPABILITY = (8, 9)


@dataclass
class Fp8Options:
    """Train the linear layers' matmuls in fp8 (torchao float8, dynamic scaling).

    Args:
        recipe: ``tensorwise`` (one scale per tensor; fastest, and the only one with fp8
            all-gather), ``rowwise`` (a power-of-two scale per row; more accurate) or
            ``rowwise_with_gw_hp`` (rowwise, with weight gradients in high precision: the most accurate).
        emulate: ``auto`` (real fp8 kernels on a GPU of compute capability 8.9+, emulation
            elsewhere), ``true`` (always emulate: the numerics without the speed), ``false`` (real
            kernels or a refusal).
        fsdp_all_gather: under FSDP2, all-gather weights in fp8 (tensorwise only).
        target_modules: linear layers to convert, by name or name suffix, or ``all-linear``
            (every eligible one: not the LM head, routers or layers with a size not a multiple of 16).
            MoE experts (loop; grouped with the rowwise recipe) convert under ``all-linear`` or when
            ``experts`` is named.
        skip: layers kept in high precision, by name or name suffix (the LM head by default).
    """

    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    emulate: bool | Literal["auto"] = "auto"
    fsdp_all_gather: bool = False
    target_modules: list[str] | str = "all-linear"
    skip: list[str] = field(default_factory=lambda: ["lm_head"])

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ConfigError(f"{FP8_KEY}.recipe", self.recipe, f"choose one of {list(RECIPES)}")
        if self.emulate not in ("auto", True, False):
            raise ConfigError(f"{FP8_KEY}.emulate", self.emulate, "use auto, true or false")
        if self.fsdp_all_gather and self.recipe != "tensorwise":
            raise ConfigError(
                f"{FP8_KEY}.fsdp_all_gather",
                True,
                f"torchao gathers fp8 weights with one scale per tensor only: use recipe: tensorwise, "
                f"or fsdp_all_gather: false with {self.recipe}",
            )
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ConfigError(
                f"{FP8_KEY}.target_modules",
                self.target_modules,
                "give a list of module names, e.g. [q_proj, down_proj], or all-linear",
            )
        if not self.target_modules:
            raise ConfigError(
                f"{FP8_KEY}.target_modules", self.target_modules, "name at least one module, or all-linear"
            )

    def torchao_config(self, emulate: bool):  # torchao's Float8LinearConfig, imported lazily
        """torchao's ``Float8LinearConfig`` for the recipe, emulated or not.

        Real kernels get ``pad_inner_dim``: ``torch._scaled_mm`` needs every contracted dimension to
        be a multiple of 16, and the weight gradient contracts over the tokens (rows of a batch, an
        expert's share of them), which can be any count. torchao then zero-pads the fp8 operands of
        each matmul along the contracted dimension after casting them, so the scales are those of the
        unpadded tensors and the zeros add nothing to the sums: the result is exact, for every recipe
        (``rowwise_with_gw_hp`` computes the weight gradient in high precision and needs none). The
        emulation multiplies in fp32 with no such constraint and ignores the switch.
        """
        import dataclasses

        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(
            config, emulate=emulate, enable_fsdp_float8_all_gather=self.fsdp_all_gather, pad_inner_dim=not emulate
        )


def fp8_kernels_unavailable(device: torch.device) -> str | None:
    """Why real fp8 kernels cannot run on ``device``, or None when they can."""
    if device.type != "cuda":
        return (
            "fp8 kernels need a CUDA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell); "
            f"this run is on {device.type}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; fp8 kernels need 8.9+"
    return None


def resolve_emulation(options: Fp8Options, device: torch.device) -> tuple[bool, str | None]:
    """``(emulate, why)``: whether the run emulates fp8 on ``device``, and why when it does.

    ``emulate: false`` where no fp8 kernel runs is refused (one line naming the key).
    """
    unavailable = fp8_kernels_unavailable(device)
    if options.emulate is False and unavailable:
        raise ConfigError(
            f"{FP8_KEY}.emulate",
            False,
            f"{unavailable}; use emulate: auto (fp8 numerics emulated in fp32 matmuls here) or run on such a GPU",
        )
    if options.emulate is True:
        return True, "emulate: true"
    return (True, unavailable) if unavailable else (False, None)


def fp8_linear_names(model: nn.Module, options: Fp8Options) -> list[str]:
    """Names of the ``nn.Linear`` layers ``convert_fp8`` converts.

    Raises ``ConfigError`` when ``target_modules`` names a layer fp8 cannot take (a size not a
    multiple of 16, a router); ``convert_fp8`` refuses a selection that leaves nothing to convert.
    """
    explicit = not isinstance(options.target_modules, str)
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or _matches(name, options.skip):
            continue
        if explicit and not _matches(name, options.target_modules):
            continue
        problem = _router_problem(model, name) or _alignment_problem(module.in_features, module.out_features)
        if problem and explicit:
            raise ConfigError(
                f"{FP8_KEY}.target_modules",
                options.target_modules,
                f"{name}: {problem}; leave it out (all-linear skips it) or add it to skip",
            )
        if not problem:
            names.append(name)
    return names


def convert_fp8(model: nn.Module, options: Fp8Options, emulate: bool) -> list[str]:
    """Convert ``model``'s chosen linear layers (and MoE experts) to fp8 training, in place;
    returns the names of what was converted.

    Call it on the built model before adapters are injected and before any sharding (the ``meta``
    device is fine: conversion reuses the parameters).
    """
    require("torchao", FP8_KEY, asdict(options), "fp8 training (torchao float8)")
    from torchao.float8 import convert_to_float8_training

    from lit_ablate.models.fp8.grouped_experts import convert_grouped_experts
    from lit_ablate.models.moe.blocks import MOE_KEY
    from lit_ablate.models.moe.experts import RoutedExperts

    names = fp8_linear_names(model, options)
    config = options.torchao_config(emulate)
    convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn in names, config=config)
    for name in names:  # the input in the autocast dtype on every device, as under CUDA autocast
        model.get_submodule(name).register_forward_pre_hook(cast_input_as_autocast)
    explicit = not isinstance(options.target_modules, str)
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Experts") or _matches(name, options.skip):
            continue
        if explicit and not _matches(name, options.target_modules):
            continue
        if not isinstance(module, RoutedExperts):
            raise ConfigError(
                MOE_KEY,
                None,
                f"{name}: transformers' own experts ({type(module).__name__}) would stay in "
                "high precision under fp8; set moe: {experts: loop} (or add experts to fp8 skip)",
            )
        hidden, intermediate = module.down_proj.shape[1], module.down_proj.shape[2]
        problem = _alignment_problem(hidden, intermediate)
        if problem:
            raise ConfigError(FP8_KEY, options.target_modules, f"{name}: {problem}; add experts to fp8 skip")
        if module.implementation == "grouped":
            convert_grouped_experts(name, module, options.recipe, emulate, config, FP8_KEY)
        elif module.implementation == "loop":
            module.linear = Fp8Matmul(config)
        else:
            raise ConfigError(
                f"{MOE_KEY}.experts", module.implementation, "fp8 experts run loop or grouped; use one of them"
            )
        names.append(name)
    if not names:
        raise ConfigError(
            f"{FP8_KEY}.target_modules",
            options.target_modules,
            "no linear layer is left to convert (skipped, routers, or sizes not multiples of 16)",
        )
    return names


def is_fp8(module: nn.Module) -> bool:
    """Whether ``module`` holds layers converted by ``convert_fp8``."""
    if "torchao.float8" not in sys.modules:  # nothing was converted (and importing torchao costs seconds)
        return False
    from torchao.float8.float8_linear import Float8Linear

    return any(
        isinstance(m, Float8Linear)
        or isinstance(getattr(m, "linear", None), Fp8Matmul)
        or getattr(m, "grouped_mm", None) is not None
        for m in module.modules()
    )


def precompute_fp8_scales(module: nn.Module) -> None:
    """After an optimizer step: the next all-gather's fp8 weight scales, all layers in one
    all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``); a no-op without fp8 all-gather."""
    if "torchao.float8" not in sys.modules:  # nothing was converted (and importing torchao costs seconds)
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)


def _matches(name: str, patterns: list[str] | str) -> bool:
    return any(name == p or name.endswith("." + p) for p in patterns)


def _router_problem(model: nn.Module, name: str) -> str | None:
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if attr in ("gate", "router") and hasattr(owner, "experts"):
        return "an MoE router stays in high precision (routing flips on small logit changes)"
    return None


def _alignment_problem(in_features: int, out_features: int) -> str | None:
    if in_features % ALIGNMENT or out_features % ALIGNMENT:
        return (
            f"sizes {in_features} -> {out_features} are not multiples of {ALIGNMENT}, "
            "which fp8 kernels (torch._scaled_mm) need"
        )
    return None

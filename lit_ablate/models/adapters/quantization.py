"""Quantised frozen base weights (QLoRA): bitsandbytes 4-bit (NF4/FP4) or 8-bit linear layers.

``quantize_linears(model, QuantizationOptions(bits=4))`` replaces the model's ``nn.Linear`` layers
(the LM head excepted by default) by bitsandbytes' own ``Linear4bit``/``Linear8bitLt`` holding the
quantised weights. It works on a model built from a config as well as on one loaded from
``pretrained:`` (transformers quantises only while it loads a checkpoint, so a config-built model
needs this path anyway, and one path for both keeps the two identical). The quantised weights are
frozen: they train only through adapters (``lit_ablate.models.adapters.lora``).

The eval-mode trap: on CPUs with AVX-512-BF16, bitsandbytes' ``Linear4bit``
repacks its weight *in place* into another layout on the first no-grad forward in eval mode and
mutates the ``quant_state`` that FSDP2's gathered copies share, so later sharded training steps
silently compute with stale weights. Every ``Linear4bit`` built here has that repacking turned off
(``support_avx512bf16_for_cpu = False``): evaluation costs the unpacked kernel's speed on such CPUs
and nothing else; ``tests/test_adapters.py`` shows the weight stays bit-identical
(docs/platform.md#bitsandbytes-repacks-4-bit-weights-in-an-eval-forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lit_ablate.errors import ConfigError

QUANTIZATION_KEY = "model.init_args.model.quantization"
"""Where ``QuantizationOptions`` sit in a fit config (named in error messages)."""
QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
STORAGE_DTYPES: dict[str, torch.dtype] = {"uint8": torch.uint8, **COMPUTE_DTYPES}
"""dtypes a 4-bit weight's packed bytes may be stored as (``quant_storage``)."""


@dataclass
class QuantizationOptions:
    """How the frozen base weights are stored (bitsandbytes): QLoRA is ``bits: 4`` + an adapter.

    Args:
        bits: 4 (``Linear4bit``, QLoRA) or 8 (``Linear8bitLt``, LLM.int8()).
        quant_type: 4-bit code: ``nf4`` (normal-float, QLoRA's choice for normally distributed
            weights) or ``fp4``.
        double_quant: 4-bit: quantise the per-block scales too (QLoRA's double quantisation,
            ~0.37 bit per weight saved).
        blocksize: 4-bit: weights per scale (64 in QLoRA; smaller is more accurate, larger smaller).
        compute_dtype: dtype the 4-bit weights are dequantised to for each matmul (``float32``,
            ``bfloat16``, ``float16``); null = the input's dtype.
        quant_storage: 4-bit: the dtype the packed bytes are stored as (the same bytes, another view):
            ``uint8``, or a float dtype (``bfloat16``, ``float32``, ``float16``) for FSDP1, which flattens a
            unit's weights into one tensor of one float dtype: the standard FSDP-QLoRA recipe, with
            the model's own dtype.
        outlier_threshold: 8-bit: LLM.int8()'s outlier threshold (activation columns above it run
            in 16/32 bits); 0 quantises everything.
        skip_modules: linear layers kept in full precision, by module name or name suffix (the
            LM head by default: it is small next to the decoder and the most sensitive layer).
    """

    bits: int = 4
    quant_type: str = "nf4"
    double_quant: bool = True
    blocksize: int = 64
    compute_dtype: str | None = None
    quant_storage: str = "uint8"
    outlier_threshold: float = 6.0
    skip_modules: list[str] = field(default_factory=lambda: ["lm_head"])

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"{QUANTIZATION_KEY}.bits", self.bits, "use 4 (NF4/FP4, QLoRA) or 8 (LLM.int8())")
        if self.quant_type not in QUANT_TYPES:
            raise ConfigError(f"{QUANTIZATION_KEY}.quant_type", self.quant_type, f"choose one of {list(QUANT_TYPES)}")
        if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise ConfigError(
                f"{QUANTIZATION_KEY}.blocksize", self.blocksize, "use a power of two from 32 to 4096 (64 is QLoRA's)"
            )
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(
                f"{QUANTIZATION_KEY}.compute_dtype",
                self.compute_dtype,
                f"choose one of {sorted(COMPUTE_DTYPES)} or null",
            )
        if self.quant_storage not in STORAGE_DTYPES:
            raise ConfigError(
                f"{QUANTIZATION_KEY}.quant_storage", self.quant_storage, f"choose one of {list(STORAGE_DTYPES)}"
            )
        if self.bits == 8 and self.quant_storage != "uint8":
            raise ConfigError(
                f"{QUANTIZATION_KEY}.quant_storage",
                self.quant_storage,
                "8-bit weights are stored as int8; quant_storage is for bits: 4",
            )
        if self.outlier_threshold < 0:
            raise ConfigError(
                f"{QUANTIZATION_KEY}.outlier_threshold",
                self.outlier_threshold,
                "use 0 or a positive threshold (6.0 is LLM.int8()'s)",
            )

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per quantised weight, scales included (for the memory estimate): 4 bits plus
        an fp32 scale per block, or with double quantisation an 8-bit scale per block plus an fp32
        scale per 256 blocks; 8-bit: 8 bits plus an fp32 scale per output row (not counted)."""
        if self.bits == 8:
            return 8.0
        scales = 8 / self.blocksize + 32 / (self.blocksize * 256) if self.double_quant else 32 / self.blocksize
        return 4.0 + scales


def quantized_linear_names(model: nn.Module, options: QuantizationOptions) -> list[str]:
    """Names of the ``nn.Linear`` layers ``quantize_linears`` replaces."""
    return [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not _skipped(name, options.skip_modules)
    ]


def quantize_linears(model: nn.Module, options: QuantizationOptions) -> list[str]:
    """Replace ``model``'s linear layers by frozen bitsandbytes ones (in place); returns their names.

    The weights must be real (not ``meta``): quantisation reads them.
    """
    import bitsandbytes as bnb

    names = quantized_linear_names(model, options)
    if not names:
        raise ConfigError(
            f"{QUANTIZATION_KEY}.skip_modules", options.skip_modules, "no linear layer is left to quantise"
        )
    for name in names:
        linear = model.get_submodule(name)
        if linear.weight.is_meta:
            raise ConfigError(
                QUANTIZATION_KEY, options.bits, f"{name} has no weights yet (meta device); quantise a built model"
            )
        if options.bits == 4:
            quantized = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=COMPUTE_DTYPES.get(options.compute_dtype),
                compress_statistics=options.double_quant,
                quant_type=options.quant_type,
                quant_storage=STORAGE_DTYPES[options.quant_storage],
                device="meta",
            )
            quantized.weight = bnb.nn.Params4bit(
                linear.weight.data,
                requires_grad=False,
                blocksize=options.blocksize,
                compress_statistics=options.double_quant,
                quant_type=options.quant_type,
                quant_storage=STORAGE_DTYPES[options.quant_storage],
                module=quantized,
            )
            quantized.support_avx512bf16_for_cpu = False  # the eval-mode in-place repack (module docstring)
            quantized.register_load_state_dict_pre_hook(_load_quant_state)
        else:
            quantized = bnb.nn.Linear8bitLt(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                has_fp16_weights=False,
                threshold=options.outlier_threshold,
                device="meta",
            )
            quantized.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
        if linear.bias is not None:
            quantized.bias = nn.Parameter(linear.bias.data, requires_grad=linear.bias.requires_grad)
        quantized = quantized.to(linear.weight.device)  # bitsandbytes quantises on the first move to a device
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, quantized)
    return names


def _load_quant_state(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
    """Load-state-dict pre-hook of each ``Linear4bit``: bitsandbytes saves the weight's quantisation
    state beside it (``weight.absmax``, ``weight.quant_map``, ...) but loads none of it back. Take
    those entries out and rebuild the state from them (bitsandbytes' ``QuantState.from_dict``), so a
    state dict round-trips: the copy of rank 0's weights a sharding strategy loads into every rank
    carries rank 0's scales with its packed weights."""
    from bitsandbytes.functional import QuantState

    start = prefix + "weight."
    values = {key[len(start) :]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(start)]}
    if not values:
        return
    state = QuantState.from_dict(values, device=values["absmax"].device)
    module.quant_state = state
    if hasattr(module.weight, "quant_state"):  # a Params4bit (not a sharding strategy's DTensor)
        module.weight.quant_state = state


def dequantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as the same model without quantisation holds it: every quantised weight
    dequantised (bitsandbytes' ``dequantize_4bit``, or for 8-bit its int8 rows times their scales,
    ``int8_vectorwise_dequant``: the matrix each forward multiplies by), its quantisation-state entries
    (4-bit ``weight.*``, 8-bit ``SCB`` and ``weight_format``) dropped. What ``export --merge`` merges the
    adapters into."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit, int8_vectorwise_dequant

    state = model.state_dict()
    for name, module in model.named_modules():
        key = f"{name}.weight"
        if isinstance(module, bnb.nn.Linear4bit):
            for entry in [k for k in state if k.startswith(key + ".")]:
                del state[entry]
            state[key] = dequantize_4bit(module.weight.data, module.weight.quant_state)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            for entry in (f"{name}.SCB", f"{name}.weight_format"):
                state.pop(entry, None)
            scales = (
                module.weight.SCB if module.weight.SCB is not None else module.state.SCB
            )  # moved there by a forward
            state[key] = int8_vectorwise_dequant(module.weight.data, scales)
    return state


def is_quantized(param: torch.Tensor) -> bool:
    """Whether a parameter holds bitsandbytes-quantised storage (4-bit packed, in any ``quant_storage``
    dtype, or int8)."""
    return param.dtype in (torch.uint8, torch.int8) or getattr(param, "quant_state", None) is not None


def _skipped(name: str, skip: list[str]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)

"""``Fp8Matmul``: one matmul through torchao's fp8 path, as ``Float8Linear`` computes it (what converted
MoE experts call per expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ALIGNMENT = 16
"""``torch._scaled_mm`` needs both dimensions of each weight, and every contracted dimension, to be
multiples of this (a token count is padded: ``Fp8Options.torchao_config``)."""


def autocast_input(x: Tensor) -> Tensor:
    """``x`` in the autocast dtype of its device when autocast is on there, as a GPU run casts a linear
    layer's input before fp8 quantises it. torchao's ``Float8Linear`` casts under CUDA autocast only
    (``torch.is_autocast_enabled()`` asks about CUDA), so on CPU ``bf16-mixed`` would otherwise quantise
    fp32 activations and return fp32: not the numerics the emulation stands in for."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(device))
    return x


def cast_input_as_autocast(module: torch.nn.Module, args: tuple) -> tuple:
    """A forward pre-hook putting ``autocast_input`` before a converted ``Float8Linear``."""
    return (autocast_input(args[0]), *args[1:])


class Fp8Matmul:
    """``F.linear(x, weight)`` (no bias) through torchao's fp8 matmul, as ``Float8Linear`` computes it:
    what loop MoE experts call per expert once converted."""

    def __init__(self, config) -> None:  # torchao's Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear

        with torch.device("meta"):  # the per-gemm settings Float8Linear derives from the config
            probe = Float8Linear(ALIGNMENT, ALIGNMENT, bias=False, config=config)
        self.config, self.mm_config = config, probe.linear_mm_config

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        x = autocast_input(x)
        if x.numel() == 0:  # an expert without tokens: nothing to scale (torchao's amax needs elements)
            return F.linear(x, weight)
        return matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)

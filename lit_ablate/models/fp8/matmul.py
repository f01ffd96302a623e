"""``Fp8Matmul``: one matmul through torchao's fp8 path, as ``Float8Linear`` computes it (what converted
MoE experts call per expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ALIGNMENT = 16
"""``torch._scaled_mm`` needs both dimensions of each weight to be multiples of this."""


class Fp8Matmul:
    """``F.linear(x, weight)`` (no bias) through torchao's fp8 matmul, as ``Float8Linear`` computes it:
    what loop MoE experts call per expert once converted."""

    def __init__(self, config) -> None:  # noqa: ANN001 (torchao's Float8LinearConfig)
        from torchao.float8.float8_linear import Float8Linear

        with torch.device("meta"):  # the per-gemm settings Float8Linear derives from the config
            probe = Float8Linear(ALIGNMENT, ALIGNMENT, bias=False, config=config)
        self.config, self.mm_config = config, probe.linear_mm_config

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        if x.numel() == 0:  # an expert without tokens: nothing to scale (torchao's amax needs elements)
            return F.linear(x, weight)
        return matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)

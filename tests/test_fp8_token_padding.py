"""Real fp8 matmuls whose contracted dimension is a token count run on Hopper's constraint, exactly.

``torch._scaled_mm`` on a GPU needs every contracted dimension to be a multiple of 16; the weight
gradient contracts over the tokens (an expert's share, a batch's rows), which can be any count. On
CPU the op runs as a reference kernel that does not check this, so ``hopper_scaled_mm`` stands in
for it: it refuses what CUDA refuses, with CUDA's message, and otherwise calls the real CPU op.
Through it the real (not emulated) fp8 path of every recipe must run, and equal the same matmuls
with the rows zero-padded to a multiple of 16 by hand (scales from amaxes, which zero rows leave
unchanged; zeros add nothing to a contraction). Seen failing without ``pad_inner_dim`` in
``Fp8Options.torchao_config`` (the H200 lane's crash, reproduced under tensorwise and rowwise:
"Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: (32x21)" in the loop
experts' backward, "(32x37)" in the dense layer's; ``rowwise_with_gw_hp`` computes the weight
gradient in high precision and passes either way). Tolerance 0: the same kernel on the same fp8
operands (measured difference 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_ablate.models.fp8.conversion import RECIPES, Fp8Matmul, Fp8Options, convert_fp8
from lit_ablate.models.moe.experts import loop_experts

COUNTS = [6, 13, 0, 21]
"""Tokens per expert: none a multiple of 16 but the empty expert."""
E, H, I = len(COUNTS), 32, 48
ROWS = 37
"""A dense layer's batch rows, not a multiple of 16."""


def _cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes per-row scales (2.13's does; 2.11's refuses them:
    "Now _scaled_mm only supports per-tensor scaling for CPU backend")."""
    operand = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(operand, operand.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)  # fmt: skip
    except RuntimeError:
        return False
    return True


CPU_RECIPES = [
    pytest.param(recipe, marks=pytest.mark.skipif(
        recipe != "tensorwise" and not _cpu_scaled_mm_takes_row_scales(),
        reason=f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only: the rowwise recipes' "
               "real fp8 kernels run on a GPU (the lane's gpu tests) or here on torch 2.13"))
    for recipe in RECIPES
]  # fmt: skip
"""The recipes whose real fp8 kernels this torch's CPU runs (tensorwise always)."""


@pytest.fixture(autouse=True)
def hopper_scaled_mm(monkeypatch):
    """``torch._scaled_mm`` with the shape checks CUDA makes on Hopper (torch 2.11-2.13)."""
    real = torch._scaled_mm

    def strict(mat1: torch.Tensor, mat2: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if mat1.shape[1] % 16:
            raise RuntimeError("Expected trailing dimension of mat1 to be divisible by 16 "
                               f"but got mat1 shape: ({mat1.shape[0]}x{mat1.shape[1]}).")  # fmt: skip
        if mat2.shape[0] % 16 or mat2.shape[1] % 16:
            raise RuntimeError(f"mat2 shape ({mat2.shape[0]}x{mat2.shape[1]}) must be divisible by 16")
        return real(mat1, mat2, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", strict)


def rows_padded_by_hand(matmul):
    """``matmul(x, w)`` on ``x``'s rows zero-padded to a multiple of 16, the padding's output dropped."""
    def padded(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return matmul(F.pad(x, (0, 0, 0, -rows % 16)), weight)[:rows]

    return padded


def _operands() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(sum(COUNTS), H, generator=gen)
    return tokens, torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5


def _experts(linear, operands) -> list[torch.Tensor]:
    tokens, gate_up, down = (t.clone().requires_grad_() for t in operands)
    out = loop_experts(tokens, torch.tensor(COUNTS), gate_up, down, F.silu, linear=linear)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach(), tokens.grad, gate_up.grad, down.grad]


@pytest.mark.parametrize("recipe", CPU_RECIPES)
def test_loop_experts_real_fp8_runs_any_token_count_exactly(recipe):
    matmul, operands = Fp8Matmul(Fp8Options(recipe=recipe).torchao_config(emulate=False)), _operands()
    got = _experts(matmul, operands)
    want = _experts(rows_padded_by_hand(matmul), operands)
    for name, a, b in zip(("out", "tokens", "gate_up", "down"), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    plain = _experts(F.linear, operands)[0]
    assert (got[0] - plain).norm() / plain.norm() > 1e-3  # it really ran in fp8


@pytest.mark.parametrize("recipe", CPU_RECIPES)
def test_dense_real_fp8_linear_runs_any_row_count_exactly(recipe):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 32))
    convert_fp8(layer, Fp8Options(recipe=recipe, skip=[]), emulate=False)
    x = torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(2))
    cotangent = torch.randn(ROWS, 32, generator=torch.Generator().manual_seed(3))

    def run(forward) -> list[torch.Tensor]:
        layer.zero_grad()
        inputs = x.clone().requires_grad_()
        out = forward(inputs)
        out.backward(cotangent)
        return [out.detach(), inputs.grad, layer[0].weight.grad.clone(), layer[0].bias.grad.clone()]

    got = run(layer)
    want = run(lambda inputs: layer(F.pad(inputs, (0, 0, 0, -ROWS % 16)))[:ROWS])
    for name, a, b in zip(("out", "input", "weight", "bias"), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    plain = F.linear(x, layer[0].weight, layer[0].bias)
    assert (got[0] - plain).norm() / plain.norm() > 1e-3  # it really ran in fp8

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
gradient in high precision and passes either way). Tolerance: ``RTOL``/``ATOL`` below (the same fp8
operands; a CPU kernel's blocking may follow the padded shapes). Where this CPU has no fp8 kernel
for a recipe's matmuls (torch 2.11 and per-row scales; oneDNN without AVX-512), the test skips with
the kernel's words, decided by the by-hand reference, which needs no padding of ours.
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
E, H, FF = len(COUNTS), 32, 48
ROWS = 37
"""A dense layer's batch rows, not a multiple of 16."""
RTOL = ATOL = 1e-5
"""Measured: 0 with this machine's AVX-512 kernels; up to 1.9e-6 (3.3e-7 relative) with MKL's AVX2
kernels (``MKL_ENABLE_INSTRUCTIONS=AVX2``), whose blocking follows the padded shapes. A padding
that is not zero, or scales taken over it, is off by more than 1e-2."""


CPU_KERNEL_REFUSALS = (
    "only supports per-tensor scaling for CPU",  # torch 2.11's CPU _scaled_mm and per-row scales
    "could not create a primitive descriptor",  # oneDNN on a CPU without AVX-512, by shape and threads
)
"""What this machine's CPU ``_scaled_mm`` says when it has no kernel for an fp8 matmul it is asked."""


def reference_or_skip(compute):
    """The by-hand padded reference (every shape a multiple of 16, so it needs no padding of ours),
    or a skip with the CPU kernel's own words where this CPU has no fp8 kernel for it: then the
    real fp8 path can only be checked on a GPU (the lane's gpu tests)."""
    try:
        return compute()
    except RuntimeError as error:
        if not any(words in str(error) for words in CPU_KERNEL_REFUSALS):
            raise
        pytest.skip(
            f"this CPU's _scaled_mm (torch {torch.__version__}) has no real fp8 kernel here: "
            f"{str(error).splitlines()[0]}"
        )


@pytest.fixture(autouse=True)
def hopper_scaled_mm(monkeypatch):
    """``torch._scaled_mm`` with the shape checks CUDA makes on Hopper (torch 2.11-2.13)."""
    real = torch._scaled_mm

    def strict(mat1: torch.Tensor, mat2: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if mat1.shape[1] % 16:
            raise RuntimeError(
                "Expected trailing dimension of mat1 to be divisible by 16 "
                f"but got mat1 shape: ({mat1.shape[0]}x{mat1.shape[1]})."
            )
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
    return tokens, torch.randn(E, 2 * FF, H, generator=gen) / H**0.5, torch.randn(E, H, FF, generator=gen) / FF**0.5


def _experts(linear, operands) -> list[torch.Tensor]:
    tokens, gate_up, down = (t.clone().requires_grad_() for t in operands)
    out = loop_experts(tokens, torch.tensor(COUNTS), gate_up, down, F.silu, linear=linear)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach(), tokens.grad, gate_up.grad, down.grad]


@pytest.mark.parametrize("recipe", RECIPES)
def test_loop_experts_real_fp8_runs_any_token_count_exactly(recipe):
    matmul, operands = Fp8Matmul(Fp8Options(recipe=recipe).torchao_config(emulate=False)), _operands()
    want = reference_or_skip(lambda: _experts(rows_padded_by_hand(matmul), operands))
    got = _experts(matmul, operands)
    for name, a, b in zip(("out", "tokens", "gate_up", "down"), got, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    plain = _experts(F.linear, operands)[0]
    assert (got[0] - plain).norm() / plain.norm() > 1e-3  # it really ran in fp8


@pytest.mark.parametrize("recipe", RECIPES)
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

    want = reference_or_skip(lambda: run(lambda inputs: layer(F.pad(inputs, (0, 0, 0, -ROWS % 16)))[:ROWS]))
    got = run(layer)
    for name, a, b in zip(("out", "input", "weight", "bias"), got, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    plain = F.linear(x, layer[0].weight, layer[0].bias)
    assert (got[0] - plain).norm() / plain.norm() > 1e-3  # it really ran in fp8

"""Grouped MoE experts in fp8 (``lit_ablate.models.fp8.grouped_experts``).

torchao's scaled grouped matmul needs a GPU of compute capability 9.0+, so on CPU its glue runs
against a stand-in written from its contract and strict about it (``_scaled_grouped_mm_stand_in``:
2-D row-major tokens, per-expert column-major weights, int32 group ends, every group a multiple
of 16 rows, the last ending at the buffer's end); the stand-in computes each group with the
emulated rowwise fp8 matmul the loop experts use, so ``fp8_grouped_mm_experts`` must equal the
loop experts under fp8 in outputs and in every gradient. Seen failing with the glue broken on
purpose (by hand, once each): groups not padded to 16 (the stand-in refuses); each copy's row
off by its expert's padding (``destination`` without the padded starts: outputs off by O(1));
the last group not stretched to the buffer's end (the stand-in refuses). A converted model with
``experts: grouped`` trains the loop's fp8 numerics when emulated, and says so in its fallbacks.
On a GPU with the kernels the real path is compared with the loop's real fp8 (``gpu``-marked).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_ablate.errors import ConfigError
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.fp8 import grouped_experts as fp8_grouped_experts
from lit_ablate.models.fp8.conversion import Fp8Matmul, Fp8Options
from lit_ablate.models.fp8.grouped_experts import GROUP_ALIGNMENT, fp8_grouped_mm_experts, padded_group_layout
from lit_ablate.models.moe.experts import loop_experts

E, H, FF = 4, 32, 48
COUNTS = [3, 0, 21, 6]
"""Tokens per expert: an empty expert, groups below and above 16 rows."""
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 32,
}


def rowwise_matmul() -> Fp8Matmul:
    return Fp8Matmul(Fp8Options(recipe="rowwise").torchao_config(emulate=True))


def _scaled_grouped_mm_stand_in(a: torch.Tensor, b_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    assert a.dim() == 2 and a.stride(1) == 1, "tokens: row-major [M, K]"
    experts, k, n = b_t.shape
    assert b_t.stride() == (k * n, 1, k), "weights: per-expert column-major [E, K, N]"
    assert k % 16 == 0 and n % 16 == 0 and a.shape[1] == k
    assert offsets.dtype == torch.int32 and offsets.numel() == experts
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    assert bool((sizes % GROUP_ALIGNMENT == 0).all()) and int(offsets[-1]) == a.shape[0], "groups of 16, ending at M"
    matmul = rowwise_matmul()
    return torch.cat([matmul(rows, weight.t()) for rows, weight in zip(a.split(sizes.tolist()), b_t.unbind(0))])


def _operands(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(sum(COUNTS), H, generator=gen)
    gate_up, down = torch.randn(E, 2 * FF, H, generator=gen) / H**0.5, torch.randn(E, H, FF, generator=gen) / FF**0.5
    return tokens, gate_up, down


def _run(experts_fn, operands) -> dict[str, torch.Tensor]:
    tokens, gate_up, down = (t.clone().requires_grad_() for t in operands)
    out = experts_fn(tokens, torch.tensor(COUNTS), gate_up, down, F.silu)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return {"out": out.detach(), "tokens": tokens.grad, "gate_up": gate_up.grad, "down": down.grad}


def test_padded_layout_puts_every_expert_on_a_multiple_of_16_rows():
    destination, ends, rows = padded_group_layout(torch.tensor(COUNTS), sum(COUNTS), GROUP_ALIGNMENT)
    assert rows == 96  # (30 tokens + 4 experts x 15) rounded up to 16
    assert ends.tolist() == [16, 16, 48, 96]  # 3 -> 16, 0 -> 0, 21 -> 32, and the last to the end
    expected = [*range(0, 3), *range(16, 37), *range(48, 54)]
    assert destination.tolist() == expected


def test_grouped_fp8_glue_equals_the_loop_experts_fp8(monkeypatch):
    monkeypatch.setattr(fp8_grouped_experts, "scaled_grouped_mm", _scaled_grouped_mm_stand_in)
    operands = _operands()
    grouped = _run(fp8_grouped_mm_experts, operands)
    loop = _run(lambda *args: loop_experts(*args, linear=rowwise_matmul()), operands)
    for name, value in loop.items():
        torch.testing.assert_close(grouped[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    plain = _run(lambda *args: loop_experts(*args), operands)
    assert (grouped["out"] - plain["out"]).abs().max() > 1e-3  # it really quantised


def test_an_emulated_grouped_model_trains_the_loop_fp8_numerics_and_says_so():
    """``experts: grouped`` + rowwise, emulated: each expert through Float8Linear's matmul, as loop."""

    def build(experts: str):
        torch.manual_seed(0)
        return ModelFactory(
            preset="tiny-qwen3-moe", config=TINY, moe={"experts": experts}, fp8={"recipe": "rowwise"}
        ).build()

    grouped, loop = build("grouped"), build("loop")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = [m(input_ids=ids, labels=ids).loss for m in (grouped, loop)]
    assert losses[0].item() == pytest.approx(losses[1].item(), abs=1e-6)
    losses[0].backward()
    experts = grouped.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad.abs().sum() > 0
    assert experts.fallback.startswith("fp8 emulated: the grouped experts' rowwise fp8 numerics computed per expert")


def test_grouped_fp8_refusals_name_the_key():
    with pytest.raises(ConfigError, match=r"fp8.recipe='rowwise_with_gw_hp'.*rowwise recipe only"):
        ModelFactory(
            preset="tiny-qwen3-moe", config=TINY, moe={"experts": "grouped"}, fp8={"recipe": "rowwise_with_gw_hp"}
        ).build()


def _gpu_capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_capability() < (9, 0), reason="needs a CUDA GPU of compute capability 9.0+ (Hopper)")
def test_gpu_scaled_grouped_mm_equals_the_loop_experts_real_fp8():
    """torchao's kernels against the loop's real fp8 matmul, bf16; tolerance not yet measured on a GPU:
    the same scales and casts, another accumulation (fast accumulation in the grouped kernel)."""
    operands = [t.to("cuda", torch.bfloat16) for t in _operands()]
    real = Fp8Matmul(Fp8Options(recipe="rowwise").torchao_config(emulate=False))

    def run(fn):
        tokens, gate_up, down = (t.clone().requires_grad_() for t in operands)
        out = fn(tokens, torch.tensor(COUNTS, device="cuda"), gate_up, down, F.silu)
        out.float().pow(2).sum().backward()
        return out.float(), tokens.grad.float(), gate_up.grad.float(), down.grad.float()

    for got, want in zip(run(fp8_grouped_mm_experts), run(lambda *a: loop_experts(*a, linear=real))):
        assert ((got - want).norm() / want.norm()).item() < 2e-2

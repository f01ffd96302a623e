"""The ``liger`` and ``cce`` loss kernels against ``torch``: on CPU through Triton's interpreter, on CUDA compiled.

One set of cases (``tests/loss_kernel_cases.py``) serves both. On CPU it runs once, in a fresh
process with ``LIT_ABLATE_TRITON_INTERPRET=1``: the interpreter must be switched on before triton
is imported, and this pytest process imported triton compiled long ago (Lightning imports it).
The tests need the ``kernels-cpu`` extra (triton, liger-kernel, cut-cross-entropy, numpy,
packaging) and skip with that reason without it.

Tolerances (max abs difference over max abs reference value): liger in fp32 1e-5 on CPU (measured
<= 7.4e-7); on CUDA 1e-4 / 1e-3 (TF32 dots). cce in fp16 against torch on fp32 copies of the same
fp16 inputs: loss 1e-4 (measured 1.2e-5), gradients 2e-3 (measured 4.5e-4, fp16 output rounding).
Three bf16 cases run on CUDA only (bf16 logits: loss 5e-3, gradients 2e-2, about two bf16 ulps);
no GPU was available to run the CUDA side when these were written.

Broken on purpose once in a copy of the package (each made the named cases fail):
- liger ``reduction="mean"`` instead of ``"sum"`` (Liger's default): every liger case but all_ignored.
- liger without ``lse_square_scale``: liger_z_loss_bias.
- liger without the bias: liger_bias_mean and liger_z_loss_bias (d_bias missing, d_hidden off by 0.5).
- Liger's last partial chunk dropped (``num_chunks = BT // chunk_size``): every liger case with a partial
  chunk, whatever ``chunk_tokens`` (see ``test_interpreted_liger_chunks_hold_the_asked_tokens``).
- cce without ``reduction="sum"`` (CCE's default is mean): every cce case.
- cce's ``ignore_index`` set to 0, a real label: every cce case (the -100 labels then index the
  vocabulary: loss NaN or off, gradients off by 0.3-0.7).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lit_ablate.errors import ConfigError
from lit_ablate.models.losses import triton_interpreter
from lit_ablate.models.losses.cross_entropy import liger_chunk, liger_chunk_budget, loss_backend

TESTS = Path(__file__).resolve().parent
CASES_SCRIPT = TESTS / "loss_kernel_cases.py"
KERNEL_PACKAGES = ("triton", "liger_kernel", "cut_cross_entropy", "numpy")
MISSING = [p for p in KERNEL_PACKAGES if importlib.util.find_spec(p) is None]
needs_kernels = pytest.mark.skipif(
    bool(MISSING),
    reason=f"{', '.join(MISSING)} not installed: "
    f"{triton_interpreter.INSTALL_FIX} runs the liger/cce kernels interpreted on CPU",
)
TOLERANCES = {  # device -> backend -> (loss, gradients); bf16 (CUDA only): about two bf16 ulps
    "cpu": {"liger": (1e-5, 1e-5), "cce": (1e-4, 2e-3)},
    "cuda": {"liger": (1e-4, 1e-3), "cce": (1e-4, 2e-3), "bf16": (5e-3, 2e-2)},
}
CASE_NAMES = [
    "liger_odd_shape_ignored_sum",
    "liger_bias_mean",
    "liger_z_loss_bias",
    "liger_all_ignored",
    "liger_chunk_tokens_16",
    "liger_chunk_tokens_32_accum_fp32",
    "liger_chunk_tokens_64",
    "cce_odd_shape_ignored_sum",
    "cce_mean",
    "cce_default_filter_eps",
]
CUDA_CASE_NAMES = [*CASE_NAMES, "liger_bf16_cuda", "liger_bf16_chunk_tokens_128_accum_fp32_cuda", "cce_bf16_cuda"]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    """Every case, computed once by a fresh interpreted process: ~12 s of CPU (imports, the kernels in
    Python, CCE's compiled vocabulary sort), 20 s wall on a quiet 2-core machine, so its tests are slow."""
    env = {
        **os.environ,
        triton_interpreter.OPT_IN_ENV: "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")])),
    }
    env.pop("TRITON_INTERPRET", None)  # the opt-in alone must switch the interpreter on
    done = subprocess.run(
        [sys.executable, str(CASES_SCRIPT), "cpu"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_parity(errors: dict[str, float], backend: str, device: str, case: str) -> None:
    loss_tol, grad_tol = TOLERANCES[device]["bf16" if "bf16" in case else backend]
    assert errors["loss"] <= loss_tol, (case, errors)
    expected = {"d_hidden", "d_weight"} | ({"d_bias"} if "bias" in case else set())
    assert expected <= set(errors), (case, "gradients missing", errors)
    for grad in expected:
        assert errors[grad] <= grad_tol, (case, grad, errors)
    assert errors["grad_dtypes_match_inputs"] == 1.0, (case, "gradients not in the inputs' dtype")


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("case", CASE_NAMES)
def test_interpreted_kernel_matches_torch(interpreted: dict[str, Any], case: str) -> None:
    assert interpreted["kernel_mode"] == "interpreted"
    assert_parity(interpreted["parity"][case], case.split("_")[0], "cpu", case)


@pytest.mark.slow
@needs_kernels
def test_interpreted_all_ignored_gives_zero_loss_and_grads(interpreted: dict[str, Any]) -> None:
    errors = interpreted["parity"]["liger_all_ignored"]
    assert errors["loss_abs"] == 0.0 and errors["loss"] == 0.0 and errors["d_hidden"] == errors["d_weight"] == 0.0


@pytest.mark.slow
@needs_kernels
def test_interpreter_refuses_bf16_and_cce_float32_in_one_line(interpreted: dict[str, Any]) -> None:
    """bf16 is silently wrong under the interpreter; cce's backward asserts fp16/bf16 hidden states
    (on CUDA too); this cut-cross-entropy takes no bias. Each: one ConfigError line naming key and fix."""
    refusals = interpreted["refusals"]
    for name in ("liger_bf16_check", "liger_bf16_call", "cce_bf16_check"):
        assert refusals[name].startswith("model.init_args.model.dtype='bfloat16': Triton's interpreter"), name
        assert "use float32 (liger) or float16 (cce)" in refusals[name]
    for name in ("cce_float32_check", "cce_float32_call"):
        assert refusals[name].startswith("model.init_args.model.dtype='float32': cce's Triton backward"), name
    assert "takes no LM-head bias" in refusals["cce_bias"]
    assert refusals["liger_float32_check"] == refusals["cce_float16_check"] == ""
    assert all("\n" not in message for message in refusals.values())


@pytest.mark.slow
@needs_kernels
def test_interpreted_liger_chunks_hold_the_asked_tokens(interpreted: dict[str, Any]) -> None:
    """``chunk_tokens`` reaches Liger as the budget whose chunks hold that many tokens (the last one
    what is left), null keeps Liger's own chunks, ``accum_dtype: float32`` reaches Liger as fp32, and
    a size below Liger's own chunk is one ConfigError line naming the sizes the shape allows. The
    parity cases ``liger_chunk_tokens_*`` check every size gives torch's loss and gradients. Seen
    failing (by hand, once each): the budget one too large (chunks of 32 for 16); the budget not
    passed (chunks of 8 whatever was asked); ``accum_dtype`` not passed (None); and, in a copy of
    liger-kernel, the last partial chunk dropped (``num_chunks = BT // chunk_size``: the parity cases
    with a partial chunk failed, loss off by 0.11-0.5, gradients by 0.5-1; one chunk of all 37 tokens
    and all_ignored passed)."""
    chunks = interpreted["liger_chunks"]
    assert chunks["own"] == {"rows": [8, 8, 8, 8, 5], "accum_dtype": "None", "chunk_mem_const": 1}
    assert chunks["16"]["rows"] == [16, 16, 5] and chunks["32_fp32"]["rows"] == [32, 5] and chunks["64"]["rows"] == [37]
    assert chunks["32_fp32"]["accum_dtype"] == "torch.float32" and chunks["16"]["accum_dtype"] == "None"
    assert interpreted["refusals"]["liger_chunk_below_its_own"] == (
        "model.init_args.loss_options.chunk_tokens=4: Liger's chunks of 37 tokens at vocabulary 101 and hidden 24 "
        "can hold [8, 16, 32, 37] tokens (its own: 8); use one of these or null"
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"chunk_tokens": 24}, r"loss_options\.chunk_tokens=24: Liger's chunks are powers of two"),
        ({"chunk_tokens": 0}, r"loss_options\.chunk_tokens=0: Liger's chunks are powers of two"),
        ({"accum_dtype": "bfloat16"}, r"loss_options\.accum_dtype='bfloat16': use float32 .* or null"),
        ({"chunk_size": 256}, r"loss_options=\{'chunk_size': 256\}: 'liger' takes no option \['chunk_size'\]"),
    ],
)
def test_liger_chunking_options_are_refused_in_one_line(options: dict[str, Any], match: str) -> None:
    """Checked before the backend looks for a GPU or the package, so they hold on any machine."""
    with pytest.raises(ConfigError, match=match):
        loss_backend("liger", **options)


def test_liger_chunk_budget_at_the_seed_shape() -> None:
    """Qwen3's head (V 151,936, H 1,024) on 8,192 tokens: Liger's own chunk is 64 tokens (128 reads of
    the head); each larger power of two is reached by the smallest budget, and a chunk over the
    batch's tokens is one chunk of all of them."""
    tokens, vocab, hidden = 8192, 151936, 1024
    assert liger_chunk(tokens, vocab, hidden, 1) == 64
    for size in (64, 128, 256, 512, 1024, 2048, 4096, 8192):
        budget = liger_chunk_budget(tokens, vocab, hidden, size)
        assert liger_chunk(tokens, vocab, hidden, budget) == size
        assert budget == 1 or liger_chunk(tokens, vocab, hidden, budget - 1) < size
    assert liger_chunk(tokens, vocab, hidden, liger_chunk_budget(tokens, vocab, hidden, 16384)) == tokens
    with pytest.raises(ConfigError, match=r"chunk_tokens=32: .* can hold \[64, 128, .*8192\] tokens \(its own: 64\)"):
        liger_chunk_budget(tokens, vocab, hidden, 32)


@pytest.mark.slow
def test_liger_s_options_reach_its_kernel_call_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where neither liger-kernel nor a GPU is (most CI machines), ``chunk_tokens``, ``accum_dtype`` and
    ``z_loss_weight`` still reach the call of Liger's function, here a stand-in module that records it:
    the budget whose chunks hold the asked tokens, fp32 accumulation, the z-loss as ``lse_square_scale``, a
    summed loss. Seen failing with ``accum_dtype`` not passed (no ``accum_dtype`` in the call) and with
    ``chunk_tokens`` dropped (no ``chunk_mem_const``)."""
    import types

    from lit_ablate.models.losses import cross_entropy

    calls: list[dict[str, Any]] = []

    def liger_fused_linear_cross_entropy(hidden, weight, labels, bias, **options):
        calls.append(options)
        return (hidden @ weight.t()).sum()

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    for name, module in (
        ("liger_kernel", types.ModuleType("liger_kernel")),
        ("liger_kernel.transformers", types.ModuleType("liger_kernel.transformers")),
        ("liger_kernel.transformers.functional", functional),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(cross_entropy, "_require_kernel_package", lambda *args: None)  # no package, no GPU here
    tokens, vocab, hidden = 37, 101, 24
    backend = loss_backend("liger", chunk_tokens=16, accum_dtype="float32", z_loss_weight=1e-4)
    backend(torch.randn(tokens, hidden), torch.randn(vocab, hidden), torch.zeros(tokens, dtype=torch.long))
    (options,) = calls
    assert liger_chunk(tokens, vocab, hidden, options.pop("chunk_mem_const")) == 16
    assert options == {"ignore_index": -100, "lse_square_scale": 1e-4, "reduction": "sum", "accum_dtype": torch.float32}


@needs_kernels
def test_libdevice_gap_and_shim(interpreted: dict[str, Any]) -> None:
    """While triton's interpreter returns None for ``libdevice.log1p`` the shim is needed and must be
    exact; once this fails with gap_open False, triton closed the gap: delete the libdevice shim
    (``LIBDEVICE_SHIMS`` in lit_ablate/models/losses/triton_interpreter.py) and this test."""
    gap = interpreted["libdevice"]
    assert gap["gap_open"], f"triton {triton_interpreter.TRITON_VERSION}'s interpreter runs libdevice: remove the shim"
    assert gap["shim_error"] <= 1e-6


def test_opt_in_refuses_another_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shims patch interpreter internals checked on one triton version only."""
    monkeypatch.setattr(triton_interpreter.importlib.metadata, "version", lambda name: "3.10.0")
    with pytest.raises(ConfigError, match=r"triton 3.10.0 is installed.*3.9.0 only"):
        triton_interpreter.enable("liger_kernel")


@needs_kernels
def test_opt_in_refused_when_triton_was_imported_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process imported triton before any opt-in (Lightning does): the switch cannot work any
    more, and saying so beats a kernel failing deep inside the interpreter (seen without this check:
    'Cannot call @triton.jit'd outside of the scope of a kernel' at CCE's first launch)."""
    import triton.language as tl

    assert not triton_interpreter._is_interpreted(tl.cdiv)
    monkeypatch.setenv(triton_interpreter.OPT_IN_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # restored after the test: enable sets it
    with pytest.raises(ConfigError, match="triton was imported before the opt-in took effect"):
        triton_interpreter.enable("cut_cross_entropy")


def test_opt_in_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only exactly 1 turns it on; a typo is refused rather than read as off."""
    monkeypatch.delenv(triton_interpreter.OPT_IN_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_interpreter.requested()
    assert triton_interpreter.kernel_mode() in ("compiled", None)
    monkeypatch.setenv(triton_interpreter.OPT_IN_ENV, "yes")
    with pytest.raises(ConfigError, match="LIT_ABLATE_TRITON_INTERPRET='yes'"):
        triton_interpreter.requested()


@pytest.fixture(scope="module")
def compiled() -> dict[str, Any]:
    """Every case on CUDA, compiled, in this process (no opt-in: the kernels compile as for users)."""
    if triton_interpreter.requested():
        pytest.fail(f"unset {triton_interpreter.OPT_IN_ENV} to test the compiled kernels")
    from tests.loss_kernel_cases import parity_errors

    return parity_errors("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernels)")
@needs_kernels
@pytest.mark.parametrize("case", CUDA_CASE_NAMES)
def test_compiled_kernel_matches_torch(compiled: dict[str, Any], case: str) -> None:
    assert_parity(compiled[case], case.split("_")[0], "cuda", case)

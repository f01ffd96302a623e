"""Loss backends: chunked (and CCE's torch_compile where installed) against the torch reference.

Tolerances: fp32 within 1e-5 relative (max abs difference over max abs value); bf16 within 1e-4
for the loss (both backends reduce the same bf16-rounded logits in fp32) and 2e-2 for gradients
(about two bf16 ulps: the bf16 matmuls are split at different places, so roundings differ).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lit_ablate.ablation.plan import plan_study
from lit_ablate.ablation.spec import load_study
from lit_ablate.config_keys import get_dotted
from lit_ablate.errors import ConfigError
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import (
    IGNORE_INDEX,
    ChunkedCrossEntropy,
    TorchCrossEntropy,
    check_loss_backend,
    loss_backend,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FP32_RTOL = 1e-5
BF16_LOSS_RTOL = 1e-4
BF16_GRAD_RTOL = 2e-2
GRAD_SCALE = 0.37  # a backward seed other than 1, as a mean over useful tokens gives


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def make_inputs(
    n_tokens: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    ignored: float = 0.25,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (n_tokens,), generator=generator)
    labels[torch.rand(n_tokens, generator=generator) < ignored] = IGNORE_INDEX
    return {
        "hidden": torch.randn(n_tokens, hidden, generator=generator).to(device, dtype).requires_grad_(),
        "weight": (torch.randn(vocab, hidden, generator=generator) * 0.5).to(device, dtype).requires_grad_(),
        "labels": labels.to(device),
        "bias": torch.randn(vocab, generator=generator).to(device, dtype).requires_grad_() if bias else None,
    }


def loss_and_grads(loss_fn, inputs: dict) -> list[torch.Tensor]:
    """``[loss, d hidden, d weight, (d bias)]`` for a backward seeded with ``GRAD_SCALE``."""
    loss = loss_fn(inputs["hidden"], inputs["weight"], inputs["labels"], inputs["bias"])
    wrt = [inputs[k] for k in ("hidden", "weight", "bias") if inputs[k] is not None]
    return [loss.detach(), *torch.autograd.grad(loss * GRAD_SCALE, wrt)]


CHUNKED_CASES = {
    # name: (tokens, vocab, chunked options, bias, z_loss_weight)
    "odd_token_chunks": (37, 101, {"chunk_tokens": 8}, False, 0.0),
    "one_chunk": (37, 101, {"chunk_tokens": 1024}, False, 0.0),
    "vocab_chunks_not_dividing": (37, 101, {"chunk_tokens": 8, "chunk_vocab": 30}, True, 0.0),
    "z_loss": (37, 101, {"chunk_tokens": 8}, False, 1e-2),
    "z_loss_vocab_chunks_bias": (50, 97, {"chunk_tokens": 16, "chunk_vocab": 20}, True, 1e-2),
}


GRAD_MODES = pytest.mark.parametrize("grad_in_forward", [True, False], ids=["grad_in_forward", "recompute"])


@GRAD_MODES
@pytest.mark.parametrize("case", sorted(CHUNKED_CASES))
def test_chunked_matches_torch_fp32(case: str, grad_in_forward: bool) -> None:
    tokens, vocab, options, bias, z = CHUNKED_CASES[case]
    inputs = make_inputs(tokens, vocab, hidden=24, bias=bias)
    expected = loss_and_grads(TorchCrossEntropy(z_loss_weight=z), inputs)
    actual = loss_and_grads(ChunkedCrossEntropy(z_loss_weight=z, grad_in_forward=grad_in_forward, **options), inputs)
    assert actual[0].dtype == torch.float32
    for name, a, e in zip(["loss", "d_hidden", "d_weight", "d_bias"], actual, expected):
        assert a.dtype == e.dtype, name
        assert relative_error(a, e) <= FP32_RTOL, (name, relative_error(a, e))


@GRAD_MODES
@pytest.mark.parametrize("options", [{"chunk_tokens": 16}, {"chunk_tokens": 16, "chunk_vocab": 48}])
def test_chunked_matches_torch_bf16(options: dict, grad_in_forward: bool) -> None:
    inputs = make_inputs(70, 131, hidden=32, dtype=torch.bfloat16, bias=True)
    expected = loss_and_grads(TorchCrossEntropy(z_loss_weight=1e-3), inputs)
    actual = loss_and_grads(ChunkedCrossEntropy(z_loss_weight=1e-3, grad_in_forward=grad_in_forward, **options), inputs)
    assert relative_error(actual[0], expected[0]) <= BF16_LOSS_RTOL
    for name, a, e in zip(["d_hidden", "d_weight", "d_bias"], actual[1:], expected[1:]):
        assert a.dtype == torch.bfloat16, name
        assert relative_error(a, e) <= BF16_GRAD_RTOL, (name, relative_error(a, e))


def test_torch_z_loss_is_ce_plus_weighted_squared_logsumexp() -> None:
    """The reference's z-loss against the formula in float64: sum over counted tokens of CE + w*lse^2."""
    inputs = make_inputs(29, 53, hidden=16, bias=True)
    weight_z = 0.05
    logits = inputs["hidden"].double() @ inputs["weight"].double().T + inputs["bias"].double()
    labels = inputs["labels"]
    counted = labels != IGNORE_INDEX
    lse = torch.logsumexp(logits, dim=-1)[counted]
    target = logits[counted].gather(1, labels[counted, None]).squeeze(1)
    expected = (lse - target + weight_z * lse.square()).sum()
    actual = TorchCrossEntropy(z_loss_weight=weight_z)(inputs["hidden"], inputs["weight"], labels, inputs["bias"])
    assert relative_error(actual.detach(), expected) <= FP32_RTOL


@pytest.mark.parametrize("name, options", [("torch", {}), ("chunked", {}), ("chunked", {"grad_in_forward": False})])
def test_all_labels_ignored_gives_zero_loss_and_zero_grads(name: str, options: dict) -> None:
    inputs = make_inputs(19, 41, hidden=8, bias=True, ignored=1.0)
    loss, *grads = loss_and_grads(loss_backend(name, z_loss_weight=1e-2, **options), inputs)
    assert loss.item() == 0.0
    for grad in grads:
        assert torch.isfinite(grad).all() and grad.abs().max().item() == 0.0


def test_chunked_without_grad_matches_torch() -> None:
    """Validation runs under no_grad: the forward alone must give the same sum."""
    inputs = make_inputs(33, 70, hidden=12)
    with torch.no_grad():
        args = (inputs["hidden"], inputs["weight"], inputs["labels"])
        expected = TorchCrossEntropy()(*args)
        actual = ChunkedCrossEntropy(chunk_tokens=5, chunk_vocab=9)(*args)
    assert relative_error(actual, expected) <= FP32_RTOL


def test_chunked_backward_twice_needs_recompute_mode() -> None:
    """grad_in_forward hands its gradients over once; the recompute mode supports retain_graph."""
    inputs = make_inputs(20, 30, hidden=8)
    args = (inputs["hidden"], inputs["weight"], inputs["labels"])
    loss = ChunkedCrossEntropy(chunk_tokens=6)(*args)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="grad_in_forward: false"):
        loss.backward()
    inputs["hidden"].grad = None
    loss = ChunkedCrossEntropy(chunk_tokens=6, grad_in_forward=False)(*args)
    loss.backward(retain_graph=True)
    once = inputs["hidden"].grad.clone()
    loss.backward()
    assert relative_error(inputs["hidden"].grad, 2 * once) <= FP32_RTOL


def test_chunked_rejects_label_outside_vocabulary() -> None:
    inputs = make_inputs(8, 16, hidden=4)
    labels = inputs["labels"].clone()
    labels[0] = 16
    with pytest.raises(RuntimeError, match="outside"):
        ChunkedCrossEntropy(chunk_tokens=4)(inputs["hidden"], inputs["weight"], labels)


def peak_loss_bytes(loss_fn, inputs: dict) -> int:
    """Peak tensor bytes allocated by one forward+backward, above the inputs (MemTracker, CPU)."""
    tracker = MemTracker()
    tracker.track_external(inputs["hidden"], inputs["weight"], inputs["labels"])
    cpu = torch.device("cpu")
    with tracker:
        before = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        loss_fn(inputs["hidden"], inputs["weight"], inputs["labels"]).backward()
    return tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before


@GRAD_MODES
def test_chunked_never_holds_full_logits(grad_in_forward: bool) -> None:
    """Forward+backward peak stays far below one [tokens, vocab] fp32 buffer; torch's is above it."""
    tokens, vocab, hidden, chunk = 512, 8192, 16, 32
    logits_bytes = tokens * vocab * 4
    torch_peak = peak_loss_bytes(TorchCrossEntropy(), make_inputs(tokens, vocab, hidden))
    chunked = ChunkedCrossEntropy(chunk_tokens=chunk, grad_in_forward=grad_in_forward)
    chunked_peak = peak_loss_bytes(chunked, make_inputs(tokens, vocab, hidden))
    # chunked: ~2 chunk buffers (chunk x vocab fp32) + grad of weight and hidden, no [tokens, vocab].
    grads_bytes = (vocab + tokens) * hidden * 4
    assert torch_peak >= 2 * logits_bytes
    assert chunked_peak <= 3 * chunk * vocab * 4 + grads_bytes + 64 * 1024
    assert chunked_peak < logits_bytes / 4


def test_causal_lm_with_chunked_loss_matches_torch() -> None:
    """Through the real module (tiny Llama): same summed loss and same LM-head / embedding grads."""
    torch.manual_seed(0)
    lm = ModelFactory(preset="tiny-llama").build()
    input_ids = torch.randint(0, 320, (2, 24))
    labels = input_ids.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :5] = IGNORE_INDEX
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids)}
    results = {}
    for name, options in [("torch", {}), ("chunked", {"chunk_tokens": 7, "chunk_vocab": 100})]:
        module = CausalLMWithLoss(lm, loss_backend(name, **options))
        lm.zero_grad(set_to_none=True)
        loss_sum, useful = module(batch)
        (loss_sum / useful).backward()
        results[name] = (
            loss_sum.detach(),
            lm.get_output_embeddings().weight.grad.clone(),
            lm.get_input_embeddings().weight.grad.clone(),
            useful,
        )
    assert results["torch"][3] == results["chunked"][3] == (labels != IGNORE_INDEX).sum()
    for a, e in zip(results["chunked"][:3], results["torch"][:3]):
        assert relative_error(a, e) <= FP32_RTOL


# --- registry, options and start-up checks -------------------------------------------------------


def test_loss_backend_builds_with_options_and_rejects_bad_ones() -> None:
    assert loss_backend("chunked", chunk_tokens=64) == ChunkedCrossEntropy(chunk_tokens=64)
    assert loss_backend("torch") == TorchCrossEntropy()
    with pytest.raises(ConfigError, match=r"model.init_args.loss='nope'.*chunked"):
        loss_backend("nope")
    with pytest.raises(ConfigError, match="takes no option \\['chunk_tokens'\\]"):
        loss_backend("torch", chunk_tokens=64)
    with pytest.raises(ConfigError, match="chunk_tokens=0"):
        loss_backend("chunked", chunk_tokens=0)
    with pytest.raises(ConfigError, match="z_loss_weight=-1"):
        loss_backend("chunked", z_loss_weight=-1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("name", ["liger", "cce"])
def test_gpu_backends_are_refused_at_startup_on_cpu(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the interpreter opt-in (tests/test_loss_kernels.py runs them with it); the refusal names it."""
    monkeypatch.delenv("LIT_ABLATE_TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=f"loss='{name}'.*(needs CUDA.*LIT_ABLATE_TRITON_INTERPRET=1|pip install)"):
        check_loss_backend(name)


def test_cce_rejects_z_loss_and_unknown_impl() -> None:
    with pytest.raises(ConfigError, match=r"z_loss_weight.*log-sum-exp"):
        check_loss_backend("cce", z_loss_weight=1e-4)
    with pytest.raises(ConfigError, match="impl='triton'"):
        check_loss_backend("cce", impl="triton")


@pytest.mark.parametrize(
    ("study", "second_axis", "variants"),
    [
        ("liger_vs_cce", "model.init_args.model.dtype", 12),
        ("loss_batch_size", "data.init_args.batch_size", 12),
    ],
)
def test_loss_studies_plan_with_gpu_variants_skipped_on_cpu(
    study: str, second_axis: str, variants: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every variant resolves as ``fit`` would (~3 s a study); liger/cce are skipped where they cannot run
    (without the interpreter opt-in: on CPU all of them; cce in float32 everywhere)."""
    monkeypatch.delenv("LIT_ABLATE_TRITON_INTERPRET", raising=False)
    spec = load_study(CONFIGS / "studies" / f"{study}.yaml")
    assert list(spec.variables) == ["model.init_args.loss", second_axis]
    runs = plan_study(spec, tmp_path)
    assert len(runs) == variants and [r.variant.name for r in runs if r.invalid] == []
    for run in runs:
        loss = run.variant.axis_values["model.init_args.loss"]
        if loss in ("torch", "chunked"):
            assert run.skip_reason is None, run.variant.name
        else:  # skipped exactly when its start-up check refuses this machine, with that reason
            with pytest.raises(ConfigError) if run.skip_reason else contextlib.nullcontext():
                check_loss_backend(loss, compute_dtype=get_dotted(run.config, "model.init_args.model.dtype", "float32"))


# --- optional packages: CCE's compiled reference on CPU (the Liger and CCE kernels: test_loss_kernels.py) ---


@pytest.mark.slow
def test_cce_torch_compile_matches_torch() -> None:
    pytest.importorskip("cut_cross_entropy", reason="cut-cross-entropy not installed (pip install 'lit-ablate[gpu]')")
    inputs = make_inputs(40, 96, hidden=16)
    expected = loss_and_grads(TorchCrossEntropy(), inputs)
    actual = loss_and_grads(loss_backend("cce", impl="torch_compile"), inputs)
    for name, a, e in zip(["loss", "d_hidden", "d_weight"], actual, expected):
        assert relative_error(a, e) <= FP32_RTOL, (name, relative_error(a, e))

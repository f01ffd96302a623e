"""``logprobs: liger`` (Liger-Kernel's fused linear DPO) against the ``torch`` and ``chunked`` backends.

Liger's fused DPO is plain torch, so it runs here on CPU (no Triton interpreter). One padded batch
of 6 ``ArithmeticPreference`` pairs of unequal lengths, through the tiny Llama moved away from its
frozen reference (``tests/test_dpo.module``): the summed pair loss, per-pair log-probs and rewards
and every policy gradient must agree with the per-token backends + ``PreferenceLoss`` to fp32
rounding (loss and log-probs 1e-5 absolute, gradients ``GRAD_RTOL`` relative), in chunks of 2
pairs (Liger accumulates its gradients over chunks in its forward).

Bugs put in on purpose, and which test saw them:
- the Liger loss taken as the micro-batch's sum while Liger returns the pair mean (``* pairs``
  dropped in ``LigerDPOLoss``): ``test_liger_equals_torch_and_chunked`` fails on loss and gradients;
- the reference head taken from the current policy instead of a copy of the initial head
  (``LigerDPOPolicy.reference_head`` read from ``head.weight`` at each step): fails on rewards
  and loss for ``frozen``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lit_ablate.errors import ConfigError
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import DPO
from tests.test_dpo import GRAD_RTOL, packed, padded, pairs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None,
    reason="liger-kernel is not installed (pip install 'lit-ablate[gpu]')",
)


def perturbed(loss_type: str, reference: str, logprobs: str, options: dict | None = None) -> DPO:
    """The tiny Llama policy moved 0.02 x noise away from its (frozen) initial weights (as
    ``tests/test_dpo.module``)."""
    torch.manual_seed(0)
    dpo = DPO(
        ModelFactory(preset="tiny-llama", attn_implementation="sdpa"),
        loss_type=loss_type,
        beta=0.5,
        reference=reference,
        logprobs=logprobs,
        logprobs_options=options,
    )
    dpo.configure_model()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in dpo.model.parameters():  # not Liger's frozen copy of the reference head
            if p.requires_grad:
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
    return dpo


def step_and_grads(dpo: DPO, batch: dict) -> tuple:
    step = dpo.pair_step(batch)
    named = [(n, p) for n, p in dpo.model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(step.loss_sum, [p for _, p in named])
    return step, {n: g for (n, _), g in zip(named, grads)}


@pytest.mark.parametrize("loss_type,reference", [("sigmoid", "frozen"), ("hinge", "frozen"), ("sigmoid", "none")])
def test_liger_equals_torch_and_chunked(loss_type: str, reference: str) -> None:
    batch = padded(pairs())
    got, got_grads = step_and_grads(perturbed(loss_type, reference, "liger", {"chunk_pairs": 2}), batch)
    assert got.chosen_rewards.ne(got.rejected_rewards).all() and got.loss_sum.abs() > 0.1
    for backend in ("torch", "chunked"):
        want, want_grads = step_and_grads(perturbed(loss_type, reference, backend), batch)
        for field in ("loss_sum", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards"):
            torch.testing.assert_close(
                getattr(got, field),
                getattr(want, field).detach(),
                atol=1e-5,
                rtol=0,
                msg=lambda m, f=field, b=backend: f"{f} vs {b}: {m}",
            )
        for name, value in want_grads.items():
            error = ((got_grads[name] - value).abs().max() / value.abs().max().clamp(min=1e-30)).item()
            assert error <= GRAD_RTOL, f"{name} vs {backend}: relative gradient error {error:.1e}"


def test_liger_with_a_separate_reference_equals_torch(tmp_path) -> None:
    """With ``reference_model``, Liger reads the reference checkpoint's hidden states and LM head (its
    frozen copy inside the policy): the pair step equals the torch backend's against the same checkpoint.
    Seen failing with the head copied from the policy's start as before (loss sum 4.576 vs 4.522)."""
    perturbed("sigmoid", "frozen", "torch").model.lm.save_pretrained(tmp_path)  # a checkpoint other than the start
    batch = padded(pairs())

    def step(logprobs: str, options: dict | None = None) -> tuple:
        torch.manual_seed(0)
        dpo = DPO(
            ModelFactory(preset="tiny-llama", attn_implementation="sdpa"),
            beta=0.5,
            reference_model=str(tmp_path),
            logprobs=logprobs,
            logprobs_options=options,
        )
        dpo.configure_model()
        return step_and_grads(dpo, batch)

    got, got_grads = step("liger", {"chunk_pairs": 2})
    want, want_grads = step("torch")
    assert want.chosen_rewards.abs().max() > 0.1  # the separate reference matters
    for field in ("loss_sum", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field).detach(), atol=1e-5, rtol=0)
    for name, value in want_grads.items():
        error = ((got_grads[name] - value).abs().max() / value.abs().max().clamp(min=1e-30)).item()
        assert error <= GRAD_RTOL, f"{name}: relative gradient error {error:.1e}"


def test_liger_training_step_reports_the_same_statistics() -> None:
    """``training_step``'s loss and ``preference`` sums (what ``PreferenceMonitor`` logs) match ``torch``."""
    batch = padded(pairs(4))
    got = perturbed("sigmoid", "frozen", "liger").training_step(batch, 0)
    want = perturbed("sigmoid", "frozen", "torch").training_step(batch, 0)
    torch.testing.assert_close(got["preference"], want["preference"], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["loss"], want["loss"].detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "options,key",
    [
        ({"loss_type": "ipo"}, "loss_type"),
        ({"loss_type": "simpo", "reference": "none"}, "loss_type"),
        ({"label_smoothing": 0.1}, "label_smoothing"),
        ({"reference": "precomputed"}, "reference"),
        ({"logprobs_options": {"chunk_tokens": 4}}, "logprobs_options"),
    ],
)
def test_liger_refuses_what_it_cannot_compute(options: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"model\.init_args\.{key}.*"):
        DPO(ModelFactory(preset="tiny-llama"), logprobs="liger", **options)


def test_liger_refuses_packed_batches() -> None:
    dpo = perturbed("sigmoid", "frozen", "liger")
    with pytest.raises(ConfigError, match=r"data.init_args.collator.*PreferencePaddingCollator"):
        dpo.pair_step(packed(pairs(2)))


def test_liger_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"model\.init_args\.logprobs='liger'.*lit-ablate\[gpu\]"):
        DPO(ModelFactory(preset="tiny-llama"), logprobs="liger")


def test_liger_fit_refuses_a_packing_collator_before_the_first_step(tmp_path) -> None:
    import lightning.pytorch as L

    from lit_ablate.data import ArithmeticPreference, LMDataModule, PreferencePackingCollator

    module = DPO(ModelFactory(preset="tiny-llama"), logprobs="liger")
    data = LMDataModule(
        ArithmeticPreference(num_examples=8, max_operand=9),
        format="preference",
        seq_len=64,
        batch_size=2,
        val_examples=0,
        collator=PreferencePackingCollator(),
    )
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(ConfigError, match=r"data\.init_args\.collator='PreferencePackingCollator'"):
        trainer.fit(module, data)

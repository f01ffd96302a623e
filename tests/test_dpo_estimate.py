"""DPO in the memory and FLOPs estimates, and its frozen reference in the measured tensor breakdown.

- ``training_shape_of`` reads a DPO config as ``2 x batch_size`` sequences (padded pairs), its
  log-prob backend and its reference; ``estimate_for_config`` adds a frozen reference's parameters
  as a ``reference`` category (a precomputed or adapter-disabled reference costs nothing at train
  time), and Liger's copy of the reference head with ``logprobs: liger``.
- A 3-step fit of DPO (``logprobs: liger``, frozen reference) under ``MemoryMonitor``: the run
  record's ``reference`` category holds exactly the reference model and Liger's head copy
  (``DPO.memory_categories``), not ``params``, and the estimate's ``reference`` is within 1% of it
  (the estimate counts parameters, the tracker also the reference's rotary buffers).

Bugs put in on purpose, and which test saw them: ``DPO.memory_categories`` removed (the reference
counted as ``params``): ``test_fit_counts_the_frozen_reference_apart`` fails; the reference
head's copy not counted by ``reference_bytes``: the same test fails on the estimate.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import lightning.pytorch as L
import pytest

from lit_ablate.callbacks import MemoryMonitor, RunRecorder
from lit_ablate.data import ArithmeticPreference, LMDataModule
from lit_ablate.estimate.flops import preference_flops_factor
from lit_ablate.estimate.from_config import estimate_for_config, training_shape_of
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import DPO

BATCH_PAIRS, SEQ_LEN = 2, 64
CONFIG = {
    "trainer": {"accelerator": "cpu", "devices": 1, "strategy": "auto"},
    "model": {
        "class_path": "lit_ablate.modules.DPO",
        "init_args": {"model": {"preset": "tiny-llama"}, "reference": "frozen", "logprobs": "torch"},
    },
    "data": {
        "class_path": "lit_ablate.data.LMDataModule",
        "init_args": {"format": "preference", "batch_size": BATCH_PAIRS, "seq_len": SEQ_LEN},
    },
}


def config(**model_args: object) -> dict:
    out = copy.deepcopy(CONFIG)
    out["model"]["init_args"].update(model_args)
    return out


def test_estimate_counts_pairs_and_the_reference_model() -> None:
    shape = training_shape_of(config())
    assert (shape.micro_batch, shape.seq_len, shape.reference, shape.loss) == (
        2 * BATCH_PAIRS,
        SEQ_LEN,
        "frozen",
        "torch",
    )
    frozen = estimate_for_config(config())
    assert frozen.reference == frozen.params > 0  # a second copy of the model, no grads or optimizer states
    for reference in ("precomputed", "adapter", "none"):
        other = estimate_for_config(config(reference=reference))
        assert other.reference == 0 and other.total == frozen.total - frozen.params
    chunked = training_shape_of(config(logprobs="chunked", logprobs_options={"chunk_tokens": 32}))
    assert (chunked.loss, chunked.chunk_tokens, chunked.loss_grad_in_forward) == ("chunked", 32, False)
    assert estimate_for_config(config(logprobs="chunked")).activations < frozen.activations
    assert preference_flops_factor("frozen") == preference_flops_factor("adapter") == pytest.approx(4 / 3)
    assert preference_flops_factor("precomputed") == preference_flops_factor("none") == 1.0


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_fit_counts_the_frozen_reference_apart(tmp_path) -> None:
    L.seed_everything(0)
    module = DPO(ModelFactory(preset="tiny-llama"), logprobs="liger", warmup_steps=0)
    data = LMDataModule(
        ArithmeticPreference(num_examples=16, max_operand=9),
        format="preference",
        seq_len=SEQ_LEN,
        batch_size=BATCH_PAIRS,
        val_examples=0,
    )
    path = tmp_path / "run.json"
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[MemoryMonitor(), RunRecorder(path=str(path), warmup_steps=2)],
    )
    trainer.fit(module, data)
    record = json.loads(path.read_text())
    maxima = record["summary"]["tensor_breakdown"]["max"]
    reference = [*module.reference.parameters(), *module.reference.buffers(), *module.model.reference_head.parameters()]
    policy = [p for p in module.model.parameters() if p.requires_grad]
    assert maxima["reference"] == sum(t.numel() * t.element_size() for t in reference)
    assert maxima["params"] == sum(t.numel() * t.element_size() for t in policy) + sum(
        b.numel() * b.element_size() for b in module.model.buffers()
    )
    assert all(s["loss"] > 0 for s in record["steps"])  # the fused loss trained through Lightning
    estimate = estimate_for_config(config(logprobs="liger"))
    assert estimate.reference == pytest.approx(maxima["reference"], rel=0.01)


@pytest.mark.parametrize("logprobs", ["torch", "liger"])
def test_memory_categories_resolve_for_each_backend(logprobs: str) -> None:
    """The declared ``reference`` paths exist for every policy (a missing one crashed MemoryMonitor)."""
    from lit_ablate.callbacks.memory import declared_categories

    if logprobs == "liger" and importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed")
    dpo = DPO(ModelFactory(preset="tiny-llama"), logprobs=logprobs)
    dpo.configure_model()
    modules = declared_categories(dpo)["reference"]
    assert modules[0] is dpo.reference and len(modules) == (2 if logprobs == "liger" else 1)

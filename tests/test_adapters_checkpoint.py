"""Adapter-only checkpoints (``AdapterCheckpoint``): the checkpoint holds the trainable adapters and
their optimizer states, not the frozen base, and a run resumed from it on the same base trains
exactly like one never interrupted (bit-equal adapters and step losses; same protocol as
``tests/test_adapters_resume.py``, whose FSDP2 test also resumes QLoRA from adapter-only checkpoints
on 2 ranks).

Bugs these catch (each seen failing on purpose): a filter that drops the adapters too (the resume
restarts them from their initialisation: losses differ at step 3); a resume on another base (a
different seed) accepted without the fingerprint check.
"""

from __future__ import annotations

import math
import os

import lightning.pytorch as pl
import pytest
import torch

from lit_ablate.callbacks.adapter_checkpoint import FINGERPRINT_KEY, AdapterCheckpoint, base_fingerprint
from lit_ablate.errors import ConfigError
from lit_ablate.models.adapters.quantization import QuantizationOptions
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import FSDP2Strategy
from tests.test_adapters_resume import assert_resumed_exactly, fit


def _bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_adapter_checkpoint_holds_adapters_only_and_resumes_exactly(tmp_path):
    root = str(tmp_path)
    first = fit(root, 2, False, callbacks=(AdapterCheckpoint(),))  # QLoRA: in test_adapters_resume's FSDP2 test
    resumed = fit(root, 4, False, ckpt_path=f"{root}/step2.ckpt", callbacks=(AdapterCheckpoint(),))
    assert_resumed_exactly(first, resumed, fit(f"{root}/straight", 4, False))

    saved = torch.load(f"{root}/step2.ckpt", weights_only=True)
    state = saved["state_dict"]
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state), sorted(state)[:3]
    assert set(state) == set(first["adapters"])
    assert {"exp_avg", "exp_avg_sq"} <= set(saved["optimizer_states"][0]["state"][0])
    assert saved[FINGERPRINT_KEY]  # one sum per frozen weight
    full = torch.load(f"{root}/straight/step4.ckpt", weights_only=True)
    frozen = _bytes(full["state_dict"]) - _bytes(state)
    # The file shrinks by the frozen base's bytes, up to pickling slack.
    shrink = os.path.getsize(f"{root}/straight/step4.ckpt") - os.path.getsize(f"{root}/step2.ckpt")
    assert frozen > _bytes(state) and shrink > 0.95 * frozen, (shrink, frozen)


def test_adapter_checkpoint_refuses_another_base(tmp_path):
    root = str(tmp_path)
    fit(root, 2, False, callbacks=(AdapterCheckpoint(),))
    with pytest.raises(ConfigError, match="another base"):
        fit(root, 4, False, ckpt_path=f"{root}/step2.ckpt", callbacks=(AdapterCheckpoint(),), seed=1)


def test_adapter_checkpoint_refuses_sharded_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="save_distributed_checkpoint"):
        fit(str(tmp_path), 1, False, strategy=FSDP2Strategy(), callbacks=(AdapterCheckpoint(),))


def test_an_adapter_only_checkpoint_exports_over_its_pretrained_base(tmp_path):
    """Export reads an adapter-only checkpoint over the ``pretrained:`` folder it names (fingerprint
    checked), with the trained logits; over a config-built base, which no file holds, it is refused."""
    import lightning.pytorch as pl
    from peft import PeftModel
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from lit_ablate.commands.export import export_hf_checkpoint
    from lit_ablate.models.factory import ModelFactory
    from lit_ablate.modules import CausalLM
    from tests.test_step_objective import micro_batches

    torch.manual_seed(0)
    ModelFactory(preset="tiny-llama").build().save_pretrained(tmp_path / "base")
    pl.seed_everything(0, verbose=False)
    module = CausalLM(
        ModelFactory(pretrained=str(tmp_path / "base"), adapter={"r": 8}), learning_rate=1e-2, warmup_steps=0
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[AdapterCheckpoint()],
    )
    trainer.fit(module, DataLoader(micro_batches("reference"), batch_size=None))
    trainer.save_checkpoint(tmp_path / "adapters.ckpt")
    ids = torch.arange(40).reshape(2, 20) % 250
    trained = module.eval().model.logits(ids)
    out = export_hf_checkpoint(tmp_path / "adapters.ckpt", tmp_path / "adapter", tokenizer="byte")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), out)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, rtol=0, atol=0)

    fit(str(tmp_path / "config"), 1, False, callbacks=(AdapterCheckpoint(),))
    with pytest.raises(ConfigError, match="no file holds that base"):
        export_hf_checkpoint(tmp_path / "config" / "step1.ckpt", tmp_path / "refused", tokenizer="byte")


def test_the_base_fingerprint_of_4bit_weights_stored_as_floats_is_that_of_their_bytes():
    """Packed 4-bit bytes viewed as float32 (``quant_storage``) hold NaNs: summed as floats, the
    fingerprint matched nothing, itself included (seen: every FSDP2 QLoRA resume from an adapter-only
    checkpoint with float32 storage refused as "trained on another base"). Summed as bytes it is the
    uint8-stored model's, and another base still differs."""

    def fingerprint(storage: str, seed: int = 0) -> dict[str, float]:
        pl.seed_everything(seed, verbose=False)
        quantization = QuantizationOptions(bits=4, quant_type="nf4", quant_storage=storage)
        module = CausalLM(ModelFactory(preset="tiny-llama", adapter={"r": 8}, quantization=quantization))
        module.configure_model()
        return base_fingerprint(module)

    as_floats, as_bytes = fingerprint("float32"), fingerprint("uint8")
    assert as_floats == as_bytes and all(math.isfinite(v) for v in as_floats.values())
    assert any(".base_layer.weight" in name for name in as_floats)
    assert fingerprint("float32", seed=1) != as_floats

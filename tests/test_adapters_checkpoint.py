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

import os

import pytest
import torch

from lit_ablate.callbacks.adapter_checkpoint import FINGERPRINT_KEY, AdapterCheckpoint
from lit_ablate.errors import ConfigError
from lit_ablate.strategies import FSDP2Strategy
from tests.test_adapters_resume import assert_resumed_exactly, fit


def _bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_adapter_checkpoint_holds_adapters_only_and_resumes_exactly(tmp_path):
    root = str(tmp_path)
    first = fit(root, 2, True, callbacks=(AdapterCheckpoint(),))  # QLoRA: the 4-bit base is rebuilt, not saved
    resumed = fit(root, 4, True, ckpt_path=f"{root}/step2.ckpt", callbacks=(AdapterCheckpoint(),))
    assert_resumed_exactly(first, resumed, fit(f"{root}/straight", 4, True))

    saved = torch.load(f"{root}/step2.ckpt", weights_only=True)
    state = saved["state_dict"]
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state), sorted(state)[:3]
    assert set(state) == set(first["adapters"])
    assert {"exp_avg", "exp_avg_sq"} <= set(saved["optimizer_states"][0]["state"][0])
    assert saved[FINGERPRINT_KEY]  # one sum per frozen weight
    full = torch.load(f"{root}/straight/step4.ckpt", weights_only=True)
    frozen = _bytes(full["state_dict"]) - _bytes(state)
    # The file shrinks by the frozen base's bytes (packed 4-bit weights, scales, LM head), up to pickling slack.
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

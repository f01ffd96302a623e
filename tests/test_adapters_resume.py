"""A LoRA/QLoRA run resumed from its checkpoint trains exactly like one never interrupted: adapters,
their optimizer states and (QLoRA) the 4-bit base with its scales come back from the checkpoint,
in one process (a ``.ckpt`` file) and under FSDP2 on 2 ranks (a sharded DCP folder).

Each run trains 2 steps and saves, then a new Trainer resumes to step 4 on the batches not yet
seen; the reference trains 4 steps straight (constant learning rate). Equal means bit-equal adapters
and step losses: the same ops on the same values. A resume that lost the optimizer state (Adam's
moments restarting at zero) moves the adapters by ~lr per step and fails; so does a 4-bit base whose
scales were not restored (seen failing with ``_load_quant_state`` unregistered: strict loading
refuses the scale keys).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from lit_ablate.callbacks.adapter_checkpoint import AdapterCheckpoint
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import FSDP2Strategy
from tests.distributed import run_ranks
from tests.test_adapters_strategies import FSDP2_QUANT_STORAGE
from tests.test_step_objective import StepLosses, micro_batches

QUANTIZED = {"bits": 4, "quant_type": "nf4"}


def fit(
    root: str,
    steps: int,
    quantized: bool,
    ckpt_path: str | None = None,
    strategy="auto",
    devices: int = 1,
    rank: int = 0,
    callbacks: tuple = (),
    seed: int = 0,
) -> dict:
    pl.seed_everything(seed, verbose=False)
    storage = FSDP2_QUANT_STORAGE if isinstance(strategy, FSDP2Strategy) else "uint8"
    quantization = {**QUANTIZED, "quant_storage": storage} if quantized else None
    factory = ModelFactory(preset="tiny-llama", adapter={"r": 8}, quantization=quantization)
    # A constant learning rate: the cosine schedule's length is max_steps, which the first part differs in.
    module = CausalLM(factory, learning_rate=1e-2, warmup_steps=0, weight_decay=0.1, min_lr_ratio=1.0)
    losses = StepLosses()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=[losses, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    batches = micro_batches("reference" if devices == 1 else "ranks", rank)
    # Lightning resumes a plain DataLoader at the saved batch index but from its first item: rotate the
    # batches so that item is the first one not yet trained on (the epoch keeps its length).
    start = 2 if ckpt_path else 0
    trainer.fit(module, DataLoader(batches[start:] + batches[:start], batch_size=None), ckpt_path=ckpt_path)
    trainer.save_checkpoint(f"{root}/step{steps}.ckpt")
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    adapters = get_model_state_dict(trainer.strategy.model, options=options)
    return {"losses": losses.losses, "adapters": {k: v.clone() for k, v in adapters.items() if ".lora_" in k}}


def assert_resumed_exactly(first: dict, resumed: dict, straight: dict) -> None:
    assert first["losses"] + resumed["losses"] == straight["losses"]
    assert resumed["adapters"].keys() == straight["adapters"].keys() and straight["adapters"]
    for name, value in straight["adapters"].items():
        assert torch.equal(resumed["adapters"][name], value), name


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
def test_one_process_resume_equals_uninterrupted_training(tmp_path, quantized):
    first = fit(str(tmp_path), 2, quantized)
    resumed = fit(str(tmp_path), 4, quantized, ckpt_path=str(tmp_path / "step2.ckpt"))
    assert_resumed_exactly(first, resumed, fit(str(tmp_path / "straight"), 4, quantized))


def _fsdp2_resume(rank: int, world_size: int, root: str, quantized: bool) -> dict:
    first = fit(root, 2, quantized, strategy=FSDP2Strategy(), devices=2, rank=rank)
    resumed = fit(root, 4, quantized, ckpt_path=f"{root}/step2.ckpt", strategy=FSDP2Strategy(), devices=2, rank=rank)
    straight = fit(f"{root}/straight", 4, quantized, strategy=FSDP2Strategy(), devices=2, rank=rank)
    # The same resume from adapter-only checkpoints (tests/test_adapters_checkpoint.py), one file gathered on rank 0.
    one_file = {"strategy": FSDP2Strategy(save_distributed_checkpoint=False), "devices": 2, "rank": rank}
    adapters_first = fit(f"{root}/adapters", 2, quantized, callbacks=(AdapterCheckpoint(),), **one_file)
    one_file["strategy"] = FSDP2Strategy(save_distributed_checkpoint=False)
    adapters_resumed = fit(
        f"{root}/adapters",
        4,
        quantized,
        ckpt_path=f"{root}/adapters/step2.ckpt",
        callbacks=(AdapterCheckpoint(),),
        **one_file,
    )
    return {
        "first": first,
        "resumed": resumed,
        "straight": straight,
        "adapters_first": adapters_first,
        "adapters_resumed": adapters_resumed,
    }


@pytest.mark.slow  # ~45 s on a loaded 2-core machine: 5 Trainer runs per rank
def test_fsdp2_qlora_resumes_from_a_sharded_checkpoint_exactly(tmp_path):
    """Also: from an adapter-only checkpoint (``AdapterCheckpoint``), which holds no frozen weight."""
    for run in run_ranks(_fsdp2_resume, 2, str(tmp_path), True, init_process_group=False, timeout_s=400):
        assert_resumed_exactly(run["first"], run["resumed"], run["straight"])
        assert_resumed_exactly(run["adapters_first"], run["adapters_resumed"], run["straight"])
    state = torch.load(tmp_path / "adapters" / "step2.ckpt", weights_only=True)["state_dict"]
    assert state and all(".lora_" in k for k in state)

"""``ExpertLoadMonitor``: its record equals the routing the model really did, step by step."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_ablate.callbacks import RunRecorder
from lit_ablate.callbacks.expert_load import ExpertLoadMonitor, load_statistics
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.moe.blocks import MoEOptions, moe_blocks
from lit_ablate.modules import CausalLM

SEQ = 16


def MoECausalLM(moe: MoEOptions, **kwargs) -> CausalLM:
    """The tiny Qwen3-MoE with patched blocks, built the way a config builds it (``model.moe``)."""
    return CausalLM(ModelFactory(preset="tiny-qwen3-moe", moe=moe), warmup_steps=0, **kwargs)


def batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 256, (2, SEQ), generator=generator) for _ in range(n)]
    return [{"input_ids": i, "labels": i.roll(-1, 1)} for i in ids]


def test_load_statistics_of_even_and_collapsed_routing() -> None:
    assert load_statistics([3, 3, 3, 3]) == {"max_over_mean": 1.0, "cv": 0.0}
    collapsed = load_statistics([12, 0, 0, 0])
    assert collapsed["max_over_mean"] == 4.0 and collapsed["cv"] == pytest.approx(math.sqrt(3))


def test_expert_load_in_the_run_record_matches_the_routing(tmp_path) -> None:
    L.seed_everything(0)
    module = MoECausalLM(
        MoEOptions(experts="grouped", load_balance_weight=0.01, z_loss_weight=0.001), learning_rate=1e-12
    )  # weights stay put, so the routing can be replayed afterwards
    data = batches(4)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        accumulate_grad_batches=2,
        logger=False,
        callbacks=[ExpertLoadMonitor(), RunRecorder(path=str(tmp_path / "run.json"), warmup_steps=0)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=None))
    steps = json.loads((tmp_path / "run.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2]

    lm = module.model.lm.train()
    blocks = moe_blocks(lm)
    for step in steps:
        for batch in data[2 * (step["step"] - 1) : 2 * step["step"]]:  # replay the step's micro-batches
            lm(input_ids=batch["input_ids"], use_cache=False)
        per_layer = []
        for block in blocks:
            load = block.pop_load()
            layer = f"moe/layer{block.layer_index}"
            fractions = (load.counts / load.counts.sum()).tolist()
            assert step[f"{layer}/expert_fraction"] == pytest.approx(fractions, abs=1e-9)
            stats = load_statistics(load.counts.tolist())
            assert step[f"{layer}/max_over_mean"] == pytest.approx(stats["max_over_mean"], rel=1e-9)
            assert step[f"{layer}/cv"] == pytest.approx(stats["cv"], rel=1e-9)
            assert step[f"{layer}/load_balance_loss"] == pytest.approx(load.load_balance_loss, rel=1e-5)
            assert step[f"{layer}/z_loss"] == pytest.approx(load.z_loss, rel=1e-5)
            per_layer.append(stats)
        assert step["moe/max_over_mean"] == pytest.approx(max(s["max_over_mean"] for s in per_layer), rel=1e-9)
        assert step["moe/cv"] == pytest.approx(sum(s["cv"] for s in per_layer) / len(blocks), rel=1e-9)


def test_monitor_warns_when_there_are_no_moe_blocks() -> None:
    module = CausalLM(ModelFactory(preset="tiny-llama"))
    module.configure_model()
    monitor = ExpertLoadMonitor()

    class Trainer:  # what on_train_start reads (a plain class: the step clock keeps a weak reference to it)
        global_step, callbacks = 0, [monitor]

    with pytest.warns(UserWarning, match="no lit-ablate MoE blocks"):
        monitor.on_train_start(Trainer(), module)


def test_module_reports_the_experts_fallback_for_the_run_record() -> None:
    module = MoECausalLM(MoEOptions(experts="grouped"))
    module.configure_model()
    assert module.fallbacks == []
    module.model.double()  # grouped_mm has no float64 CPU kernel: the experts fall back
    module.model(batches(1)[0])
    assert module.fallbacks == ["torch._grouped_mm does not run torch.float64 on cpu"]

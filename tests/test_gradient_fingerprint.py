"""``GradientFingerprint``: one step's gradient norms, read where the optimizer reads them, named and reduced
alike in every layout, so that a study can compare layouts tensor by tensor (``expect_equal_gradients``).

The layouts' data hold unequal useful tokens per rank (``test_step_objective``'s micro-batches: rank 0 the
long rows), so a gradient read before the step objective's rescaling would differ between them.

Seen failing: with the norms read in ``on_after_backward`` (the first micro-batch's, before the rescaling:
0.77 for 1.81) and in ``on_train_batch_end`` (after clipping to 1e-3: 4.3e-4); with a DTensor's local shard
taken for its gradient (fsdp2's q_norm off by 0.40, and the MoE layouts); without the wrappers' name segments
left out (fsdp1: 88 tensors under ``_fsdp_wrapped_module`` names); without the ranks' records gathered (pp2:
24 tensors of the last stage missing on rank 0); with one norm per stacked expert tensor (8 expected). A
planted bug in one expert's gradient failing a whole study: ``test_gradient_check_study.py``.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lit_ablate.ablation.gradient_agreement import gradient_check
from lit_ablate.callbacks import GradientFingerprint
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.moe.blocks import MoEOptions
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import (
    DDPStrategy,
    ExpertParallelStrategy,
    FSDP1Strategy,
    FSDP2Strategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)
from tests.distributed import run_ranks
from tests.test_step_objective import micro_batches

RTOL = 1e-5
"""float32 rounding between layouts measured at most 3.7e-7 of a tensor's largest norm here (tp2 + SP's
k_norm); a gradient scaled by 1.01 on one expert is about 1e-2."""


class ModelAtStart(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.model = copy.deepcopy(pl_module.model)


def fit(
    strategy="auto",
    devices: int = 1,
    data: str = "reference",
    rank: int = 0,
    preset: str = "tiny-qwen3",
    accumulate: int = 1,
    clip: float | None = 1.0,
    callbacks: tuple = (),
) -> dict:
    pl.seed_everything(0, verbose=False)
    moe = MoEOptions(experts="grouped") if preset == "tiny-qwen3-moe" else None
    module = CausalLM(ModelFactory(preset=preset, moe=moe), learning_rate=1e-2, warmup_steps=0)
    fingerprint = GradientFingerprint(step=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        accumulate_grad_batches=accumulate,
        callbacks=[fingerprint, *callbacks],
        gradient_clip_val=clip,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(micro_batches(data, rank), batch_size=None))
    return fingerprint.record_section()


def as_run(section: dict | None) -> list[tuple[str, dict]]:
    """A recorded section as the one ok run of a study variant (what ``gradient_check`` reads)."""
    return [("run.json", {"seed": 0, "summary": {"status": "ok"}, "gradients": section})]


def assert_same_gradients(sections: dict[str, dict], reference: dict) -> None:
    for name, section in sections.items():
        check = gradient_check(as_run(section), as_run(reference), {"rtol": RTOL, "step": 1})
        assert check["passed"], f"{name}: {check['reason']}"


def test_the_norms_are_the_step_objective_s_gradients_before_clipping():
    """Two micro-batches of unequal useful tokens, clipped to 1e-3: the recorded norms are those of the
    gradient of the step's token mean (every token loss over every useful token), not the clipped ones."""
    start = ModelAtStart()
    recorded = fit(data="accumulate", accumulate=2, clip=1e-3, callbacks=(start,))
    batches = micro_batches("accumulate")[:2]
    sums = [start.model(batch) for batch in batches]
    (sum(loss for loss, _ in sums) / sum(useful for _, useful in sums)).backward()
    expected = {f"model.{name}": [p.grad.double().norm().item()] for name, p in start.model.named_parameters()}
    assert recorded["step"] == 1 and recorded["norms"].keys() == expected.keys()
    total = sum(norm**2 for (norm,) in expected.values()) ** 0.5
    assert total > 1.0, "clipping at 1e-3 must act for the test to tell before from after it"
    for name, (norm,) in expected.items():
        assert recorded["norms"][name] == [pytest.approx(norm, rel=RTOL)], name


def _dense_layouts(rank: int, world_size: int) -> dict:
    layouts = {
        "ddp": (DDPStrategy(), "ranks"),
        "fsdp1": (FSDP1Strategy(), "ranks"),
        "fsdp2": (FSDP2Strategy(), "ranks"),
        "fsdp2_ac": (FSDP2Strategy(activation_checkpointing="full"), "ranks"),
        "tp2": (TensorParallelStrategy(tp=2), "reference"),
        "pp2": (PipelineParallelStrategy(pp=2, microbatches=2), "reference"),
    }
    return {name: fit(strategy, 2, batches, rank) for name, (strategy, batches) in layouts.items()}


@pytest.mark.slow  # six 2-rank fits: ~20 s on 2 cores
def test_dense_layouts_record_one_process_s_norms_under_its_names():
    """DDP, FSDP1, FSDP2 (and with activation checkpointing), TP and PP on 2
    ranks: every rank's record holds every parameter of the model, named as in one process, with one
    process's norms (each rank's data holds half the rows; TP and PP ranks read them all)."""
    reference = fit()
    for rank_sections in run_ranks(_dense_layouts, 2, init_process_group=False, timeout_s=600):
        assert_same_gradients(rank_sections, reference)


def _moe_layouts(rank: int, world_size: int) -> dict:
    layouts = {
        "fsdp2": FSDP2Strategy(),
        "fsdp1": FSDP1Strategy(),
        "ep_all_to_all": ExpertParallelStrategy(ep=2),
        "ep_all_reduce": ExpertParallelStrategy(ep=2, dispatch="all_reduce"),
    }
    return {name: fit(strategy, 2, "ranks", rank, "tiny-qwen3-moe") for name, strategy in layouts.items()}


def test_moe_layouts_record_fsdp2_s_norms_one_per_expert():
    """The tiny Qwen3-MoE on 2 ranks (the router losses are statistics of each rank's tokens, so the reference
    is FSDP2 on the same ranks, not one process): FSDP1's flat parameters and EP's experts (each rank 4 of 8)
    record FSDP2's norms, one per expert for the stacked expert weights."""
    for sections in run_ranks(_moe_layouts, 2, init_process_group=False, timeout_s=600):
        experts = sections["fsdp2"]["norms"]["model.lm.model.layers.0.mlp.experts.gate_up_proj"]
        assert len(experts) == 8 and len(set(experts)) == 8
        assert_same_gradients({k: v for k, v in sections.items() if k != "fsdp2"}, sections["fsdp2"])

"""Pipeline parallelism with gradient clipping, gradient accumulation, packed batches and MoE trains
one process's model (pp=2 on 2 gloo ranks; clipping over FSDP-sharded stages on 4).

Each pipeline run uses the strategy's step as ``CausalLM`` under Lightning does (``forward_backward``,
the objective's totals, the zeroing Lightning does after a step's first ``training_step``,
``deliver_gradients``, ``StepObjective.normalize_gradients``, then clipping); the reference is one
process with the same accumulation and clipping (``torch.nn.utils.clip_grad_norm_``) through the
same ``StepObjective``. SGD, so that a wrong gradient scale shows. Useful tokens differ between rows,
micro-batches and accumulated batches (the SFT rows of ``tests/test_pipeline_parallel.py``: 28, 4, 20
and 31). Tolerances: losses and weights within 1e-5 (measured below 1e-6).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lit_ablate.data import LMDataModule, PackingCollator, SyntheticText
from lit_ablate.errors import ConfigError
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX, loss_backend
from lit_ablate.models.moe.blocks import MoEOptions, collect_aux_losses
from lit_ablate.modules import CausalLM
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
from lit_ablate.strategies.step_objective import StepObjective
from tests.distributed import run_ranks
from tests.test_pipeline_parallel import Seen, sft_batch
from tests.test_strategies_equivalence import rows_of

STEPS = 3
LR = 0.5
ATOL = 1e-5
CLIP = 0.5
"""Below every step's gradient norm here (measured 1.5-2.6 for tiny Llama on the SFT rows): clipping bites."""
MOE = {"moe": {"load_balance_weight": 0.5, "z_loss_weight": 0.05}}
"""Router losses large enough that dropping a stage's share moves the weights far beyond the tolerance."""


def build(preset: str, meta: bool = False, **factory: object) -> CausalLMWithLoss:
    torch.manual_seed(0)
    if "moe" in factory:
        factory = {**factory, "moe": MoEOptions(**factory["moe"])}
    with torch.device("meta") if meta else nullcontext():
        lm = ModelFactory(preset=preset, **factory).build()
    return CausalLMWithLoss(lm, loss_backend("torch"))


def packed_batch() -> dict[str, torch.Tensor]:
    """4 packed rows of 32 tokens, 1 to 3 documents each: positions restart at every document, whose last
    token predicts nothing (label -100), and the second row's first document is a masked prompt."""
    documents = [[10, 22], [5, 7, 20], [32], [3, 14, 15]]
    tokens = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(2))
    labels = torch.full_like(tokens, IGNORE_INDEX)
    positions = torch.zeros_like(tokens)
    for row, lengths in enumerate(documents):
        start = 0
        for length in lengths:
            end = start + length
            labels[row, start : end - 1] = tokens[row, start + 1 : end]
            positions[row, start:end] = torch.arange(length)
            start = end
    labels[1, :5] = IGNORE_INDEX
    return {"input_ids": tokens, "labels": labels, "position_ids": positions}


def step_batches(data: str) -> list[dict[str, torch.Tensor]]:
    """The batches of one optimizer step: the four SFT rows at once, as two accumulated halves (32 and 51
    useful tokens), or the packed rows."""
    if data == "sft":
        return [sft_batch()]
    if data == "sft_accumulated":
        return [rows_of(sft_batch(), 0, 2), rows_of(sft_batch(), 1, 2)]
    return [packed_batch()]


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def train_one_process(preset: str, data: str, clip: float | None = None, **factory: object) -> dict:
    """``STEPS`` SGD steps, each accumulating ``step_batches(data)`` as Lightning does (every batch's
    objective loss divided by their number), the router losses added as ``CausalLM.training_step`` adds them."""
    model, batches = build(preset, **factory), step_batches(data)
    objective, optimizer = StepObjective(), torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, aux = [], [], []
    for _ in range(STEPS):
        for batch in batches:
            loss_sum, useful = model(batch)
            extra = collect_aux_losses(model)
            aux.append({name: value.item() for name, value in extra.items()})
            loss = objective.backward_loss(loss_sum, useful, sum(extra.values(), 0.0), None)
            (loss / len(batches)).backward()
        objective.normalize_gradients(model.parameters(), None, accumulate_grad_batches=len(batches))
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(objective.last_step_loss.item())
    return {"losses": losses, "norms": norms, "aux": aux, "weights": _snapshot(model)}


def _pipeline_run(
    rank: int,
    world_size: int,
    preset: str,
    data: str,
    strategy_kwargs: dict,
    clip: float | None = None,
    factory: dict | None = None,
) -> dict:
    """The same steps through the stages; with ``dp_shard`` ranks, each reads its share of every batch's rows."""
    shards = strategy_kwargs.get("dp_shard", 1)
    strategy = PipelineParallelStrategy(pp=world_size // shards, **strategy_kwargs)
    strategy.build_mesh("cpu", world_size)
    model = strategy.parallelize(build(preset, meta=rank != 0, **(factory or {})))
    batches = [
        {k: v.tensor_split(shards)[strategy.data_parallel_rank] for k, v in batch.items()}
        for batch in step_batches(data)
    ]
    objective, optimizer = StepObjective(), torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, aux = [], [], []
    for _ in range(STEPS):
        for index, batch in enumerate(batches):
            loss_sum, useful = strategy.forward_backward(model, batch, objective)
            aux.append({name: value.item() for name, value in collect_aux_losses(model).items()})
            objective.backward_loss(loss_sum, useful, 0.0, strategy)
            if index == 0:
                optimizer.zero_grad()  # Lightning zeroes after the step's first training_step
            strategy.deliver_gradients(len(batches))  # the strategy's backward
        objective.normalize_gradients(model.parameters(), strategy, accumulate_grad_batches=len(batches))
        if clip is not None:  # what a fit's gradient_clip_val runs (the norm over the stages)
            norms.append(strategy.clip_gradients_by_norm(optimizer, clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(objective.last_step_loss.item())
    return {"losses": losses, "norms": norms, "aux": aux, "weights": _snapshot(model)}


RUNS = {  # name: (preset, data, strategy options, clip, model factory options)
    "clipped": ("tiny-llama", "sft", {"schedule": "1f1b", "microbatches": 2}, CLIP, {}),
    "accumulated": ("tiny-qwen3", "sft_accumulated", {"schedule": "gpipe", "microbatches": 2}, None, {}),
    "packed_sdpa": ("tiny-llama", "packed", {"schedule": "1f1b", "microbatches": 2}, None, {}),
    "packed_sdpa_packed": (
        "tiny-llama",
        "packed",
        {"schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 2},
        None,
        {"attn_implementation": "sdpa_packed"},
    ),
    "moe": ("tiny-qwen3-moe", "sft", {"schedule": "gpipe", "microbatches": 1}, None, MOE),
    "moe_microbatches": ("tiny-qwen3-moe", "sft", {"schedule": "1f1b", "microbatches": 2}, None, MOE),
}


def _two_ranks(rank: int, world_size: int) -> dict:
    return {
        name: _pipeline_run(rank, world_size, preset, data, options, clip, factory)
        for name, (preset, data, options, clip, factory) in RUNS.items()
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks, 2, timeout_s=300)


def assert_trains_as(ranks: list[dict], reference: dict, falls: bool = True) -> None:
    """Every rank's losses (and clipping norms) equal the reference's, and every parameter, held by
    exactly one stage, equals it; with ``falls``, the reference's loss fell (the steps trained)."""
    held = set()
    for result in ranks:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=0, atol=ATOL)
        for name, weight in result["weights"].items():
            if name in reference["weights"]:
                torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=ATOL, msg=name)
                held.add(name)
    assert held == set(reference["weights"]), "every parameter lives on one stage"
    assert not falls or reference["losses"][-1] < reference["losses"][0] - 0.05, "the model did not train"


def test_clipping_uses_the_norm_over_all_stages(two_ranks):
    """``gradient_clip_val`` under pp=2 clips by the norm of the whole model's gradient: each step's
    pre-clip norm, the losses and the weights equal one process's, with a clip value below every step's
    norm. Seen failing with each stage clipped by its own stage's norm (no all-reduce over pp: losses
    off by 0.032)."""
    reference = train_one_process("tiny-llama", "sft", clip=CLIP)
    assert min(reference["norms"]) > 2 * CLIP, "the clip value must bite"
    assert_trains_as([rank["clipped"] for rank in two_ranks], reference)


def test_accumulation_adds_the_batches_and_normalises_over_the_step(two_ranks):
    """``accumulate_grad_batches: 2`` with pp=2 (2 micro-batches per batch): each batch's schedule
    gradients add to the step's earlier ones, and the step is normalised by its 83 useful tokens, not
    each batch by its own (32 and 51). Seen failing with the pending gradients replacing the earlier
    batch's instead of adding (losses off by 0.16), with ``deliver_gradients`` not dividing by the
    accumulated batches (0.26), and with each batch's schedule loss divided by its own useful tokens
    instead of the run constant (1.3)."""
    assert_trains_as([rank["accumulated"] for rank in two_ranks], train_one_process("tiny-qwen3", "sft_accumulated"))


@pytest.mark.parametrize(("run", "attention"), [("packed_sdpa", "sdpa"), ("packed_sdpa_packed", "sdpa_packed")])
def test_packed_batches_keep_documents_apart_on_every_stage(two_ranks, run, attention):
    """Packed rows (positions restarting at each document) through pp=2, 1f1b with transformers' sdpa
    and interleaved 1f1b with lit-ablate's block-diagonal sdpa_packed: every stage gets its
    micro-batch's positions (rotary angles and per-document attention), so the losses and weights
    equal one process's on the same packed batch. Seen failing with the positions given to the first
    stage only (the later stage attends across documents: losses off by 0.036)."""
    reference = train_one_process("tiny-llama", "packed", attn_implementation=attention)
    assert_trains_as([rank[run] for rank in two_ranks], reference)


def test_moe_router_losses_of_every_stage_are_trained_and_logged(two_ranks):
    """Tiny Qwen3-MoE under pp=2: the router losses (load balancing and z-loss) of the first stage's
    layers are backpropagated on that stage, weighted as one process weighs them (the batch's useful
    tokens, the mean over all MoE layers), and what the training step logs is the mean over all layers
    of both stages, one process's value. Seen failing with the non-last stage's router losses dropped
    (losses off by 0.30), with them weighted by a row's useful tokens instead of the micro-batch's
    (0.46), with the logged values not added over the stages (0.56), and with torch's shape-inference
    forward counted in them (1.03 at the first step)."""
    reference = train_one_process("tiny-qwen3-moe", "sft", **MOE)
    ranks = [rank["moe"] for rank in two_ranks]
    assert_trains_as(ranks, reference)
    assert set(reference["aux"][0]) == {"load_balance_loss", "z_loss"}
    for result in ranks:
        for logged, expected in zip(result["aux"], reference["aux"], strict=True):
            assert logged == pytest.approx(expected, abs=ATOL)


def test_moe_router_losses_per_micro_batch_train_as_one_process_accumulating_them(two_ranks):
    """With 2 micro-batches per batch each micro-batch's router losses weigh by its own useful tokens
    (32 and 51), as one process accumulating the two halves weighs each half's: the same model.
    Seen failing with every micro-batch weighted by the whole batch's mean useful tokens per row (off by
    0.43; the single micro-batch test cannot see that)."""
    reference = train_one_process("tiny-qwen3-moe", "sft_accumulated", **MOE)
    # The router losses' gradients dominate these steps: the token loss rises (5.81 to 5.98).
    assert_trains_as([rank["moe_microbatches"] for rank in two_ranks], reference, falls=False)


def _two_shapes(rank: int, world_size: int) -> str:
    strategy = PipelineParallelStrategy(pp=2, schedule="gpipe", microbatches=2)
    strategy.build_mesh("cpu", world_size)
    model = strategy.parallelize(build("tiny-llama", meta=rank != 0))
    objective = StepObjective()
    strategy.forward_backward(model, sft_batch(), objective)
    try:
        strategy.forward_backward(model, {k: v[:, :16] for k, v in sft_batch().items()}, objective)
    except ConfigError as error:
        return str(error)
    return "not refused"


def test_a_batch_of_another_shape_is_refused_in_one_line():
    """torch's stages size their hand-off buffers at the first step: a later batch of another width is
    refused naming the collator options. Seen failing without the check (the last stage's rank aborted
    inside torch's receive)."""
    for message in run_ranks(_two_shapes, 2, timeout_s=120):
        assert message.startswith("data.init_args.collator='a batch of (4, 16) after (4, 32)'"), message
        assert "static_length: true" in message


def _sharded_clipping(rank: int, world_size: int) -> dict:
    return _pipeline_run(
        rank, world_size, "tiny-llama", "sft_accumulated", {"schedule": "gpipe", "microbatches": 1, "dp_shard": 2}, CLIP
    )


@pytest.mark.slow  # 4 gloo ranks on 2 cores
def test_clipping_and_accumulation_over_fsdp_sharded_stages():
    """pp=2 x dp_shard=2: each stage's gradients are FSDP shards (DTensors), so the global norm sums
    the shards' squares over dp_shard and then the stages' over pp; with two accumulated batches per
    step (each rank one row of each: 28/4 and 20/31 useful tokens). Seen failing with the shards'
    squares not summed over dp_shard (losses off by 0.037) and without the sum over pp (0.032)."""
    assert_trains_as(
        run_ranks(_sharded_clipping, 4, timeout_s=300), train_one_process("tiny-llama", "sft_accumulated", clip=CLIP)
    )


# ---------------------------------------------------------------- under a Lightning Trainer
class SquaredGradients(Callback):
    """This rank's squared gradient norm at each optimizer step, before clipping and after it."""

    def __init__(self) -> None:
        self.before: list[float] = []
        self.after: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # Lightning clips after this hook
        self.before.append(_squared(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:  # stepped: the clipped gradients are still there
            self.after.append(_squared(pl_module))


def _squared(module: torch.nn.Module) -> float:
    return sum(p.grad.double().square().sum().item() for p in module.parameters() if p.grad is not None)


def fit(strategy: object, devices: int, root: Path) -> dict:
    """3 AdamW steps of tiny Qwen3-MoE on packed rows, 2 batches accumulated per step, clipped at 0.05;
    each batch's loss, each step's squared gradient norms (this rank's) and the last logged values."""
    pl.seed_everything(0, verbose=False)
    module = CausalLM(
        ModelFactory(preset="tiny-qwen3-moe", moe=MoEOptions(**MOE["moe"])), learning_rate=1e-3, warmup_steps=1
    )
    data = LMDataModule(
        SyntheticText(num_documents=60, median_sentences=1),
        format="documents",
        seq_len=64,
        batch_size=2,
        collator=PackingCollator(static_shape=True),
    )  # one shape for the stages
    seen, squares = Seen(), SquaredGradients()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=3,
        callbacks=[seen, squares],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        accumulate_grad_batches=2,
        gradient_clip_val=LIGHTNING_CLIP,
        default_root_dir=root,
    )
    trainer.fit(module, data)
    logged = {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
    return {"losses": seen.losses, "before": squares.before, "after": squares.after, "logged": logged}


LIGHTNING_CLIP = 0.05


def _lightning_pp(rank: int, world_size: int, root: str) -> dict:
    return fit(PipelineParallelStrategy(pp=2, schedule="gpipe", microbatches=1), 2, Path(root))


@pytest.mark.slow  # two Lightning fits
def test_lightning_fit_with_clipping_accumulation_packing_and_moe_equals_one_device(tmp_path):
    """Inside Lightning's loop, all at once: packed batches reach both stages, each accumulated batch's
    gradients add (divided as Lightning divides a loss), Lightning's norm clipping goes to the norm over
    the stages, and the router losses logged equal one device's. The stages' squared gradient norms
    add up to one device's before clipping and to the clip value after it. Seen failing with
    Lightning's own clipping (each stage clipped by its own norm: the third step's pre-clip norm off by
    0.035) and with the backward not dividing by ``accumulate_grad_batches`` (pre-clip norms doubled,
    off by 7.0; AdamW hides it in the losses)."""
    one = fit("auto", 1, tmp_path / "one")
    stages = run_ranks(_lightning_pp, 2, str(tmp_path / "pp"), init_process_group=False, timeout_s=300)
    assert {"train/loss", "train/load_balance_loss", "train/z_loss"} <= set(one["logged"])
    assert min(one["before"]) > (2 * LIGHTNING_CLIP) ** 2, "the clip value must bite"
    for key, tolerance in (("before", 1e-5), ("after", 1e-7)):
        total = torch.tensor([a + b for a, b in zip(stages[0][key], stages[1][key], strict=True)]).sqrt()
        torch.testing.assert_close(total, torch.tensor(one[key]).sqrt(), rtol=0, atol=tolerance, check_dtype=False)
    for run in stages:
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(one["losses"]), rtol=0, atol=ATOL)
        for name, value in one["logged"].items():
            assert run["logged"][name] == pytest.approx(value, abs=ATOL), name

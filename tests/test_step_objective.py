"""Every optimizer step trains the global token mean, whatever the accumulation, ranks, strategy
or packing (``lit_ablate.modules.step_objective``).

The data is built so that useful tokens differ a lot between micro-batches *and* between ranks
(SFT rows of 4 to 31 tokens with prompts of 0 to 20 masked tokens), because a normalisation bug
is invisible when counts are equal. Each step holds the same four examples in every variant:

    reference  1 process, micro-batch 4 (one micro-batch per step: its mean is the step's mean)
    accumulate 1 process, micro-batch 2 x accumulate_grad_batches 2
    packed     1 process, each micro-batch one packed row (sdpa_packed) x accumulate 2
    ddp/zero1/fsdp1/fsdp2/hsdp  2 ranks, micro-batch 2 each (rank 0 the long rows, rank 1 the short)
    ddp_accumulate  2 ranks, micro-batch 1 x accumulate 2
    ep         the tiny Qwen3-MoE, 2 ranks with expert parallelism (all-to-all), against the MoE
               model's own 1-process reference (router aux losses off: they are per micro-batch
               statistics, weighted by useful tokens, so they equal a one-batch aux only when off),
               both in float64 (below)

After 5 steps at a real learning rate, per-step losses and every weight must equal the
reference's. ``test_the_old_per_micro_batch_mean_fails_these_checks`` puts the old division
back (each micro-batch divided by its own useful tokens, then averaged by accumulation and by
the strategy) and shows the same comparisons fail: that is the bug these tests catch. Also seen
failing (by hand): forgetting the strategy's gradient averaging (``W = 1`` in
``StepObjective.normalize_gradients``) fails every two-rank test (clipping and Adam's epsilon
make a uniform gradient scale visible).

Tolerances (fp32, measured): summing the same token losses in another order moves the step
losses by at most ~3e-6 (``LOSS_ATOL``) and the weights by ~2e-7 on average per tensor
(``WEIGHT_MEAN_ATOL``); single elements whose gradient is near zero can move by ~1e-4, since
Adam's first updates are about ``lr * sign(g)`` (``WEIGHT_MAX_ATOL``). The old objective moves
the losses by ~0.16 and the weights by ~0.02 on average per tensor (0.06 at most).

The MoE pair trains in float64: in float32 the two reduction orders decide top-k near-ties
differently on some CPUs' kernels (with ATen's AVX2 kernels, ``ATEN_CPU_CAPABILITY=avx2``, two
tokens of step 5 whose 2nd and 3rd router probabilities were 6.7e-7 and 1.8e-6 apart picked other
experts: 1.8e-4 off; an AMD EPYC without AVX-512 failed at 1.0e-4), and no tolerance separates that
fork from a bug. In float64 they differ by at most 5.4e-7 in the (float32-logged) losses and
1.6e-6 / 1.3e-9 in the weights' max / mean, measured with ATen's AVX-512, AVX2 and default kernels.
Seen failing in float64 with EP's expert gradients divided twice (FSDP's divide factor on a
one-rank shard dimension, the bug ``tests/test_moe_expert_parallel.py``'s float64 gradient test
guards): losses 6.2e-5 off at step 2, weights 2.6e-4 on average, 2.9e-2 at most.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from lit_ablate.data import PackingCollator, PaddingCollator
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.models.moe.blocks import MoEOptions
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    ExpertParallelStrategy,
    FSDP1Strategy,
    FSDP2Strategy,
    HSDPStrategy,
    ZeRO1Strategy,
)
from lit_ablate.strategies.step_objective import StepObjective
from tests.distributed import run_ranks
from tests.test_moe_expert_parallel import Float64ModelFactory

STEPS = 5
LOSS_ATOL = 2e-5
WEIGHT_MEAN_ATOL = 2e-6
WEIGHT_MAX_ATOL = 1e-3
# (length, masked prompt) per example; per step: two long rows (rank 0), two short ones (rank 1).
SHAPES = [
    (31, 2),
    (26, 0),
    (6, 4),
    (9, 7),
    (28, 20),
    (30, 1),
    (5, 0),
    (4, 3),
    (29, 3),
    (24, 0),
    (8, 5),
    (7, 6),
    (31, 0),
    (27, 12),
    (6, 1),
    (10, 8),
    (25, 2),
    (30, 18),
    (4, 0),
    (9, 2),
]


def _examples() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for length, prompt in SHAPES:  # arithmetic progressions: learnable within a few steps
        start, stride = torch.randint(0, 64, (2,), generator=gen).tolist()
        ids = (start + (stride % 7 + 1) * torch.arange(length)) % 64
        labels = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
        labels[:prompt] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def _padded(groups: list[list[dict]]) -> list[dict]:
    collate = PaddingCollator()
    collate.bind(pad_id=0, seq_len=64)
    return [collate(g) for g in groups]


def _packed(groups: list[list[dict]]) -> list[dict]:
    collate = PackingCollator(max_tokens=64)
    collate.bind(pad_id=0, seq_len=64)
    return [collate([g]) for g in groups]  # one row per micro-batch


def micro_batches(variant: str, rank: int = 0) -> list[dict]:
    """The micro-batches ``variant`` reads on ``rank``, in order."""
    ex = _examples()
    steps = [ex[4 * s : 4 * s + 4] for s in range(STEPS)]
    if variant == "reference":
        return _padded(steps)
    if variant == "accumulate":
        return _padded([half for step in steps for half in (step[:2], step[2:])])
    if variant == "packed":
        return _packed([half for step in steps for half in (step[:2], step[2:])])
    mine = [step[2 * rank : 2 * rank + 2] for step in steps]  # rank 0: the long rows
    if variant == "ddp_accumulate":
        return _padded([[e] for pair in mine for e in pair])
    return _padded(mine)


class PerMicroBatchMean(StepObjective):
    """The old objective, kept to show the tests catch it: each micro-batch divided by its own
    useful tokens, then averaged again by accumulation and by the strategy."""

    def backward_loss(self, loss_sum, units, extra, strategy):
        super().backward_loss(loss_sum, units, extra, strategy)  # keeps the step's loss for logging
        return loss_sum / units.clamp(min=1) + extra

    def normalize_gradients(self, parameters, strategy, accumulate_grad_batches):
        super().normalize_gradients([], strategy, accumulate_grad_batches)  # no rescaling


class StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.objective.last_step_loss is not None:
            self.losses.append(pl_module.objective.last_step_loss.item())


def fit(variant: str, strategy="auto", devices: int = 1, rank: int = 0, old: bool = False, moe: bool = False) -> dict:
    pl.seed_everything(0, verbose=False)
    attention = "sdpa_packed" if variant == "packed" else "sdpa"
    factory = (
        Float64ModelFactory(preset="tiny-qwen3-moe", moe=MoEOptions(experts="grouped", load_balance_weight=0.0))
        if moe
        else ModelFactory(preset="tiny-llama", attn_implementation=attention)
    )
    module = CausalLM(factory, learning_rate=1e-2, warmup_steps=0, weight_decay=0.1)
    if old:
        module.objective = PerMicroBatchMean()
    losses = StepLosses()
    accumulate = 2 if variant in ("accumulate", "packed", "ddp_accumulate") else 1
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        callbacks=[losses],
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(micro_batches(variant, rank), batch_size=None))
    return {"losses": losses.losses, "weights": full_weights(trainer)}


def full_weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Every weight whole, on every rank: from the strategy's root (DDP/FSDP1 wrap the whole LightningModule),
    or under DeepSpeed from the module with ZeRO-3's partitions gathered for the while."""
    if isinstance(trainer.strategy, DeepSpeedStrategy):
        import deepspeed

        module = trainer.lightning_module
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    weights = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in weights.items()}


STRATEGIES = {
    "ddp": DDPStrategy,
    "zero1": ZeRO1Strategy,
    "fsdp1": FSDP1Strategy,
    "fsdp2": FSDP2Strategy,
    "hsdp": lambda: HSDPStrategy(dp_replicate=2, dp_shard=1),
    "ddp_accumulate": DDPStrategy,
    "ep": lambda: ExpertParallelStrategy(ep=2, dispatch="all_to_all"),
}


def _two_rank_fits(rank: int, world_size: int, names: list[str], old: bool) -> dict:
    return {
        name: fit(
            name if name == "ddp_accumulate" else "ranks",
            STRATEGIES[name](),
            devices=2,
            rank=rank,
            old=old,
            moe=name == "ep",
        )
        for name in names
    }


def assert_same_training(
    run: dict,
    reference: dict,
    steps: int = STEPS,
    loss_atol: float = LOSS_ATOL,
    weight_mean_atol: float = WEIGHT_MEAN_ATOL,
    weight_max_atol: float = WEIGHT_MAX_ATOL,
) -> None:
    """Equal per-step losses and equal weights after the last step (the tolerances above unless a
    test measured its own)."""
    assert len(run["losses"]) == steps
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=loss_atol)
    for name, value in reference["weights"].items():
        difference = (run["weights"][name] - value).abs()
        assert difference.mean() <= weight_mean_atol and difference.max() <= weight_max_atol, (
            f"{name}: mean |diff| {difference.mean():.2e}, max {difference.max():.2e}"
        )


@pytest.fixture(scope="module")
def reference() -> dict:
    return fit("reference")


@pytest.fixture(scope="module")
def moe_reference() -> dict:
    return fit("reference", moe=True)


def test_the_data_has_unequal_useful_tokens_per_micro_batch_and_rank():
    useful = [[int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches("ranks", rank)] for rank in (0, 1)]
    assert all(long > 2 * short for long, short in zip(*useful)), useful  # rank 0 holds many more per step
    halves = [int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches("accumulate")]
    assert all(a != b for a, b in zip(halves[::2], halves[1::2])), halves


def test_reference_trains(reference):
    assert reference["losses"][-1] < reference["losses"][0] - 0.1


@pytest.mark.parametrize("variant", ["accumulate", "packed"])
def test_one_process_variants_train_the_reference_model(reference, variant):
    assert_same_training(fit(variant), reference)


@pytest.fixture(scope="module")
def two_rank_runs() -> list[dict]:
    names = ["ddp", "zero1", "fsdp1", "fsdp2", "hsdp", "ddp_accumulate", "ep"]
    return run_ranks(_two_rank_fits, 2, names, False, init_process_group=False, timeout_s=500)


@pytest.mark.parametrize("name", ["ddp", "zero1", "fsdp1", "fsdp2", "hsdp", "ddp_accumulate", "ep"])
def test_two_rank_strategies_train_the_reference_model(reference, moe_reference, two_rank_runs, name):
    for rank_run in two_rank_runs:  # every rank ends with the same weights and logs the same step loss
        assert_same_training(rank_run[name], moe_reference if name == "ep" else reference)


def test_the_old_per_micro_batch_mean_fails_these_checks(reference):
    """The regression guard: with each micro-batch divided by its own tokens (the old objective),
    accumulation and data-parallel ranks train a different model, and the checks above say so."""
    with pytest.raises(AssertionError):
        assert_same_training(fit("accumulate", old=True), reference)
    ranks = run_ranks(_two_rank_fits, 2, ["ddp"], True, init_process_group=False, timeout_s=300)
    with pytest.raises(AssertionError):
        assert_same_training(ranks[0]["ddp"], reference)

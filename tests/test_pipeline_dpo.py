"""DPO under pipeline parallelism trains one process's model (pp=2 on 2 gloo ranks).

A preference batch's rows are all chosen sequences, then all rejected ones; the strategy reorders
them so that every micro-batch holds whole pairs (its pairs' chosen rows, then their rejected rows),
the last stage computes each micro-batch's pair losses from the sequences' log-probs (``DPO``'s
``unit_loss``), and the step's units are pairs. The pairs (``ArithmeticPreference`` with worked
examples) differ a lot in length, so micro-batches differ in tokens. The reference log-probs are a
``precomputed`` table (the initial policy's, moved by noise, so that log-ratios are far from 0). SGD, so that a wrong
scale shows; losses within 1e-5 (and 1e-6 relative: ipo's are ~50) and weights within 1e-5 of one process.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor

from lit_ablate.data import ArithmeticPreference, LMDataModule, PreferencePaddingCollator
from lit_ablate.errors import ConfigError
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.moe.blocks import MoEOptions
from lit_ablate.modules import DPO
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
from lit_ablate.strategies.step_objective import StepObjective
from tests.distributed import run_ranks
from tests.test_dpo import padded, pairs

STEPS = 3
ATOL = 1e-5
LOSSES = {"sigmoid": {"label_smoothing": 0.1}, "ipo": {}, "simpo": {"reference": "none"}}
LR = {"sigmoid": 0.5, "ipo": 0.01, "simpo": 0.5}
"""SGD learning rates at which each loss falls over the steps (ipo's squared loss diverges at 0.5)."""


def dpo_module(loss_type: str, preset: str = "tiny-llama") -> DPO:
    """A DPO module with a precomputed reference table for the batch's pairs (tiny Qwen3-MoE: with
    router losses of weight 0.5)."""
    options = dict(LOSSES[loss_type])
    torch.manual_seed(0)
    moe = MoEOptions(load_balance_weight=0.5) if preset == "tiny-qwen3-moe" else None
    dpo = DPO(
        ModelFactory(preset=preset, moe=moe),
        loss_type=loss_type,
        beta=0.5,
        reference=options.pop("reference", "precomputed"),
        **options,
    )
    dpo.configure_model()
    data = batch()
    with torch.no_grad():  # the initial policy's log-probs, moved 0.5 x noise: log-ratios far from 0, not huge
        logps = dpo.model(data)[0].view(2, -1).t()
    dpo.reference_logps = torch.zeros(int(data["pair_index"].max()) + 1, 2)
    dpo.reference_logps[data["pair_index"]] = logps + 0.5 * torch.randn(
        logps.shape, generator=torch.Generator().manual_seed(5)
    )
    return dpo


def batch(part: int = 0, parts: int = 1) -> dict:
    """4 pairs, sorted longest first, so the two micro-batches of 2 pairs differ in tokens (``part`` of
    ``parts``: a data-parallel rank's share of them)."""
    items = sorted(pairs(4, seed=3), key=lambda p: -len(p["input_ids"]))
    share = len(items) // parts
    return padded(items[part * share : (part + 1) * share])


def train_one_process(loss_type: str, preset: str = "tiny-llama") -> dict:
    dpo, data = dpo_module(loss_type, preset), batch()
    optimizer = torch.optim.SGD(dpo.model.parameters(), lr=LR[loss_type])
    losses, statistics = [], []
    for _ in range(STEPS):
        out = dpo.training_step(data, 0)
        out["loss"].backward()
        dpo.objective.normalize_gradients(dpo.model.parameters(), None, accumulate_grad_batches=1)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(dpo.objective.last_step_loss.item())
        statistics.append(out["preference"])
    with torch.no_grad():
        logps = dpo.model(data)[0]
    return {"losses": losses, "statistics": torch.stack(statistics), "weights": _weights(dpo), "eval": logps}


def _weights(dpo: DPO) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in dpo.model.state_dict().items()
    }


def _pipeline_run(rank: int, world_size: int, loss_type: str, strategy_kwargs: dict, preset: str) -> dict:
    """The same steps as ``DPO.training_step`` runs them under the strategy (its pipeline branch)."""
    shards = strategy_kwargs.get("dp_shard", 1)
    strategy = PipelineParallelStrategy(pp=world_size // shards, **strategy_kwargs)
    strategy.build_mesh("cpu", world_size)
    dpo, data = dpo_module(loss_type, preset), batch(strategy.data_parallel_rank, shards)
    model = strategy.parallelize(dpo.model)
    objective, optimizer = StepObjective(), torch.optim.SGD(model.parameters(), lr=LR[loss_type])
    losses, statistics = [], []
    for _ in range(STEPS):
        totals, pairs_ = strategy.forward_backward(
            model,
            {**data, "reference_logps": dpo._pipeline_reference(data)},
            objective,
            unit_loss=dpo._micro_batch_pair_losses,
        )
        objective.backward_loss(totals[0], pairs_, 0.0, strategy)  # the router losses: trained by the stages
        strategy.deliver_gradients()
        objective.normalize_gradients(model.parameters(), strategy, accumulate_grad_batches=1)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(objective.last_step_loss.item())
        statistics.append(totals[1:].double())
    with torch.no_grad():
        logps, _tokens = model(data)  # evaluation: forward only through the stages
    return {
        "losses": losses,
        "statistics": torch.stack(statistics),
        "weights": _weights(dpo),
        "eval": logps,
        "shard": strategy.data_parallel_rank,
    }


RUNS = {
    "sigmoid_1f1b": ("sigmoid", {"schedule": "1f1b", "microbatches": 2}, "tiny-llama"),
    "ipo_gpipe": ("ipo", {"schedule": "gpipe", "microbatches": 4}, "tiny-llama"),
    "simpo_interleaved": (
        "simpo",
        {"schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 2},
        "tiny-llama",
    ),
    "sigmoid_moe_gpipe": ("sigmoid", {"schedule": "gpipe", "microbatches": 1}, "tiny-qwen3-moe"),
}


def _two_ranks(rank: int, world_size: int) -> dict:
    return {name: _pipeline_run(rank, world_size, *run) for name, run in RUNS.items()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks, 2, timeout_s=300)


@pytest.mark.parametrize("run", list(RUNS))
def test_dpo_pp2_equals_one_process(two_ranks, run):
    """sigmoid (label smoothing) with 2 micro-batches of 2 pairs under 1f1b, ipo (response-token
    averages) with 4 micro-batches of 1 pair under gpipe, reference-free simpo interleaved: losses, the
    preference statistics (pairs, loss sum, accuracy, rewards, log-probs, summed over the step) and every
    weight equal one process's, and the trained pipeline's forward returns one process's sequence
    log-probs; and tiny Qwen3-MoE (router losses weighted by pairs, half a pair per row). Seen failing
    with the rows left in their order (a micro-batch of chosen rows only: losses off by 0.75), with the
    step's sums taken from its last micro-batch only (0.52), with torch's shape-inference call of the
    loss counted in the first step (0.49), and (MoE) with the padded batch's attention mask left out of
    the stages (the padding's hidden states, which the routers see, differ: 0.025)."""
    loss_type, _, preset = RUNS[run]
    reference = train_one_process(loss_type, preset)
    held = set()
    for result in (rank[run] for rank in two_ranks):
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=ATOL
        )
        torch.testing.assert_close(result["statistics"], reference["statistics"], rtol=1e-5, atol=1e-4)
        for name, weight in result["weights"].items():
            if name in reference["weights"]:
                torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=ATOL, msg=name)
                held.add(name)
        torch.testing.assert_close(result["eval"], reference["eval"], rtol=0, atol=1e-4)  # sums of ~100 log-probs
    assert held == set(reference["weights"])
    assert reference["losses"][-1] < reference["losses"][0] - 0.01, "the model did not train"


def _sharded(rank: int, world_size: int) -> dict:
    return _pipeline_run(
        rank, world_size, "sigmoid", {"schedule": "1f1b", "microbatches": 2, "dp_shard": 2}, "tiny-llama"
    )


@pytest.mark.slow  # 4 gloo ranks on 2 cores
def test_dpo_pp2_x_dp_shard2_equals_one_process():
    """FSDP-sharded stages on 2 data-parallel ranks, each reading 2 of the 4 pairs (of unequal lengths:
    different padded widths) in 2 micro-batches of 1 pair: the step's pairs counted over both, so the
    losses and gathered weights equal one process's on all 4, and the two ranks' preference sums add up
    to one process's. Seen failing with a micro-batch's units counted in rows instead of pairs (losses
    off by 0.30)."""
    reference = train_one_process("sigmoid")
    ranks = run_ranks(_sharded, 4, timeout_s=300)
    for result in ranks:
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=ATOL
        )
        for name, weight in result["weights"].items():
            if name in reference["weights"]:
                torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=ATOL, msg=name)
    per_shard = {result["shard"]: result["statistics"] for result in ranks}
    torch.testing.assert_close(per_shard[0] + per_shard[1], reference["statistics"], rtol=1e-5, atol=1e-4)


def test_a_batch_of_pairs_splits_into_whole_pairs_only():
    """3 pairs cannot make 2 micro-batches of whole pairs: refused naming the key."""
    from lit_ablate.strategies.pipeline_stages import pair_rows

    assert pair_rows(4, 2, torch.device("cpu")).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    with pytest.raises(ConfigError, match="microbatches"):
        pair_rows(3, 2, torch.device("cpu"))


def test_liger_s_fused_policy_is_refused_naming_the_fix():
    """Liger's fused DPO loss reads the whole batch's hidden states at once: refused by the stages. The
    policy's class is what they refuse, so a stand-in loss does (liger-kernel need not be installed)."""
    from lit_ablate.models.losses.liger_dpo import LigerDPOPolicy

    strategy = PipelineParallelStrategy(pp=2)
    strategy.pp = 2
    policy = LigerDPOPolicy(
        ModelFactory(preset="tiny-llama").build(device="meta"), loss_fn=lambda *args: None, frozen_reference=False
    )
    with pytest.raises(ConfigError, match=r"Liger's fused DPO .* use logprobs: chunked"):
        strategy.check_model(policy)


# ---------------------------------------------------------------- under a Lightning Trainer
def fit(strategy: object, devices: int, root: Path, reference: str = "precomputed") -> dict:
    """3 AdamW steps of DPO (precomputed reference, computed before the first step), validation after."""
    pl.seed_everything(0, verbose=False)
    data = LMDataModule(
        ArithmeticPreference(num_examples=30, max_operand=30, median_shots=2.0, seed=3),
        format="preference",
        seq_len=96,
        batch_size=4,
        val_examples=6,
        collator=PreferencePaddingCollator(static_length=True),
    )  # one shape for the stages
    dpo = DPO(ModelFactory(preset="tiny-llama"), reference=reference, learning_rate=1e-2, warmup_steps=0)
    seen = Outputs()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=3,
        callbacks=[seen],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        val_check_interval=3,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        default_root_dir=root,
    )
    trainer.fit(dpo, data)
    return {
        "losses": seen.losses,
        "statistics": seen.statistics,
        "reference": dpo.reference_logps.cpu(),
        "val_loss": trainer.callback_metrics["val/loss"].item(),
    }


class Outputs(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.statistics: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append((outputs["loss_sum"] / outputs["loss_units"]).item())
        self.statistics.append(outputs["preference"].cpu())


def _lightning_pp(rank: int, world_size: int, root: str) -> dict:
    return fit(PipelineParallelStrategy(pp=2, schedule="1f1b", microbatches=2), 2, Path(root))


@pytest.mark.slow  # two Lightning fits
def test_lightning_dpo_fit_with_pp2_equals_one_device(tmp_path):
    """Inside Lightning's loop: the reference log-probs precomputed through the stages (forward only,
    every pair's on every rank), 3 clipped AdamW steps whose losses and preference statistics, and the
    validation loss after them, equal one device's."""
    one = fit("auto", 1, tmp_path / "one")
    for run in run_ranks(_lightning_pp, 2, str(tmp_path / "pp"), init_process_group=False, timeout_s=300):
        torch.testing.assert_close(run["reference"], one["reference"], rtol=0, atol=ATOL)
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(one["losses"]), rtol=0, atol=ATOL)
        torch.testing.assert_close(torch.stack(run["statistics"]), torch.stack(one["statistics"]), rtol=1e-5, atol=1e-4)
        assert run["val_loss"] == pytest.approx(one["val_loss"], abs=ATOL)


def _refused(rank: int, world_size: int, root: str, reference: str) -> str:
    try:
        fit(PipelineParallelStrategy(pp=2, schedule="1f1b", microbatches=2), 2, Path(root), reference=reference)
    except ConfigError as error:
        return str(error)
    return "not refused"


def test_a_frozen_reference_is_refused_naming_the_fix(tmp_path):
    """A frozen reference is a second model, which the stages do not hold: every rank refuses it in one
    line before any collective, naming ``reference: precomputed``."""
    for message in run_ranks(_refused, 2, str(tmp_path), "frozen", init_process_group=False, timeout_s=300):
        assert message.startswith("model.init_args.reference='frozen'") and "use reference: precomputed" in message


DPO_TINY = Path(__file__).resolve().parents[1] / "configs" / "dpo_tiny.yaml"
PIPELINE = ("--trainer.devices", "2", "--trainer.strategy.class_path", "lit_ablate.strategies.PipelineParallelStrategy")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ((), "model.init_args.reference='frozen'"),  # dpo_tiny's own reference
        (
            ("--model.init_args.reference", "precomputed", "--model.init_args.logprobs", "liger"),
            "model.init_args.logprobs='liger'",
        ),
        (
            (
                "--model.init_args.reference",
                "precomputed",
                "--data.init_args.collator.class_path",
                "lit_ablate.data.PreferencePackingCollator",
            ),
            "data.init_args.collator=",
        ),
    ],
)
def test_what_the_stages_cannot_train_is_refused_before_any_rank_starts(options, named):
    """A frozen reference, Liger's fused DPO and packed pairs under pp are refused by ``lit-ablate fit`` in one
    line naming the key and the fix, before any class is built (the rule ``pipeline_stages_train_the_objective``,
    which studies apply to their variants too); a precomputed reference passes (with its pairs padded to one
    shape: ``pipeline_stages_fit``). Seen failing with the rule left out of fit's hand-written list, which the
    registry has since replaced (no refusal: the ranks would start and refuse it at set-up)."""
    from lit_ablate.fit_cli import resolve_fit_config
    from lit_ablate.rules import check_run

    with pytest.raises(ConfigError) as refusal:
        check_run(resolve_fit_config(["--config", str(DPO_TINY), *PIPELINE, *options]))
    message = str(refusal.value)
    assert "\n" not in message and message.startswith(named) and "pp: 1" in message, message
    check_run(
        resolve_fit_config(
            [
                "--config",
                str(DPO_TINY),
                *PIPELINE,
                "--model.init_args.reference",
                "precomputed",
                "--data.init_args.collator.init_args.static_length",
                "true",
            ]
        ),
    )

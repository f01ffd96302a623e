"""Pipeline parallelism trains the same model as one process: pp=2 (2 gloo ranks), gpipe, 1f1b and interleaved 1f1b.

The pipeline runs use the strategy's step (``forward_backward``) and ``StepObjective``
as ``CausalLM`` does; the reference is one process training the whole batch on ``loss_sum /
useful``. SGD, not Adam: Adam would hide a wrong overall gradient scale. The labels are masked
SFT-style so the micro-batches hold unequal useful tokens (28, 4, 20 and 31 per row): a step that
averaged micro-batch means would train a different model. Losses within 1e-5 (measured 6e-7), weights
of each stage within 1e-5 (measured 4e-7).

Bugs these catch (each seen failing): each micro-batch's loss taken as its token mean instead of
its sum (losses off by 3.1); torch's default ``scale_grads=True``, dividing the gradients by the
micro-batch count again (losses off by 0.06-0.2 at step 3); the schedule's gradients of the
matrices not handed over to Lightning's backward (the fit test: off by 0.7); the resumed run not
reading the checkpoint (off by 0.55). Interleaved (pp=2 x 2 stages per rank, looped): seen failing
with every stage applying the final norm (off by 0.16) and with each stage running all its rank's
layers (off by 0.11). Evaluation: each trained pipeline, called on all four rows at once (a batch
of another size than its training micro-batches), returns one process's loss, forward only through
the stages (seen failing with the loss not broadcast from the last stage: 0 on the first).
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lit_ablate.callbacks import RunRecorder
from lit_ablate.callbacks.pipeline_bubble import PipelineBubbleMonitor
from lit_ablate.data import LMDataModule, SyntheticText
from lit_ablate.errors import ConfigError
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss, decoder_layers
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import loss_backend
from lit_ablate.models.presets import preset_config
from lit_ablate.modules import CausalLM
from lit_ablate.record import read_record
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
from lit_ablate.strategies.pipeline_split import balanced_split_points, check_split_points
from lit_ablate.strategies.pipeline_stages import pipeline_batch
from lit_ablate.strategies.step_objective import StepObjective
from tests.distributed import run_ranks
from tests.test_strategies_equivalence import fixed_batch, rows_of

STEPS = 3
LR = 0.5
ATOL = 1e-5


def build(preset: str, meta: bool = False, config: dict | None = None) -> CausalLMWithLoss:
    """``preset`` (its Hugging Face ``config`` keys overridden: ``{"tie_word_embeddings": True}``)."""
    torch.manual_seed(0)
    with torch.device("meta") if meta else nullcontext():
        lm = ModelFactory(preset=preset, config=config or {}).build()
    return CausalLMWithLoss(lm, loss_backend("torch"))


def sft_batch() -> dict[str, torch.Tensor]:
    """4 rows of 32 tokens; prompts masked to -100 so every row has a different number of useful tokens."""
    batch = fixed_batch()
    for row, prompt in enumerate((4, 28, 12, 1)):
        batch["labels"][row, :prompt] = -100
    return batch


def train_one_process(preset: str) -> dict:
    model, batch = build(preset), sft_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss_sum, useful = model(batch)
        loss = loss_sum / useful
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "eval": evaluate(model),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


@torch.no_grad()
def evaluate(model: CausalLMWithLoss) -> float:
    """The trained model's token-mean loss on all four rows (under pp: through the stages, forward only)."""
    loss_sum, useful = model(sft_batch())
    return (loss_sum / useful).item()


def _pipeline_run(rank: int, world_size: int, preset: str, strategy_kwargs: dict) -> dict:
    """``STEPS`` SGD steps of the 4-row batch; with ``dp_replicate`` replicas or ``dp_shard`` ranks,
    each data-parallel rank reads its share of the rows. Weights are returned whole (FSDP's gathered)."""
    replicas = strategy_kwargs.get("dp_replicate", 1) * strategy_kwargs.get("dp_shard", 1)
    strategy = PipelineParallelStrategy(pp=world_size // replicas, **strategy_kwargs)
    strategy.build_mesh("cpu", world_size)
    model = strategy.parallelize(build(preset, meta=rank != 0))
    objective = StepObjective()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    batch = rows_of(sft_batch(), strategy.data_parallel_rank, replicas)
    for _ in range(STEPS):
        loss_sum, useful = strategy.forward_backward(model, batch, objective)
        objective.backward_loss(loss_sum, useful, 0.0, strategy)  # as CausalLM.training_step: the step's totals
        strategy.deliver_gradients()  # as the strategy's backward in a fit
        objective.normalize_gradients(model.parameters(), strategy, accumulate_grad_batches=1)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(objective.last_step_loss.item())
    return {
        "losses": losses,
        "stage_layers": strategy.stage_layers,
        "eval": evaluate(model),
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()),
        "weights": {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        },
    }


def _two_ranks(rank: int, world_size: int) -> dict:
    return {
        "gpipe_llama": _pipeline_run(rank, world_size, "tiny-llama", {"schedule": "gpipe", "microbatches": 4}),
        "1f1b_qwen3": _pipeline_run(
            rank, world_size, "tiny-qwen3", {"schedule": "1f1b", "microbatches": 2, "split_points": [1]}
        ),
        "interleaved_llama": _pipeline_run(
            rank, world_size, "tiny-llama", {"schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 4}
        ),
    }


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {preset: train_one_process(preset) for preset in ("tiny-llama", "tiny-qwen3")}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks, 2)


@pytest.mark.parametrize(
    ("run", "preset"),
    [("gpipe_llama", "tiny-llama"), ("1f1b_qwen3", "tiny-qwen3"), ("interleaved_llama", "tiny-llama")],
)
def test_pp2_equals_one_process(two_ranks, references, run, preset):
    reference = references[preset]
    held = set()
    for rank in two_ranks:
        result = rank[run]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
        assert result["eval"] == pytest.approx(reference["eval"], abs=ATOL)  # forward only, all four rows at once
        for name, weight in result["weights"].items():
            if name in reference["weights"]:
                torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=ATOL, msg=name)
                held.add(name)
    assert held == set(reference["weights"]), "every parameter lives on exactly one stage"
    assert reference["losses"][-1] < reference["losses"][0] - 0.1, "the model did not train"


def _replicated(rank: int, world_size: int) -> dict:
    return _pipeline_run(rank, world_size, "tiny-llama", {"schedule": "1f1b", "microbatches": 2, "dp_replicate": 2})


@pytest.mark.slow  # 4 gloo ranks on 2 cores
def test_pp2_x_dp_replicate2_equals_one_process(references):
    """Two replicas of a 2-stage pipeline, each reading two of the four rows (28 + 4 useful tokens on
    replica 0, 20 + 31 on replica 1: unequal), train one process's model on all four: each stage's
    gradients averaged over its replicas, the step's tokens counted over them. Seen failing with
    the gradients not averaged (the third loss off by 0.36) and with each replica's own token count
    (StepObjective without the replica group, the gradients still averaged: off by 0.53)."""
    reference = references["tiny-llama"]
    ranks = run_ranks(_replicated, 4)
    held = set()
    for result in ranks:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
        assert result["eval"] == pytest.approx(reference["eval"], abs=ATOL)
        for name, weight in result["weights"].items():
            if name in reference["weights"]:
                torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=ATOL, msg=name)
                held.add(name)
    assert held == set(reference["weights"])


def test_stages_hold_the_split_layers(two_ranks):
    assert [rank["1f1b_qwen3"]["stage_layers"] for rank in two_ranks] == [[0], [1, 2, 3]]
    assert sorted(layer for rank in two_ranks for layer in rank["gpipe_llama"]["stage_layers"]) == [0, 1, 2, 3]
    assert [rank["interleaved_llama"]["stage_layers"] for rank in two_ranks] == [[0, 2], [1, 3]]  # looped stages


def _balanced(rank: int, world_size: int) -> dict:
    return _pipeline_run(rank, world_size, "tiny-llama", {"schedule": "1f1b", "microbatches": 2})


def test_a_balanced_run_s_stages_are_the_balanced_split(references):
    """pp=2 with ``split_points: null`` trains one process's model, and the layers each rank actually
    holds (its parameters' names) are ``balanced_split_points``'s stages, whose largest stage is the
    smallest any split can make (4 equal layers, the embeddings and the LM head ~0.2 layer each:
    layers 0-1 and 2-3). The existing runs check only that every layer is somewhere: any split trains
    the same model. Seen failing (by hand, once) with ``balanced_split_points`` reporting each stage's
    last layer instead of the next stage's first (``(end - 1, ...)``): the ranks hold [0] and [1, 2, 3],
    a largest stage of 631,552 parameters instead of 434,688 (the unit test fails under it too, and
    the interleaved run, whose split point 0 is refused)."""
    model = build("tiny-llama")
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    head, tail = model.lm.get_input_embeddings().weight.numel(), model.lm.get_output_embeddings().weight.numel()
    n = len(sizes)

    def stage_size(start: int, end: int) -> int:  # the objective balanced_split_points minimises
        return sum(sizes[start:end]) + (head if start == 0 else 0) + (tail if end == n else 0)

    smallest_largest = min(max(stage_size(0, point), stage_size(point, n)) for point in range(1, n))
    ranks = run_ranks(_balanced, 2)
    layer_index = re.compile(r"\.layers\.(\d+)\.")
    held = [sorted({int(m[1]) for m in map(layer_index.search, r["weights"]) if m}) for r in ranks]
    assert held == [r["stage_layers"] for r in ranks]
    (point,) = balanced_split_points(sizes, 2, head, tail)
    assert held == [list(range(point)), list(range(point, n))]
    assert max(stage_size(h[0], h[-1] + 1) for h in held) == smallest_largest
    for result in ranks:
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(references["tiny-llama"]["losses"]), rtol=0, atol=ATOL
        )


# ---------------------------------------------------------------- under a Lightning Trainer
class Seen(Callback):
    """This rank's loss of each step, and its loss sum and useful tokens (data-parallel ranks add theirs)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.sums: list[tuple[float, float]] = []
        self.val_loss: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append((outputs["loss_sum"] / outputs["useful_tokens"]).item())
        self.sums.append((outputs["loss_sum"].item(), float(outputs["useful_tokens"])))


def fit(
    strategy,
    devices: int,
    root: Path,
    steps: int = 3,
    ckpt_path: str | None = None,
    batch_size: int = 2,
    validate: bool = False,
    config: dict | None = None,
) -> Seen:
    """``steps`` AdamW steps of tiny Llama (its Hugging Face ``config`` keys overridden); with ``validate``,
    a sanity batch before them and the 5 held-out rows after them (the last batch smaller than the others)."""
    pl.seed_everything(0, verbose=False)
    # Adam amplifies the summation-order difference of micro-batches: at 1e-2 the third loss drifted 8e-5
    # (one process splitting its own batch in two drifts 5e-6 the same way); the SGD tests above are exact.
    module = CausalLM(ModelFactory(preset="tiny-llama", config=config or {}), learning_rate=1e-3, warmup_steps=1)
    data = LMDataModule(SyntheticText(num_documents=40), seq_len=32, batch_size=batch_size, val_examples=5)
    seen = Seen()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=[seen],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=1.0 if validate else 0,
        val_check_interval=steps,
        num_sanity_val_steps=int(validate),
        default_root_dir=root,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if validate:
        seen.val_loss = trainer.callback_metrics["val/loss"].item()
    if ckpt_path is None:
        trainer.save_checkpoint(root / "last.ckpt")
    return seen


def _lightning_pp(rank: int, world_size: int, root: str) -> dict:
    def strategy() -> PipelineParallelStrategy:
        return PipelineParallelStrategy(pp=2, schedule="1f1b", microbatches=2)

    whole = fit(strategy(), 2, Path(root) / "whole", validate=True)
    fit(strategy(), 2, Path(root) / "cut", steps=2)
    resumed = fit(strategy(), 2, Path(root) / "resumed", ckpt_path=str(Path(root) / "cut" / "last.ckpt")).losses
    return {"losses": whole.losses, "val_loss": whole.val_loss, "resumed": resumed}


def test_lightning_fit_with_pp2_equals_one_device(tmp_path):
    """Inside Lightning's loop: both stages read the batch one process reads, the schedule's backward
    replaces Lightning's, the objective rescales every stage, and every rank records the same loss.
    A run saved after 2 steps and resumed for a third continues as one device resumed the same way.
    Validation (a sanity batch before training, the held-out rows after it) runs each batch forward
    through the stages: its loss equals one device's (seen failing with the loss not broadcast from
    the last stage: the first stage's rank logs 0 and the synced value is halved)."""
    assert_ranks_fit_and_resume_as_one_device(tmp_path, _lightning_pp, 2)


def assert_ranks_fit_and_resume_as_one_device(
    tmp_path: Path, ranks_fit, world_size: int, config: dict | None = None
) -> None:
    """``ranks_fit`` on ``world_size`` ranks (returning each rank's losses, validation loss and the
    losses of a run saved after 2 steps and resumed) records one device's (the model's ``config``
    keys overridden alike), saved and resumed the same way."""
    reference = fit("auto", 1, tmp_path / "one", validate=True, config=config)
    fit("auto", 1, tmp_path / "one-cut", steps=2, config=config)
    resumed = fit(
        "auto", 1, tmp_path / "one-resumed", ckpt_path=str(tmp_path / "one-cut" / "last.ckpt"), config=config
    ).losses
    ranks = run_ranks(ranks_fit, world_size, str(tmp_path / "ranks"), init_process_group=False, timeout_s=400)
    assert reference.losses[-1] < reference.losses[0] - 1e-3, "the model did not train"
    for run in ranks:
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference.losses), rtol=0, atol=ATOL)
        assert run["val_loss"] == pytest.approx(reference.val_loss, abs=ATOL)
        # each stage saves and reloads only its own weights and optimizer state (sharded DCP folder)
        torch.testing.assert_close(torch.tensor(run["resumed"]), torch.tensor(resumed), rtol=0, atol=ATOL)


def _bubble_runs(rank: int, world_size: int, root: str) -> None:
    for microbatches in (1, 4):
        pl.seed_everything(0, verbose=False)
        module = CausalLM(ModelFactory(preset="tiny-llama"), learning_rate=1e-3, warmup_steps=1)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            max_steps=4,
            logger=False,
            enable_progress_bar=False,
            strategy=PipelineParallelStrategy(pp=2, schedule="gpipe", microbatches=microbatches),
            callbacks=[RunRecorder(path=f"{root}/m{microbatches}.json", warmup_steps=1), PipelineBubbleMonitor()],
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=root,
        )
        trainer.fit(module, LMDataModule(SyntheticText(num_documents=40), seq_len=32, batch_size=4))


def test_the_cli_adds_the_bubble_monitor_to_a_pipeline_run():
    """``lit-ablate fit`` puts PipelineBubbleMonitor into every pipeline run (seen failing without it)."""
    from lit_ablate.fit_cli import LitAblateCLI

    cli = LitAblateCLI(
        args=[
            "--config",
            str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"),
            "--trainer.strategy.class_path",
            "lit_ablate.strategies.PipelineParallelStrategy",
            "--trainer.devices",
            "2",
        ],
        run=False,
    )
    assert sum(isinstance(c, PipelineBubbleMonitor) for c in cli.trainer.callbacks) == 1


def test_the_record_shows_the_pipeline_bubble(tmp_path):
    """Every pipeline run's record holds its idle share (``lit-ablate fit`` adds
    PipelineBubbleMonitor to every pipeline run; here it is listed) and the schedule's own bubble,
    (pp - 1) / (m + pp - 1). gpipe with one micro-batch leaves each stage idle about half of the
    step whatever the load (it waits for the other's whole forward and backward: measured 0.45);
    with four, tiny stages on gloo add their communication to the schedule's 1/5 (measured 0.38 on 2
    cores), which this does not assert. Seen failing with the stage's chunks untimed (idle share
    1.0) and with the schedule clock started after its step (0)."""
    run_ranks(_bubble_runs, 2, str(tmp_path), init_process_group=False, timeout_s=300)
    one, four = (read_record(tmp_path / f"m{m}.json")["summary"] for m in (1, 4))
    assert one["pipeline_bubble_theory"]["median"] == pytest.approx(1 / 2)
    assert four["pipeline_bubble_theory"]["median"] == pytest.approx(1 / 5)
    for summary in (one, four):
        assert 0 < summary["pipeline_idle_share"]["min"] <= summary["pipeline_idle_share"]["max"] < 1
    assert one["pipeline_idle_share"]["min"] > 0.3


# ---------------------------------------------------------------- refusals and the split, one process
@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"tp": 0}, "init_args.tp"),
        ({"dp_shard": 0}, "init_args.dp_shard"),
        ({"reshard_after_forward": True}, "init_args.reshard_after_forward"),
        ({"schedule": "zb"}, "init_args.schedule"),
        ({"schedule": "interleaved_1f1b"}, "init_args.stages_per_rank"),
        ({"stages_per_rank": 2}, "init_args.stages_per_rank"),
        ({"microbatches": 0}, "init_args.microbatches"),
        ({"pp": 0}, "init_args.pp"),
    ],
)
def test_bad_options_are_refused_naming_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        PipelineParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("points", "stages"),
    [([0], 2), ([4], 2), ([2, 1], 3), ([1, 2], 2)],
    ids=["before-first", "past-last", "decreasing", "too-many"],
)
def test_split_points_out_of_range_are_refused(points, stages):
    with pytest.raises(ConfigError, match="split_points"):
        check_split_points(points, num_layers=4, stages=stages)
    check_split_points([1, 3], num_layers=4, stages=3)  # valid: no error


def test_other_families_are_refused():
    """Families whose decoder rescales ``inputs_embeds`` (Gemma) are refused; tied embeddings are taken
    (tests/test_pipeline_tied_embeddings.py)."""
    strategy = PipelineParallelStrategy(pp=2)
    strategy.pp = 2
    strategy.check_model(build("tiny-llama", meta=True, config={"tie_word_embeddings": True}))
    gemma = ModelFactory(config={**preset_config("tiny-llama"), "model_type": "gemma"}).build(device="meta")
    with pytest.raises(ConfigError, match="gemma"):
        strategy.check_model(CausalLMWithLoss(gemma, loss_backend("torch")))
    strategy.check_model(build("tiny-qwen3-moe", meta=True))  # MoE stages: tests/test_pipeline_features.py


def test_left_padded_batches_are_refused():
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ConfigError, match="right-padded"):
        pipeline_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1]] * 2)})
    right = pipeline_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1, 1, 0, 0]] * 2)})
    assert "attention_mask" in right  # kept: the padding's hidden states are one process's (MoE routers see them)


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split_points([1] * 4, 2, head=0, tail=0) == [2]
    assert balanced_split_points([1] * 4, 2, head=2, tail=0) == [1]  # the embeddings weigh two layers
    assert balanced_split_points([1] * 6, 3, head=0, tail=0) == [2, 4]

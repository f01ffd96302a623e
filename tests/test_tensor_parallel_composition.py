"""Tensor parallelism composed with tied embeddings, the chunked loss and packed or padded batches
under sequence parallelism trains the same model as one process (issue 29, item 3): tp=2 x
dp_shard=2 on 4 gloo ranks.

The two data-parallel halves of the batch carry unequal useful tokens (prompt-masked labels or left
padding in one half, packed documents of other lengths), so each rank's loss must be its share of the global token
mean: ``loss_sum / (useful tokens over all ranks)``, times ``dp_shard`` because FSDP2 averages the
gradients over it (StepObjective's job in a fit). Plain SGD as in ``test_tensor_parallel`` (whose
module docstring says why not AdamW); losses within 1e-5, weights within ``PARAM_ATOL``.

Bugs these catch (each seen failing, see each test): the LM head not re-tied to the split embedding,
the chunked loss's partial log-sum-exp left unreduced over tp, the decoder's mask built for the
sequence-parallel slice instead of the whole packed sequence, a padding mask dropped. A Lightning
fit (tp=2) runs all three at once through the strategy's batch handling and clipping.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lit_ablate.data.packing import PackingCollator
from lit_ablate.estimate.flops import count_parameters
from lit_ablate.estimate.memory import estimate_memory
from lit_ablate.estimate.shapes import TrainingShape, model_shape
from lit_ablate.models.losses.chunked_cross_entropy import IGNORE_INDEX
from lit_ablate.models.losses.cross_entropy import loss_backend
from lit_ablate.strategies import MeshParallelStrategy
from lit_ablate.strategies.interface import state_sharding_of
from tests.distributed import run_ranks
from tests.test_strategies_equivalence import PARAM_ATOL, fixed_batch, full_weights
from tests.test_tensor_parallel import LOSS_ATOL, LR, STEPS, build

TP, DP = 2, 2
CHUNKED = {"chunk_tokens": 24, "chunk_vocab": 48, "z_loss_weight": 1e-3}  # 160 columns per rank: 4 chunks
CASES = {
    "tied": {"model": {"tie_word_embeddings": True}, "loss": "torch", "options": {}, "sequence_parallel": False},
    "chunked": {"model": {}, "loss": "chunked", "options": CHUNKED, "sequence_parallel": True},
    "tied_chunked": {
        "model": {"tie_word_embeddings": True},
        "loss": "chunked",
        "options": CHUNKED,
        "sequence_parallel": False,
    },
    "packed_sp": {"model": {}, "loss": "torch", "options": {}, "sequence_parallel": True, "packed": True},
    "padded_sp": {"model": {}, "loss": "torch", "options": {}, "sequence_parallel": True, "padded": True},
}
"""tiny Qwen3 under ``MeshParallelStrategy(tp=2, dp_shard=2)``: the model overrides, the loss
backend and its options, sequence parallelism, and whether the batch is packed documents or
left-padded rows."""


def unequal_batch() -> dict[str, torch.Tensor]:
    """4 rows of 32 tokens; the first data-parallel half (rows 0-1) counts 12 labels a row, the second 32."""
    batch = fixed_batch()
    batch["labels"][:2, :20] = IGNORE_INDEX
    return batch


DOCUMENT_ROWS = [[5, 9, 18], [32], [7, 7, 7, 11], [20, 12]]
"""Document lengths per packed row (each row 32 tokens); rows 0-1 are one data-parallel half."""


def packed_batch(rows: list[int]) -> dict:
    """The packing collator's batch of ``rows`` of ``DOCUMENT_ROWS``; documents of the first half
    mask their first 3 labels (a prompt), so the halves count different tokens."""
    tokens = torch.randint(0, 320, (100,), generator=torch.Generator().manual_seed(2))
    collator = PackingCollator(max_tokens=32)
    examples, start = [], 0
    for row in range(len(DOCUMENT_ROWS)):
        row_examples = []
        for length in DOCUMENT_ROWS[row]:
            ids = tokens[start : start + length]
            labels = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
            if row < 2:
                labels[:3] = IGNORE_INDEX
            row_examples.append({"input_ids": ids, "labels": labels})
            start = (start + 7) % 60
        examples.append(row_examples)
    return collator([examples[r] for r in rows])


def left_padded_batch() -> dict[str, torch.Tensor]:
    """``fixed_batch`` with rows 0 and 1 left-padded by 10 and 5 tokens (no labels, mask 0 there)."""
    batch = fixed_batch()
    mask = torch.ones_like(batch["input_ids"])
    for row, pad in ((0, 10), (1, 5)):
        mask[row, :pad] = 0
    batch["input_ids"] = batch["input_ids"].masked_fill(mask == 0, 0)
    batch["labels"] = batch["labels"].masked_fill(mask == 0, IGNORE_INDEX)
    return {**batch, "attention_mask": mask}


def case_batch(case: dict, part: int, parts: int) -> dict:
    rows = list(range(part * 4 // parts, (part + 1) * 4 // parts))
    if case.get("packed"):
        return packed_batch(rows)
    whole = left_padded_batch() if case.get("padded") else unequal_batch()
    return {k: v[rows] for k, v in whole.items()}


def case_model(case: dict, meta: bool = False) -> torch.nn.Module:
    """Tiny Qwen3 (seed 0) with the case's config overrides and loss backend options."""
    model = build("tiny-qwen3", meta=meta, **case["model"])
    model.loss_fn = loss_backend(case["loss"], **case["options"])
    return model


def train(model: torch.nn.Module, batch: dict, dp_group: dist.ProcessGroup | None = None) -> dict:
    """SGD steps on the global token mean; the loss series."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss_sum, useful = model(batch)
        sums = torch.stack([loss_sum.detach(), useful.float()])
        if dp_group is not None:
            dist.all_reduce(sums, group=dp_group)
        dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        (loss_sum / sums[1] * dp).backward()  # x dp: FSDP2 averages gradients over dp_shard
        optimizer.step()
        optimizer.zero_grad()
        losses.append((sums[0] / sums[1]).item())
    return {"losses": losses, "weights": full_weights(model)}


def _composed_run(rank: int, world_size: int, name: str) -> dict:
    case = CASES[name]
    strategy = MeshParallelStrategy(tp=TP, dp_shard=DP, sequence_parallel=case["sequence_parallel"])
    strategy.build_mesh("cpu", world_size)
    model = strategy.parallelize(case_model(case, meta=rank != 0))
    batch = case_batch(case, strategy.data_parallel_rank, strategy.data_parallel_size)
    if case["sequence_parallel"]:
        batch = strategy.sequence_parallel_batch(batch)
    with strategy.vocabulary_parallel_loss():
        result = train(model, batch, strategy.device_mesh["dp_shard"].get_group())
    lm = model.lm
    result["tied"] = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    result["local_param_bytes"] = sum(t.numel() * t.element_size() for t in local)
    if rank:
        result["weights"] = {}
    return result


@pytest.fixture(scope="module")
def four_ranks() -> Callable[[str], list[dict]]:
    """Each case's 4-rank results, run once (one launch per case keeps each test near 10 s)."""
    runs: dict[str, list[dict]] = {}

    def run(name: str) -> list[dict]:
        if name not in runs:
            runs[name] = run_ranks(_composed_run, TP * DP, name, timeout_s=300)
        return runs[name]

    return run


def one_process(name: str) -> dict:
    case = CASES[name]
    return train(case_model(case), case_batch(case, 0, 1))


def assert_same_training(result: dict, reference: dict) -> None:
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=LOSS_ATOL
    )
    assert result["losses"][-1] < result["losses"][0] - 0.1, "the model did not train"
    assert sorted(result["weights"]) == sorted(reference["weights"])
    for key, weight in reference["weights"].items():
        torch.testing.assert_close(result["weights"][key], weight, rtol=0, atol=PARAM_ATOL, msg=key)


def test_the_cases_count_unequal_tokens_per_data_parallel_half():
    for name, case in CASES.items():
        halves = [int((case_batch(case, part, 2)["labels"] != IGNORE_INDEX).sum()) for part in (0, 1)]
        assert halves[0] != halves[1], (name, halves)


def test_tp2_tied_embeddings_equal_one_process(four_ranks):
    """The embedding and the LM head share one vocabulary-sharded parameter, which takes both
    gradients. Seen failing with the re-tie skipped (``tie_split_embeddings`` a no-op): the head and
    the embedding train apart, losses off by 8.2e-2 by step 3 (tied_chunked fails too)."""
    runs = four_ranks("tied")
    assert_same_training(runs[0], one_process("tied"))
    assert all(run["tied"] for run in runs)


def test_tp2_tied_embeddings_estimate_counts_the_shared_weight_once(four_ranks):
    """Each rank holds the tied weight's vocabulary shard once, as the memory estimate divides it
    (``count_parameters`` counts a shared parameter once). Seen failing with the re-tie skipped:
    each rank then holds two shards (871168 bytes against the estimate's 828800)."""
    lm = build("tiny-qwen3", meta=True, tie_word_embeddings=True).lm
    strategy = MeshParallelStrategy(tp=TP, dp_shard=DP)
    estimate = estimate_memory(
        count_parameters(lm, lm.config),
        model_shape(lm.config),
        TrainingShape(micro_batch=2, seq_len=32),
        state_sharding_of(strategy, TP * DP),
        TP * DP,
    )
    assert max(run["local_param_bytes"] for run in four_ranks("tied")) == pytest.approx(estimate.params, rel=0.02)


def test_the_estimate_holds_no_chunked_loss_gradients_under_tp():
    """Under tp the chunked loss forms its gradients in the backward (no fp32 ``d weight`` and
    ``d hidden`` held from the forward); seen failing with ``loss_gradient_bytes`` ignoring tp."""
    from lit_ablate.estimate.memory import loss_gradient_bytes

    shape = model_shape(build("tiny-qwen3", meta=True).lm.config)
    assert loss_gradient_bytes(shape, TrainingShape(micro_batch=2, seq_len=32, loss="chunked")) > 0
    assert loss_gradient_bytes(shape, TrainingShape(micro_batch=2, seq_len=32, loss="chunked", tensor_parallel=2)) == 0


@pytest.mark.parametrize("name", ["chunked", "tied_chunked"])
def test_tp2_chunked_loss_equals_one_process(four_ranks, name):
    """The chunked backend on the vocabulary-sharded head (token and vocabulary chunks, z-loss) under
    sequence parallelism and with tied embeddings. Seen failing with the partial log-sum-exp not
    all-reduced over tp (``global_log_sum_exp`` returning each rank's own): losses off by 0.72 and
    0.70; the Lightning fit below fails too."""
    assert_same_training(four_ranks(name)[0], one_process(name))


def test_tp2_sequence_parallel_on_packed_documents_equals_one_process(four_ranks):
    """Packed rows (per-document position_ids from the packing collator) under sequence parallelism:
    attention must keep the documents apart over the whole sequence. Seen failing with the
    ``whole_sequence_masks`` hook not registered (the decoder's mask built for the 16-token slice:
    'size of tensor a (32) must match ... b (16)') and, silently, with the hook passing a plain
    causal mask over the whole sequence (documents not kept apart: losses off by 0.17)."""
    assert_same_training(four_ranks("packed_sp")[0], one_process("packed_sp"))


def test_tp2_sequence_parallel_on_left_padded_rows_equals_one_process(four_ranks):
    """Left padding under sequence parallelism: the padding mask reaches attention over the whole
    sequence. Seen failing with ``sequence_parallel_batch`` dropping every mask (the padding keys
    attended: losses off by 0.27)."""
    assert_same_training(four_ranks("padded_sp")[0], one_process("padded_sp"))


def test_whole_sequence_masks_keep_packed_documents_apart_and_refuse_sliding_windows():
    """The hook's mask, one process: block-diagonal causal over the whole packed row; causal without
    the padding keys for a padded one; nothing for an unpacked, unpadded one (the kernel's causal
    flag); a sliding-window model refused in one line."""
    from lit_ablate.errors import ConfigError
    from lit_ablate.strategies.tensor_parallel import whole_sequence_masks

    decoder = build("tiny-qwen3").lm.base_model
    input_ids = torch.zeros(1, 8, dtype=torch.long)
    packed = {"input_ids": input_ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    _, kwargs = whole_sequence_masks(decoder, (), packed)
    same_document = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    expected = (same_document[:, None] == same_document[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(kwargs["attention_mask"].reshape(8, 8), expected)
    assert whole_sequence_masks(decoder, (), {"input_ids": input_ids, "position_ids": torch.arange(8)[None]}) is None
    sliding = build(
        "tiny-qwen3", layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4, use_sliding_window=True
    ).lm.base_model
    with pytest.raises(ConfigError, match=r"sequence_parallel.*sliding-window"):
        whole_sequence_masks(sliding, (), packed)
    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    _, kwargs = whole_sequence_masks(
        decoder, (), {"input_ids": input_ids, "position_ids": torch.arange(8)[None], "attention_mask": padding}
    )
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(kwargs["attention_mask"].reshape(8, 8), causal & padding.bool())


# ---------------------------------------------------------------- under a Lightning Trainer
def _lightning_fit(rank: int, world_size: int, root: str) -> dict:
    return _fit(MeshParallelStrategy(tp=TP, dp_shard=1, sequence_parallel=True), world_size, root)


FIT_CHUNKED = {"chunk_tokens": 24, "chunk_vocab": 48}
"""``CHUNKED`` without z-loss: with it, AdamW's later steps drift 3.4e-5 relative in the gradient norm
(step-1 norms equal to 2e-7, gradients to 1e-7 absolute, checked): Adam's sign-like first update
amplifies fp32 reduction-order noise in near-zero gradients. The SGD tests above hold z-loss tight."""


def _fit(strategy, devices: int, root: str, steps: int | None = None, ckpt_path: str | None = None) -> dict:
    """3 AdamW steps of tied tiny Qwen3 with the chunked loss on packed SFT rows (prompts masked),
    clipped every step; the losses, pre-clip norms and global batches seen (``Seen``)."""
    import lightning.pytorch as pl

    from lit_ablate.data import ArithmeticSFT, LMDataModule
    from lit_ablate.models.factory import ModelFactory
    from lit_ablate.modules import CausalLM
    from tests.test_tensor_parallel import CLIP, FIT_LR, FIT_STEPS, Seen

    pl.seed_everything(0, verbose=False)
    module = CausalLM(
        ModelFactory(preset="tiny-qwen3", config={"tie_word_embeddings": True}),
        loss="chunked",
        loss_options=FIT_CHUNKED,
        learning_rate=FIT_LR,
        warmup_steps=1,
    )
    data = LMDataModule(
        ArithmeticSFT(num_examples=200),
        format="sft",
        seq_len=32,
        batch_size=2,
        collator=PackingCollator(max_tokens=32, static_shape=True),
    )
    seen = Seen()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps or FIT_STEPS,
        callbacks=[seen],
        gradient_clip_val=CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if steps is not None and ckpt_path is None:
        trainer.save_checkpoint(f"{root}/last.ckpt")
    return {"losses": seen.losses, "norms": seen.norms, "batches": seen.batches}


def test_lightning_fit_tp2_tied_chunked_packed_sequence_parallel_equals_one_device(tmp_path):
    """All three at once through Lightning's loop (the strategy's batch_to_device turns the packing
    collator's batch into a sequence-parallel one; clipping by the norm over the TP mesh): the same
    losses and pre-clip gradient norms as one device. Fails with any of the three mechanisms above
    broken, as the tests on raw ranks do."""
    reference = _fit("auto", 1, str(tmp_path / "one"))
    ranks = run_ranks(_lightning_fit, TP, str(tmp_path / "tp"), init_process_group=False, timeout_s=300)
    from tests.test_tensor_parallel import CLIP

    assert min(reference["norms"]) > CLIP, "clipping never scaled the gradients"
    for run in ranks:
        assert run["batches"] == reference["batches"]
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(
            torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=LOSS_ATOL
        )


def _lightning_resume(rank: int, world_size: int, root: str) -> list[float]:
    def strategy() -> MeshParallelStrategy:
        return MeshParallelStrategy(tp=TP, dp_shard=1, sequence_parallel=True)

    _fit(strategy(), world_size, f"{root}/cut", steps=2)
    return _fit(strategy(), world_size, f"{root}/resumed", ckpt_path=f"{root}/cut/last.ckpt")["losses"]


@pytest.mark.slow  # ~25 s: two fits on 2 ranks, two on one device
def test_lightning_tp2_tied_resume_continues_as_one_device(tmp_path):
    """Saved after 2 steps (the tied, vocabulary-sharded weight under both its names) and resumed
    for a third, the tp=2 run continues as one device saved and resumed the same way. Seen failing
    only with the re-tie skipped (third loss 2.2e-2 off); no bug of the save or load path itself
    was put in (that is Lightning's and DCP's code)."""
    _fit("auto", 1, str(tmp_path / "one-cut"), steps=2)
    resumed = _fit("auto", 1, str(tmp_path / "one-resumed"), ckpt_path=str(tmp_path / "one-cut" / "last.ckpt"))
    ranks = run_ranks(_lightning_resume, TP, str(tmp_path / "tp"), init_process_group=False, timeout_s=300)
    assert len(resumed["losses"]) == 1
    for run in ranks:
        torch.testing.assert_close(torch.tensor(run), torch.tensor(resumed["losses"]), rtol=0, atol=LOSS_ATOL)

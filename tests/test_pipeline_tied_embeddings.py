"""Pipeline parallelism with tied embeddings (``tie_word_embeddings: true``, as Qwen3-0.6B ships) trains
one process's model.

The first stage holds the embedding, the last the LM head, each a copy of the one matrix rank 0 built;
after every batch's schedule the two copies' gradients are summed over each pipeline's first and last
stage (``pipeline_tied_embeddings``), so both take one process's gradient (the lookup's plus the
head's) and the same update, and clipping counts the matrix once. The runs train tiny Qwen3 with a
tied head on the SFT rows of ``tests/test_pipeline_parallel.py`` (28, 4, 20 and 31 useful tokens:
micro-batches and data-parallel ranks carry unequal token counts) for 3 SGD steps and compare with
one process (``tests/test_pipeline_mesh.py``'s harness): losses, evaluation through the stages and
every weight within 1e-5, both copies bitwise equal. Then: clipping with accumulation, pp=2 x tp=2,
pp=2 x dp_shard=2 (interleaved), pp=2 x dp_replicate=2 and pp=4 on 4 ranks, a Lightning fit saved,
resumed and exported to a Hugging Face folder, the memory estimate, and the one-stage refusal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lit_ablate.errors import ConfigError
from lit_ablate.estimate.flops import count_parameters
from lit_ablate.estimate.memory import pipeline_stage_estimates
from lit_ablate.estimate.shapes import TrainingShape, model_shape
from lit_ablate.models.factory import ModelFactory
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
from lit_ablate.strategies.pipeline_split import keep_stages
from lit_ablate.strategies.state_sharding import REPLICATED
from tests import test_pipeline_features as features
from tests.distributed import run_ranks
from tests.test_pipeline_mesh import _fit_refusal, _mesh_pipeline_run, assert_trains_one_process_model, train_reference
from tests.test_pipeline_parallel import assert_ranks_fit_and_resume_as_one_device, build, fit

PRESET = "tiny-qwen3"
TIED = {"tie_word_embeddings": True}
EMBEDDING, HEAD = "lm.model.embed_tokens.weight", "lm.lm_head.weight"
TWO_RANKS = {  # name: strategy options (pp=2 on 2 ranks)
    "1f1b": {"pp": 2, "schedule": "1f1b", "microbatches": 2},
    "interleaved": {"pp": 2, "schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 2},
}
FOUR_RANKS = {  # name: (strategy options, ranks holding each weight)
    "pp2_x_tp2": ({"pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 2}, 2),
    "pp2_x_dp_shard2": (
        {"pp": 2, "dp_shard": 2, "schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 2},
        2,
    ),
    "pp2_x_dp_replicate2": ({"pp": 2, "dp_replicate": 2, "schedule": "gpipe", "microbatches": 2}, 2),
    "pp4": ({"pp": 4, "schedule": "1f1b", "microbatches": 4}, 1),
}


def _two_ranks(rank: int, world_size: int) -> dict:
    runs = {
        name: _mesh_pipeline_run(rank, world_size, PRESET, options, config=TIED) for name, options in TWO_RANKS.items()
    }
    runs["clipped_accumulated"] = features._pipeline_run(
        rank,
        world_size,
        PRESET,
        "sft_accumulated",
        {"schedule": "gpipe", "microbatches": 2},
        features.CLIP,
        {"config": TIED},
    )
    return runs


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks, 2, timeout_s=300)


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference(PRESET, "sft", config=TIED)


def assert_copies_equal(ranks: list[dict]) -> None:
    """The embedding's copy (first stage) and the LM head's (last stage) hold the same values, bit for
    bit: they started from one matrix and took the same updates. The first stage's ranks come first (pp
    outermost), and each holds its part of the embedding at the same mesh coordinate as its last-stage peer
    (``shards.local_parts``: the part, its global shape and offset)."""
    firsts = [r["weights"][EMBEDDING] for r in ranks if EMBEDDING in r["weights"]]
    lasts = [r["weights"][HEAD] for r in ranks if HEAD in r["weights"]]
    assert firsts and len(firsts) == len(lasts)
    for (embedding, *where), (head, *head_where) in zip(firsts, lasts, strict=True):
        assert torch.equal(embedding, head) and where == head_where


@pytest.mark.parametrize("run", list(TWO_RANKS))
def test_pp2_with_tied_embeddings_equals_one_process(two_ranks, reference, run):
    """pp=2, 1f1b and interleaved (stages 0 and 2 on rank 0, 1 and 3 on rank 1: the embedding on rank 0,
    the head on rank 1): losses, evaluation and weights (both copies) within 1e-5 of one process, each
    rank holding its stage's copy. Seen failing without the gradient sum (each copy trained by its own
    use: losses off by 0.095 at step 2), with the sum done twice (0.37 at step 3), as a mean (0.20), and
    with the head's copy not filled from rank 0 (left as allocated: 0.44, NaN interleaved)."""
    ranks = [rank[run] for rank in two_ranks]
    assert_trains_one_process_model(ranks, reference, holders=1, split=1)
    assert_copies_equal(ranks)
    assert [EMBEDDING in r["weights"] for r in ranks] == [True, False]


def test_clipping_counts_the_tied_matrix_once(two_ranks):
    """Clipped by 0.5 (below every step's norm) after 2 accumulated batches (32 and 51 useful tokens),
    gpipe: the norm over both stages counts the matrix once (the last stage's copy scaled, not counted),
    as ``clip_grad_norm_`` of one process counts the one parameter: pre-clip norms, losses and weights
    within 1e-5. Seen failing with the head's copy counted too (``repeated_parameters`` empty: losses off
    by 0.011 at step 2), and without the gradient sum (0.018), twice (0.054) or as a mean (0.047)."""
    expected = features.train_one_process(PRESET, "sft_accumulated", clip=features.CLIP, config=TIED)
    assert min(expected["norms"]) > 2 * features.CLIP, "the clip value must bite"
    features.assert_trains_as([rank["clipped_accumulated"] for rank in two_ranks], expected, falls=False)


def _layouts(rank: int, world_size: int) -> list[str]:
    """``StageCopy.check_matches`` between two ranks standing for the first and last stage: copies of one
    layout, copies whose global shapes differ, and DTensor copies of one global shape sharded by rows on
    one rank and by columns on the other (``ok`` or the error)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lit_ablate.strategies.pipeline_tied_embeddings import StageCopy

    mesh, group = init_device_mesh("cpu", (world_size,)), dist.group.WORLD
    copies = {
        "same": torch.zeros(4, 2),
        "shape": torch.zeros(4, 2) if rank == 0 else torch.zeros(2, 4),
        "placement": DTensor.from_local(
            torch.zeros(2, 4) if rank == 0 else torch.zeros(4, 2),
            mesh,
            [Shard(0) if rank == 0 else Shard(1)],
            run_check=False,
        ),
    }
    outcomes = []
    for copy in copies.values():
        try:
            StageCopy(torch.nn.Parameter(copy), group, counted=rank == 0).check_matches()
            outcomes.append("ok")
        except RuntimeError as error:
            outcomes.append(str(error))
    return outcomes


def test_copies_laid_out_differently_are_refused():
    """The copies' gradients are summed shard by shard, so both stages' copies must hold the same slice:
    the same global and local shapes and placements. Copies of another shape, or of one global shape
    split otherwise (rows on the first stage, columns on the last), fail at set-up on both ranks. Seen
    failing with the placements and local shapes left out of the comparison (the split copies passed)."""
    for outcomes in run_ranks(_layouts, 2):
        assert outcomes[0] == "ok"
        assert all("laid out differently" in outcome for outcome in outcomes[1:]), outcomes


def _tied_shapes(tied: bool = True) -> tuple:
    lm = ModelFactory(preset=PRESET, config={"tie_word_embeddings": tied}).build(device="meta")
    return count_parameters(lm, lm.config), model_shape(lm.config)


def test_the_estimate_holds_the_tied_matrix_on_both_ends(two_ranks):
    """The memory estimate counts the tied matrix on the first stage (embedding) and on the last (LM head):
    each rank's parameters are exactly what the pp=2 run held (4 bytes per element), and its gradients
    and Adam states the same as an untied model's, whose stages hold the same tensors. Seen failing with
    the last stage's copy left out (the table counted once, as on one device: the last rank 40,960
    elements short)."""
    training = TrainingShape(micro_batch=4, seq_len=32, optimizer="adamw", pipeline_parallel=2, microbatches=2)
    tied = pipeline_stage_estimates(*_tied_shapes(), training, REPLICATED)
    untied = pipeline_stage_estimates(*_tied_shapes(tied=False), training, REPLICATED)
    for stage, (estimate, result) in enumerate(zip(tied, [rank["1f1b"] for rank in two_ranks], strict=True)):
        assert estimate.params == 4 * result["local_numel"], stage
        for category in ("params", "grads", "optimizer"):
            assert getattr(estimate, category) == getattr(untied[stage], category), (stage, category)


def _four_ranks(rank: int, world_size: int) -> dict:
    return {
        name: _mesh_pipeline_run(rank, world_size, PRESET, options, config=TIED)
        for name, (options, _) in FOUR_RANKS.items()
    }


@pytest.mark.slow  # 4 gloo ranks on 2 cores, four runs
def test_tied_embeddings_over_the_mesh_equal_one_process(reference):
    """4 ranks, each run against one process: pp=2 x tp=2 (both copies split by vocabulary rows over
    the stage's tp pair, the embedding RowwiseParallel and the head ColwiseParallel, each ``Shard(0)``:
    summed shard with shard), pp=2 x dp_shard=2 interleaved (FSDP shards of both copies summed, each data
    rank reading its own rows: 28 + 4 and 20 + 31 useful tokens), pp=2 x dp_replicate=2 (replicas averaged
    by hand, then the copies summed) and pp=4 (the sum over the first and last of four stages, the middle
    ranks in no embedding group). Losses, evaluation and weights within 1e-5, both copies equal, and each
    rank holding its stage's share as the memory estimate divides it (1%). Seen failing without the
    gradient sum (each of the four runs: losses off by 0.095 at step 2), and, for pp=4, with the sum over
    the pipeline's whole ``pp`` group (the middle stages never join it: a timeout)."""
    ranks = run_ranks(_four_ranks, 4, timeout_s=500)
    counts, shape = _tied_shapes()
    for name, (options, holders) in FOUR_RANKS.items():
        runs = [rank[name] for rank in ranks]
        assert_trains_one_process_model(runs, reference, holders=holders, split=options.get("dp_replicate", 1))
        assert_copies_equal(runs)
        strategy = PipelineParallelStrategy(**options)
        training = TrainingShape(
            micro_batch=4,
            seq_len=32,
            pipeline_parallel=options["pp"],
            tensor_parallel=options.get("tp", 1),
            pipeline_schedule=options["schedule"],
            microbatches=options["microbatches"],
            pipeline_stages_per_rank=options.get("stages_per_rank", 1),
        )
        estimates = pipeline_stage_estimates(counts, shape, training, strategy.state_sharding(4))
        for run in runs:
            assert 4 * run["local_numel"] == pytest.approx(estimates[run["stage"]].params, rel=0.01), name


def _lightning_tied_pp2(rank: int, world_size: int, root: str) -> dict:
    def strategy() -> PipelineParallelStrategy:
        return PipelineParallelStrategy(pp=2, schedule="1f1b", microbatches=2)

    whole = fit(strategy(), 2, Path(root) / "whole", validate=True, config=TIED)
    fit(strategy(), 2, Path(root) / "cut", steps=2, config=TIED)
    resumed = fit(strategy(), 2, Path(root) / "resumed", ckpt_path=str(Path(root) / "cut" / "last.ckpt"), config=TIED)
    return {"losses": whole.losses, "val_loss": whole.val_loss, "resumed": resumed.losses}


def test_lightning_fit_resume_and_export_of_tied_pp2(tmp_path):
    """A Lightning fit of tied tiny Llama, pp=2 1f1b, AdamW (weight decay on the matrices, none on the
    tied table's copy on either stage, as on one device): losses and validation loss are one
    device's, and a run saved after 2 steps and resumed for a third continues as one device does
    (each stage saves and reloads its copy and its Adam states under its own name). The saved folder
    holds both copies, equal; ``lit-ablate export`` writes a Hugging Face folder with
    ``tie_word_embeddings``, which loads tied with that matrix and gives the one-device export's
    logits. Seen failing without the gradient sum (losses off by 7.7e-3 at step 2) and with the
    head's copy decayed (its name taken for a matrix that decays: 1.0e-4 at step 3)."""
    from transformers import AutoModelForCausalLM

    from lit_ablate.commands.export import export_hf_checkpoint

    assert_ranks_fit_and_resume_as_one_device(tmp_path, _lightning_tied_pp2, 2, config=TIED)
    saved = tmp_path / "ranks" / "whole" / "last.ckpt"
    dcp_to_torch_save(saved, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=True)["state_dict"]
    embedding, head = state[f"model.{EMBEDDING}"], state[f"model.{HEAD}"]
    assert torch.equal(embedding, head)
    pipelined = AutoModelForCausalLM.from_pretrained(export_hf_checkpoint(saved, tmp_path / "hf_pp")).eval()
    one = AutoModelForCausalLM.from_pretrained(
        export_hf_checkpoint(tmp_path / "one" / "last.ckpt", tmp_path / "hf_one")
    ).eval()
    assert pipelined.config.tie_word_embeddings
    assert pipelined.get_output_embeddings().weight is pipelined.get_input_embeddings().weight
    assert torch.equal(pipelined.get_input_embeddings().weight, embedding)
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(pipelined(tokens).logits, one(tokens).logits, rtol=0, atol=1e-4)


def test_tied_embeddings_pass_and_one_stage_is_refused_before_any_rank_starts():
    """``lit-ablate fit`` takes tied embeddings under the pipeline (no refusal before the ranks start), and
    refuses a pipeline of one stage in one line, where one rank would hold the first and the last stage
    (torch's schedules do not run it, tied or not: their first step raised 'loss_fn and target required
    for last stage'): ``pp: 1``, or ``pp: -1`` on one device. The strategy's split refuses it too, as its
    backstop. Seen failing with the rule returning nothing and with the split's check left out (no
    refusal)."""
    from lit_ablate.fit_cli import resolve_fit_config
    from lit_ablate.rules import check_run

    pipeline = ("--trainer.strategy.class_path", "lit_ablate.strategies.PipelineParallelStrategy")
    check_run(
        resolve_fit_config(
            [
                "--config",
                str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"),
                "--trainer.devices",
                "2",
                *pipeline,
                "--model.init_args.model.config",
                '{"tie_word_embeddings": true}',
            ]
        ),
    )
    for options in (
        ("--trainer.strategy.init_args.pp", "1", "--trainer.strategy.init_args.dp_shard", "2"),
        ("--trainer.devices", "1"),
    ):
        message = _fit_refusal(*pipeline, *options)
        assert "trainer.strategy.init_args.pp=1" in message and "2 or more stages" in message
    with pytest.raises(ConfigError, match="2 or more stages"):
        keep_stages(build(PRESET, meta=True, config=TIED), pp=1, stage_index=0, stages_per_rank=1, split_points=None)

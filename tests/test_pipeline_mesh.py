"""Pipeline parallelism composed with the mesh's other dimensions trains the same model as one process.

``PipelineParallelStrategy`` is ``MeshParallelStrategy`` with the pipeline step: each rank keeps its
stage first, then tensor, expert and context parallelism and FSDP2 act on the stage over the stage's
sub-mesh (torchtitan's order). The runs train the 4-row SFT batch of ``tests/test_pipeline_parallel.py``
(28, 4, 20 and 31 useful tokens per row, so micro-batches and data-parallel ranks carry unequal token
counts), or packed rows for context parallelism, for 3 SGD steps and compare with one process:
losses, evaluation through the stages, every weight within 1e-5, and the elements each rank holds.
As ``CausalLM.training_step`` does inside the strategy's ``training_step``, each step runs in the
strategy's vocabulary-parallel loss and context-parallel attention, on the batch as its
``batch_to_device`` shards it. pp2 x tp2, pp2 x cp2 and pp2 x ep2 take 4 gloo ranks, pp2 x tp2 x
dp_shard2 eight; then a Lightning fit with pp2 x tp2, and the refusals.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lit_ablate.errors import ConfigError
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import loss_backend
from lit_ablate.models.moe.blocks import MoEOptions, collect_aux_losses
from lit_ablate.strategies import MeshParallelStrategy
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
from lit_ablate.strategies.step_objective import StepObjective
from tests.distributed import run_ranks
from tests.shards import local_parts, whole_weights
from tests.test_pipeline_parallel import (
    ATOL,
    LR,
    STEPS,
    assert_ranks_fit_and_resume_as_one_device,
    build,
    fit,
    sft_batch,
)
from tests.test_strategies_equivalence import fixed_batch
from tests.test_tensor_parallel_composition import packed_batch


def rows_of(batch: dict[str, torch.Tensor], part: int, parts: int) -> dict[str, torch.Tensor]:
    """Part ``part`` of ``parts`` consecutive equal shares of the batch's rows."""
    return {key: value.tensor_split(parts)[part] for key, value in batch.items()}


def packed_rows() -> dict:
    """The packing collator's 4 rows of 32 tokens: documents of 5 to 32 tokens, the first two rows'
    documents with 3 masked prompt labels (``tests/test_tensor_parallel_composition.py``)."""
    return packed_batch([0, 1, 2, 3])


def sft_batch_of_8() -> dict[str, torch.Tensor]:
    """8 rows for 8 data-parallel ranks: ``sft_batch`` and its tokens shifted by 7 with prompts of 2, 20,
    9 and 30 tokens (useful tokens 28, 4, 20, 31, 30, 12, 23, 2)."""
    first = sft_batch()
    second = {"input_ids": (first["input_ids"] + 7) % 320, "labels": (fixed_batch()["labels"] + 7) % 320}
    for row, prompt in enumerate((2, 20, 9, 30)):
        second["labels"][row, :prompt] = -100
    return {key: torch.cat([first[key], second[key]]) for key in first}


BATCHES = {"sft": sft_batch, "packed": packed_rows, "sft8": sft_batch_of_8}


def build_model(name: str, meta: bool = False, config: dict | None = None) -> CausalLMWithLoss:
    """A tiny preset (its Hugging Face ``config`` keys overridden), the MoE one with lit-ablate's grouped
    experts (what expert parallelism shards) and its router losses (load balancing 0.5, z-loss 0.05, as
    ``tests/test_pipeline_features.py``), or none (``tiny-qwen3-moe-no-aux``)."""
    if not name.startswith("tiny-qwen3-moe"):
        return build(name, meta, config)
    torch.manual_seed(0)
    aux = not name.endswith("no-aux")
    moe = MoEOptions(experts="grouped", load_balance_weight=0.5 if aux else 0.0, z_loss_weight=0.05 if aux else 0.0)
    with torch.device("meta") if meta else nullcontext():
        lm = ModelFactory(preset="tiny-qwen3-moe", moe=moe).build()
    return CausalLMWithLoss(lm, loss_backend("torch"))


def train_reference(
    preset: str, batch_name: str, chunks: int = 1, steps: int = STEPS, config: dict | None = None
) -> dict:
    """One process: ``steps`` SGD steps on the whole batch's objective, then its loss on the batch.

    With ``chunks``, the rows go through in that many consecutive parts, each part's router losses
    weighted by its useful tokens (the step objective's ``(loss_sum + units x aux) / N``): what a
    distributed run computes when each of its data-parallel ranks and micro-batches holds one part
    (a router loss is a function of the tokens routed together, not a sum over them)."""
    model, batch = build_model(preset, config=config), BATCHES[batch_name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        objective = StepObjective()
        for part in range(chunks):
            loss_sum, useful = model(rows_of(batch, part, chunks) if chunks > 1 else batch)
            aux = sum(collect_aux_losses(model).values(), 0.0)
            objective.backward_loss(loss_sum, useful, aux, None).backward()
        objective.normalize_gradients(model.parameters(), None, accumulate_grad_batches=1)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(objective.last_step_loss.item())
    with torch.no_grad():
        loss_sum, useful = model(batch)
    return {
        "losses": losses,
        "eval": (loss_sum / useful).item(),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


@torch.no_grad()
def sgd_on_shards(model: torch.nn.Module) -> None:
    """``torch.optim.SGD``'s step and ``zero_grad`` on each rank's own elements. A gradient must already
    hold its parameter's placements: one left unreduced fails here, where DTensor's own ``add_`` would
    redistribute it silently. Through DTensor, SGD's per-parameter ops each propagated shardings over
    the 3-dimensional mesh (cached only from the second step on): a third of test_mesh_triples.py's
    time (94 s against 60 on 2 cores)."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(param, DTensor):
            assert grad.placements == param.placements, (
                f"a gradient placed {grad.placements}, its parameter {param.placements}"
            )
            param, grad = param.to_local(), grad.to_local()
        param.add_(grad, alpha=-LR)
    model.zero_grad()


def _mesh_pipeline_run(
    rank: int,
    world_size: int,
    preset: str,
    strategy_kwargs: dict,
    batch_name: str = "sft",
    steps: int = STEPS,
    config: dict | None = None,
) -> dict:
    """``steps`` SGD steps as ``CausalLM`` takes them under the strategy (inside its vocabulary-parallel
    loss and context-parallel attention, on the batch as its ``batch_to_device`` hands it over: this
    data-parallel rank's rows, this context-parallel rank's slice of them), then the trained model's
    loss on the whole batch (the cp ranks' sums added); weights returned whole, with the number of
    elements this rank holds."""
    strategy = PipelineParallelStrategy(**strategy_kwargs)
    strategy.build_mesh("cpu", world_size)
    model = strategy.parallelize(build_model(preset, meta=rank != 0, config=config))
    objective = StepObjective()

    def on_device(batch: dict) -> dict:
        return strategy.shard_batch(batch) if strategy.splits_sequences else batch

    whole, replicas = BATCHES[batch_name](), strategy.data_parallel_size
    batch = on_device(whole if replicas == 1 else rows_of(whole, strategy.data_parallel_rank, replicas))
    losses = []
    for _ in range(steps):
        with strategy.vocabulary_parallel_loss(), strategy.context_parallel_attention():
            loss_sum, useful = strategy.forward_backward(model, batch, objective)
        objective.backward_loss(loss_sum, useful, 0.0, strategy)
        model.zero_grad()  # as Lightning zeroes between the step's first training_step and its backward
        strategy.deliver_gradients()
        objective.normalize_gradients(model.parameters(), strategy, accumulate_grad_batches=1)
        sgd_on_shards(model)
        losses.append(objective.last_step_loss.item())
    with torch.no_grad(), strategy.vocabulary_parallel_loss(), strategy.context_parallel_attention():
        sums = torch.stack([value.float() for value in model(on_device(BATCHES[batch_name]()))])
    if strategy.splits_sequences:
        dist.all_reduce(sums, group=strategy.device_mesh.get_group("cp"))
    group, size = strategy.gradient_mean_group
    return {
        "losses": losses,
        "eval": (sums[0] / sums[1]).item(),
        "stage": strategy.stage_index,
        "gradient_mean_ranks": dist.get_process_group_ranks(group) if group is not None else [rank],
        "gradient_mean_size": size,
        "batch_replicas": strategy.batch_replicas,
        "sampler": strategy.distributed_sampler_kwargs,
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()),
        "weights": local_parts(model.state_dict()),
    }


def assert_trains_one_process_model(
    ranks: list[dict], reference: dict, holders: int, split: int, expert_copies: int = 1
) -> None:
    """Every rank's losses and evaluation are one process's; every weight is held by the ``holders``
    ranks of its stage, each equal to one process's; the ranks hold ``split`` copies of the model
    between them (1: every element on one rank; replicated norms and biases add under 1%), routed
    experts ``expert_copies`` times (tensor parallelism keeps them whole on each tp rank). The ranks' weights
    are their local parts (``shards.local_parts``), put together here."""
    ranks = whole_weights(ranks)
    whole = sum(w.numel() for w in reference["weights"].values())
    experts = sum(w.numel() for name, w in reference["weights"].items() if ".mlp.experts." in name)
    expected = split * (whole + (expert_copies - 1) * experts)
    assert sum(result["local_numel"] for result in ranks) == pytest.approx(expected, rel=0.01)
    held: dict[str, int] = {}
    for result in ranks:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
        assert result["eval"] == pytest.approx(reference["eval"], abs=ATOL)
        for name, weight in result["weights"].items():
            if name in reference["weights"]:
                torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=ATOL, msg=name)
                held[name] = held.get(name, 0) + 1
    assert held == dict.fromkeys(reference["weights"], holders), "each weight lives on one stage's ranks"
    assert min(reference["losses"][1:]) < reference["losses"][0] - 0.1, (
        "the model did not train"
    )  # (MoE overshoots at step 3)


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {preset: train_reference(preset, "sft") for preset in ("tiny-llama", "tiny-qwen3")}


def _pp2_x_tp2(rank: int, world_size: int) -> dict:
    return {
        "llama": _mesh_pipeline_run(
            rank, world_size, "tiny-llama", {"pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 2}
        ),
        "qwen3": _mesh_pipeline_run(
            rank,
            world_size,
            "tiny-qwen3",
            {"pp": 2, "tp": 2, "schedule": "gpipe", "microbatches": 2, "split_points": [1]},
        ),
    }


@pytest.mark.slow  # 4 gloo ranks on 2 cores
def test_pp2_x_tp2_equals_one_process(references):
    """pp=2 x tp=2 (4 ranks): each stage's layers, and its embeddings or LM head, split over its tp
    pair, the stages' hand-offs between tp peers, the last stage's loss on vocabulary shards.
    tiny Llama (1f1b, balanced split) and tiny Qwen3 (gpipe, split after layer 0: the q/k norms'
    partial gradients): losses, evaluation and weights within 1e-5 of one process, and each rank
    holds half of its stage (TP's split). Seen failing with the TP step left out of the pipeline
    (losses right, but each rank held its whole stage: 1739008 elements in all instead of 869504)
    and with the TP shards not filled from rank 0 (the meta-built ranks' slices left empty: NaN)."""
    ranks = run_ranks(_pp2_x_tp2, 4, timeout_s=300)
    for run, preset in (("llama", "tiny-llama"), ("qwen3", "tiny-qwen3")):
        assert_trains_one_process_model([rank[run] for rank in ranks], references[preset], holders=2, split=1)
    assert [rank["llama"]["stage"] for rank in ranks] == [0, 0, 1, 1]  # pp outermost: a stage's tp pair adjacent


def _pp2_x_tp2_x_dp_shard2(rank: int, world_size: int) -> dict:
    return _mesh_pipeline_run(
        rank, world_size, "tiny-qwen3", {"pp": 2, "tp": 2, "dp_shard": 2, "schedule": "1f1b", "microbatches": 2}
    )


@pytest.mark.slow  # 8 gloo ranks on 2 cores
def test_pp2_x_tp2_x_dp_shard2_equals_one_process(references):
    """pp=2 x dp_shard=2 x tp=2 (8 ranks, mesh order pp, dp_shard, tp): two FSDP-sharded copies of a
    tensor-parallel pipeline, copy 0 reading rows 0-1 (28 + 4 useful tokens), copy 1 rows 2-3 (20 +
    31), train one process's tiny Qwen3 on all four: each stage's layers split over its tp pair and
    sharded over its dp_shard pair (2-D DTensors, filled from rank 0 shard by shard), the step's tokens
    counted over the dp_shard pair only (a stage's tp peers count the same tokens; other stages are
    never in the group), FSDP's division by it undone once. The sampler gives the tp and pp peers one
    batch; the MFU counts the model once (``batch_replicas`` = pp x tp). Seen failing with the
    stages not FSDP-sharded (the copies' gradients never reduced: third loss off by 0.085), with the
    step's tokens counted without the dp_shard pair (``GRADIENT_MEAN_DIMS`` lacking dp_shard: off by
    0.27) and with ``batch_replicas`` counting tp only (2, not 4: MFU twice too high)."""
    ranks = run_ranks(_pp2_x_tp2_x_dp_shard2, 8, timeout_s=400)
    assert_trains_one_process_model(ranks, references["tiny-qwen3"], holders=4, split=1)
    for rank, result in enumerate(ranks):
        stage, dp, tp = rank // 4, rank // 2 % 2, rank % 2
        assert result["stage"] == stage
        assert result["sampler"] == {"num_replicas": 2, "rank": dp}
        assert result["batch_replicas"] == 4
        assert (result["gradient_mean_ranks"], result["gradient_mean_size"]) == (
            [4 * stage + tp, 4 * stage + 2 + tp],
            2,
        )


def _lightning_pp2_x_tp2(rank: int, world_size: int, root: str) -> dict:
    def strategy() -> PipelineParallelStrategy:
        return PipelineParallelStrategy(pp=2, tp=2, schedule="1f1b", microbatches=2)

    whole = fit(strategy(), 4, Path(root) / "whole", validate=True)
    fit(strategy(), 4, Path(root) / "cut", steps=2)
    resumed = fit(strategy(), 4, Path(root) / "resumed", ckpt_path=str(Path(root) / "cut" / "last.ckpt")).losses
    return {"losses": whole.losses, "val_loss": whole.val_loss, "resumed": resumed}


@pytest.mark.slow  # 4 gloo ranks on 2 cores, three fits
def test_lightning_fit_with_pp2_x_tp2_equals_one_device(tmp_path):
    """Inside Lightning's loop (the strategy's training and validation steps in the vocabulary-parallel
    loss, the sampler giving all four ranks one device's batch): every rank records one device's
    losses and validation loss, and a run saved after 2 steps (each rank its stage's TP shards in the
    DCP folder) and resumed for a third continues as one device resumed the same way. Seen failing
    with the sampler giving tp peers different batches (``tp`` among ``DATA_PARALLEL_DIMS``: off by 0.11)."""
    assert_ranks_fit_and_resume_as_one_device(tmp_path, _lightning_pp2_x_tp2, 4)


def _lightning_pp2_x_cp2(rank: int, world_size: int, root: str) -> dict:
    seen = fit(PipelineParallelStrategy(pp=2, cp=2, schedule="1f1b", microbatches=2), 4, Path(root), validate=True)
    return {"losses": seen.losses, "sums": seen.sums, "val_loss": seen.val_loss}


@pytest.mark.slow  # 4 gloo ranks on 2 cores
def test_lightning_fit_with_pp2_x_cp2_equals_one_device(tmp_path):
    """Inside Lightning's loop the strategy's ``batch_to_device`` gives each of a stage's cp ranks its
    zigzag slice of one device's batch (with explicit positions, which every stage receives), and its
    training and validation steps attend with ring attention: each step's loss over the cp pair (their
    loss sums over their useful tokens) and the validation loss are one device's. Seen failing with
    the sampler giving cp peers different rows (``cp`` among ``DATA_PARALLEL_DIMS``: off by 0.13)."""
    reference = fit("auto", 1, tmp_path / "one", validate=True)
    ranks = run_ranks(_lightning_pp2_x_cp2, 4, str(tmp_path / "pp_cp"), init_process_group=False, timeout_s=400)
    for stage in (0, 1):  # pp outermost: a stage's cp pair is adjacent
        pair = torch.tensor([ranks[2 * stage]["sums"], ranks[2 * stage + 1]["sums"]], dtype=torch.float64).sum(0)
        torch.testing.assert_close((pair[:, 0] / pair[:, 1]).float(), torch.tensor(reference.losses), rtol=0, atol=ATOL)
    for run in ranks:
        assert run["val_loss"] == pytest.approx(reference.val_loss, abs=ATOL)


# ---------------------------------------------------------------- refused before any rank starts
QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.yaml"


def _fit_refusal(*options: str) -> str:
    """The one-line refusal ``lit-ablate fit`` prints for the quickstart on 2 devices with ``options``:
    ``check_run``, which ``LitAblateCLI`` runs before it instantiates any class."""
    from lit_ablate.fit_cli import resolve_fit_config
    from lit_ablate.rules import check_run

    with pytest.raises(ConfigError) as refusal:
        check_run(resolve_fit_config(["--config", str(QUICKSTART), "--trainer.devices", "2", *options]))
    message = str(refusal.value)
    assert "\n" not in message, message
    return message


def test_pp_on_mesh_parallel_strategy_names_the_pipeline_strategy():
    """``MeshParallelStrategy`` has no pipeline step: ``pp: 2`` there is refused in one line naming
    ``PipelineParallelStrategy``, which takes every dimension with the stages."""
    with pytest.raises(
        ConfigError,
        match=r"init_args.pp=2: MeshParallelStrategy does not implement apply_pp.*"
        r"lit_ablate.strategies.PipelineParallelStrategy",
    ):
        MeshParallelStrategy(pp=2, tp=2)


def _pp2_x_cp2(rank: int, world_size: int) -> dict:
    return _mesh_pipeline_run(
        rank, world_size, "tiny-llama", {"pp": 2, "cp": 2, "schedule": "1f1b", "microbatches": 2}, "packed"
    )


@pytest.mark.slow  # 4 gloo ranks on 2 cores
def test_pp2_x_cp2_on_packed_documents_equals_one_process():
    """pp=2 x cp=2 (4 ranks) on packed rows: each stage's ranks hold zigzag halves of every row (their
    useful tokens differ: the masked prompts and the documents fall unevenly), attend over the whole
    row by ring attention with the documents kept apart by their positions, which every stage receives
    per micro-batch; each stage is sharded over its cp pair, whose gradients are summed (FSDP's mean
    undone by the step objective, which counts the tokens over the pair). Losses, evaluation and
    weights within 1e-5 of one process. Seen failing with the CP step left out of the pipeline (each
    stage attending within its slice: off by 0.23) and with the tokens counted per cp rank (cp not in
    ``GRADIENT_MEAN_DIMS``: off by 0.19)."""
    reference = train_reference("tiny-llama", "packed")
    ranks = run_ranks(_pp2_x_cp2, 4, timeout_s=300)
    assert_trains_one_process_model(ranks, reference, holders=2, split=1)
    for rank, result in enumerate(ranks):
        assert result["sampler"] == {"num_replicas": 1, "rank": 0}  # cp peers read one batch
        assert (result["gradient_mean_ranks"], result["gradient_mean_size"]) == ([rank // 2 * 2, rank // 2 * 2 + 1], 2)


def _pp2_x_ep2(rank: int, world_size: int) -> dict:
    return _mesh_pipeline_run(
        rank, world_size, "tiny-qwen3-moe", {"pp": 2, "ep": 2, "schedule": "1f1b", "microbatches": 2}
    )


@pytest.mark.slow  # 4 gloo ranks on 2 cores
def test_pp2_x_ep2_on_moe_with_router_losses_equals_one_process():
    """pp=2 x ep=2 (4 ranks) on tiny Qwen3-MoE (8 grouped experts, load-balancing and z-loss): each
    stage's ep pair holds 4 of every layer's experts and reads its own rows (pair rank 0: rows 0-1,
    28 + 4 useful tokens; 1: rows 2-3, 20 + 31), tokens travelling to their experts' rank and back in
    every micro-batch of the schedule; each stage backpropagates its own layers' router losses, and
    the experts' gradients are divided like the dense ones. One process sees the same objective when
    it takes the rows one at a time (each rank's micro-batch is one row), each row's router losses
    weighted by its useful tokens (``train_reference``). Losses, evaluation and weights within 1e-5.
    Seen failing with the EP step left out of the pipeline (every rank all experts: 2643328 elements
    held in all instead of 1463680; its losses were off by 6e-5) and with the stages' router losses
    not backpropagated (``StageModule.add_aux_gradient`` returning its input: off by 8e-3)."""
    reference = train_reference("tiny-qwen3-moe", "sft", chunks=4)
    ranks = run_ranks(_pp2_x_ep2, 4, timeout_s=300)
    assert_trains_one_process_model(ranks, reference, holders=2, split=1)
    for rank, result in enumerate(ranks):
        assert result["sampler"] == {"num_replicas": 2, "rank": rank % 2}  # ep ranks read their own rows


TRIPLES = {  # name: (model, batch, one-process row chunks, strategy options): every pp triple not tested above
    "pp_dp_replicate_tp": ("tiny-llama", 1, {"dp_replicate": 2, "tp": 2, "schedule": "1f1b", "microbatches": 2}),
    "pp_dp_replicate_cp": ("tiny-llama", 1, {"dp_replicate": 2, "cp": 2, "schedule": "1f1b", "microbatches": 2}),
    "pp_dp_replicate_ep": ("tiny-qwen3-moe", 4, {"dp_replicate": 2, "ep": 2, "schedule": "gpipe", "microbatches": 1}),
    "pp_dp_shard_cp": ("tiny-llama", 1, {"dp_shard": 2, "cp": 2, "schedule": "1f1b", "microbatches": 2}),
    "pp_dp_shard_ep": ("tiny-qwen3-moe", 4, {"dp_shard": 2, "ep": 2, "schedule": "gpipe", "microbatches": 1}),
    "pp_tp_cp": ("tiny-llama", 1, {"tp": 2, "cp": 2, "schedule": "1f1b", "microbatches": 2}),
    "pp_tp_ep": ("tiny-qwen3-moe", 4, {"tp": 2, "ep": 2, "schedule": "1f1b", "microbatches": 2}),
    "pp_cp_ep": ("tiny-qwen3-moe-no-aux", 1, {"cp": 2, "ep": 2, "schedule": "1f1b", "microbatches": 2}),
}
"""Each on 8 ranks (pp=2 x the two others at 2). The MoE runs take each rank's micro-batch as one
row (the one-process reference runs the rows one at a time, each row's router losses weighted by its
tokens); under cp x ep a rank's router losses are those of its slice of the row, which the
reference cannot split the same way, so that run has none."""


def _pp_triples(rank: int, world_size: int) -> dict:
    return {
        name: _mesh_pipeline_run(rank, world_size, model, {"pp": 2, **options}, steps=2)
        for name, (model, _, options) in TRIPLES.items()
    }


@pytest.mark.slow  # 8 gloo ranks on 2 cores, eight runs
def test_every_pp_triple_equals_one_process():
    """pp=2 with every pair of dp_replicate, dp_shard, tp, cp and ep at 2 not tested above (pp x dp_replicate
    x dp_shard: tests/test_pipeline_fsdp.py; pp x dp_shard x tp: above), 8 gloo ranks each, on the SFT
    rows with unequal useful tokens: losses, evaluation, weights within 1e-5 of one process and each
    rank's share of the model. Seen failing with the replicas of TP-split stages averaged by hand
    besides FSDP (``average_over_replicas`` keyed on dp_shard alone: 'mixed torch.Tensor and DTensor'
    on the last stage's ranks), and, before its fix, on a real bug: dp_replicate x ep, where torch
    divides the experts' gradients twice when their FSDP shard dimension holds one rank (HSDP's
    (dp_replicate, 1)) and sums are forced (losses off by 4.8e-4, expert weights by 5.8e-3)."""
    references = {
        (model, chunks): train_reference(model, "sft", chunks, steps=2) for model, chunks, _ in TRIPLES.values()
    }
    ranks = run_ranks(_pp_triples, 8, timeout_s=600)
    for name, (model, chunks, options) in TRIPLES.items():  # dp_replicate's copies each hold the model
        assert_trains_one_process_model(
            [rank[name] for rank in ranks],
            references[model, chunks],
            holders=4,
            split=options.get("dp_replicate", 1),
            expert_copies=options.get("tp", 1),
        )


def test_pipeline_sizes_that_miss_the_world_size_are_refused_before_any_rank_starts():
    """``pp`` is a mesh dimension like the others: sizes that do not make the world size are one line
    from ``check_mesh`` before the ranks start, devices given on the command line (a string there)
    included. Seen failing while ``check_mesh`` skipped the pipeline strategy, and while it skipped
    devices given as ``--trainer.devices 2`` (no refusal: each rank raised in ``build_mesh``)."""
    message = _fit_refusal(
        "--trainer.strategy.class_path",
        "lit_ablate.strategies.PipelineParallelStrategy",
        "--trainer.strategy.init_args.pp",
        "2",
        "--trainer.strategy.init_args.tp",
        "2",
    )
    assert "multiply to 4 but the world size (devices x nodes) is 2" in message


def test_state_sharding_divides_each_stage_over_its_fsdp_and_tp_ranks():
    """What the memory estimate reads: a stage's state over ``dp_shard x ep x cp x tp`` as the mesh
    strategy divides a whole model's, the layers kept gathered (divided by tp only) unless
    ``reshard_after_forward``; replicas of whole stages (``dp_replicate`` alone) hold it all. Seen
    failing with the pipeline's former rule (sharded only with ``dp_shard``: pp2 x tp2 estimated
    unsplit)."""
    from lit_ablate.strategies.state_sharding import REPLICATED, StateSharding

    # tp keeps routed experts whole: they are divided by the FSDP ranks only (expert_shards)
    assert PipelineParallelStrategy(pp=2, tp=2).state_sharding(4) == StateSharding(
        2, 2, 2, gathered=2, fsdp_units=True, expert_shards=1
    )
    assert PipelineParallelStrategy(pp=2, tp=2, dp_shard=2).state_sharding(8) == StateSharding(
        4, 4, 4, gathered=2, fsdp_units=True, expert_shards=2
    )
    assert PipelineParallelStrategy(pp=2, cp=2, dp_shard=2, reshard_after_forward=True).state_sharding(
        8
    ) == StateSharding(4, 4, 4, gathered=None, fsdp_units=True)
    assert PipelineParallelStrategy(pp=2, dp_replicate=2).state_sharding(4) == REPLICATED

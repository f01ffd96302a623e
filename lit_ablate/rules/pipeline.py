"""What a pipeline's stages can train: the model split over ``pp`` ranks, its stages, schedule and
micro-batches, and the objectives its schedule runs. The pipeline strategy refused these once its ranks ran."""

from __future__ import annotations

from lit_ablate.errors import Refusal
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY
from lit_ablate.rules.batch_rows import COLLATOR_KEY, static_rows_refusal
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import RunConfig


@rule(Scope.CONFIG, skips_variant=True)
def pipeline_stages_split_the_model(run: RunConfig) -> Refusal | None:
    """A pipeline splits the model over ranks: its first and last stage (the embeddings, the LM head) are on
    rank 0 and rank ``pp - 1`` (interleaved stages loop from one to the other), and a tied matrix is held as
    two copies whose gradients are summed (``pipeline_tied_embeddings``). With ``pp`` 1 one rank would hold
    the first and the last stage, which torch's schedules do not run: refused, for the mesh strategy that
    runs a whole model on each rank."""
    from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
    from lit_ablate.strategies.pipeline_split import ONE_STAGE_FIX

    if not run.trainer.strategy.is_a(PipelineParallelStrategy) or run.mesh_sizes is None:
        return None  # sizes that do not make the world size: mesh_lays_out's refusal
    pp = run.mesh_sizes.pp
    return Refusal(f"{STRATEGY_OPTIONS_KEY}.pp", pp, ONE_STAGE_FIX) if pp == 1 else None


@rule(Scope.CONFIG, skips_variant=True)
def pipeline_stages_train_the_objective(run: RunConfig) -> Refusal | None:
    """Pipeline stages train DPO with a ``precomputed`` or no reference, padded pairs and ``torch`` or
    ``chunked`` log-probs: a ``frozen`` reference is a second model the stages do not hold, an ``adapter``
    reference runs the policy twice per step (not built under the schedule), Liger's fused DPO reads the
    whole batch's hidden states at once, and packed pairs cannot be cut into micro-batches of whole pairs."""
    from lit_ablate.modules.dpo import DPO

    if run.mesh_size("pp") == 1 or not run.model.module.is_a(DPO):
        return None
    reference = run.model.option("reference")
    if reference in ("frozen", "adapter"):
        return Refusal(
            "model.init_args.reference",
            reference,
            "pipeline stages run one model once per micro-batch; "
            "use reference: precomputed (its log-probs computed once through the stages) or none, or pp: 1",
            shown=reference,
        )
    if run.model.option("logprobs") == "liger":
        return Refusal(
            "model.init_args.logprobs",
            "liger",
            "Liger's fused DPO loss reads the whole batch's hidden "
            "states at once, which the last stage never holds; use logprobs: chunked or torch, or pp: 1",
            shown="liger",
        )
    if run.data.packs_preference_pairs:
        return Refusal(
            COLLATOR_KEY,
            run.data.collator.section,
            "packed pairs cannot be cut into "
            "micro-batches of whole pairs; use PreferencePaddingCollator with static_length: true, or pp: 1",
            shown=run.data.collator.name,
        )
    return None


@rule(Scope.CONFIG, skips_variant=True)
def pipeline_stages_fit(run: RunConfig) -> Refusal | None:
    """A model type the stages are built for, no more stages (``pp`` x ``stages_per_rank``) than decoder
    layers, split points that split the layers into them, a schedule's micro-batch count (1f1b fills ``pp``
    stages; interleaved runs rounds of ``pp``), a batch the micro-batches divide, and batches of one length
    (torch's stages size their hand-off buffers by the first)."""
    from lit_ablate.strategies.pipeline_parallel import SUPPORTED_MODEL_TYPES, PipelineParallelStrategy
    from lit_ablate.strategies.pipeline_split import check_split_points

    strategy = run.trainer.strategy
    pp = run.mesh_size("pp")
    if pp == 1 or not strategy.is_a(PipelineParallelStrategy):
        return None
    config = run.model.hf_config
    if config is not None and config.model_type not in SUPPORTED_MODEL_TYPES:
        return Refusal(
            "model.init_args.model",
            config.model_type,
            f"pipeline stages are built for {', '.join(SUPPORTED_MODEL_TYPES)} models; use one of them, or pp: 1",
            shown=config.model_type,
        )
    per_rank, layers = strategy.option("stages_per_rank"), getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < pp * per_rank:
        key, value = ("pp", pp) if per_rank == 1 else ("stages_per_rank", per_rank)
        return Refusal(
            f"{STRATEGY_OPTIONS_KEY}.{key}",
            value,
            f"{pp * per_rank} stages of a model with {layers} decoder "
            f"layers; use at most {layers} stages (pp x stages_per_rank)",
        )
    points = strategy.option("split_points")
    if points is not None and isinstance(layers, int):
        refusal = refusal_of(check_split_points, list(points), layers, pp * per_rank)
        if refusal:
            return refusal
    microbatches, schedule = strategy.option("microbatches"), strategy.option("schedule")
    if schedule == "1f1b" and microbatches < pp:
        return Refusal(
            f"{STRATEGY_OPTIONS_KEY}.microbatches",
            microbatches,
            f"1f1b needs at least pp={pp} micro-batches to fill the pipeline; raise it or use gpipe",
        )
    if schedule == "interleaved_1f1b" and microbatches % max(1, microbatches // pp):
        return Refusal(
            f"{STRATEGY_OPTIONS_KEY}.microbatches",
            microbatches,
            f"interleaved_1f1b runs rounds of pp={pp} micro-batches: use a multiple of {pp}, or fewer than {pp}",
        )
    batch_size = run.data.batch_size
    if isinstance(batch_size, int) and batch_size % microbatches:
        return Refusal(
            f"{STRATEGY_OPTIONS_KEY}.microbatches",
            microbatches,
            f"data.init_args.batch_size is {batch_size}; use a divisor of the batch size",
        )
    if run.data.format not in (None, "pretrain"):
        return static_rows_refusal(run)
    return None

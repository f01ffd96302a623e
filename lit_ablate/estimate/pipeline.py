"""Pipeline parallelism in the estimate: layers and parameters per stage, the pieces a rank holds, the time share."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PretrainedConfig

from lit_ablate.estimate.flops import ParameterCounts, attention_shape, flops_per_token
from lit_ablate.estimate.shapes import ModelShape, TrainingShape

if TYPE_CHECKING:
    from lit_ablate.strategies.state_sharding import StateSharding

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
LOSS_LOGIT_COPIES_KEPT = {"torch": 1.0}
"""fp32 ``[tokens, vocab]`` tensors a loss keeps from a micro-batch's forward to its backward (torch:
the log-softmax; the other backends keep chunks' gradients, ``loss_gradient_bytes``, or nothing)."""


def pipeline_stage_layers(counts: ParameterCounts, shape: ModelShape, training: TrainingShape) -> list[int]:
    """Decoder layers per pipeline stage, split as ``PipelineParallelStrategy`` splits them: at its
    ``split_points``, or balanced by parameter count (embeddings on the first stage, LM head on the last)."""
    from lit_ablate.strategies.pipeline_split import balanced_split_points, check_split_points

    stages = training.pipeline_parallel * training.pipeline_stages_per_rank
    points = (
        list(training.split_points)
        if training.split_points is not None
        else balanced_split_points(
            [shape.layer_params] * shape.layers, stages, counts.embedding, shape.vocab * shape.hidden
        )
    )
    check_split_points(points, shape.layers, stages)
    bounds = [0, *points, shape.layers]
    return [end - start for start, end in itertools.pairwise(bounds)]


def pipeline_stage_parameters(counts: ParameterCounts, shape: ModelShape, training: TrainingShape) -> list[int]:
    """Parameters each stage holds: its layers, plus the embeddings (first) or final norm and LM head (last).
    A tied matrix is held twice when the first and last stage are on different ranks (``pp > 1``): the
    embedding's copy and the LM head's (``pipeline_tied_embeddings``), so its gradients and optimizer
    states are counted twice too."""
    layers = pipeline_stage_layers(counts, shape, training)
    root = counts.total - shape.layers * shape.layer_params
    head_copy = shape.vocab * shape.hidden if shape.tied_embeddings and training.pipeline_parallel > 1 else 0
    return [
        n * shape.layer_params
        + (counts.embedding if i == 0 else 0)
        + (root - counts.embedding + head_copy if i == len(layers) - 1 else 0)
        for i, n in enumerate(layers)
    ]


@dataclass(frozen=True)
class StageState:
    """Parameter elements of one stage on one of its ranks, as the mesh strategy divides them.

    ``stored``: what the rank keeps between steps (its parameters, and so its gradients and optimizer
    states): the dense parameters over ``tp x dp_shard x ep x cp`` (``sharding.params``) except those
    tensor parallelism leaves replicated (the norms; a MoE block's router, since the plan keeps MoE
    blocks whole), which only FSDP divides; routed experts over ``ep x expert_shards``.
    ``gathered``: what an FSDP-sharded stage holds gathered through the step (divided by ``tp``; its
    own ``1 / ep`` of the experts).
    """

    stored: float
    gathered: float


def pipeline_stage_states(
    counts: ParameterCounts, shape: ModelShape, training: TrainingShape, sharding: StateSharding
) -> list[StageState]:
    """``StageState`` of each stage under ``sharding`` (``training.tensor_parallel`` its tp)."""
    tp = training.tensor_parallel
    fsdp = sharding.params / tp  # dp_shard x ep x cp: the FSDP mesh of each stage
    layers = pipeline_stage_layers(counts, shape, training)
    layer_experts = counts.experts / shape.layers
    head_dim = shape.q_dim // shape.heads
    layer_replicated = 2 * shape.hidden + (2 * head_dim if shape.qk_norm else 0)  # the two RMSNorms, q/k norms
    if tp > 1 and shape.experts:
        layer_replicated += shape.hidden * shape.experts  # the router
    experts_divisor = (
        sharding.expert_parallel * sharding.expert_shards if sharding.expert_shards is not None else sharding.params
    )
    states = []
    for i, (n, total) in enumerate(zip(layers, pipeline_stage_parameters(counts, shape, training), strict=True)):
        experts = n * layer_experts
        replicated = n * layer_replicated + (shape.hidden if i == len(layers) - 1 else 0)  # + the final norm
        split = total - experts - replicated
        states.append(
            StageState(
                stored=split / sharding.params + replicated / fsdp + experts / experts_divisor,
                gathered=split / tp + replicated + experts / sharding.expert_parallel,
            )
        )
    return states


def pipeline_pieces_held(rank: int, training: TrainingShape) -> list[int]:
    """The stage of each piece ``rank`` holds at its peak (forward run, backward not yet), the last
    one the piece at its backward.

    gpipe: all ``m`` pieces; 1f1b: ``min(m, pp - rank)`` (torch's warm-up of ``pp - rank - 1``
    forwards, then one forward before each backward). interleaved_1f1b (torch's
    ``ScheduleInterleaved1F1B``): a warm-up of ``W = (v - 1) p + 2 (pp - 1 - rank)`` forwards
    (``p`` micro-batches per round, at most ``m v``) walking the rank's stages ``p`` pieces at a
    time, then one more forward before the first backward, which is the rank's last stage's.
    """
    pp, v, m = training.pipeline_parallel, training.pipeline_stages_per_rank, training.microbatches
    own = [rank + i * pp for i in range(v)]
    if training.pipeline_schedule == "gpipe":
        return [rank] * m
    if training.pipeline_schedule == "1f1b":
        return [rank] * min(m, pp - rank)
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    forwards = [own[(k // per_round) % v] for k in range(min(warmup + 1, m * v))]
    forwards.remove(own[-1])  # the piece at its backward: the first one of the last stage
    return [*forwards, own[-1]]


def pipeline_time_share(
    counts: ParameterCounts, shape: ModelShape, training: TrainingShape, seq_len: float, config: PretrainedConfig
) -> float:
    """A pipeline step's time in units of the whole model's FLOPs on one rank: the busiest rank's share
    of the model FLOPs (its stages' matmuls and attention, the LM head on the last stage), stretched by
    the schedule's ideal idle share, ``(v m + pp - 1) / (v m)`` (``v`` stages per rank: 1 for gpipe and
    1f1b). 1 without a pipeline."""
    if training.pipeline_parallel == 1:
        return 1.0
    layers = pipeline_stage_layers(counts, shape, training)
    attention = 12.0 * attention_shape(config)[1] * attention_shape(config)[2] * seq_len  # per token and layer
    whole = flops_per_token(counts, config, seq_len)
    matmul = whole - shape.layers * attention
    root_matmul = counts.matmul - shape.layers * shape.layer_params  # the LM head and final norm
    stages = [
        (n * shape.layer_params + (root_matmul if i == len(layers) - 1 else 0)) / counts.matmul * matmul + n * attention
        for i, n in enumerate(layers)
    ]
    m, pp, v = training.microbatches, training.pipeline_parallel, training.pipeline_stages_per_rank
    busiest = max(sum(stages[rank::pp]) for rank in range(pp))
    return busiest / whole * (v * m + pp - 1) / (v * m)

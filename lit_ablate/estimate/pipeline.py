"""Pipeline parallelism in the estimate: layers and parameters per stage, the pieces a rank holds, the time share."""

from __future__ import annotations

from transformers import PretrainedConfig

from lit_ablate.estimate.flops import ParameterCounts, attention_shape, flops_per_token
from lit_ablate.estimate.shapes import ModelShape, TrainingShape

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
LOSS_LOGIT_COPIES_KEPT = {"torch": 1.0}
"""fp32 ``[tokens, vocab]`` tensors a loss keeps from a micro-batch's forward to its backward (torch:
the log-softmax; the other backends keep chunks' gradients, ``loss_gradient_bytes``, or nothing)."""


def pipeline_stage_layers(counts: ParameterCounts, shape: ModelShape, training: TrainingShape) -> list[int]:
    """Decoder layers per pipeline stage, split as ``PipelineParallelStrategy`` splits them: at its
    ``split_points``, or balanced by parameter count (embeddings on the first stage, LM head on the last)."""
    from lit_ablate.strategies.pipeline_split import balanced_split_points, check_split_points

    stages = training.pipeline_parallel * training.pipeline_stages_per_rank
    points = list(training.split_points) if training.split_points is not None else balanced_split_points(
        [shape.layer_params] * shape.layers, stages, counts.embedding, shape.vocab * shape.hidden)  # fmt: skip
    check_split_points(points, shape.layers, stages)
    bounds = [0, *points, shape.layers]
    return [end - start for start, end in zip(bounds, bounds[1:], strict=False)]


def pipeline_stage_parameters(counts: ParameterCounts, shape: ModelShape, training: TrainingShape) -> list[int]:
    """Parameters each stage holds: its layers, plus the embeddings (first) or final norm and LM head (last)."""
    layers = pipeline_stage_layers(counts, shape, training)
    root = counts.total - shape.layers * shape.layer_params
    return [n * shape.layer_params + (counts.embedding if i == 0 else 0)
            + (root - counts.embedding if i == len(layers) - 1 else 0) for i, n in enumerate(layers)]  # fmt: skip




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


def pipeline_time_share(counts: ParameterCounts, shape: ModelShape, training: TrainingShape, seq_len: float,
                        config: PretrainedConfig) -> float:  # fmt: skip
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
    stages = [(n * shape.layer_params + (root_matmul if i == len(layers) - 1 else 0)) / counts.matmul * matmul
              + n * attention for i, n in enumerate(layers)]  # fmt: skip
    m, pp, v = training.microbatches, training.pipeline_parallel, training.pipeline_stages_per_rank
    busiest = max(sum(stages[rank::pp]) for rank in range(pp))
    return busiest / whole * (v * m + pp - 1) / (v * m)



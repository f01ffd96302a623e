"""Where the decoder layers split into pipeline stages (checked split points, or balanced by parameter
count), and the split itself: a rank keeps its stages of a built model."""

from __future__ import annotations

import functools
import itertools

from torch import nn

from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss, decoder_layers
from lit_ablate.strategies.pipeline_stages import PassThrough, StageModule

ONE_STAGE_FIX = (
    "a pipeline needs 2 or more stages, on as many ranks (with one, a rank would hold the first and the "
    "last stage, which torch's schedules do not run); raise pp and the devices to match, or use "
    "trainer.strategy lit_ablate.strategies.FSDP2Strategy"
)
"""Why ``pp`` 1 is refused, and what to do (``keep_stages``, and before any rank starts the rule
``pipeline_stages_split_the_model``)."""


def keep_stages(
    model: CausalLMWithLoss, pp: int, stage_index: int, stages_per_rank: int, split_points: list[int] | None
) -> tuple[list[int], dict[int, StageModule]]:
    """Keep rank ``stage_index``'s stages of ``model``: other stages' layers become pass-throughs (indices
    and names stay), the embeddings stay on the first stage and the final norm and LM head on the last.
    Returns the decoder-layer indices kept and one ``StageModule`` per stage held.

    With ``stages_per_rank = v`` there are ``pp x v`` stages, looped over the ranks: rank ``r`` holds
    stages ``r, r + pp, r + 2 pp, ...``, so the first stage (embeddings) is on rank 0 and the last
    (norm, LM head, loss) on rank ``pp - 1``, as without interleaving."""
    if pp == 1:
        raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.pp", pp, ONE_STAGE_FIX)
    layers = decoder_layers(model)
    stages = pp * stages_per_rank
    points = (
        split_points
        if split_points is not None
        else balanced_split_points(
            [_numel(layer) for layer in layers],
            stages,
            _numel(model.lm.get_input_embeddings()),
            _numel(model.lm.get_output_embeddings()),
        )
    )
    check_split_points(points, len(layers), stages)
    bounds = [0, *points, len(layers)]
    own = range(stage_index, stages, pp)
    stage_layers = {s: list(range(bounds[s], bounds[s + 1])) for s in own}
    kept = [index for s in own for index in stage_layers[s]]
    decoder = model.lm.base_model
    for index in range(len(layers)):
        if index not in kept:
            decoder.layers[index] = PassThrough()
    if stage_index != 0:
        decoder.embed_tokens = None
    if stage_index != pp - 1:
        decoder.norm = nn.Identity()
        model.lm.lm_head = None
    modules = {
        s: StageModule(
            model, first=s == 0, last=s == stages - 1, layers=None if stages_per_rank == 1 else stage_layers[s]
        )
        for s in own
    }
    return kept, modules


def holds(lm: nn.Module, name: str) -> bool:
    """Whether the stage holds submodule ``name`` of ``lm`` (``keep_stages`` sets the ends it drops to
    None, or the final norm to an identity)."""
    module = lm
    for part in name.split("."):
        module = getattr(module, part, None)
    return isinstance(module, nn.Module) and not isinstance(module, nn.Identity)


def _numel(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def check_split_points(points: list[int], num_layers: int, stages: int) -> None:
    """``stages - 1`` strictly increasing layer indices in ``1 .. num_layers - 1``."""
    inside = all(0 < p < num_layers for p in points)
    if len(points) != stages - 1 or not inside or any(b <= a for a, b in itertools.pairwise(points)):
        raise ConfigError(
            f"{STRATEGY_OPTIONS_KEY}.split_points",
            points,
            f"give {stages - 1} increasing decoder-layer indices between 1 and {num_layers - 1} "
            "(where stages 2.. start), or null to balance by parameter count",
        )


def balanced_split_points(layer_sizes: list[int], stages: int, head: int, tail: int) -> list[int]:
    """Split points minimising the largest stage's parameter count (``head`` on the first stage,
    ``tail`` on the last), each stage at least one layer."""
    n = len(layer_sizes)
    prefix = list(itertools.accumulate(layer_sizes, initial=0))

    def size(start: int, end: int) -> int:
        return prefix[end] - prefix[start] + (head if start == 0 else 0) + (tail if end == n else 0)

    @functools.cache
    def best(start: int, k: int) -> tuple[int, tuple[int, ...]]:
        if k == 1:
            return size(start, n), ()
        return min(
            (max(size(start, end), best(end, k - 1)[0]), (end, *best(end, k - 1)[1]))
            for end in range(start + 1, n - k + 2)
        )

    return list(best(0, stages)[1])

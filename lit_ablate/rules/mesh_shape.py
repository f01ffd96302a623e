"""The mesh against the run's ranks and the model's shape: sizes that make the world size, and the heads,
vocabulary, experts and attention each split dimension divides. The ranks found these out after their
start-up (104 s of it in a study's run); the strategies keep their checks as a backstop."""

from __future__ import annotations

from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY
from lit_ablate.models.moe.blocks import MOE_KEY
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import RunConfig


@rule(Scope.CONFIG)
def mesh_lays_out(run: RunConfig) -> Refusal | None:
    """A mesh strategy's sizes are sizes (positive, at most one ``-1``) that make the world size (devices x
    nodes, or a simulated job's), unless Lightning counts the devices itself (``auto``). The strategy itself
    can only check once every rank runs."""

    def lay_out() -> None:
        sizes = run.trainer.strategy.requested_mesh_sizes
        if sizes is not None and (run.simulation is not None or run.trainer.devices_per_node is not None):
            sizes.resolved(run.world_size)

    return refusal_of(lay_out)


@rule(Scope.CONFIG, skips_variant=True)
def experts_split_over_ep(run: RunConfig) -> Refusal | None:
    """Expert parallelism shards lit-ablate's MoE blocks (``moe.experts: grouped`` or ``loop``), each rank
    holding ``experts / ep`` of them: ``ep`` must divide the experts of a layer."""
    ep = run.mesh_size("ep")
    if ep == 1:
        return None
    try:
        factory = run.model.build_factory()
    except (ConfigError, TypeError):  # a model section the run itself refuses
        return None
    experts = factory.moe.experts if factory.moe is not None else "hf"
    if experts == "hf":
        return Refusal(
            f"{MOE_KEY}.experts",
            experts,
            "expert parallelism shards lit-ablate's MoE blocks; use an MoE "
            "model with moe: {experts: grouped} (or loop)",
        )
    config = run.model.hf_config
    count = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if count and count % ep:
        return Refusal(
            f"{STRATEGY_OPTIONS_KEY}.ep", ep, f"the model has {count} experts per layer; use an ep that divides {count}"
        )
    return None


@rule(Scope.CONFIG, skips_variant=True)
def tensor_parallel_splits_the_model(run: RunConfig) -> Refusal | None:
    """Tensor parallelism splits the heads, the key/value heads, the vocabulary and the dense MLP's width over
    ``tp`` ranks: ``tp`` must divide each (``tensor_parallel_shape_refusal``, what the strategy checks once
    the model is built)."""
    from lit_ablate.strategies.tensor_parallel import tensor_parallel_shape_refusal

    tp = run.mesh_size("tp")
    return None if tp == 1 or run.model.hf_config is None else tensor_parallel_shape_refusal(run.model.hf_config, tp)


@rule(Scope.CONFIG, skips_variant=True)
def context_parallel_attends(run: RunConfig) -> Refusal | None:
    """Context-parallel attention (ring, all-gather) has no dropout and no sliding window, and shards
    language-model batches, whose loss is a sum over tokens: DPO's per-sequence log-probs would sum each
    rank's part of a sequence. The first forward (or batch) refused them once the ranks ran."""
    from lit_ablate.modules.dpo import DPO

    cp = run.mesh_size("cp")
    if cp == 1:
        return None
    if run.model.module.is_a(DPO):
        return Refusal(
            f"{STRATEGY_OPTIONS_KEY}.cp",
            cp,
            "context parallelism shards language-model batches; DPO's "
            "per-sequence log-probs would sum each rank's part of a sequence: use cp: 1 for DPO",
        )
    config = run.model.hf_config
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        return Refusal(
            "model.init_args.model.config.attention_dropout",
            dropout,
            "context-parallel attention has no dropout; set attention_dropout: 0",
        )
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    windowed = window and not layer_types and getattr(config, "use_sliding_window", True)
    if "sliding_attention" in layer_types or windowed:
        return Refusal(
            "model.init_args.model.config.sliding_window",
            window,
            "context-parallel attention has no sliding window; use a model without one, or cp: 1",
        )
    return None

"""How a strategy divides training state over ranks: what the memory estimate needs per strategy.

Each lit-ablate strategy answers ``state_sharding(world_size)`` itself (it knows its own
layout); ``lightning_state_sharding`` answers for Lightning's built-in strategies by name or
instance, so ``lit-ablate estimate`` can state per-rank bytes for any configured strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning.pytorch.strategies import Strategy


@dataclass(frozen=True)
class StateSharding:
    """Divisors of each kind of training state, per rank, at the peak of a step.

    Per-rank bytes = full bytes / divisor. ``params`` counts the stored parameters (DeepSpeed's
    ZeRO-2 keeps full replicas: divisor 1; FSDP's no-reshard mode stores shards and keeps a gathered
    copy, ``gathered``). Activations are not here: data parallelism does not divide a
    micro-batch's activations.
    """

    params: int = 1
    grads: int = 1
    optimizer: int = 1
    gathered: int | None = None
    """Parameters kept gathered from each layer's forward to its backward (FSDP's ZeRO-2-like
    mode): the divisor of that gathered copy (1, or the tensor-parallel size), which exists beside
    the stored shards and is a transient at the step's peak (the tensor tracker sees it so). None:
    gathered layer by layer and freed after use."""
    fsdp_units: bool = False
    """FSDP2 wraps each layer and the root, even over one rank: it gathers each into a new buffer and
    copies its gradients into a reduce-scatter buffer whatever ``params`` divides by (a 1-rank FSDP2
    run measured a 2.7 MiB transient that a replicated one has not)."""
    expert_parallel: int = 1
    """Ranks the routed experts are split over (``ep``): each holds and computes only its experts."""
    master_copy: bool = False
    """An fp32 copy of the trained parameters kept with the optimizer states and divided like them
    (DeepSpeed's ZeRO keeps one whatever the training precision)."""
    optimizer_on_host: bool = False
    """The optimizer states (and the master copy) live in host memory: none on a GPU (DeepSpeed's optimizer
    offload; ranks that compute on the host keep them, ``TrainingShape.on_host``)."""
    gradient_bucket_elements: int = 0
    """Elements of gradient buffers the strategy allocates whole whatever the model, in the gradients'
    dtype (DeepSpeed's reduce bucket: ``reduce_bucket_size``)."""
    half_weights: bool = False
    """Under a mixed half precision (``bf16-mixed``, ``16-mixed``) the module's weights and gradients are
    stored in the half dtype, the fp32 copy being the master copy: DeepSpeed casts the module when its
    ``bf16`` or ``fp16`` is enabled, where other strategies keep fp32 weights and autocast."""
    expert_shards: int | None = None
    """The ranks FSDP shards each rank's routed experts over (``dp_shard x cp``) when that differs
    from the dense parameters' division: under tensor parallelism (which keeps experts whole) and
    under expert parallelism, where a layer also gathers only its own experts' shards (nothing at
    all for them when this is 1). The experts' state is divided by ``expert_parallel x
    expert_shards``. None: the experts are divided and gathered like the dense parameters."""


REPLICATED = StateSharding()


def deepspeed_sharding(stage: int, world_size: int) -> StateSharding:
    """ZeRO stage 1: optimizer states; 2: + gradients; 3: + parameters."""
    return StateSharding(
        params=world_size if stage >= 3 else 1,
        grads=world_size if stage >= 2 else 1,
        optimizer=world_size if stage >= 1 else 1,
    )


def fsdp1_sharding(sharding_strategy: str, world_size: int) -> StateSharding:
    """FSDP1's ``FULL_SHARD`` is ZeRO-3, ``NO_SHARD`` DDP; ``SHARD_GRAD_OP`` stores shards like
    ZeRO-3 but keeps each unit's gathered parameters from forward to backward."""
    if sharding_strategy == "SHARD_GRAD_OP":
        return StateSharding(params=world_size, grads=world_size, optimizer=world_size, gathered=1)
    return deepspeed_sharding({"FULL_SHARD": 3, "NO_SHARD": 0}[sharding_strategy], world_size)


def lightning_state_sharding(strategy: Strategy | str, world_size: int) -> StateSharding:
    """The sharding of one of Lightning's own strategies, or of its name (``ddp``, ``deepspeed_stage_2``)."""
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    if name.startswith("deepspeed_stage_"):
        return deepspeed_sharding(int(name.split("_")[2]), world_size)
    if name == "DeepSpeedStrategy":
        return deepspeed_sharding(int(strategy.config.get("zero_optimization", {}).get("stage", 0)), world_size)
    if name == "FSDPStrategy":
        return fsdp1_sharding(strategy.sharding_strategy.name, world_size)
    if name in ("fsdp", "ModelParallelStrategy"):
        return deepspeed_sharding(3, world_size)
    return REPLICATED  # auto, single device, ddp and its variants: every rank holds everything

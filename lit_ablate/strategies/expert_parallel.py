"""The EP steps of the mesh strategy: experts sharded over the mesh's ``ep`` ranks (``ExpertParallelSteps``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lit_ablate.errors import ConfigError
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.moe.blocks import MOE_KEY, MoEBlock, moe_blocks
from lit_ablate.models.moe.dispatch import DISPATCH_MODES
from lit_ablate.strategies.fsdp2 import FullyShardSteps
from lit_ablate.strategies.mesh import STRATEGY_OPTIONS_KEY
from lit_ablate.strategies.state_sharding import StateSharding

DispatchMode = Literal["all_to_all", "all_reduce"]


class ExpertParallelSteps(FullyShardSteps):
    """Expert parallelism (torchtitan's): each ``ep`` rank holds ``num_experts / ep`` experts.

    Tokens travel to the ranks holding their experts and back (``dispatch: all_to_all``), or, as
    the naive baseline, every EP rank gathers all tokens, computes its own experts and an
    all-reduce sums the results (``dispatch: all_reduce``). Choose it when the experts' weights
    dominate memory (each rank stores and updates only its experts) or to ablate the two schemes.
    EP ranks read different batches, like data-parallel ranks. Expert weights are additionally
    FSDP-sharded over ``dp_replicate x dp_shard x cp``; everything else is FSDP2-sharded over all
    ranks as with ``FSDP2Strategy``, so ``ep`` composes with ``dp_shard`` (world = ``dp_shard x ep``).
    The experts' FSDP is a step of its own (``apply_expert_fsdp``), so a subclass that replaces
    ``apply_fsdp`` keeps it.
    Expert gradients are divided by the full data-parallel size, like every other gradient, so
    the run trains the same model as without EP. Needs MoE blocks patched by lit-ablate
    (``moe.experts: grouped`` or ``loop``).

    The step of ``MeshParallelStrategy`` that runs when ``ep > 1`` (``ExpertParallelStrategy`` is its
    preset); ``ep`` must divide the number of experts.

    Args:
        dispatch: ``all_to_all`` (real EP) or ``all_reduce`` (every rank sees every token).
        **kwargs: the mesh sizes and the other steps' options (``MeshParallelStrategy``).
    """

    def __init__(self, dispatch: DispatchMode = "all_to_all", **kwargs: Any) -> None:
        if dispatch not in DISPATCH_MODES:
            raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.dispatch", dispatch, f"choose one of {sorted(DISPATCH_MODES)}")
        super().__init__(**kwargs)
        self.dispatch = dispatch

    def state_sharding(self, world_size: int) -> StateSharding:
        """FSDP2's division of the training state (the experts over ``ep x dp_shard x cp`` ranks hold
        the same share as the dense parameters over those ranks), but a layer gathers only this
        rank's experts, over ``dp_shard x cp``."""
        sizes = self.requested_mesh_sizes.resolved(world_size)
        if sizes.ep == 1:
            return super().state_sharding(world_size)
        return replace(
            super().state_sharding(world_size), expert_parallel=sizes.ep, expert_shards=sizes.dp_shard * sizes.cp
        )

    def build_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        ep = self.requested_mesh_sizes.ep
        if ep > world_size:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.ep",
                ep,
                f"ep cannot exceed the world size ({world_size} ranks = "
                f"devices x nodes); use ep <= {world_size}, or -1 for all ranks",
            )
        return super().build_mesh(device_type, world_size)

    def apply_ep(self, model: CausalLMWithLoss) -> None:
        """Keep this rank's slice of every expert weight (a DTensor on the ``ep`` mesh) and install the dispatcher."""
        blocks = self._moe_blocks(model)
        mesh = self.device_mesh["ep"]
        num_experts = blocks[0].gate.num_experts
        dispatcher = DISPATCH_MODES[self.dispatch](mesh.get_group(), num_experts)
        first, last = dispatcher.first_local, dispatcher.first_local + dispatcher.num_local
        for block in blocks:
            for owner, name in block.experts.expert_dim_parameters():  # the weights and their expert LoRA
                full = getattr(owner, name)
                local = DTensor.from_local(full.detach()[first:last].clone(), mesh, [Shard(0)], run_check=False)
                setattr(owner, name, nn.Parameter(local, requires_grad=full.requires_grad))
            block.dispatcher = dispatcher

    def apply_expert_fsdp(self, model: CausalLMWithLoss) -> None:
        """Each MoE block's experts an FSDP unit over the ranks holding the same experts (``expert_fsdp_mesh``),
        before ``apply_fsdp`` shards the layers and the root as FSDP2 does."""
        from torch.distributed.fsdp import fully_shard

        kwargs = {**self.fsdp_kwargs(), "mesh": self.expert_fsdp_mesh()}
        data_parallel = float(self.fsdp_mesh.size())
        for block in moe_blocks(model):
            experts = fully_shard(block.experts, **kwargs)
            # Each expert's gradient already sums the ep ranks' tokens (the all-to-all backward); FSDP
            # sums it over the ranks sharing the expert (plain sums: gloo has no pre-multiplied sum),
            # and one division by every data-parallel rank after the reductions makes it the same mean
            # as a dense gradient. Not through FSDP's divide factor: where the shard dimension holds
            # one rank (ep = world, HSDP's (dp_replicate, 1)) torch 2.13 divides its copy by the factor
            # and again after forced sums, or always for a reduce dtype other than float32/bfloat16
            # (float64 at ep 2 on 2 ranks: every expert gradient came out halved).
            experts.set_gradient_divide_factor(1.0)
            experts.set_force_sum_reduction_for_comms(True)
            experts.set_all_reduce_hook(lambda reduced: reduced.div_(data_parallel))

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The ranks holding the same experts: ``dp_shard x cp`` (flattened), with ``dp_replicate`` for HSDP."""
        mesh = self.device_mesh
        dims = tuple(d for d in ("dp_shard", "cp") if self.mesh_sizes[d] > 1) or ("dp_shard",)
        shard = mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten("_".join(dims))
        if self.mesh_sizes.dp_replicate == 1:
            return shard
        return DeviceMesh._concatenate([mesh["dp_replicate"], shard])

    def _moe_blocks(self, model: CausalLMWithLoss) -> list[MoEBlock]:
        blocks = moe_blocks(model)
        if not blocks:
            raise ConfigError(
                f"{MOE_KEY}.experts",
                "hf or unset",
                "ExpertParallelStrategy shards lit-ablate MoE blocks: use an MoE model with "
                "moe.experts: grouped (or loop)",
            )
        num_experts, ep = blocks[0].gate.num_experts, self.mesh_sizes.ep
        if num_experts % ep:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.ep",
                ep,
                f"the model has {num_experts} experts per layer; use an ep that divides {num_experts}",
            )
        return blocks

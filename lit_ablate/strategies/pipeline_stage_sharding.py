"""The FSDP step of a pipeline: each stage's module sharded on its own (``StageSharding``)."""

from __future__ import annotations

from torch import nn

from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.strategies.fsdp2 import FullyShardSteps, shard_layers_then_root


class StageSharding(FullyShardSteps):
    """``apply_fsdp`` for a model split into pipeline stages: each of this rank's stage modules is an
    FSDP2 root over ``fsdp_mesh`` (``dp_shard x ep x cp``, with ``dp_replicate`` for HSDP), after its
    own decoder layers: the unit torch's ``PipelineStage`` recognises, and one root per interleaved
    stage. The stage module's ``head_loss``, which the schedule calls outside the forward, gathers
    the LM head like a forward.

    The stage's experts are FSDP units already (``apply_expert_fsdp``, the step before this one, as
    without a pipeline).
    """

    def stage_modules(self) -> dict[int, nn.Module]:
        """This rank's stage modules by stage index (``PipelineParallelStrategy.apply_pp`` builds them)."""
        raise NotImplementedError(f"{type(self).__name__} must say which stage modules it holds")

    def apply_fsdp(self, model: CausalLMWithLoss) -> None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        layer_types = model.decoder_layer_types
        for module in self.stage_modules().values():
            layers = [part for part in module.parts if isinstance(part, layer_types)]
            shard_layers_then_root(layers, module, self.fsdp_kwargs())
            register_fsdp_forward_method(module, "head_loss")

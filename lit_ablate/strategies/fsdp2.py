"""The FSDP step of the mesh strategy: per-parameter sharding with torch's ``fully_shard`` (``FullyShardSteps``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import MESH_DIMS
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.fp8.conversion import precompute_fp8_scales
from lit_ablate.strategies.gpu_only import check_gpu_only_options
from lit_ablate.strategies.mesh import FSDP_SHARD_DIMS, STRATEGY_OPTIONS_KEY, MeshStrategy, decoder_layers
from lit_ablate.strategies.options import keyword_options, options_type
from lit_ablate.strategies.state_sharding import StateSharding

DTypeName = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FullyShardSteps(MeshStrategy):
    """The FSDP step (FSDP2, ``fully_shard``): each decoder layer, then the root, over ``fsdp_mesh``.

    Not selected on its own: ``MeshParallelStrategy`` and its presets (``FSDP2Strategy``, ...) stand on
    it. ``reshard_after_forward: true`` is ZeRO-3; ``false`` is ZeRO-2-like (parameters stay gathered
    from forward to backward, one all-gather per layer fewer, more memory). With ``dp_replicate > 1``
    it is HSDP.

    Args:
        reshard_after_forward: free gathered parameters after each layer's forward (ZeRO-3) or
            keep them until its backward (ZeRO-2-like).
        param_dtype: compute dtype of gathered parameters (``MixedPrecisionPolicy``); ``null`` = as stored.
        reduce_dtype: dtype of the gradient reduce-scatter; ``null`` = ``param_dtype``.
        cpu_offload: keep shards, gradients and optimizer states in host memory (GPU only: on
            CPU there is nothing to offload from, and it is refused).
        **kwargs: the mesh sizes and the other ``MeshStrategy`` options.
    """

    def __init__(
        self,
        reshard_after_forward: bool = True,
        param_dtype: DTypeName | None = None,
        reduce_dtype: DTypeName | None = None,
        cpu_offload: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for key, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in DTYPES:
                raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.{key}", value, f"choose one of {sorted(DTYPES)} or null")
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.cpu_offload = cpu_offload

    def setup_environment(self) -> None:
        check_gpu_only_options({"cpu_offload": self.cpu_offload}, self.root_device.type)
        super().setup_environment()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The step, then fp8 all-gather's weight scales for the next step (one all-reduce for all
        fp8 layers; nothing without ``model.fp8.fsdp_all_gather``)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        precompute_fp8_scales(self.lightning_module)
        return output

    def state_sharding(self, world_size: int) -> StateSharding:
        """Dense state divided over the shard ranks (x tp); without resharding after forward each
        layer's gathered parameters (divided by tp only) stay from its forward to its backward."""
        sizes = self.requested_mesh_sizes.resolved(world_size)
        shard = math.prod(sizes[d] for d in FSDP_SHARD_DIMS) * sizes["tp"]
        gathered = None if self.reshard_after_forward else sizes["tp"]
        return StateSharding(params=shard, grads=shard, optimizer=shard, gathered=gathered, fsdp_units=True)

    def fsdp_kwargs(self) -> dict:
        """The ``fully_shard`` arguments every unit gets (mesh, resharding, precision, offload)."""
        return fsdp_arguments(
            self.fsdp_mesh, self.reshard_after_forward, self.param_dtype, self.reduce_dtype, self.cpu_offload
        )

    def apply_fsdp(self, model: CausalLMWithLoss) -> None:
        """Each decoder layer, then the root (``shard_layers_then_root``). ``logits`` (evaluation) is
        registered as a forward too, so it gathers the root's parameters like ``forward``."""
        from torch.distributed.fsdp import register_fsdp_forward_method

        shard_layers_then_root(decoder_layers(model), model, self.fsdp_kwargs())
        register_fsdp_forward_method(model, "logits")


def fsdp_arguments(
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    param_dtype: DTypeName | None = None,
    reduce_dtype: DTypeName | None = None,
    cpu_offload: bool = False,
) -> dict:
    """``fully_shard``'s keyword arguments from lit-ablate's options (shared with the pipeline's stages)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[param_dtype] if param_dtype else None,
        reduce_dtype=DTYPES[reduce_dtype] if reduce_dtype else None,
    )
    return {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy,
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }


def shard_layers_then_root(layers: Iterable[nn.Module], root: nn.Module, kwargs: dict) -> None:
    """One FSDP unit per decoder layer (its all-gather overlaps the previous layer's compute), then
    ``root`` for the parameters left (embeddings, final norm, LM head): the order FSDP2 needs, since a
    unit takes every parameter below it that no inner unit holds."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)


FSDPOptions = options_type(
    "FSDPOptions", keyword_options(FullyShardSteps), keyword_options(MeshStrategy, leave_out=MESH_DIMS)
)
"""The options every mesh strategy takes beside its mesh sizes: FSDP2's and the mesh's."""

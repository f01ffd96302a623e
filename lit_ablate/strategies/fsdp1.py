"""``FSDP1Strategy``: the FlatParameter FSDP baseline, on CPU as well as GPU.

Lightning's ``FSDPStrategy`` refuses ``accelerator: cpu`` and passes ``device_id=None`` on CPU,
which FSDP1 cannot use; this subclass passes the device itself and wraps each decoder layer
(from the model's ``_no_split_modules``), so the FSDP1-vs-FSDP2 comparison runs anywhere.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Literal

from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.optim import Optimizer

from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.strategies.gpu_only import check_gpu_only_options
from lit_ablate.strategies.interface import StrategyInterface, flat_parameter_gradients_in_full
from lit_ablate.strategies.mesh import decoder_layers
from lit_ablate.strategies.state_sharding import StateSharding, fsdp1_sharding

ShardingStrategyName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


class FSDP1Strategy(FSDPStrategy, StrategyInterface):
    """PyTorch's first FSDP (one flattened parameter per wrapped unit): each decoder layer, then the root.

    Choose it as the baseline that FSDP2 replaced, or to reproduce results made with it.
    ``FULL_SHARD`` is ZeRO-3, ``SHARD_GRAD_OP`` ZeRO-2 (parameters stay gathered from forward
    to backward), ``NO_SHARD`` DDP. (For hybrid sharding use ``HSDPStrategy``.) Every rank builds
    the full model from the seed before wrapping (FSDP1's ``sync_module_states`` needs a GPU), so
    all ranks start from the same weights as one process.

    Args:
        sharding_strategy: see above.
        limit_all_gathers: rate-limit prefetching all-gathers (bounds memory; FSDP1's default).
        cpu_offload: keep parameters and gradients in host memory (GPU only; refused on CPU).
        state_dict_type: ``sharded`` writes a DCP folder, each rank its shards; ``full`` gathers
            one file on rank 0.
        process_group_backend: ``gloo``/``nccl``; by default the device's.
        timeout_s: collective timeout.
    """

    def __init__(
        self,
        sharding_strategy: ShardingStrategyName = "FULL_SHARD",
        limit_all_gathers: bool = True,
        cpu_offload: bool = False,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        super().__init__(
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            state_dict_type=state_dict_type,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
            limit_all_gathers=limit_all_gathers,
        )

    def setup_environment(self) -> None:
        check_gpu_only_options({"cpu_offload": self.cpu_offload.offload_params}, self.root_device.type)
        super().setup_environment()

    def state_sharding(self, world_size: int) -> StateSharding:
        return fsdp1_sharding(self.sharding_strategy.name, world_size)

    def gradients_in_full(self) -> AbstractContextManager:
        return flat_parameter_gradients_in_full(self.model)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Wrap with FSDP1: one unit per decoder layer, the rest in the root, on this rank's device."""
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layer_types = {
            type(layer) for m in model.modules() if isinstance(m, CausalLMWithLoss) for layer in decoder_layers(m)
        }
        wrapped = FullyShardedDataParallel(
            module=model,
            auto_wrap_policy=ModuleWrapPolicy(layer_types),
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            # Original parameters (views into the flat shards) keep names and per-parameter
            # optimizer groups: no weight decay on norms/biases/embeddings, as under FSDP2.
            **{"use_orig_params": True, **self.kwargs},
        )
        self.precision_plugin = RootClippingFSDPPrecision(self.precision_plugin, wrapped)
        return wrapped


class RootClippingFSDPPrecision(FSDPPrecision):
    """Lightning's FSDP precision, plus ``gradient_clip_val`` by norm, which it refuses.

    Clipping sharded gradients needs the norm over every rank's shards: FSDP1's root module
    computes it (``clip_grad_norm_``), and the plugin gets a reference to that root here.
    """

    def __init__(self, plugin: FSDPPrecision, root: nn.Module) -> None:
        super().__init__(plugin.precision, scaler=plugin.scaler)
        self.root = root

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self.root.clip_grad_norm_(clip_val)

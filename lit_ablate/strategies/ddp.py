"""``DDPStrategy``: Lightning's DDP with its tuning knobs and gradient-compression hooks typed for YAML.

Lightning's own ``DDPStrategy`` takes these as untyped ``**kwargs`` (so a config cannot be
checked) and registers communication hooks only on CUDA; this subclass names each knob and
registers hooks on any backend that supports them (fp16 and PowerSGD run on gloo too).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

from lit_ablate.errors import ConfigError
from lit_ablate.strategies.gpu_only import check_gpu_only_options
from lit_ablate.strategies.interface import StrategyInterface
from lit_ablate.strategies.mesh import STRATEGY_OPTIONS_KEY
from lit_ablate.strategies.state_sharding import REPLICATED, StateSharding

CommHook = Literal["none", "fp16", "bf16", "powersgd"]


class DDPStrategy(LightningDDPStrategy, StrategyInterface):
    """Data parallelism with full replicas: gradients all-reduced in buckets, overlapped with backward.

    The baseline of data-parallel studies. Choose the knobs to reproduce "overlap-DDP" tuning
    (bucket size, gradient views, static graph) or gradient compression (fp16/bf16 casts halve
    the all-reduce bytes; PowerSGD sends low-rank factors, an approximation with error feedback).

    Args:
        bucket_cap_mb: gradient bucket size; larger = fewer, bigger all-reduces, later first overlap.
        gradient_as_bucket_view: gradients are views into the buckets (saves one gradient copy).
        static_graph: the set of used parameters never changes; lets DDP skip per-step checks.
        find_unused_parameters: search for parameters without gradients each step (slower; only
            for models that skip parameters).
        comm_hook: gradient compression: ``none``, ``fp16``, ``bf16`` (NCCL only) or ``powersgd``.
        powersgd_rank: PowerSGD's matrix-approximation rank (higher = more exact, more bytes).
        powersgd_start_iter: plain all-reduce for this many steps before compressing (PowerSGD's
            warm-up; it must be at least 2).
        process_group_backend: ``gloo``/``nccl``; by default the device's.
        timeout_s: collective timeout.
    """

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        comm_hook: CommHook = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        if comm_hook not in ("none", "fp16", "bf16", "powersgd"):
            raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.comm_hook", comm_hook, "choose none, fp16, bf16 or powersgd")
        if comm_hook == "powersgd" and powersgd_start_iter < 2:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.powersgd_start_iter",
                powersgd_start_iter,
                "PowerSGD with error feedback needs at least 2 plain all-reduce steps first",
            )
        if powersgd_rank < 1:
            raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.powersgd_rank", powersgd_rank, "use 1 or more")
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        self.comm_hook = comm_hook
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter

    def setup_environment(self) -> None:
        check_gpu_only_options({"comm_hook": self.comm_hook}, self.root_device.type)
        super().setup_environment()

    def state_sharding(self, world_size: int) -> StateSharding:
        return REPLICATED

    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.comm_hook != "none":
            self.model.register_comm_hook(*self._comm_hook_and_state())

    def _comm_hook_and_state(self) -> tuple[Any, Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.comm_hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            return state, powerSGD_hook.powerSGD_hook
        hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        return None, hooks[self.comm_hook]

"""Strategy options that need a GPU, in one place: checked by the strategies at set-up and,
from a config alone, by the rule ``strategy_options_run_here`` before anything launches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_ablate.errors import ConfigError
from lit_ablate.strategies.mesh import STRATEGY_OPTIONS_KEY


def check_gpu_only_options(options: Mapping[str, Any], device_type: str) -> None:
    """Raise ``ConfigError`` when ``options`` (a strategy's ``init_args``) need a GPU but the run is on
    ``device_type``."""
    if device_type == "cuda":
        return
    if options.get("cpu_offload"):
        raise ConfigError(
            f"{STRATEGY_OPTIONS_KEY}.cpu_offload",
            True,
            "CPU offload moves shards from a GPU to host memory; with accelerator: cpu everything already is in host "
            "memory. Set cpu_offload: false, or train on GPUs",
        )
    if options.get("quantized_gradients"):
        raise ConfigError(
            f"{STRATEGY_OPTIONS_KEY}.quantized_gradients",
            True,
            "ZeRO++'s quantised gradients need DeepSpeed's CUDA quantizer (GPUs); on CPU reduce gradients in "
            "half precision with communication_data_type: fp16",
        )
    if options.get("comm_hook") == "bf16":
        raise ConfigError(
            f"{STRATEGY_OPTIONS_KEY}.comm_hook",
            "bf16",
            "torch's bf16 compression hook needs NCCL (GPUs); on CPU use fp16 or powersgd",
        )

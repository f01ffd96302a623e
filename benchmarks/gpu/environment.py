"""What the GPU lane runs on: versions, the GPU, and which optional kernels exist there.

    python benchmarks/gpu/environment.py

Ends with ``RESULT name=value`` lines (values may hold spaces: a GPU's name).
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from importlib import metadata

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "lightning",
    "peft",
    "torchmetrics",
    "jsonargparse",
    "liger-kernel",
    "cut-cross-entropy",
    "torchao",
    "bitsandbytes",
    "submitit",
    "datasets",
    "flash-attn",
)


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


def main() -> None:
    import torch

    results: dict[str, object] = {"python": platform.python_version()}
    results.update({name.replace("-", "_"): package_version(name) for name in PACKAGES})
    results["torch_cuda"] = torch.version.cuda
    results["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    results["gpu_count"] = torch.cuda.device_count()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        results["gpu"] = props.name
        results["gpu_capability"] = f"{props.major}.{props.minor}"
        results["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        results["gpu"] = "none (CPU)"
    # the packed-attention kernels the issue names: torch's own varlen attention appeared after 2.8
    results["torch_varlen_attention"] = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    results["flash_attn_importable"] = importlib.util.find_spec("flash_attn") is not None
    for name, value in results.items():
        print(f"RESULT {name}={value}")


if __name__ == "__main__":
    sys.exit(main())

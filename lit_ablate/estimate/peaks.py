"""Spec-sheet peak TFLOP/s per device: the denominator of ``mfu`` (``MFUMonitor``, ``lit-ablate peak``)."""

from __future__ import annotations

PEAK_DTYPE = "bfloat16"
"""The dtype of the table's peaks."""
# Dense bf16 peak TFLOP/s (no 2:4 sparsity), matched against torch.cuda.get_device_name() in
# order: the first key contained in the lower-cased name wins, so specific names come first.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "h100 nvl": 835.0,
    "h100 pcie": 756.0,
    "h100": 989.0,  # SXM, and the default for an unqualified H100
    "h200 nvl": 835.0,
    "h200": 989.0,  # torch reports a plain "NVIDIA H200" for the SXM part
    "gb200": 2500.0,
    "b200": 2250.0,
    "a100": 312.0,
    "mi300x": 1307.0,
    "mi325x": 1307.0,
    "mi355x": 2500.0,
}
PEAK_FP8_TFLOPS: dict[str, float] = {key: 2 * peak for key, peak in PEAK_BF16_TFLOPS.items() if key != "a100"}
"""Dense fp8 peaks: twice bf16's on every listed part with fp8 tensor cores (Hopper, Blackwell, MI300
series: their spec sheets); the A100 has none."""


def peak_tflops_of(device_name: str, table: dict[str, float] = PEAK_BF16_TFLOPS) -> float | None:
    """The table's peak (bf16 by default) for a device name, or None when the device is not in it."""
    name = device_name.lower()
    return next((peak for key, peak in table.items() if key in name), None)

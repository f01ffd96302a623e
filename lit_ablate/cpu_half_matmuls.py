"""bf16 matmuls on a CPU without bf16 matrix kernels: correct, and orders of magnitude slower.

oneDNN's bf16 matrix kernels need AVX-512 (or AMX); on an AVX2-only CPU (AMD EPYC Zen 3, many cloud
VMs) torch computes a bf16 matmul with its reference GEMM loop. Measured once on such a VM (another job
on its second core): 52 s for a 128 x 4096 x 12288 product that took 0.3 s in fp32. The results are
right, but a bf16 study whose steps take seconds on a Xeon takes minutes per step there, so it is said
before the work: in a study's plan and when ``lit-ablate fit`` starts.
"""

from __future__ import annotations


def has_bf16_matmul_kernels() -> bool:
    """Whether this CPU has oneDNN's bf16 matrix kernels (AVX-512 or AMX)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def slow_bf16_matmuls(compute_dtype: str | None, device_type: str) -> str | None:
    """Why a run computing in ``compute_dtype`` on ``device_type`` will be slow, or None."""
    if device_type != "cpu" or compute_dtype != "bfloat16" or has_bf16_matmul_kernels():
        return None
    return (
        "this CPU has no bf16 matrix kernels (oneDNN needs AVX-512 or AMX): bf16 matmuls run torch's reference "
        "GEMM, orders of magnitude slower than fp32 (docs/platform.md); a CPU with AVX-512, or fp32, runs them at speed"
    )

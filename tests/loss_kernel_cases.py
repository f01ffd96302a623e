"""The parity cases of ``tests/test_loss_kernels.py``: the ``liger`` and ``cce`` backends vs ``torch``.

One function computes every case's relative errors on a device; the CPU test runs this file as a
fresh process with ``LIT_ABLATE_TRITON_INTERPRET=1`` (the switch must precede triton's import, and
the pytest process has long imported it compiled), the CUDA test calls it in-process. Kept tiny:
under the interpreter every Triton program runs in Python.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# isort: off
import lit_ablate  # noqa: F401  (first: under the opt-in it sets TRITON_INTERPRET before triton loads)
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
# isort: on

from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX, TorchCrossEntropy, check_loss_backend, loss_backend

GRAD_SCALE = 0.37  # a backward seed other than 1
CASES: dict[str, dict[str, Any]] = {
    # liger in fp32 (Triton's interpreter computes fp32 like the GPU, minus TF32).
    "liger_odd_shape_ignored_sum": {"backend": "liger", "tokens": 37, "vocab": 101, "dtype": "float32"},
    "liger_bias_mean": {
        "backend": "liger",
        "tokens": 29,
        "vocab": 67,
        "dtype": "float32",
        "bias": True,
        "reduction": "mean",
    },
    "liger_z_loss_bias": {
        "backend": "liger",
        "tokens": 37,
        "vocab": 101,
        "dtype": "float32",
        "bias": True,
        "options": {"z_loss_weight": 1e-2},
    },
    "liger_all_ignored": {"backend": "liger", "tokens": 11, "vocab": 31, "dtype": "float32", "ignored": 1.0},
    # liger's chunking (37 tokens, vocabulary 101, hidden 24: Liger's own chunk is 8 tokens): chunks of
    # 16 (two full, one of 5), 32 with the weight gradient summed in fp32, and 64 (one chunk of 37).
    "liger_chunk_tokens_16": {
        "backend": "liger",
        "tokens": 37,
        "vocab": 101,
        "dtype": "float32",
        "bias": True,
        "options": {"chunk_tokens": 16},
    },
    "liger_chunk_tokens_32_accum_fp32": {
        "backend": "liger",
        "tokens": 37,
        "vocab": 101,
        "dtype": "float32",
        "options": {"chunk_tokens": 32, "accum_dtype": "float32"},
    },
    "liger_chunk_tokens_64": {
        "backend": "liger",
        "tokens": 37,
        "vocab": 101,
        "dtype": "float32",
        "options": {"chunk_tokens": 64, "z_loss_weight": 1e-2},
    },
    # cce in fp16: its backward takes only fp16/bf16 hidden states, bf16 is wrong under the interpreter.
    "cce_odd_shape_ignored_sum": {
        "backend": "cce",
        "tokens": 37,
        "vocab": 101,
        "dtype": "float16",
        "options": {"filter_eps": None},
    },
    "cce_mean": {
        "backend": "cce",
        "tokens": 29,
        "vocab": 67,
        "dtype": "float16",
        "reduction": "mean",
        "options": {"filter_eps": None},
    },
    "cce_default_filter_eps": {"backend": "cce", "tokens": 37, "vocab": 101, "dtype": "float16"},
    # bf16, the GPU training dtype: compiled only (wrong without an error under the interpreter).
    "liger_bf16_cuda": {"backend": "liger", "tokens": 300, "vocab": 1000, "dtype": "bfloat16", "devices": ["cuda"]},
    "liger_bf16_chunk_tokens_128_accum_fp32_cuda": {
        "backend": "liger",
        "tokens": 300,
        "vocab": 1000,
        "dtype": "bfloat16",
        "devices": ["cuda"],
        "options": {"chunk_tokens": 128, "accum_dtype": "float32"},
    },
    "cce_bf16_cuda": {"backend": "cce", "tokens": 300, "vocab": 1000, "dtype": "bfloat16", "devices": ["cuda"]},
}


def make_inputs(case: dict[str, Any], device: str, seed: int = 0) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    tokens, vocab, dtype = case["tokens"], case["vocab"], getattr(torch, case["dtype"])
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[torch.rand(tokens, generator=generator) < case.get("ignored", 0.25)] = IGNORE_INDEX
    hidden = torch.randn(tokens, 24, generator=generator)
    weight = torch.randn(vocab, 24, generator=generator) * 0.5
    bias = torch.randn(vocab, generator=generator) if case.get("bias") else None
    return {
        "hidden": hidden.to(device, dtype),
        "weight": weight.to(device, dtype),
        "labels": labels.to(device),
        "bias": None if bias is None else bias.to(device, dtype),
    }


def loss_and_grads(loss_fn, inputs: dict, reduction: str, upcast: bool) -> list[torch.Tensor | None]:
    """``[loss, d hidden, d weight, (d bias)]`` of the summed loss, or of its mean over counted labels
    (None for an input the loss did not use).

    ``upcast``: the reference runs on fp32 copies of the (fp16) inputs, so it is exact for them.
    """
    leaves = {k: None if v is None or k == "labels" else v.detach().clone() for k, v in inputs.items()}
    leaves = {k: v.float() if upcast and v is not None else v for k, v in leaves.items()}
    wrt = [leaves[k].requires_grad_() for k in ("hidden", "weight", "bias") if leaves[k] is not None]
    loss = loss_fn(leaves["hidden"], leaves["weight"], inputs["labels"], leaves["bias"])
    if reduction == "mean":
        loss = loss / (inputs["labels"] != IGNORE_INDEX).sum().clamp(min=1)
    return [loss.detach(), *torch.autograd.grad(loss * GRAD_SCALE, wrt, allow_unused=True)]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs difference over max abs reference value (the absolute difference for a zero reference)."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    scale = expected.abs().max().item() or 1.0
    return (actual - expected).abs().max().item() / scale


def parity_errors(device: str) -> dict[str, dict[str, float]]:
    """Per case, the relative error of the loss and of each gradient against ``torch``."""
    results = {}
    for name, case in CASES.items():
        if device not in case.get("devices", ["cpu", "cuda"]):
            continue
        inputs = make_inputs(case, device)
        reduction = case.get("reduction", "sum")
        options = case.get("options", {})
        z_loss = options.get("z_loss_weight", 0.0)
        expected = loss_and_grads(TorchCrossEntropy(z_loss_weight=z_loss), inputs, reduction, upcast=True)
        actual = loss_and_grads(loss_backend(case["backend"], **options), inputs, reduction, upcast=False)
        labels = ["loss", "d_hidden", "d_weight", "d_bias"]
        results[name] = {label: relative_error(a, e) for label, a, e in zip(labels, actual, expected) if a is not None}
        results[name]["grad_dtypes_match_inputs"] = float(
            all(g.dtype == inputs["hidden"].dtype for g in actual[1:] if g is not None)
        )
        results[name]["loss_abs"] = abs(expected[0].item())
    return results


CHUNK_CASE = "liger_odd_shape_ignored_sum"
"""The inputs ``liger_chunks`` runs on: 37 tokens, vocabulary 101, hidden 24."""


def liger_chunks(device: str) -> dict[str, dict[str, Any]]:
    """Per liger option set: the rows of each chunk Liger's cross-entropy kernel was launched on, and
    the ``chunk_mem_const``/``accum_dtype`` that reached Liger's forward (spied on in its module)."""
    import liger_kernel.ops.fused_linear_cross_entropy as fused

    real_kernel, real_forward = fused.liger_cross_entropy_kernel, fused.fused_linear_cross_entropy_forward
    seen: dict[str, Any] = {}

    class RecordingKernel:
        def __getitem__(self, grid: tuple[int, ...]):
            seen["rows"].append(grid[0])
            return real_kernel[grid]

    def recording_forward(*args: Any, **kwargs: Any):
        seen.update(accum_dtype=str(kwargs.get("accum_dtype")), chunk_mem_const=kwargs.get("chunk_mem_const"))
        return real_forward(*args, **kwargs)

    settings = {
        "own": {},
        "16": {"chunk_tokens": 16},
        "32_fp32": {"chunk_tokens": 32, "accum_dtype": "float32"},
        "64": {"chunk_tokens": 64},
    }
    results = {}
    fused.liger_cross_entropy_kernel, fused.fused_linear_cross_entropy_forward = RecordingKernel(), recording_forward
    try:
        for name, options in settings.items():
            seen = {"rows": []}
            loss_and_grads(
                loss_backend("liger", **options), make_inputs(CASES[CHUNK_CASE], device), "sum", upcast=False
            )
            results[name] = seen
    finally:
        fused.liger_cross_entropy_kernel, fused.fused_linear_cross_entropy_forward = real_kernel, real_forward
    return results


def refusals() -> dict[str, str]:
    """The one-line ConfigError each refused combination gives (empty string: not refused)."""
    attempts = {
        "liger_bf16_check": lambda: check_loss_backend("liger", compute_dtype="bfloat16"),
        "liger_bf16_call": lambda: loss_backend("liger")(*_bf16_call_args()),
        "cce_bf16_check": lambda: check_loss_backend("cce", compute_dtype="bfloat16"),
        "cce_float32_check": lambda: check_loss_backend("cce", compute_dtype="float32"),
        "cce_float32_call": lambda: loss_backend("cce")(*_float32_call_args()),
        "cce_bias": lambda: loss_backend("cce")(*_float32_call_args(torch.float16), torch.zeros(5).half()),
        "liger_float32_check": lambda: check_loss_backend("liger", compute_dtype="float32"),
        "cce_float16_check": lambda: check_loss_backend("cce", compute_dtype="float16"),
        "liger_chunk_below_its_own": lambda: loss_backend("liger", chunk_tokens=4)(
            *(make_inputs(CASES[CHUNK_CASE], "cpu")[k] for k in ("hidden", "weight", "labels"))
        ),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = ""
        except ConfigError as err:
            messages[name] = str(err)
    return messages


def _bf16_call_args() -> tuple[torch.Tensor, ...]:
    return torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(5, 4, dtype=torch.bfloat16), torch.tensor([0, 1, 2])


def _float32_call_args(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return torch.randn(3, 4, dtype=dtype, requires_grad=True), torch.randn(5, 4, dtype=dtype), torch.tensor([0, 1, 2])


@triton.jit
def log1p_kernel(x_ptr, y_ptr, n: tl.constexpr):
    offsets = tl.arange(0, n)
    tl.store(y_ptr + offsets, libdevice.log1p(tl.load(x_ptr + offsets)))


def libdevice_gap() -> dict[str, Any]:
    """Whether triton's interpreter still returns None for ``libdevice.log1p`` (the gap the shim covers),
    and the shim's error once installed. Must run before any backend is built (that installs it)."""
    x = torch.rand(8) * 1e-3
    y = torch.zeros(8)
    try:
        log1p_kernel[(1,)](x, y, 8)
        gap_open = not torch.allclose(y, torch.log1p(x), rtol=1e-6, atol=0)
    except Exception:  # the stub returns None: the interpreter raises on storing it
        gap_open = True
    loss_backend("cce")  # installs the shims
    log1p_kernel[(1,)](x, y, 8)
    return {"gap_open": gap_open, "shim_error": relative_error(y, torch.log1p(x))}


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    from lit_ablate.models.losses.triton_interpreter import kernel_mode

    report = {"kernel_mode": kernel_mode(), "libdevice": libdevice_gap()}
    report.update(parity=parity_errors(device), refusals=refusals(), liger_chunks=liger_chunks(device))
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""Opt-in: the ``liger`` and ``cce`` loss kernels run on CPU through Triton's interpreter.

``LIT_ABLATE_TRITON_INTERPRET=1`` in a run's environment (a user's shell, a study's ``ablate``
command, a test's subprocess) makes those backends build on a machine without CUDA: their Triton
kernels then execute one program at a time in Python on CPU tensors. That proves the integration
and the math (argument order, shapes, ``ignore_index``, reduction, gradients) at tiny shapes; it
says nothing about GPU speed, autotune configurations, races or on-chip memory limits.

Why our own variable rather than triton's ``TRITON_INTERPRET``: triton decides at ``@triton.jit``
time, i.e. when ``triton.language`` (imported by Lightning, so in every run) and the kernel
packages are imported, and a kernel decorated before the switch stays compiled (an interpreted
kernel calling triton's compiled ``tl.cdiv`` fails). ``import lit_ablate`` sets ``TRITON_INTERPRET``
under the opt-in before anything else loads triton (``set_before_triton_loads``); building a
``liger``/``cce`` backend then checks that the kernels really are interpreted, pins the triton
version the shims were checked on, and bf16 is refused. The run record says so
(``environment.triton_kernels``). Nothing turns it on but the variable.

The shims patch gaps of triton 3.9.0's interpreter (private internals, hence the pin):

- ``triton.language.extra.libdevice`` functions are stubs that return None under the
  interpreter (the compiler maps them to the device library); CCE's forward calls ``log1p``
  (``tl_logaddexp``) and, with a softcap, ``tanh``. The shims compute them with numpy.
- Plain Python float kernel arguments are not converted (``'float' object has no attribute
  'to'``): Liger's RMSNorm/LayerNorm kernels hit it, the fused linear cross-entropy and CCE do
  not, so there is no shim for it here.

``tests/test_loss_kernels.py`` fails when a gap is closed (remove the shim then).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Callable
from typing import Any

from lit_ablate.errors import ConfigError
from lit_ablate.extras import require

OPT_IN_ENV = "LIT_ABLATE_TRITON_INTERPRET"
TRITON_VERSION = "3.9.0"
"""The triton version the shims were checked on; another version is refused (they patch internals)."""
INSTALL_FIX = "pip install 'lit-ablate[kernels-cpu]'"
KERNELS: dict[str, tuple[str, str]] = {
    "liger_kernel": ("liger_kernel.ops.cross_entropy", "liger_cross_entropy_kernel"),
    "cut_cross_entropy": ("cut_cross_entropy.cce_lse_forward", "_cce_lse_forward_kernel"),
}
"""Per kernel package, one of the kernels our backends launch: it must come out interpreted."""
LIBDEVICE_SHIMS = ("log1p", "tanh")
"""``libdevice`` stubs (None under the interpreter) that CCE's kernels call."""


def set_before_triton_loads() -> None:
    """Under the opt-in, set ``TRITON_INTERPRET=1`` (called by ``import lit_ablate``, before triton loads)."""
    if os.environ.get(OPT_IN_ENV) == "1":
        os.environ["TRITON_INTERPRET"] = "1"


def requested() -> bool:
    """Whether this process runs with the opt-in (``LIT_ABLATE_TRITON_INTERPRET=1``)."""
    value = os.environ.get(OPT_IN_ENV, "")
    if value not in ("", "0", "1"):
        raise ConfigError(OPT_IN_ENV, value, "set 1 to run Triton kernels interpreted on CPU, or 0 / unset")
    return value == "1"


def kernel_mode() -> str | None:
    """How Triton kernels run in this process: ``interpreted``, ``compiled``, or None without triton."""
    if requested() or os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreted"
    return "compiled" if importlib.util.find_spec("triton") is not None else None


def enable(package: str) -> None:
    """Switch Triton to its interpreter (with the shims) and check ``package``'s kernels obey.

    Raises ``ConfigError`` for a triton other than ``TRITON_VERSION``, or when triton or
    ``package`` was imported (and its kernels compiled) before the switch.
    """
    require("triton", OPT_IN_ENV, "1", "Triton's interpreter")
    installed = importlib.metadata.version("triton")
    if installed != TRITON_VERSION:
        raise ConfigError(
            OPT_IN_ENV,
            "1",
            f"triton {installed} is installed; the interpreter shims are checked on "
            f"triton {TRITON_VERSION} only: {INSTALL_FIX}",
        )
    if importlib.util.find_spec("numpy") is None:
        raise ConfigError(OPT_IN_ENV, "1", f"Triton's interpreter computes with numpy (not installed): {INSTALL_FIX}")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl

    module, name = KERNELS[package]
    kernels = (("triton", lambda: tl.cdiv), (package, lambda: getattr(importlib.import_module(module), name)))
    for owner, kernel in kernels:  # triton first: a refusal leaves the package unimported
        if not _is_interpreted(kernel()):
            raise ConfigError(
                OPT_IN_ENV,
                "1",
                f"{owner} was imported before the opt-in took effect, so its kernels "
                f"are compiled: set {OPT_IN_ENV}=1 in the environment before Python starts and import "
                "lit_ablate before lightning, torch._dynamo or triton (or set TRITON_INTERPRET=1 too)",
            )
    _install_libdevice_shims()


def refuse_bf16(dtype: Any) -> None:
    """Under the interpreter bf16 (``torch.bfloat16``) is silently wrong (raw 16-bit patterns: NaNs,
    gradients off by 1e37). torch is not imported here: ``import lit_ablate`` loads this module."""
    if str(dtype).removeprefix("torch.") == "bfloat16":
        raise ConfigError(
            "model.init_args.model.dtype",
            "bfloat16",
            f"Triton's interpreter ({OPT_IN_ENV}=1) computes bf16 wrongly without an error: "
            "use float32 (liger) or float16 (cce) and trainer.precision 32-true, or run bf16 on CUDA",
        )


def _is_interpreted(kernel: object) -> bool:
    """Whether a (possibly autotuned / heuristics-wrapped) Triton kernel is an interpreted function."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, (InterpretedFunction, JITFunction)) and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return isinstance(kernel, InterpretedFunction)


@functools.cache
def _install_libdevice_shims() -> None:
    """Replace the libdevice stubs our kernels call by numpy versions (interpreter only: ``enable``
    has made sure no compiled kernel of ours is left to call them)."""
    import numpy as np
    from triton.language.extra import libdevice

    for name in LIBDEVICE_SHIMS:
        setattr(libdevice, name, _numpy_elementwise(getattr(np, name)))


def _numpy_elementwise(function: Callable) -> Callable:
    """A Triton-language function computing ``function`` on the interpreter's numpy block."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def shim(x: tl.tensor) -> tl.tensor:
        return tl.tensor(TensorHandle(function(x.handle.data), x.handle.dtype.scalar), x.type)

    return shim

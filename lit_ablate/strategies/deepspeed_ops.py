"""DeepSpeed's C++/CUDA ops a config needs, built before any rank starts.

DeepSpeed builds some ops when a run first uses them, after its ranks started: ZeRO++'s quantizer
(quantised gradients or weights) and the asynchronous I/O of an NVMe offload. Built there, every rank
of every variant would wait on the same build, and a build that fails would stop a run after its
ranks started. The rule ``deepspeed_ops_build_here`` builds them first, in a child process (the build
prints thousands of lines and must not touch the launcher's devices), into ``TORCH_EXTENSIONS_DIR``:
lit-ablate's machine cache unless set, where the ranks then find them built. An op is built once per
machine; loading a built one takes seconds. On a CPU a DeepSpeed run needs none (the shared-memory
all-reduce is skipped, the optimizer is the module's torch optimizer).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

from lit_ablate.machine_cache import machine_cache

EXTENSIONS_DIR_ENV = "TORCH_EXTENSIONS_DIR"
"""Where torch builds C++/CUDA ops, DeepSpeed's too."""


def extensions_dir() -> str:
    """``TORCH_EXTENSIONS_DIR`` when set, else the machine cache's ``torch_extensions``: one build per
    machine, shared by every run, test and study."""
    return os.environ.get(EXTENSIONS_DIR_ENV) or str(machine_cache("torch_extensions"))


class OpNeed(NamedTuple):
    """The DeepSpeed key whose value needs an op, and what to set instead where the op cannot build."""

    key: str
    value: Any
    instead: str


def ops_needed(ds: Mapping[str, Any]) -> dict[str, OpNeed]:
    """DeepSpeed's op builders a run of config ``ds`` loads once it has started, each with the key that
    needs it."""
    zero = ds.get("zero_optimization") or {}
    needed = {}
    for key in ("zero_quantized_gradients", "zero_quantized_weights"):
        if zero.get(key):
            needed.setdefault("QuantizerBuilder", OpNeed(f"zero_optimization.{key}", zero[key], "set it to false"))
    for key in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(key), Mapping) and zero[key].get("device") == "nvme":
            needed.setdefault("AsyncIOBuilder", OpNeed(f"zero_optimization.{key}.device", "nvme", "offload to cpu"))
    return needed


LOAD_OP = """
import sys
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder(sys.argv[1])
if builder is None:
    sys.exit(f"error: DeepSpeed's {get_accelerator().device_name()} accelerator has no {sys.argv[1]}")
builder.load(verbose=False)
"""
"""The child's program: only DeepSpeed imported, so loading an op built before takes seconds."""


def build_op(name: str) -> str | None:
    """Build DeepSpeed's op ``name`` (or load it, built) in a child process: None when it loads, else why
    not, in one line (the compiler's first error)."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD_OP, name],
        capture_output=True,
        text=True,
        env={**os.environ, EXTENSIONS_DIR_ENV: extensions_dir()},
    )
    return None if done.returncode == 0 else first_compiler_error(done.stdout + "\n" + done.stderr)


COMPILER_ERROR = re.compile(r"(?:^|[\s:)])(?:fatal )?error:", re.IGNORECASE)
"""How gcc, nvcc and the linker start an error (``x.cu(12): error: ...``, ``collect2: error: ...``); a Python
exception's name (``CalledProcessError:``) does not match."""


def first_compiler_error(message: str) -> str:
    """The first line of a failed op build's output where a compiler says ``error:`` (else its last line: a
    Python exception's message, e.g. DeepSpeed's reason the op is not compatible with this machine)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "the build printed nothing"
    return next((line for line in lines if COMPILER_ERROR.search(line)), lines[-1])

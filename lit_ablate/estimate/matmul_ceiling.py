"""The measured matmul ceiling: the FLOP/s this device really reaches on large matmuls.

A spec-sheet peak is unreachable in practice (an H100 SXM's best bf16 matmul reaches about 80%
of its 989 TFLOP/s) and unknown for a CPU, so MFU against it is hard to compare across devices
and missing on the machines most tests and examples run on. The ceiling here is measured instead:
a short sweep of a few large matmul shapes in the run's dtype, on the run's device, with the
intra-op threads the process uses; the best sustained rate of any shape wins.

``MFUMonitor`` measures it at the start of every run (``ceiling_here``, a shorter sweep), in the
run's process and threads, and records it with its time: a ceiling measured on a quiet machine and
reused under load (or the reverse) makes MFU wrong by the ratio of the two (measured here: 22 GFLOP/s
under load, 95 quiet). Each measurement says how far it can be trusted: its two best windows must
agree (``STABLE_WITHIN``) and other processes must not have loaded the machine meanwhile
(``LOADED_CORES``, from ``machine_load``). A run measures again when they do not (``RUN_ATTEMPTS``);
``lit-ablate peak`` caches the best trustworthy measurement per device, dtype, torch version and
threads (``measured_ceiling``) and never one that is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lit_ablate import machine_load
from lit_ablate.machine_cache import machine_cache

SWEEPS: dict[str, tuple[tuple[int, int, int], ...]] = {
    "cpu": ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 512, 2048)),
    "cuda": ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 16384)),
}
"""``(m, k, n)`` shapes per device type: large enough to be compute-bound (a ``k = 512`` shape too,
the width of a small model's projections), small enough that the sweep takes seconds."""
SECONDS_PER_SHAPE = {"cpu": 0.5, "cuda": 0.3}
WINDOW_SECONDS = {"cpu": 0.1, "cuda": 0.05}
"""Each shape runs back-to-back windows of at least this long for ``SECONDS_PER_SHAPE``; the best
window's rate is the shape's sustained rate (a window, not one call, so clock ramps and one slow
call on a shared machine neither inflate nor sink it)."""
STABLE_WITHIN = 0.05
"""The two best windows of the best shape agree within this on a quiet device (seen: within 2% on the
2-core VM, idle); further apart, something else was using the device."""
LOADED_CORES = 0.25
"""Other processes' load (cores) above which a sweep is taken as measured under load."""
RUN_ATTEMPTS = 2
"""Sweeps a run's start makes at most until one is trustworthy (then the best one is used, doubt recorded):
a second sweep outlasts a burst of load, not a machine that stays busy."""
PROBE_SHAPE = (256, 256, 256)
MAX_CALL_SECONDS = {"cpu": 2.0, "cuda": 1.0}
"""A shape is swept only if one call of it, predicted from a small probe's rate, takes at most this
long: a CPU without fast half-precision matmuls runs float16 at a few GFLOP/s or less, where the
sweep's largest shapes took minutes per call (and the probe's rate bounds the big shapes' from below,
so fast dtypes keep every shape)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class MatmulCeiling:
    """The best sustained matmul rate measured on one device, in one dtype, with some threads."""

    tflops: float
    device_name: str
    device_type: str
    dtype: str
    torch: str
    threads: int | None
    """Intra-op threads on a CPU (None on a GPU, where they do not matter)."""
    shape: tuple[int, int, int]
    """The ``(m, k, n)`` that reached it."""
    measured_at: float
    sweep_seconds: float
    agreement: float | None = None
    """How far the second-best window of the best shape fell below the best one, relatively."""
    foreign_cores: float | None = None
    """Other processes' CPU load during the sweep, in cores (None where it cannot be read)."""

    def doubt(self) -> str | None:
        """Why this measurement cannot be trusted as the device's ceiling, or None."""
        if self.foreign_cores is not None and self.foreign_cores > LOADED_CORES:
            return f"other processes loaded {self.foreign_cores:.2f} cores during the sweep"
        if self.agreement is not None and self.agreement > STABLE_WITHIN:
            return f"its two best windows differ by {100 * self.agreement:.0f}%"
        return None

    def conditions(self) -> str:
        """Device, dtype and threads: what sets the ceiling besides the machine's load (a 2-rank run on
        2 cores measures half a 1-rank run's, and bf16 on a CPU half of fp32's)."""
        threads = f", {self.threads} thread(s)" if self.threads is not None else ""
        return f"{self.dtype} on {self.device_type}{threads}"

    def describe(self) -> str:
        threads = f", {self.threads} thread(s)" if self.threads is not None else ""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.measured_at))
        return (
            f"{self.dtype} {'x'.join(map(str, self.shape))} matmuls on {self.device_name}{threads}, "
            f"torch {self.torch}, measured {when}"
        )


def device_name(device: torch.device) -> str:
    """What the device is: the GPU's name, or the CPU's model name (``/proc/cpuinfo``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu" and os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        if model:
            return model
    return platform.processor() or platform.machine() or device.type


def cache_dir() -> Path:
    """Where ceilings are cached: the per-machine cache's ``matmul_ceiling`` folder."""
    return machine_cache("matmul_ceiling")


def cache_path(device: torch.device, dtype: torch.dtype) -> Path:
    """The cache file of this device, dtype, torch version and (CPU) thread count."""
    key = {
        "device_name": device_name(device),
        "dtype": _dtype_name(dtype),
        "torch": torch.__version__,
        "threads": _threads(device),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{device.type}-{key['dtype']}-{digest}.json"


RUN_SWEEP_SECONDS = {"cpu": (0.15, 0.05), "cuda": (0.1, 0.02)}
"""``(seconds per shape, window seconds)`` of the sweep at a run's start."""
RUN_BUDGET_SECONDS = 1.0
"""What a run's start (or a re-measure between steps) may spend on its ceiling, every attempt included: a
shape is swept only while its least cost (``LEAST_CALLS`` calls at the probe's rate) fits in what is left.
Without it a loaded CPU, or one slow in the run's dtype, spent 3 s and more per rank on every fit start
(four calls of each large shape, twice: a loaded machine makes the first sweep doubtful)."""
LEAST_CALLS = 4
"""A swept shape's calls at the least: a warm-up, one timed call that sizes the windows, two windows."""


def ceiling_here(device: torch.device | str, dtype: torch.dtype) -> MatmulCeiling:
    """The ceiling measured now, in this process with its threads (no cache): what a run divides by.
    Measured again, up to ``RUN_ATTEMPTS`` sweeps, while it is not trustworthy and ``RUN_BUDGET_SECONDS``
    has time left; the best is kept."""
    device = torch.device(device)
    kind = device.type if device.type in RUN_SWEEP_SECONDS else "cuda"
    seconds, window = RUN_SWEEP_SECONDS[kind]
    deadline = clock() + RUN_BUDGET_SECONDS
    best = None
    for _ in range(RUN_ATTEMPTS):
        ceiling = _measured(device, dtype, seconds_per_shape=seconds, window_seconds=window, deadline=deadline)
        if best is None or ceiling.tflops > best.tflops:
            best = ceiling
        if ceiling.doubt() is None or clock() >= deadline:
            return ceiling if ceiling.doubt() is None else best
    return best


def _measured(device: torch.device, dtype: torch.dtype, **budget: float | None) -> MatmulCeiling:
    started = time.time()
    before = machine_load.sample(process_groups=[os.getpgrp()])  # this run's ranks sweep too: not "other"
    tflops, shape, runner_up = measure_matmul_ceiling(device, dtype, **budget)
    after = machine_load.sample(process_groups=[os.getpgrp()])
    return MatmulCeiling(
        tflops=tflops,
        device_name=device_name(device),
        device_type=device.type,
        dtype=_dtype_name(dtype),
        torch=torch.__version__,
        threads=_threads(device),
        shape=shape,
        measured_at=started,
        sweep_seconds=time.time() - started,
        agreement=1 - runner_up / tflops if runner_up and tflops else None,
        foreign_cores=machine_load.foreign_cores(before, after),
    )


def measured_ceiling(device: torch.device | str, dtype: torch.dtype, remeasure: bool = False) -> MatmulCeiling:
    """The cached ceiling of ``device`` and ``dtype`` with the current threads; measured when there is
    none yet, or when ``remeasure`` asks for a fresh one.

    A ceiling is a maximum, and other work on the machine can only make a sweep measure it too low
    (on this project's shared 2-core VM: 22 GFLOP/s under load, 95 quiet, with one thread), so only a
    trustworthy measurement is cached (``MatmulCeiling.doubt``: none), and it replaces the cached one
    only when it is higher; an untrustworthy one is returned, uncached, with its doubt. Delete the
    cache file to start over on changed hardware."""
    device = torch.device(device)
    path = cache_path(device, dtype)
    cached = None
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            cached = MatmulCeiling(**{**data, "shape": tuple(data["shape"])})
        except (ValueError, TypeError, KeyError) as err:  # written by another lit-ablate version: measure anew
            warnings.warn(
                f"{path}: unreadable cached ceiling ({type(err).__name__}: {err}); measuring again", stacklevel=2
            )
    if cached is not None and not remeasure:
        return cached
    ceiling = _measured(device, dtype)
    if ceiling.doubt() is not None or (cached is not None and cached.tflops >= ceiling.tflops):
        return ceiling if ceiling.doubt() is not None else cached
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # atomic: ranks of one node may write it at once
    tmp.write_text(json.dumps(asdict(ceiling), indent=1) + "\n")
    os.replace(tmp, path)
    return ceiling


def measure_matmul_ceiling(
    device: torch.device,
    dtype: torch.dtype,
    shapes: tuple[tuple[int, int, int], ...] | None = None,
    seconds_per_shape: float | None = None,
    window_seconds: float | None = None,
    deadline: float | None = None,
) -> tuple[float, tuple[int, int, int], float | None]:
    """``(TFLOP/s, shape, runner-up)``: the best sustained rate of ``A @ B`` over ``shapes`` (``2 m k n``
    FLOPs each), and the second-best window of that shape (None when it ran one window only). With a
    ``deadline`` (a ``clock()`` time) a shape whose least cost would pass it is left out, the first one
    swept excepted: there is always a rate."""
    kind = device.type if device.type in SWEEPS else "cuda"
    budget = SECONDS_PER_SHAPE[kind] if seconds_per_shape is None else seconds_per_shape
    window = WINDOW_SECONDS[kind] if window_seconds is None else window_seconds
    rate = _probe_rate(device, dtype)
    affordable = [s for s in shapes or SWEEPS[kind] if _flops(s) / rate <= MAX_CALL_SECONDS[kind]] or [PROBE_SHAPE]
    best: list[float] = [0.0]
    best_shape = affordable[0]
    for shape in affordable:
        if deadline is not None and best[0] > 0 and clock() + LEAST_CALLS * _flops(shape) / rate > deadline:
            continue
        a = torch.randn(shape[0], shape[1], device=device, dtype=dtype)
        b = torch.randn(shape[1], shape[2], device=device, dtype=dtype)
        out = torch.empty(shape[0], shape[2], device=device, dtype=dtype)
        start = clock()
        _timed(a, b, out, 1)  # warm-up: kernel choice, page faults
        per_call = _timed(a, b, out, 1)
        calls = max(1, int(window / max(per_call, 1e-9)))
        rates = []
        while True:
            rates.append(_flops(shape) * calls / _timed(a, b, out, calls) / 1e12)
            now = clock()
            if len(rates) >= 2 and (now - start >= budget or (deadline is not None and now >= deadline)):
                break  # two windows at the least: their agreement
        rates.sort(reverse=True)
        rate = min(rate, rates[-1] * 1e12)  # the slowest seen predicts the next shape's cost: load varies
        if rates[0] > best[0]:
            best, best_shape = rates, shape
    return best[0], best_shape, best[1] if len(best) > 1 else None


def _probe_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of ``PROBE_SHAPE``, below the large shapes' on a quiet device: what predicts their calls' cost."""
    a = torch.randn(PROBE_SHAPE[0], PROBE_SHAPE[1], device=device, dtype=dtype)
    b = torch.randn(PROBE_SHAPE[1], PROBE_SHAPE[2], device=device, dtype=dtype)
    out = torch.empty(PROBE_SHAPE[0], PROBE_SHAPE[2], device=device, dtype=dtype)
    _timed(a, b, out, 1)
    return _flops(PROBE_SHAPE) / max(_timed(a, b, out, 2) / 2, 1e-9)


def _flops(shape: tuple[int, int, int]) -> int:
    return 2 * shape[0] * shape[1] * shape[2]


def clock() -> float:
    """The sweep's clock (``time.perf_counter``), one name for every reading of it."""
    return time.perf_counter()


def _timed(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, repeats: int) -> float:
    """Seconds of ``repeats`` back-to-back ``a @ b`` (the device drained before and after)."""
    _synchronize(a.device)
    start = clock()
    for _ in range(repeats):
        torch.matmul(a, b, out=out)
    _synchronize(a.device)
    return clock() - start


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":  # an accelerator runs kernels asynchronously: drain it before reading the clock
        torch.accelerator.synchronize(device)


def _threads(device: torch.device) -> int | None:
    return torch.get_num_threads() if device.type == "cpu" else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

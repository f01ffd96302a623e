"""The run record: the one contract between a training run and the ablation report.

Callbacks write it (``RunRecorder``), the ablation runner and report read it, and neither side
imports the other: both depend only on this module. A record is one JSON file per run::

    {
      "schema_version": 1,
      "variant": "chunked", "seed": 0,          # set by the ablation runner, else null
      "config": {...},                          # the resolved LightningCLI config
      "environment": {"python": ..., "torch": ..., "lightning": ..., "transformers": ...,
                      "device_name": ..., "device_count": ..., "world_size": ..., "git_commit": ...,
                      "triton_kernels": "compiled" | "interpreted" | null,  # interpreted: CPU opt-in
                                                # (LIT_ABLATE_TRITON_INTERPRET=1); null: no triton
                      "fp8": "real" | "emulated" | null,  # which fp8 matmuls ran (lit_ablate.models.fp8.conversion)
                      "optimizer_implementation": "fused" | "foreach" | "for-loop" | null,  # torch's kernels
                                                # for the update (lit_ablate.modules.optim); null: another library's
                      "flush_denormal": bool},  # subnormal floats flushed to zero on the CPU (lit_ablate.subnormals)
      "simulated": null | {"world_size": 64, "rank": 0},  # one process played this rank of a larger job
                                                # over a fake process group (docs/simulation.md): no loss and
                                                # no job tokens/s; memory, step time and MFU are the rank's own
      "warmup_steps": 3,                        # steps excluded from the summary
      "resumed_from": null | {"checkpoint": "path", "step_offset": 3},  # a resumed fit: its steps are offset + 1, ...
      "steps_before_resume": null | [{"step": 1, "loss": ...}, ...],  # the losses the checkpoint carried (all ranks')
      "job": null | {"id": ..., "state": ..., "cluster": ..., "restarts": 0,  # a SLURM job (launch.executor: slurm)
                     "nodes": [...], "ranks": [{"rank": r, "node_rank": n, "local_rank": l, "node": "name"}]},
      "fallbacks": ["..."],                     # every fallback a part took, in words
      "profile": {...},                         # only with KernelProfile (a RecordSection): top kernels or CPU
                                                # operators of the profiled steps, host syncs, torch.compile's
                                                # graph breaks and recompiles (docs/profiling.md)
      "gradients": {"step": 1, "norms": {name: [norm, ...]}},  # only with GradientFingerprint (a study's
                                                # expect_equal_gradients): each parameter's gradient norm at that
                                                # step, before clipping; one per expert for stacked expert weights
      "data": null | {"storage": "memory" | "cache" | "stream", "storage_requested": "auto" | ...,
               "storage_reason": "why auto chose it", "seconds": ..., "cache_hit": bool | null,
               "cache_path": str | null, "examples": n},  # LMDataModule's set-up (null: another data module)
      "steps": [{"step": 1, "loss": ..., "lr": ..., "step_time_s": ..., "data_wait_s": ...,
                 "tokens_per_sec": ..., "useful_tokens_per_sec": ..., "mfu": ..., "mfu_measured": ...,
                 "memory_peak_bytes": ..., "memory_peak_bytes_per_rank": [...],
                 "tensor_peak_bytes": ..., "tensor_peak_bytes_per_rank": [...],  # see below
                 "tensor_breakdown": null | {"method": ..., "rank": r, "at_peak": {category: bytes},
                                             "max": {category: bytes}, "forward_backward_max": bytes}}, ...],
      "speed_blocks": null | {"design": "steps" | "runs", "group": "...",  # written by a study's runner:
                      "blocks": [{"round": 1, "first_step": 4, "last_step": 5, "waited_s": ..., "seconds": ...,
                                  "foreign_cores": ...}, ...]},  # the blocks the run's speed was measured in,
                                                # runs of one group in turns (lit_ablate.ablation.turns)
      "summary": {
        "status": "ok" | "error" | "oom" | "timeout" | "running" | "interrupted" | "skipped",
        "message": null | "the error, one line",
        "tokens_per_sec": {"median": ..., "min": ..., "max": ..., "n": ...} | null,
        "useful_tokens_per_sec": {...}, "tokens_per_sec_per_device": {...},
        "useful_tokens_per_sec_per_device": {...}, "step_time_s": {...}, "data_wait_s": {...},
        "data_wait_share": float | null,        # summed data wait / summed step time after warm-up
        "mfu": {...} | null,                    # vs the spec peak; null when no honest peak is known
        "mfu_measured": {...} | null,           # vs the measured matmul ceiling (lit_ablate.estimate.matmul_ceiling)
        "mfu_peak": str | null,                 # where mfu's peak came from, or why there is none
        "mfu_ceilings": null | {"mfu": {"tflops": float | null, "source": str,   # each MFU's denominator
                                        "above_one_steps": [int]},  # steps whose MFU came out above 1: null
                                "mfu_measured": {"tflops": float | null, "source": str, "doubt": str | null,
                                                 "remeasured": int, "above_one_steps": [int], ...}},
        "peak_memory_bytes": int | null,        # the largest over steps and ranks
        "peak_memory_bytes_per_rank": [int] | null, "memory_method": str | null,
        "peak_tensor_bytes": int | null,        # the largest tensor peak over steps and ranks
        "peak_tensor_bytes_per_rank": [int] | null,
        "tensor_method": "cpu_tracked_tensors" | "cuda_max_allocated" | null,
        "tensor_breakdown": null | {"step": s, "method": ..., "rank": r, "at_peak": {...}, "max": {...},
                                    "forward_backward_max": bytes},  # the tracked step with the largest peak
        "final_loss": float | null,
        "exact_match": float | null             # ExactMatchEvaluator's accuracy after the last step
      }
    }

A record whose status is ``running`` belongs to a run that was killed before it could finish:
the ablation runner redoes it on resume.

Memory has two measurements (``MemoryMonitor``). ``memory_peak_bytes`` is the process peak every
step: the CUDA allocator's peak allocated bytes, or on CPU the process's peak resident set
(``memory_method`` says which; on CPU it includes the Python runtime, ~0.5 GB). ``tensor_peak_bytes``
is the peak of tensor bytes the rank holds: on CUDA the allocator's peak again (every step), on
CPU the ``TensorCategoryTracker``'s, only on the tracked steps (the last warm-up steps, never timed).
``tensor_breakdown`` (tracked steps) splits it into categories: ``params``, ``grads``,
``optimizer`` (what the rank itself holds: its shard under FSDP/ZeRO), ``activations`` (made in
forward or recomputed in backward), ``temporaries`` (made in backward or the optimizer update),
``transient`` (what a parallel strategy adds: gathered parameters and their full gradients,
communication buffers, DDP's gradient buckets), any category the module declares (``reference``),
and on CUDA ``untracked`` (allocator peak minus tracked bytes). ``at_peak`` is the composition at
the moment of the peak (it adds up to the tracked peak), ``max`` each category's own largest
value during the step, and ``forward_backward_max`` the largest activations + temporaries during
forward and backward: the quantity the estimator's activation model predicts. Per-rank values
are in rank order; the breakdown is the rank's with the largest tracked peak.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

SCHEMA_VERSION = 1
RECORD_FILENAME = "run.json"
RECORD_PATH_ENV = "LIT_ABLATE_RUN_RECORD"
"""Environment variable through which a launcher (the ablation runner) chooses where a run's
record is written, without touching the run's config."""
VARIANT_ENV = "LIT_ABLATE_VARIANT"
"""Environment variable naming the study variant a run belongs to (written into its record)."""
GRADIENTS_SECTION = "gradients"
"""The record's section of one step's gradient norms (``GradientFingerprint``), which a study's
``expect_equal_gradients`` compares."""

Status = Literal["ok", "error", "oom", "timeout", "running", "interrupted", "skipped"]
FINISHED_STATUSES: tuple[str, ...] = ("ok", "error", "oom", "timeout")
"""Final statuses; ``running``/``interrupted`` (killed) and ``skipped`` (could not run here) are
redone when a study resumes. ``timeout``, ``interrupted`` and ``skipped`` are written by the
ablation runner, which also adds ``stderr_tail`` and ``returncode`` to a failed run's summary."""

# Per-step series that summaries are made of: series name -> summary key.
SUMMARISED_SERIES: dict[str, str] = {
    "tokens_per_sec": "tokens_per_sec",
    "useful_tokens_per_sec": "useful_tokens_per_sec",
    "tokens_per_sec_per_device": "tokens_per_sec_per_device",
    "useful_tokens_per_sec_per_device": "useful_tokens_per_sec_per_device",
    "step_time_s": "step_time_s",
    "data_wait_s": "data_wait_s",
    "mfu": "mfu",
    "mfu_measured": "mfu_measured",
    "pipeline_idle_share": "pipeline_idle_share",  # PipelineBubbleMonitor (pipeline-parallel runs)
    "pipeline_bubble_theory": "pipeline_bubble_theory",
}

PREFERENCE_STATS = ("pairs", "loss", "correct", "reward_chosen", "reward_rejected", "logps_chosen", "logps_rejected")
"""What ``DPO.training_step`` reports per micro-batch under ``outputs["preference"]`` (sums over its
pairs, in this order), for ``PreferenceMonitor``."""

# Evaluations of the model (not of a step's speed): the summary keeps the value after the last
# step, the model a run ends with. Series name -> summary key.
FINAL_VALUE_SERIES: dict[str, str] = {
    "exact_match": "exact_match",
    "reward_accuracy": "reward_accuracy",  # DPO (PreferenceMonitor): the last step's pairs
    "reward_margin": "reward_margin",
}


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    """Median, min, max and count of the finite values, or None when there are none."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite), "n": len(finite)}


def summarize_steps(steps: Sequence[Mapping[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """Summaries over the steps after warm-up: the medians with min/max the report shows."""
    measured = [s for s in steps if s["step"] > warmup_steps]
    summary: dict[str, Any] = {
        key: spread(s.get(series) for s in measured) for series, key in SUMMARISED_SERIES.items()
    }
    waits = [(s.get("data_wait_s"), s.get("step_time_s")) for s in measured]
    waits = [(w, t) for w, t in waits if w is not None and t]
    summary["data_wait_share"] = sum(w for w, _ in waits) / sum(t for _, t in waits) if waits else None
    peaks = [s["memory_peak_bytes"] for s in steps if s.get("memory_peak_bytes") is not None]
    summary["peak_memory_bytes"] = int(max(peaks)) if peaks else None
    per_rank = [s["memory_peak_bytes_per_rank"] for s in steps if s.get("memory_peak_bytes_per_rank")]
    summary["peak_memory_bytes_per_rank"] = [int(max(column)) for column in zip(*per_rank)] if per_rank else None
    summary.update(tensor_peak_summary(steps))
    losses = [s["loss"] for s in steps if s.get("loss") is not None]
    summary["final_loss"] = float(losses[-1]) if losses else None
    for series, key in FINAL_VALUE_SERIES.items():
        values = [s[series] for s in steps if s.get(series) is not None]
        summary[key] = float(values[-1]) if values else None
    return summary


def tensor_peak_summary(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The tensor peak over the steps that have one (and each rank's), and the breakdown by
    category of the tracked step with the largest tracked peak."""
    peaks = [s["tensor_peak_bytes"] for s in steps if s.get("tensor_peak_bytes") is not None]
    per_rank = [s["tensor_peak_bytes_per_rank"] for s in steps if s.get("tensor_peak_bytes_per_rank")]
    tracked = [(s["step"], s["tensor_breakdown"]) for s in steps if s.get("tensor_breakdown")]
    step, breakdown = max(tracked, key=lambda t: sum(t[1]["at_peak"].values()), default=(None, None))
    return {
        "peak_tensor_bytes": int(max(peaks)) if peaks else None,
        "peak_tensor_bytes_per_rank": [int(max(column)) for column in zip(*per_rank)] if per_rank else None,
        "tensor_method": breakdown["method"] if breakdown else None,
        "tensor_breakdown": {"step": step, **breakdown} if breakdown else None,
    }


def write_record(path: str | os.PathLike[str], record: Mapping[str, Any]) -> Path:
    """Write ``record`` as JSON atomically: a reader sees the old file or the new one, never half.

    The temporary file is created with mode 0o666 so the user's umask applies, as to any file they
    create (``tempfile.mkstemp`` would make the record owner-only).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}-{secrets.token_hex(8)}{path.suffix}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "w") as f:
        json.dump(_finite(record), f, indent=1, default=str, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a record; raises ``ValueError`` naming the file when it is not a run record."""
    with open(path) as f:
        try:
            record = json.load(f)
        except json.JSONDecodeError as err:  # a ValueError: the runner reads it as no record
            raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}: cut short?)") from err
    if not isinstance(record, dict) or record.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: not a lit-ablate run record (schema_version {SCHEMA_VERSION} expected)")
    return record


def is_finished(record: Mapping[str, Any]) -> bool:
    """True when the run ended (well or badly) and its record is final."""
    return record.get("summary", {}).get("status") in FINISHED_STATUSES


def _finite(value: Any) -> Any:
    """The record with NaN/inf (a diverged loss) as null: JSON has no NaN, and null reads as 'no value'."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value

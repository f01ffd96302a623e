"""The GPU lane: every GPU check and measurement, each in its own process under its own time limit.

The device gives one remote command of at most 10 minutes inside 15 minutes of GPU time (start-up
included), so the lane has a budget of 520 s, installation of the wheels included (one call of at
most 9 minutes on a fresh machine): ``STEPS``
lists each step's limit, and those limits (plus the reserves for installing and finishing) add up
to no more than ``LANE_BUDGET_S`` (``tests/test_gpu_lane.py`` checks it). A step that fails or
runs out of time loses only itself. After every step the lane rewrites one JSON of all results
(``lane.json``: each step's status, time, ``RESULT`` lines or collected figures and the tail of its
output) and appends the step's whole output to ``lane.log``, both in ``--out`` (the device's
``$OUT``: what is there comes back even if the command is killed); the last thing printed is a
short table.

``--dry-run`` (``benchmarks/gpu/prepare`` runs it on the CPU) starts every step with the same
command line plus ``dry_argv`` appended: tiny shapes and the CPU (argparse and jsonargparse keep
the last value of a repeated option), so every flag name and value of the real command is parsed,
every import and the code path up to the kernels run, and no typo costs device minutes.

    python benchmarks/gpu/lane.py [--dry-run] [--out DIR] [--only STEP ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LANE_BUDGET_S = 520
"""The whole remote command: one device call of at most 9 minutes (540 s), 20 s left for the machine."""
INSTALL_RESERVE_S = 20
"""``run``'s pip install of the wheels and the interpreter's start, before the first step."""
FINISH_RESERVE_S = 10
"""Writing the JSON, the compile-cache archive and the table after the last step."""
MIN_STEP_S = 5
"""A step whose limit the budget cuts below this is skipped, not started."""
DRY_RUN_TIMEOUT_S = 420
"""Per step on the CPU (2 shared cores: imports alone take 10-30 s there)."""
RESULT_LINE = re.compile(r"^RESULT (\S+?)=(.*)$")
TAIL_LINES, TAIL_CHARS = 60, 6000
LOG_LIMIT_BYTES = 15 * 2**20
"""lane.log stops growing here: the device returns files of at most 16 MiB."""
GPU_TESTS_PLACEHOLDER = "{gpu_test_files}"
GPU_MARK = "pytest.mark.gpu"
"""What a test file with gpu-marked tests holds (a decorator, ``pytestmark = ...`` or a parameter's ``marks=``)."""
COMPILE_CACHE = "compile_cache.tar.gz"
"""Inductor's and Triton's caches of a lane run, written to ``--out`` when under ``COMPILE_CACHE_LIMIT``;
carried back as ``benchmarks/gpu/wheels/compile_cache.tar.gz``, a later run on a fresh machine of
the same torch, triton and GPU starts with warm compiles."""
COMPILE_CACHE_LIMIT = 15 * 2**20


@dataclass(frozen=True)
class Step:
    """One command of the lane. ``argv`` may hold ``{python}`` (this interpreter), ``{scratch}``
    (a temporary folder of this lane run) and ``{gpu_test_files}`` (the test files with gpu marks)."""

    name: str
    what: str
    argv: tuple[str, ...]
    timeout_s: int
    dry_argv: tuple[str, ...] = ()
    collect: str = "results"
    """How the step's figures are read: ``results`` (its RESULT lines), ``pytest`` (JUnit XML, else
    the verbose lines), ``peak`` (the JSON ``lit-ablate peak --json`` prints), ``fit`` (its run.json)."""


PY = "{python}"
# Limits from the first run (H200, 2026-11-27, fresh machine, cold compiles): gpu tests 106 s serially
# (so 6 workers here), the dense MFU run ~120 s of which ~6 s were its 25 steps, loss 31 s, moe 21 s,
# fp8 80 s cold for three variants, dpo 27 s, fit 23 s; packing compiled flex once per row width and
# did not finish (rows have one static shape now). They add up, with the reserves, to LANE_BUDGET_S;
# the most wanted steps come first, so an overrun costs the last ones. mesh_sim's 30 s (six simulated
# layouts in one process, never run on a GPU yet) came from fp8 (50 -> 35) and packing (40 -> 25).
# A table kept out of the formatter (fmt: skip): one step a row, each flag beside its value.
STEPS: tuple[Step, ...] = (
    Step("env", "versions, GPU, optional kernels", (PY, "benchmarks/gpu/environment.py"), 10),
    Step("gpu_tests", "every gpu-marked test in 6 workers, each skip with its reason, the slowest with their times",
         (PY, "-m", "pytest", "-m", "gpu", "-n", "6", "--dist", "load", "-v", "-rs", "--durations", "15",
          "-p", "no:cacheprovider", "--timeout", "40", "--junitxml", "{scratch}/pytest.xml", GPU_TESTS_PLACEHOLDER),
         45, dry_argv=("-n", "0", "--collect-only"), collect="pytest"),
    Step("mfu_seed", "the seed's dense headline: Qwen3-0.6B with 217,473 tokens, 10,240-token packed rows, 4 per "
         "optimizer step, bf16, compiled layers, fastest packed attention, fused loss; lit-ablate beside a hand loop, "
         "two steps profiled",
         (PY, "benchmarks/mfu.py", "--shape", "qwen3-0.6b", "--vocab", "217473", "--seq-len", "10240", "--accumulate",
          "4", "--steps", "8", "--warmup", "3", "--profile", "--name", "seed"),
         150, dry_argv=("--device", "cpu", "--precision", "32-true", "--shape", "tiny-qwen3", "--vocab", "512",
                        "--seq-len", "128", "--accumulate", "2", "--steps", "3", "--warmup", "1", "--no-compile")),
    Step("mfu_dense", "dense MFU: Qwen3-0.6B (151,936 tokens), 8,192-token packed rows, bf16, compiled, "
         "lit-ablate only",
         (PY, "benchmarks/mfu.py", "--shape", "qwen3-0.6b", "--seq-len", "8192", "--steps", "12", "--warmup", "4",
          "--no-hand-loop", "--name", "dense"),
         75, dry_argv=("--device", "cpu", "--precision", "32-true", "--shape", "tiny-qwen3", "--seq-len", "128",
                       "--steps", "3", "--warmup", "1", "--no-compile")),
    Step("fit", "lit-ablate fit: the quickstart on the GPU, run.json with the allocator's memory categories",
         (PY, "-m", "lit_ablate.cli", "fit", "--config", "configs/quickstart.yaml", "--trainer.accelerator", "gpu",
          "--trainer.default_root_dir", "{scratch}/fit", "--recorder.path", "{scratch}/fit/run.json"),
         25, dry_argv=("--trainer.accelerator", "cpu", "--trainer.max_steps", "4"), collect="fit"),
    Step("mesh_sim", "every mesh dimension's CUDA path (dp_shard, dp_replicate, tp, cp, ep, pp): rank 0 of 8, "
         "simulated over a fake process group for two steps, bf16, memory beside the estimate",
         (PY, "benchmarks/gpu/simulated_mesh.py", "--device", "cuda"),
         30, dry_argv=("--device", "cpu", "--precision", "32-true", "--only", "dp_shard,pp")),
    Step("loss", "loss backends: vocab 151936, hidden 1024, 16k tokens, bf16; Liger's chunking swept",
         (PY, "benchmarks/loss_memory.py", "--vocab", "151936", "--tokens", "16384", "--hidden", "1024",
          "--dtype", "bfloat16", "--repeats", "2", "--liger-chunk-tokens", "own", "512", "2048",
          "--liger-accum-dtype", "none", "float32"),
         40, dry_argv=("--device", "cpu", "--vocab", "2048", "--tokens", "256", "--hidden", "64", "--dtype", "float32",
                       "--repeats", "1", "--liger-chunk-tokens", "own", "--liger-accum-dtype", "none")),
    Step("moe", "MoE layer: Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert 768), bf16, fwd+bwd",
         (PY, "benchmarks/moe.py", "--shapes", "30b-a3b-layer", "--dtype", "bfloat16", "--repeats", "5"),
         25, dry_argv=("--device", "cpu", "--shapes", "tiny", "--tokens", "128", "--dtype", "float32",
                       "--repeats", "1")),
    Step("dpo", "DPO log-probs: torch vs chunked vs Liger at Qwen3-32B's head, 15k tokens",
         (PY, "benchmarks/dpo_memory.py", "--tokens", "15360", "--chunk-tokens", "1024"),
         30, dry_argv=("--device", "cpu", "--tokens", "96", "--vocab", "2048", "--hidden", "64",
                       "--chunk-tokens", "32")),
    Step("fp8", "fp8: bf16 vs torchao tensorwise, Qwen3-8B shape (4 layers), 8k tokens, compiled",
         (PY, "benchmarks/fp8.py", "--shape", "qwen3-8b", "--layers", "4", "--seq-len", "8192", "--steps", "6",
          "--recipes", "tensorwise"),
         35, dry_argv=("--shape", "tiny-qwen3", "--layers", "1", "--seq-len", "64", "--steps", "1", "--tokens", "64",
                       "--timing-on-cpu", "--no-compile")),
    Step("packing", "packing vs padding, Qwen3-0.6B shape (8 layers), static packed rows, per packed attention backend",
         (PY, "benchmarks/packing.py", "--preset", "qwen3-0.6b", "--layers", "8", "--examples", "160",
          "--median", "400", "--max-len", "4096", "--batch-size", "4", "--rows", "2", "--repeats", "3",
          "--packed-attention", "torch_varlen", "flex", "sdpa_packed"),
         25, dry_argv=("--device", "cpu", "--preset", "tiny-llama", "--layers", "2", "--examples", "24",
                       "--median", "32", "--max-len", "128", "--repeats", "1", "--packed-attention", "sdpa_packed")),
)  # fmt: skip


def gpu_test_files() -> list[str]:
    """Test files that hold a ``gpu`` mark (a decorator, ``pytestmark`` or a parameter's marks).
    Only these are collected: ``tests/test_adapters.py`` imports bitsandbytes at the top, and a
    collection error elsewhere would hide nothing here but cost the import time of 80 files."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if GPU_MARK in p.read_text())


def command(step: Step, scratch: Path, dry_run: bool) -> list[str]:
    argv: list[str] = []
    for arg in (*step.argv, *(step.dry_argv if dry_run else ())):
        if arg == GPU_TESTS_PLACEHOLDER:
            argv.extend(gpu_test_files())
        else:
            argv.append(arg.replace("{python}", sys.executable).replace("{scratch}", str(scratch)))
    return argv


def step_timeout(step: Step, dry_run: bool, seconds_left: float) -> int:
    """The step's own limit, cut to what is left of the lane's budget (dry runs have no budget)."""
    if dry_run:
        return DRY_RUN_TIMEOUT_S
    return int(min(step.timeout_s, seconds_left - FINISH_RESERVE_S))


def step_environment(scratch: Path, dry_run: bool) -> dict[str, str]:
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(path if str(ROOT) in path else [*path, str(ROOT)]),
            "PYTHONUNBUFFERED": "1",
            "LIT_ABLATE_CACHE_DIR": str(scratch / "cache"),  # matmul ceilings measured on this machine, this run
            "LIT_ABLATE_DATA_CACHE": str(scratch / "data_cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(scratch / "compile_cache" / "inductor"),
            "TRITON_CACHE_DIR": str(scratch / "compile_cache" / "triton"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if dry_run:
        env.setdefault("OMP_NUM_THREADS", "1")  # the CPU here is 2 cores shared with other work
    return env


def run_step(
    argv: list[str], timeout_s: int, env: dict[str, str], log: Callable[[str], None]
) -> tuple[int | None, float, list[str]]:
    """``(returncode or None on timeout, seconds, output lines)``; the whole process group is
    killed at the limit (a benchmark's compile workers and ranks included)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            log(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode: int | None = proc.wait(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        returncode = None
        _kill_group(proc)
    reader.join(timeout=10)
    return returncode, time.monotonic() - started, lines


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def result_lines(lines: list[str]) -> dict[str, object]:
    """``RESULT name=value`` lines as a mapping; numbers become numbers, the rest stays text."""
    results: dict[str, object] = {}
    for line in lines:
        match = RESULT_LINE.match(line.strip())
        if match:
            results[match.group(1)] = _value(match.group(2).strip())
    return results


def _value(text: str) -> object:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def collect_pytest(lines: list[str], scratch: Path) -> dict[str, object]:
    """Counts and every test's outcome: skips with their reason, failures with their message."""
    xml = scratch / "pytest.xml"
    tests: dict[str, dict[str, str]] = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    message = (node.get("message") or node.text or "").strip()[:500]
                    break
            tests[name] = {"outcome": outcome, "message": message}
    else:  # killed before pytest wrote its XML: the verbose lines say what finished
        for line in lines:
            match = re.match(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", line)
            if match:
                tests[match.group(1)] = {"outcome": match.group(2).lower(), "message": ""}
        for line in lines:  # -rs: "SKIPPED [1] tests/x.py:12: reason"
            match = re.match(r"^SKIPPED \[\d+\] (\S+?):\d+: (.*)$", line)
            if match:
                for name, test in tests.items():
                    if name.startswith(match.group(1)) and test["outcome"] == "skipped" and not test["message"]:
                        test["message"] = match.group(2)
        _failure_messages(lines, tests)
    counts = {
        outcome: sum(t["outcome"] == outcome for t in tests.values())
        for outcome in ("passed", "failed", "error", "skipped")
    }
    durations = [
        {"seconds": float(m.group(1)), "phase": m.group(2), "test": m.group(3)}
        for m in (re.match(r"^(\d+\.\d+)s (setup|call|teardown) +(\S+)", line) for line in lines)
        if m
    ]
    collected = next(
        (line for line in lines if line.startswith("collect")), ""
    )  # "collected 114 items / ... / 21 selected"
    selected = re.search(r"(\d+) selected", collected) or re.search(r"collected (\d+) item", collected)
    selected = int(selected.group(1)) if selected else None
    return {**counts, "selected": selected, "tests": tests, "durations": durations}


def _failure_messages(lines: list[str], tests: dict[str, dict[str, str]]) -> None:
    """A failed test's message from pytest's FAILURES section: the first ``E`` line under the
    ``____ test_name[param] ____`` header (what the JUnit XML would have held)."""
    current = None
    for line in lines:
        header = re.match(r"^_{3,} (\S+) _{3,}$", line)
        if header:
            current = next(
                (
                    t
                    for name, t in tests.items()
                    if name.endswith(f"::{header.group(1)}")
                    and t["outcome"] in ("failed", "error")
                    and not t["message"]
                ),
                None,
            )
        elif current is not None and line.startswith("E "):
            current["message"] = line[1:].strip()[:500]
            current = None


def collect_fit(lines: list[str], scratch: Path) -> dict[str, object]:
    """The run record's summary (memory categories included) and environment."""
    record = json.loads((scratch / "fit" / "run.json").read_text())
    summary = record["summary"]
    return {
        "status": summary["status"],
        "final_loss": summary.get("final_loss"),
        "tokens_per_sec": (summary.get("tokens_per_sec") or {}).get("median"),
        "mfu": (summary.get("mfu") or {}).get("median"),
        "mfu_measured": (summary.get("mfu_measured") or {}).get("median"),
        "memory_method": summary.get("memory_method"),
        "tensor_method": summary.get("tensor_method"),
        "peak_memory_bytes": summary.get("peak_memory_bytes"),
        "peak_tensor_bytes": summary.get("peak_tensor_bytes"),
        "tensor_breakdown": summary.get("tensor_breakdown"),
        "environment": record.get("environment"),
        "fallbacks": record.get("fallbacks"),
    }


COLLECTORS: dict[str, Callable[[list[str], Path], dict[str, object]]] = {
    "results": lambda lines, scratch: result_lines(lines),
    "pytest": collect_pytest,
    "fit": collect_fit,
}


def tail(lines: list[str]) -> str:
    return "\n".join(lines[-TAIL_LINES:])[-TAIL_CHARS:]


def status_of(returncode: int | None, collected_error: str | None) -> str:
    if returncode is None:
        return "timeout"
    if returncode != 0:
        return "failed"
    return "failed" if collected_error else "ok"


def run_lane(steps: tuple[Step, ...], out: Path, dry_run: bool, started_at: float) -> dict:
    """Runs ``steps`` in order; returns (and keeps writing) the lane's record."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-lane-"))
    env = step_environment(scratch, dry_run)
    record = {
        "lane": {
            "budget_s": LANE_BUDGET_S,
            "dry_run": dry_run,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "prepared": _manifest(),
            "gpu_test_files": gpu_test_files(),
            "compile_cache": restore_compile_cache(scratch / "compile_cache"),
        },
        "steps": {},
    }
    log_path, written = out / "lane.log", 0
    with log_path.open("w") as log_file:

        def log(text: str) -> None:
            nonlocal written
            if written < LOG_LIMIT_BYTES:
                log_file.write(text)
                written += len(text)
                if written >= LOG_LIMIT_BYTES:
                    log_file.write("\n[lane.log truncated at 15 MiB]\n")

        for step in steps:
            left = LANE_BUDGET_S - (time.time() - started_at)
            timeout = step_timeout(step, dry_run, left)
            argv = command(step, scratch, dry_run)
            entry: dict[str, object] = {"what": step.what, "command": " ".join(argv), "timeout_s": timeout}
            if timeout < min(step.timeout_s, MIN_STEP_S):
                entry.update(status="skipped", message=f"lane budget spent ({left:.0f} s left)")
                record["steps"][step.name] = entry
                _write(out, record)
                print(f"[lane] {step.name}: skipped, lane budget spent", flush=True)
                continue
            print(f"[lane] {step.name}: {step.what} (limit {timeout} s)", flush=True)
            log(f"\n===== {step.name}: {' '.join(argv)}\n")
            returncode, seconds, lines = run_step(argv, timeout, env, log)
            log(f"===== {step.name}: returncode {returncode}, {seconds:.1f} s\n")
            log_file.flush()
            error = None
            try:
                results = COLLECTORS[step.collect](lines, scratch)
            except (OSError, ValueError, KeyError) as err:  # a step that died before writing what is read
                results, error = {}, f"{type(err).__name__}: {err}"
            entry.update(
                status=status_of(returncode, error),
                returncode=returncode,
                seconds=round(seconds, 1),
                results=results,
                tail=tail(lines),
            )
            if error:
                entry["collect_error"] = error
            record["steps"][step.name] = entry
            record["lane"]["elapsed_s"] = round(time.time() - started_at, 1)
            _write(out, record)
            figures = ", ".join(f"{k}={results[k]}" for k in HEADLINES.get(step.name, ()) if k in results)
            print(
                f"[lane] {step.name}: {entry['status']} in {seconds:.1f} s" + (f": {figures}" if figures else ""),
                flush=True,
            )
    record["lane"]["compile_cache"]["saved"] = save_compile_cache(scratch / "compile_cache", out)
    record["lane"]["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write(out, record)
    shutil.rmtree(scratch, ignore_errors=True)  # what the steps left there (run.json, pytest.xml) is in the record
    return record


def restore_compile_cache(
    folder: Path, archive: Path = ROOT / "benchmarks" / "gpu" / "wheels" / COMPILE_CACHE
) -> dict[str, object]:
    """Unpacks a carried ``COMPILE_CACHE`` (from an earlier lane run's ``--out``) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if not archive.is_file():
        return {"restored": False}
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return {"restored": True, "bytes": archive.stat().st_size}


def save_compile_cache(folder: Path, out: Path, limit: int = COMPILE_CACHE_LIMIT) -> str:
    """``folder`` as ``out/COMPILE_CACHE`` when it is small enough to come back from the device."""
    archive = out / COMPILE_CACHE
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("inductor", "triton"):
            if (folder / name).is_dir():
                tar.add(folder / name, arcname=name)
    size = archive.stat().st_size
    if size > limit:
        archive.unlink()
        return f"not saved: {size / 2**20:.1f} MiB > {limit / 2**20:.1f} MiB"
    return f"{archive.name}, {size / 2**20:.1f} MiB"


def _manifest() -> dict | None:
    path = ROOT / "benchmarks" / "gpu" / "wheels" / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _write(out: Path, record: dict) -> None:
    tmp = out / ".lane.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, out / "lane.json")


HEADLINES: dict[str, tuple[str, ...]] = {
    "env": ("gpu", "torch", "torch_cuda", "triton", "transformers", "lightning"),
    "gpu_tests": ("selected", "passed", "failed", "error", "skipped"),
    "mesh_sim": ("sim_dimensions_ok", "sim_dp_shard", "sim_dp_replicate", "sim_tp", "sim_cp", "sim_ep", "sim_pp"),
    "mfu_seed": ("seed_useful_tokens_per_s", "seed_lit_vs_hand", "seed_mfu", "seed_mfu_seed_formula", "seed_attention"),
    "mfu_dense": ("dense_useful_tokens_per_s", "dense_mfu", "dense_mfu_measured", "dense_attention", "dense_loss"),
    "loss": (
        "liger_memory_ratio",
        "cce_memory_ratio",
        "chunked_memory_ratio",
        "liger_best_chunk_tokens",
        "liger_best_time_ratio",
    ),
    "moe": ("grouped_speedup", "grouped_speedup_vs_hf_eager"),
    "fp8": ("fp8_tensorwise_speedup", "fp8_rowwise_speedup", "fp8_kernels"),
    "packing": ("packing_speedup", "packing_speedup_vs_grouped"),
    "dpo": ("dpo_chunked_memory_ratio", "dpo_liger_memory_ratio"),
    "fit": ("status", "tensor_method", "peak_tensor_bytes"),
}
"""The few figures of each step the closing table shows (all of them are in lane.json)."""


def summary_table(record: dict) -> str:
    lines = ["| step | status | s / limit | figures |", "|---|---|---|---|"]
    for name, entry in record["steps"].items():
        results = entry.get("results") or {}
        figures = ", ".join(f"{k}={results[k]}" for k in HEADLINES.get(name, ()) if k in results)
        if entry["status"] != "ok":
            figures = figures or (
                entry.get("collect_error") or entry.get("message") or _last_line(entry.get("tail", ""))
            )
        lines.append(f"| {name} | {entry['status']} | {entry.get('seconds', '-')} / {entry['timeout_s']} | {figures} |")
    return "\n".join(lines)


def step_table() -> str:
    """The steps, their limits and commands, as Markdown (the budget at a glance)."""
    lines = ["| step | limit (s) | what | command |", "|---|---|---|---|"]
    for step in STEPS:
        argv = " ".join(a.replace("{python}", "python") for a in step.argv)
        lines.append(f"| {step.name} | {step.timeout_s} | {step.what} | `{argv}` |")
    reserves = INSTALL_RESERVE_S + FINISH_RESERVE_S
    total = sum(s.timeout_s for s in STEPS)
    lines.append(f"| (install, finish) | {reserves} | pip install of the wheels; lane.json and the table | |")
    lines.append(f"| **total** | **{total + reserves}** | of the {LANE_BUDGET_S} s budget | |")
    return "\n".join(lines)


def _last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")[:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="every step on the CPU with tiny shapes (prepare runs it)"
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(Path(tempfile.gettempdir()) / "lit-ablate-gpu-lane"),
        help="where lane.json and lane.log go (default: $OUT, the device's returned folder)",
    )
    parser.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], help="run these steps only")
    parser.add_argument("--list", action="store_true", help="print the step table (limits and commands) and exit")
    args = parser.parse_args()
    if args.list:
        print(step_table())
        return 0
    started_at = float(os.environ.get("LANE_STARTED_AT") or time.time() - INSTALL_RESERVE_S)
    steps = tuple(s for s in STEPS if not args.only or s.name in args.only)
    record = run_lane(steps, Path(args.out), args.dry_run, started_at)
    print(f"\nlane: {record['lane'].get('elapsed_s')} s of {LANE_BUDGET_S}; {Path(args.out) / 'lane.json'}\n")
    print(summary_table(record))
    return 0 if all(e["status"] == "ok" for e in record["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

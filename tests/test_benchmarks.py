"""Every benchmark's default path runs, at a smoke size, so none rots unseen (``benchmarks/mfu.py``
once failed at its default for weeks: no test ran it). Sizes are shrunk by the scripts' own flags,
never by a code path of their own: what runs is the code a user runs. The scripts run in one
process (``tests/benchmark_smoke.py``: imports paid once); each must exit 0 and print its headline
``RESULT`` lines. Their figures mean nothing at this size and are not checked, except those that
hold at any size (``test_lora_memory_s_state_estimate_equals_the_measured_bytes``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_BENCHMARKS = {"model_shapes.py", "kernels_here.py", "lockstep.py"}
"""Modules the benchmarks import, not scripts."""

COUNTED_BUDGETS = {"lit_extra_ops_per_step": 36, "lit_extra_calls_per_step": 2200}
"""What ``lit-ablate fit`` may do per step beyond the hand-written loop in the smoke's window (``overhead.py
--count --shape dispatch --steps 9``: steps 6-8, none of them a logging step), measured at 34.0 ATen operators
and 1,902 main-thread Python calls. Over 25 steps, logging steps included: 35.2 and 2,272
(benchmarks/README.md, *overhead*)."""

SMOKE: dict[str, tuple[list[str], set[str]]] = {
    "mfu.py": (  # eager layers: inductor's cold compile would add ~20 s here (compiled layers are tested elsewhere)
        [
            "--layers",
            "1",
            "--seq-len",
            "64",
            "--rows",
            "2",
            "--accumulate",
            "2",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--no-compile",
        ],
        {"cpu_mfu_measured", "cpu_lit_vs_hand", "cpu_useful_tokens_per_s"},
    ),
    "overhead.py": (
        ["--steps", "8", "--repeats", "1", "--shape", "dispatch"],
        {"overhead_ratio", "vs_hf_trainer_ratio", "lit_extra_ms", "trainer_extra_ms"},
    ),
    "overhead.py:count": (["--count", "--shape", "dispatch", "--steps", "9"], set(COUNTED_BUDGETS)),
    "packing.py": (
        ["--examples", "16", "--median", "16", "--max-len", "64", "--repeats", "1"],
        {"packing_speedup", "packing_speedup_vs_grouped"},
    ),
    "loss_memory.py": (["--vocab", "256", "--tokens", "64", "--hidden", "32"], {"chunked_memory_ratio"}),
    "moe.py": (["--shapes", "tiny", "--tokens", "32", "--repeats", "1"], {"grouped_speedup", "grouped_fallback"}),
    "fp8.py": (
        ["--shape", "tiny-qwen3", "--layers", "1", "--seq-len", "32", "--steps", "1", "--tokens", "32", "--no-compile"],
        {"fp8_tensorwise_output_rel_error"},
    ),
    "dpo_memory.py": (
        ["--tokens", "64", "--vocab", "512", "--hidden", "32", "--chunk-tokens", "16"],
        {"dpo_chunked_memory_ratio"},
    ),
    "dpo_packing.py": (["--pairs", "8", "--repeats", "1", "--hidden", "32"], {"dpo_packing_speedup"}),
    "lora_memory.py": (
        ["--seq-len", "64", "--steps", "4"],
        {f"tiny_{s}_state_estimate_over_measured" for s in ("full", "lora", "qlora")},
    ),
    "ring_attention.py": (["--lengths", "64", "--cp", "2", "--repeats", "1"], set()),
    "data_setup.py": (
        ["--mb", "0.05", "--memory-up-to-mb", "0.05", "--stream-batches", "20", "--workers", "1", "--out", ""],
        {"data_setup_cache_hit_ratio"},
    ),
    "regenerate_reports.py": (["--check"], {"studies", "reports_with_problems"}),
    "speed_verdicts.py": (
        ["--null-studies", "1", "--known-studies", "0", "--steps", "14"],
        {"false_speed_verdicts", "null_studies", "detected_differences", "known_studies"},
    ),
}
"""Per script: its arguments at smoke size, and RESULT names it must print."""


def test_every_benchmark_has_a_smoke_case():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - NOT_BENCHMARKS
    cases = {case.split(":", 1)[0] for case in SMOKE}
    assert scripts == cases, f"benchmarks without a smoke case: {sorted(scripts - cases)}"


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("benchmarks") / "smoke.json"
    scripts = {script: args for script, (args, _) in SMOKE.items()}
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "LIT_ABLATE_CACHE_DIR": str(out.parent / "cache"),
        "LIT_ABLATE_DATA_CACHE": str(out.parent / "data_cache"),
    }
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "benchmark_smoke.py"), str(out), json.dumps(scripts)],
        cwd=out.parent,
        env=env,
        timeout=900,
        check=True,
    )
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_the_benchmark_runs_and_prints_its_results(smoke_runs, script):
    run = smoke_runs[script]
    assert run["status"] == 0, f"{script} failed:\n{run['tail']}"
    missing = SMOKE[script][1] - set(run["results"])
    assert not missing, f"{script} printed no RESULT {sorted(missing)}:\n{run['tail']}"
    assert run["results"], f"{script} printed no RESULT line at all"


@pytest.mark.slow
def test_lora_memory_s_state_estimate_equals_the_measured_bytes(smoke_runs):
    """Parameters, gradients and optimizer states are counted bytes, not timings: the estimate equals
    what the tensor tracker measures at any size (QLoRA's 0.4%: bitsandbytes' block scales, which the
    tracker does not see). Seen failing after frozen parameters became a category of their own: the
    benchmark compared the estimate's parameters with the trainable ones alone (LoRA 2.397)."""
    results = smoke_runs["lora_memory.py"]["results"]
    for setup in ("full", "lora", "qlora"):
        assert float(results[f"tiny_{setup}_state_estimate_over_measured"]) == pytest.approx(1.0, abs=0.01), results


@pytest.mark.slow
def test_the_framework_s_work_per_step_stays_within_its_budget(smoke_runs):
    """Operators and Python calls per step are counted, not timed: the same on any machine and load (the
    operators exactly, the calls within a few per step). Seen failing with Lightning's default profiler in
    place of ``NoProfiler`` (2,526 calls per step) and with the step clock cloning its sums before the copy
    (37 operators)."""
    results = smoke_runs["overhead.py:count"]["results"]
    over = {name: float(results[name]) for name, budget in COUNTED_BUDGETS.items() if float(results[name]) > budget}
    assert not over, f"over the budget {COUNTED_BUDGETS}: {over}"

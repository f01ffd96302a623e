"""The study report's memory: the measured tensor peak is the main column (its ratio is memory ×),
the process peak stays as a labelled secondary column, the estimator's categories are held
against the measured ones, and the categories are drawn stacked beside the estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_ablate.ablation.report import render_markdown, write_report
from lit_ablate.ablation.summary import study_summary
from lit_ablate.estimate.agreement import AGREEMENT_FACTORS
from lit_ablate.estimate.from_config import estimate_for_config
from lit_ablate.record import SCHEMA_VERSION, summarize_steps
from tests.test_ablation_report import make_study

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
MIB = 2**20


def _record(variant: str, config: dict, categories: dict[str, int], forward_backward: int, rss_mib: float) -> dict:
    """A run whose tracked step (3) held ``categories`` at its peak (each also its own maximum)."""
    peak = sum(categories.values())
    breakdown = {
        "method": "cpu_tracked_tensors",
        "rank": 0,
        "at_peak": categories,
        "max": categories,
        "forward_backward_max": forward_backward,
    }
    steps = [
        {
            "step": s,
            "loss": 1.0,
            "tokens_per_sec": 10.0,
            "useful_tokens_per_sec": 10.0,
            "step_time_s": 1.0,
            "memory_peak_bytes": int(rss_mib * MIB),
            "memory_peak_bytes_per_rank": [int(rss_mib * MIB)] * 2,
            **(
                {
                    "tensor_peak_bytes": peak,
                    "tensor_peak_bytes_per_rank": [peak, peak - 1],
                    "tensor_breakdown": breakdown,
                }
                if s == 3
                else {}
            ),
        }
        for s in range(1, 6)
    ]
    summary = summarize_steps(steps, 3)
    summary.update(status="ok", message=None, memory_method="cpu_process_peak_rss")
    return {
        "schema_version": SCHEMA_VERSION,
        "variant": variant,
        "seed": 0,
        "config": config,
        "warmup_steps": 3,
        "environment": {"device_name": "cpu", "device_type": "cpu", "world_size": 1},
        "model": {"total": 1},
        "fallbacks": [],
        "steps": steps,
        "summary": summary,
    }


@pytest.fixture(scope="module")
def config() -> dict:
    from lit_ablate.fit_cli import resolve_fit_config

    return resolve_fit_config(["--config", str(QUICKSTART)])


def _records(config: dict) -> list[dict]:
    estimate = estimate_for_config(config, 1)
    exact = {
        "params": estimate.params,
        "grads": estimate.grads,
        "optimizer": estimate.optimizer,
        "activations": estimate.activations,
        "temporaries": 0,
        "transient": estimate.transient,
    }
    # the second variant measured three times the activations the estimator predicts, at a smaller RSS
    tripled = {**exact, "activations": 3 * estimate.activations}
    return [
        _record("agrees", config, exact, estimate.activations, rss_mib=500),
        _record("more_activations", config, tripled, 3 * estimate.activations, rss_mib=400),
    ]


def test_the_tensor_peak_is_the_main_column_and_the_estimate_is_checked_per_category(config):
    records = _records(config)
    plan = {"name": "m", "baseline": "agrees", "variants": [{"name": "agrees"}, {"name": "more_activations"}]}
    summary = study_summary(plan, [(f"runs/{r['variant']}/seed0/run.json", r) for r in records])
    base, other = summary["variants"]
    peaks = [r["summary"]["peak_tensor_bytes"] for r in records]
    assert base["peak_tensor_bytes"]["median"] == peaks[0] and other["peak_tensor_bytes"]["median"] == peaks[1]
    # memory x follows the tensor peak (up), not the resident set (down from 500 to 400 MiB)
    assert other["memory_ratio"] == pytest.approx(peaks[1] / peaks[0]) and other["memory_ratio"] > 1
    assert all(r["agrees"] for r in base["estimate_vs_measured"].values())
    off = {c for c, r in other["estimate_vs_measured"].items() if not r["agrees"]}
    assert off == {"activations"} and other["estimate_vs_measured"]["activations"]["ratio"] == pytest.approx(1 / 3)
    table = render_markdown(summary)
    assert "| peak tensor memory | process peak |" in table and "| est. ÷ measured |" in table
    assert "| agrees |" in table and "| activations ×0.33 |" in table
    assert "500 MiB (cpu_process_peak_rss)" in table  # the resident set, labelled, still there
    assert f"activations ×{AGREEMENT_FACTORS['activations']:g}" in table  # the factors are stated


def test_the_category_plot_is_drawn_when_runs_tracked_their_tensors(config, tmp_path):
    records = _records(config)
    plan = {"name": "m", "baseline": "agrees", "variants": [{"name": "agrees"}, {"name": "more_activations"}]}
    directory = make_study(tmp_path, records, plan)
    report = json.loads(write_report(directory).with_name("report.json").read_text())
    assert "memory_categories.png" in report["plots"] and (directory / "memory_categories.png").stat().st_size > 0
    assert report["variants"][0]["estimated_memory_categories"]["activations"] > 0

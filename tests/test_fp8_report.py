"""The study report's per-step loss difference from the baseline (``lit_ablate.ablation.loss_divergence``),
which the fp8 studies read, and its fp8 column (real or emulated, from each run's record).

Catches a delta taken against the wrong curve or step (values checked step by step against the
hand-made curves), a sign flip, and an emulated fp8 run not marked as such.
"""

from __future__ import annotations

from lit_ablate.ablation.report import render_markdown
from lit_ablate.ablation.summary import study_summary
from tests.test_ablation_report import make_record

PLAN = {
    "name": "precision",
    "baseline": "fp32",
    "variables": ["model.init_args.model.fp8"],
    "seeds": [0, 1],
    "steps": 8,
    "warmup_steps": 1,
    "variants": [{"name": n} for n in ("fp32", "fp8")],
}


def _runs() -> list[tuple[str, dict]]:
    base = [4.0 - 0.25 * i for i in range(8)]
    runs = []
    for seed in (0, 1):
        fp32 = make_record("fp32", seed, speed=100.0, peak_mib=10, losses=[x + 0.01 * seed for x in base])
        fp8 = make_record(
            "fp8", seed, speed=100.0, peak_mib=10, losses=[x + 0.01 * seed + 0.002 * i for i, x in enumerate(base)]
        )  # drifts: +0.002 per step
        fp8["environment"]["fp8"] = "emulated"
        runs += [(f"runs/fp32/seed{seed}/run.json", fp32), (f"runs/fp8/seed{seed}/run.json", fp8)]
    return runs


def test_each_step_s_loss_difference_and_the_emulated_mark():
    summary = study_summary(PLAN, _runs())
    fp32, fp8 = summary["variants"]
    assert fp32["loss_delta_by_step"] is None and fp32["fp8"] is None and fp8["fp8"] == "emulated"
    series = fp8["loss_delta_by_step"]
    assert series["step"] == list(range(1, 9))
    assert all(abs(d - 0.002 * i) < 1e-12 for i, d in enumerate(series["delta"]))
    page = render_markdown(summary)
    assert "## Loss difference from the baseline (fp32) by step" in page
    assert "| fp8 | emulated | +0.0000 | +0.0020 | +0.0060 | +0.0100 | +0.0140 | 0.0140 (8) |" in page

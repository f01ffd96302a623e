"""DPO's preference series reach the run record's summary and the study report: the reward accuracy
and margin of the last step (``record.FINAL_VALUE_SERIES``), median [min-max] over seeds, in
columns that appear only when some run is a DPO run."""

from __future__ import annotations

import json

import pytest

from lit_ablate.ablation.report import write_report
from lit_ablate.record import summarize_steps, write_record
from tests.test_ablation_report import make_record


def _study(tmp_path, preference: dict[str, list[tuple[float, float]]] | None) -> str:
    """Two variants x two seeds; with ``preference``, every step carries (reward_accuracy, reward_margin)
    and the last step the given values."""
    plan = {
        "name": "dpo",
        "baseline": "a",
        "variables": ["x"],
        "axes": {"x": [1, 2]},
        "seeds": [0, 1],
        "steps": 3,
        "warmup_steps": 1,
        "expect_equal_loss": None,
        "variants": [{"name": n, "axis_values": {"x": i}} for i, n in enumerate("ab")],
    }
    for name in "ab":
        for seed in (0, 1):
            record = make_record(name, seed, speed=100.0, peak_mib=100, losses=[0.7, 0.6, 0.5])
            if preference:
                for step in record["steps"]:
                    step.update(reward_accuracy=0.0, reward_margin=-1.0)  # earlier steps: not what is reported
                record["steps"][-1].update(zip(("reward_accuracy", "reward_margin"), preference[name][seed]))
                record["summary"] = {**summarize_steps(record["steps"], 1), "status": "ok"}
            write_record(tmp_path / "runs" / name / f"seed{seed}" / "run.json", record)
    (tmp_path / "study.json").write_text(json.dumps(plan))
    assert write_report(tmp_path)
    return (tmp_path / "report.md").read_text()


def test_report_shows_the_last_steps_reward_accuracy_and_margin(tmp_path):
    text = _study(tmp_path / "dpo", {"a": [(0.5, 0.1), (0.75, 0.3)], "b": [(1.0, 2.0), (1.0, 2.0)]})
    table = text[text.index("| variant") :].split("\n\n")[0]  # the variants table (other tables follow)
    header, _, row_a, row_b = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    accuracy, margin = header.index("reward accuracy"), header.index("reward margin")
    assert row_a[accuracy] == "62.5% [50.0%–75.0%]" and row_b[accuracy] == "100.0%"
    assert row_a[margin] == "0.2 [0.1–0.3]" and row_b[margin] == "2"
    summary = json.loads((tmp_path / "dpo" / "report.json").read_text())
    assert summary["variants"][0]["reward_accuracy"] == {"median": 0.625, "min": 0.5, "max": 0.75, "n": 2}
    assert summary["variants"][1]["reward_margin"]["median"] == pytest.approx(2.0)
    assert "reward accuracy" not in _study(tmp_path / "lm", None)

"""``lit-ablate ablate`` end to end with real ``lit-ablate fit`` runs (a tiny model, 3 steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lit_ablate.commands.ablate import ablate_main
from lit_ablate.commands.report import report_main
from lit_ablate.record import read_record

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
MONITORS = [{"class_path": f"lit_ablate.callbacks.{name}"} for name in ("ThroughputMonitor", "MemoryMonitor")]


@pytest.mark.slow
def test_loss_backend_study_runs_reports_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    study = {
        "name": "losses",
        "base": str(QUICKSTART),
        "overrides": {
            "model.init_args.model.config.num_hidden_layers": 1,
            "data.init_args.source.init_args.num_documents": 40,
            "data.init_args.seq_len": 32,
            "data.init_args.batch_size": 2,
            "data.init_args.val_examples": 2,
            "trainer.limit_val_batches": 0,
            "trainer.enable_checkpointing": False,
            "trainer.callbacks": MONITORS,
        },
        "variants": [
            {"name": "torch"},
            {"name": "chunked", "overrides": {"model.init_args.loss": "chunked"}},
            {"name": "typo", "overrides": {"model.init_args.loss": "nonexistent"}},
        ],
        "vary": ["model.init_args.loss"],
        "steps": 3,
        "warmup_steps": 1,
        "launch": {"devices": 1, "accelerator": "cpu", "timeout_s": 300},
        "expect_equal_loss": {"rtol": 1e-5, "atol": 1e-6},
    }
    path = tmp_path / "losses.yaml"
    path.write_text(yaml.safe_dump(study))
    out = tmp_path / "out"
    assert ablate_main(["--config", str(path), "--output_dir", str(out), "--dry-run"]) == 2
    plan = capsys.readouterr().out
    assert "chunked seed0" in plan and "fails: config refused: model.init_args.loss='nonexistent'" in plan
    assert not out.exists(), "a dry run runs nothing and writes nothing"
    # a bad variant refuses the study before its first run: nothing trained, nothing written
    assert ablate_main(["--config", str(path), "--output_dir", str(out)]) == 2
    assert "variants=['typo']" in capsys.readouterr().err and not out.exists()
    study["variants"] = study["variants"][:2]
    path.write_text(yaml.safe_dump(study))
    assert ablate_main(["--config", str(path), "--output_dir", str(out)]) == 0

    records = {name: read_record(out / "runs" / name / "seed0" / "run.json") for name in ("torch", "chunked")}
    assert records["torch"]["summary"]["status"] == "ok" and len(records["torch"]["steps"]) == 3
    assert records["chunked"]["summary"]["status"] == "ok"
    text = (out / "report.md").read_text()
    assert "| chunked | ok |" in text and "| pass, max abs diff" in text
    assert (out / "loss.png").is_file()
    summary = json.loads((out / "report.json").read_text())
    assert summary["variants"][0]["estimated_memory_bytes"] > 0, "the estimate is shown beside the measurement"

    # resume: every run is finished, so nothing is launched and no record changes
    before = {name: (out / "runs" / name / "seed0" / "run.json").read_bytes() for name in records}
    produced = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert ablate_main(["--config", str(path), "--output_dir", str(out)]) == 0
    assert before == {name: (out / "runs" / name / "seed0" / "run.json").read_bytes() for name in records}
    # the report is a function of the records: re-rendered, it is the same bytes
    assert report_main([str(out)]) == 0
    assert produced == {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

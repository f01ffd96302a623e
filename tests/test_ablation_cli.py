"""``lit-ablate ablate`` end to end with real ``lit-ablate fit`` runs (a tiny model, 3 steps)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
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


@pytest.mark.slow
def test_a_study_measures_its_variants_in_turns_and_judges_speed_with_an_interval(tmp_path: Path):
    """Issue 48 end to end: real fits of a 2-layer baseline, a twin that cannot differ in speed (its model
    summary is printed before training) and an 8-layer model take turns, one block of steps each per round,
    with a CPU-bound process started mid-study. Each record holds its ten blocks, whose steps' times leave out
    the waits for a turn (a block's first step is shorter than the wait before it; seen failing with
    ``TurnTaking`` not pausing the step clock); the twin is never called faster or slower, and the deeper
    model never faster."""
    study = {
        "name": "speed",
        "base": str(QUICKSTART),
        "overrides": {
            "data.init_args.source.init_args.num_documents": 200,
            "data.init_args.seq_len": 64,
            "data.init_args.batch_size": 4,
            "trainer.limit_val_batches": 0,
            "trainer.enable_checkpointing": False,
            "trainer.callbacks": MONITORS,
        },
        "variants": [
            {"name": "base", "overrides": {"model.init_args.model.config.num_hidden_layers": 2}},
            {
                "name": "twin",
                "overrides": {
                    "model.init_args.model.config.num_hidden_layers": 2,
                    "trainer.enable_model_summary": False,
                },
            },
            {"name": "deep", "overrides": {"model.init_args.model.config.num_hidden_layers": 8}},
        ],
        "vary": ["model.init_args.model.config.num_hidden_layers", "trainer.enable_model_summary"],
        "steps": 12,
        "warmup_steps": 2,
        "launch": {"devices": 1, "accelerator": "cpu", "timeout_s": 600},
        "speed": {"interleave": "steps"},
    }
    path = tmp_path / "speed.yaml"
    path.write_text(yaml.safe_dump(study))
    out = tmp_path / "out"
    burner = threading.Timer(12.0, _burn_for, args=(4.0,))
    burner.start()
    try:
        assert ablate_main(["--config", str(path), "--output_dir", str(out)]) == 0
    finally:
        burner.cancel()
        burner.join()
    for name in ("base", "twin", "deep"):
        record = read_record(out / "runs" / name / "seed0" / "run.json")
        blocks = record["speed_blocks"]["blocks"]
        assert record["speed_blocks"]["design"] == "steps" and [b["round"] for b in blocks] == list(range(1, 11))
        steps = {s["step"]: s["step_time_s"] for s in record["steps"]}
        waited = [b for b in blocks if b["waited_s"] > 0.2]  # behind another run's turn
        assert waited and all(steps[b["first_step"]] < b["waited_s"] for b in waited), (name, blocks)
    speed = {v["name"]: v["speed"] for v in json.loads((out / "report.json").read_text())["variants"]}
    assert speed["twin"]["verdict"] in ("no difference detected", "inconclusive"), speed["twin"]
    assert speed["deep"]["verdict"] in ("slower", "inconclusive") and speed["deep"]["ratio"] < 1, speed["deep"]


def _burn_for(seconds: float) -> None:
    """A CPU-bound process in its own session for ``seconds``: another job's load on the machine."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    time.sleep(seconds)
    process.kill()
    process.wait()

"""The research-code examples keep working: they are the documented extension points."""

import math
from pathlib import Path

from lit_ablate.cli import main
from lit_ablate.record import RECORD_PATH_ENV, read_record

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")


def test_custom_metric_lands_in_the_run_record(tmp_path, monkeypatch):
    monkeypatch.setenv(RECORD_PATH_ENV, str(tmp_path / "run.json"))
    main(["fit", "--config", QUICKSTART, "--trainer.max_steps", "3",
          "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
          "--trainer.callbacks+=examples.custom_metric.GradNormMonitor"])
    steps = read_record(tmp_path / "run.json")["steps"]
    norms = [s["grad_norm"] for s in steps]
    assert len(norms) == 3 and all(n is not None and math.isfinite(n) and n > 0 for n in norms)

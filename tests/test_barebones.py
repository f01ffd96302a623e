"""``trainer.barebones`` (Lightning's mode for timing its own loop): a config that asks for nothing it turns
off trains, measures and records its run, quietly.

Seen failing with lit-ablate's CSV logger still added under barebones (Lightning's refusal of any logger,
a stack trace from ``Trainer``) and with the module's loss still logged on the last step (Lightning's
warning that ``self.log`` does nothing under barebones). The refusals of a key it turns off are rows of
``tests/test_bad_inputs.py`` (``barebones_*``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from lit_ablate.fit_cli import LitAblateCLI

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
MONITORS = "[lit_ablate.callbacks.ThroughputMonitor, lit_ablate.callbacks.MemoryMonitor]"


def test_a_barebones_fit_trains_measures_and_records_its_run_quietly(tmp_path):
    args = ["--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "6"]
    args += ["--trainer.limit_val_batches", "0", "--trainer.callbacks", MONITORS]
    args += ["--trainer.barebones", "true", "--trainer.log_every_n_steps", "null"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = LitAblateCLI(args=args, run=False)
        cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 6
    assert cli.trainer.logger is None and not cli.trainer.checkpoint_callbacks
    barebones_warnings = [str(w.message) for w in caught if "Trainer(barebones=True)" in str(w.message)]
    assert not barebones_warnings, barebones_warnings
    (record_path,) = tmp_path.rglob("run.json")
    record = json.loads(record_path.read_text())
    summary = record["summary"]
    assert summary["status"] == "ok", summary["message"]
    assert summary["useful_tokens_per_sec"]["n"] == 3 and summary["useful_tokens_per_sec"]["median"] > 0
    assert summary["tensor_breakdown"]["at_peak"]["optimizer"] > 0

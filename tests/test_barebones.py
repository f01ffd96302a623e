"""``trainer.barebones`` (Lightning's mode for timing its own loop): a config that asks for nothing it turns
off trains, measures and records its run, quietly.

Seen failing with lit-ablate's CSV logger still added under barebones (Lightning's refusal of any logger,
a stack trace from ``Trainer``) and with the module's loss still logged on the last step (Lightning's
warning that ``self.log`` does nothing under barebones). Each key it turns off is refused with a fix that
builds the trainer (``test_each_key_barebones_turns_off_is_refused_with_a_fix_lightning_takes``; a wrong
fix, ``null`` for ``fast_dev_run`` and ``detect_anomaly``, was the parser's refusal); how a refusal reaches
the terminal: ``tests/test_bad_inputs.py``'s rows ``barebones_*``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from lit_ablate.errors import ConfigError
from lit_ablate.fit_cli import LitAblateCLI, resolve_fit_config
from lit_ablate.rules import check_run
from lit_ablate.run_config import BAREBONES_OFF

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
MONITORS = "[lit_ablate.callbacks.ThroughputMonitor, lit_ablate.callbacks.MemoryMonitor]"


def test_a_barebones_fit_trains_measures_and_records_its_run_quietly(tmp_path):
    args = ["--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "6"]
    args += ["--trainer.limit_val_batches", "0", "--trainer.callbacks", MONITORS]
    args += ["--trainer.barebones", "true", "--trainer.log_every_n_steps", "0"]  # as its refusal says
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


ASKING = {
    "enable_checkpointing": "true",
    "logger": "true",
    "enable_progress_bar": "true",
    "log_every_n_steps": "5",
    "enable_model_summary": "true",
    "num_sanity_val_steps": "2",
    "fast_dev_run": "true",
    "detect_anomaly": "true",
    "profiler": "simple",
}


@pytest.mark.parametrize("key", list(BAREBONES_OFF))
def test_each_key_barebones_turns_off_is_refused_with_a_fix_lightning_takes(key, tmp_path):
    bare = ["--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks", MONITORS]
    bare += ["--trainer.barebones", "true", "--trainer.log_every_n_steps", "0"]
    with pytest.raises(ConfigError) as refused:
        check_run(resolve_fit_config([*bare, f"--trainer.{key}", ASKING[key]]))
    assert refused.value.key == f"trainer.{key}"
    fix = refused.value.fix.rsplit("set it to ", 1)[1]
    fixed = [*bare, f"--trainer.{key}", fix]
    check_run(resolve_fit_config(fixed))
    assert LitAblateCLI(args=fixed, run=False).trainer.barebones

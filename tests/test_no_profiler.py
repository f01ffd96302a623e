"""With no ``trainer.profiler`` configured, a run's trainer profiles nothing at no cost per hook
(``NoProfiler``); a configured profiler is used as configured.

``test_a_fit_makes_no_profiler_context_per_hook`` was seen failing with the default left to Lightning's
``PassThroughProfiler`` (the generator of Lightning's ``Profiler.profile`` entered 306 times in the
2-step fit); ``test_a_configured_profiler_sees_every_hook`` with ``NoProfiler`` put in place of the configured
``simple`` (no hook recorded), and ``test_the_trainer_profiles_with_no_profiler_unless_one_is_configured``
with ``NoProfiler`` also under ``barebones`` (Lightning's refusal of any profiler there).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.profilers import PassThroughProfiler, Profiler, SimpleProfiler

from lit_ablate.fit_cli import LitAblateCLI
from lit_ablate.no_profiler import NoProfiler

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")


def _cli(root: Path, *overrides: str) -> LitAblateCLI:
    return LitAblateCLI(
        args=[
            "--config",
            QUICKSTART,
            "--trainer.default_root_dir",
            str(root),
            "--trainer.max_steps",
            "2",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks",
            "[]",
            *overrides,
        ],
        run=False,
    )


def test_the_trainer_profiles_with_no_profiler_unless_one_is_configured(tmp_path):
    assert type(_cli(tmp_path).trainer.profiler) is NoProfiler
    assert type(_cli(tmp_path, "--trainer.profiler", "simple").trainer.profiler) is SimpleProfiler
    # barebones: Lightning refuses any profiler beside it, so its own (pass-through) stays
    barebones = _cli(tmp_path, "--trainer.barebones", "true", "--trainer.log_every_n_steps", "null")
    assert type(barebones.trainer.profiler) is PassThroughProfiler


def test_a_fit_makes_no_profiler_context_per_hook(tmp_path):
    cli = _cli(tmp_path)
    generator_code = Profiler.profile.__wrapped__.__code__  # the generator behind Lightning's context manager
    runs = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is generator_code:
            runs.append(frame)

    sys.setprofile(watch)
    try:
        cli.trainer.fit(cli.model, cli.datamodule)
    finally:
        sys.setprofile(None)
    assert cli.trainer.global_step == 2
    assert not runs, f"Lightning's Profiler.profile ran {len(runs)} times"


def test_a_configured_profiler_sees_every_hook(tmp_path):
    cli = _cli(tmp_path, "--trainer.profiler", "simple")
    cli.trainer.fit(cli.model, cli.datamodule)
    actions = set(cli.trainer.profiler.recorded_durations)
    assert "[LightningModule]CausalLM.optimizer_step" in actions
    assert any(a.startswith("[Callback]") and a.endswith("on_train_batch_end") for a in actions), sorted(actions)

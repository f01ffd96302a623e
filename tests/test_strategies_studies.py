"""The strategy studies and the FSDP2 config are valid: every variant resolves as ``fit`` would
resolve it, and the variants differ only in the variables each study declares.

Running them takes minutes (one launch per variant; their CPU reports are in
``benchmarks/results/``); the numerics they rely on are asserted in the other
``test_strategies_*`` files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_ablate.ablation.plan import plan_study
from lit_ablate.ablation.spec import load_study
from lit_ablate.fit_cli import resolve_fit_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

pytestmark = pytest.mark.slow  # ~35 config resolutions through LightningCLI: ~20-40 s on 2 loaded cores


@pytest.mark.parametrize(
    ("study", "variables", "variants"),
    [
        ("fsdp2_vs_hsdp", ["trainer.strategy"], 3),
        ("zero_stages", ["trainer.strategy", "trainer.accumulate_grad_batches", "data.init_args.batch_size"], 14),
        ("ml815_deepspeed", ["trainer.strategy", "trainer.accumulate_grad_batches", "data.init_args.batch_size"], 7),
        ("dp_scaling", ["trainer.strategy", "trainer.devices", "data.init_args.seq_len"], 12),
    ],
)
def test_study_plans_with_every_variant_resolved(study, variables, variants, tmp_path, monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)  # a study's file paths (ml815_deepspeed's JSON files) are the repository root's
    spec = load_study(CONFIGS / "studies" / f"{study}.yaml")
    assert list(spec.variables) == variables
    runs = plan_study(spec, tmp_path)
    assert len(runs) == variants
    assert [r.variant.name for r in runs if r.invalid] == []


def test_fsdp2_tiny_config_resolves_to_two_sharding_ranks():
    config = resolve_fit_config(["--config", str(CONFIGS / "fsdp2_tiny.yaml")])
    assert config["trainer"]["devices"] == 2
    assert config["trainer"]["strategy"]["class_path"] == "lit_ablate.strategies.FSDP2Strategy"
    assert config["trainer"]["strategy"]["init_args"]["dp_shard"] == -1

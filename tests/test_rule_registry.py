"""One registry of rules (``lit_ablate.rules``): a rule is added by writing it in one file, and every command
judges it in the scopes it can judge. A rule written beside a research part, in the part's own module, is
registered when a config names the part, and ``fit``, ``ablate --dry-run`` and ``estimate`` refuse with it;
the registry's lists are derived from each rule's scopes, never written by hand. Seen failing before the
registry: a rule added to the studies' list alone let ``fit`` start its ranks (twice: the pipeline objective
rule, the sequence-parallel adapters rule), and ``estimate`` judged no rule at all."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from lit_ablate.cli import main
from lit_ablate.commands.ablate import ablate_main
from lit_ablate.commands.estimate import estimate_main
from lit_ablate.rules import Scope, registry, rules_for

QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
SCRATCH = '''
"""A research part and the rule that guards it, in one file."""
from lightning.pytorch import Callback

from lit_ablate.errors import Refusal
from lit_ablate.rules import Scope, rule


class LearningRateProbe(Callback):
    """Stands for any part of one's own, named by class_path: importing it registers the rule below."""


@rule(Scope.CONFIG)
def learning_rate_is_tame(run):
    """The probe's study assumes learning rates of at most 0.01."""
    rate = run.model.option("learning_rate")
    if rate is not None and rate > 0.01:
        return Refusal("model.init_args.learning_rate", rate, "the probe assumes at most 0.01; use 0.01 or less")
    return None
'''
PROBE = "scratch_rules.LearningRateProbe"
REFUSAL = "model.init_args.learning_rate=0.02: the probe assumes at most 0.01; use 0.01 or less"


@pytest.fixture
def scratch_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``scratch_rules.py`` on the path; each command must import it itself (through the ``class_path`` it
    parses), and the rule leaves the registry with the test."""
    (tmp_path / "scratch_rules.py").write_text(SCRATCH)
    monkeypatch.syspath_prepend(str(tmp_path))
    rules_for(Scope.CONFIG)  # the package's own rules, registered before the copy
    monkeypatch.setattr(registry, "RULES", dict(registry.RULES))
    yield tmp_path
    sys.modules.pop("scratch_rules", None)


def forget_scratch_rule() -> None:
    sys.modules.pop("scratch_rules", None)
    registry.RULES.pop("learning_rate_is_tame", None)


def test_a_rule_in_one_file_refuses_fit_a_study_s_dry_run_and_estimate(scratch_module: Path, capsys) -> None:
    options = [f"--trainer.callbacks+={PROBE}", "--model.init_args.learning_rate", "0.02"]

    forget_scratch_rule()
    with pytest.raises(SystemExit) as fit:
        main(["fit", "--config", str(QUICKSTART), *options, "--trainer.default_root_dir", str(scratch_module / "f")])
    assert fit.value.code == 2 and capsys.readouterr().err.strip() == f"lit-ablate: error: {REFUSAL}"
    assert not (scratch_module / "f").exists()

    forget_scratch_rule()
    study = {
        "name": "probe",
        "base": str(QUICKSTART),
        "overrides": {"trainer.callbacks": [{"class_path": PROBE}]},
        "axes": {"model.init_args.learning_rate": [0.003, 0.02]},
        "steps": 2,
    }
    (scratch_module / "study.yaml").write_text(yaml.safe_dump(study))
    out = scratch_module / "out"
    assert ablate_main(["--config", str(scratch_module / "study.yaml"), "--output_dir", str(out), "--dry-run"]) == 2
    printed = capsys.readouterr().out
    assert f"fails: config refused: {REFUSAL}" in printed and not out.exists()

    forget_scratch_rule()
    assert estimate_main(["--config", str(QUICKSTART), *options]) == 2
    assert capsys.readouterr().err.strip() == f"lit-ablate estimate: error: {REFUSAL}"


def test_each_command_judges_the_scopes_it_can() -> None:
    """Every rule names its scopes; what each command judges is derived from them: ``fit`` the config and this
    machine, a local study the same, a SLURM study the config and its cluster's nodes, ``estimate`` the config."""
    every = rules_for(*Scope)
    assert every and all(registered.scopes for registered in every)
    names = {scope: {registered.name for registered in rules_for(scope)} for scope in Scope}
    assert "accelerator_present" in names[Scope.MACHINE] - names[Scope.CLUSTER]  # the login node's GPUs are no node's
    assert "fp8_runs_on_cluster_nodes" in names[Scope.CLUSTER] - names[Scope.MACHINE]
    assert "tensor_parallel_splits_the_model" in names[Scope.CONFIG]
    assert {"built_quantization_runs_under_strategy", "built_fp8_runs_under_strategy"} == names[Scope.BUILT_PARTS]

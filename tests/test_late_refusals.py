"""The last kinds of refusal that came late, now refused before any variant trains or any rank starts:

- a value only its class's constructor validates (a negative ``seq_len``): the study trained its other
  variant, then the run refused it and the study exited 0; now the planner makes every class a variant's
  config names, as ``fit`` does, once the rules have passed;
- a loss check over more steps than the runs train (``expect_equal_loss.steps`` > ``steps``): every run
  ran, then "LOSS DIFFERS" for identical losses;
- tensor parallelism over a dense MLP width ``tp`` does not divide: a traceback from every rank.

Seen failing before each change: the study planned the negative ``seq_len`` variant to run, parsed the check
of 5 steps in a 3-step study, and planned ``tp: 2`` over an MLP width of 97.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lit_ablate.ablation.plan import plan_study
from lit_ablate.ablation.spec import parse_study
from lit_ablate.cli import main
from lit_ablate.commands.ablate import ablate_main
from lit_ablate.errors import ConfigError
from lit_ablate.rules.mesh_shape import tensor_parallel_splits_the_model
from lit_ablate.strategies.tensor_parallel import tensor_parallel_shape_refusal

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
TP = "lit_ablate.strategies.TensorParallelStrategy"


def test_a_value_only_a_constructor_refuses_refuses_the_study_before_any_run(tmp_path: Path, capsys) -> None:
    study = {
        "name": "seq",
        "base": QUICKSTART,
        "axes": {"data.init_args.seq_len": [32, -4]},
        "steps": 2,
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    out = tmp_path / "out"
    assert ablate_main(["--config", str(tmp_path / "study.yaml"), "--output_dir", str(out)]) == 2
    printed = capsys.readouterr()
    assert "data.init_args.seq_len=-4: use a positive integer" in printed.out + printed.err
    assert not out.exists(), "nothing ran"


def test_a_loss_check_over_more_steps_than_the_runs_train_is_refused(tmp_path: Path) -> None:
    study = {"name": "steps", "base": QUICKSTART, "axes": {"model.init_args.loss": ["torch", "chunked"]}}
    with pytest.raises(ConfigError, match=r"expect_equal_loss\.steps=5: the runs train 3 steps; compare at most 3"):
        parse_study({**study, "steps": 3, "expect_equal_loss": {"steps": 5}})
    parse_study({**study, "steps": 3, "expect_equal_loss": {"steps": 3}})
    short = parse_study({**study, "overrides": {"trainer.max_steps": 3}, "expect_equal_loss": {"steps": 5}})
    with pytest.raises(ConfigError, match=r"expect_equal_loss\.steps=5: the runs train 3 steps"):
        plan_study(short, tmp_path / "out")  # the steps come from the config, known once it is resolved


def tensor_parallel(intermediate_size: int) -> dict:
    return {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": {"class_path": TP, "init_args": {"tp": 2}}},
        "model": {"init_args": {"model": {"preset": "tiny-llama", "config": {"intermediate_size": intermediate_size}}}},
    }


def test_tensor_parallelism_covers_the_mlp_width(tmp_path: Path, capsys) -> None:
    refusal = tensor_parallel_splits_the_model(tensor_parallel(97))
    assert refusal == "trainer.strategy.init_args.tp=2: the model's intermediate_size is 97; use a tp that divides it"
    assert tensor_parallel_splits_the_model(tensor_parallel(98)) is None
    moe = type("MoEConfig", (), {"num_experts": 8, "intermediate_size": 97, "vocab_size": 64})()
    assert tensor_parallel_shape_refusal(moe, 2) is None  # every layer an MoE block: they stay whole
    with pytest.raises(SystemExit) as fit:
        main(
            [
                "fit",
                "--config",
                QUICKSTART,
                "--trainer.devices",
                "2",
                "--trainer.strategy",
                TP,
                "--model.init_args.model.config",
                '{"intermediate_size": 97}',
                "--trainer.default_root_dir",
                str(tmp_path),
            ]
        )
    line = capsys.readouterr().err.strip()
    assert fit.value.code == 2 and "\n" not in line and "intermediate_size is 97" in line
    assert not any(tmp_path.iterdir()), "no rank started"

"""``trainer.strategy`` given as a string: a Lightning name (``ddp``), a class's dotted path (the README's
``lit_ablate.strategies.DDPStrategy``) or a lit-ablate strategy's own name (``FSDP2Strategy``).

Lightning takes a string only as a registry name, so a class path ended in its ``invalid strategy name:
'lit_ablate.strategies.ddpstrategy'`` with a traceback; now the path builds the class with its
``init_args``, in YAML and on the command line, the config view reads the same class (a study's planner
and the estimator see what the run builds), and a name that is neither is one line listing both kinds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lit_ablate.ablation.plan import plan_study
from lit_ablate.ablation.spec import parse_study
from lit_ablate.cli import main
from lit_ablate.config_keys import with_overrides
from lit_ablate.errors import ConfigError
from lit_ablate.record import read_record
from lit_ablate.run_config import RunConfig
from lit_ablate.strategies import DDPStrategy, FSDP2Strategy, HSDPStrategy

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


def _fit(tmp_path: Path, *args: str) -> dict:
    """A one-step quickstart fit with ``args``; returns its run record."""
    record = tmp_path / "run.json"
    main(
        [
            "fit",
            "--config",
            str(QUICKSTART),
            "--trainer.max_steps",
            "1",
            "--trainer.val_check_interval",
            "null",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--recorder.path",
            str(record),
            *args,
        ]
    )
    return read_record(record)


@pytest.mark.parametrize("form", ["yaml_path", "cli_name"])
def test_a_strategy_named_by_a_string_trains(form: str, tmp_path: Path) -> None:
    """The YAML path form (``trainer.strategy: lit_ablate.strategies.DDPStrategy``) and the command-line
    short name (``--trainer.strategy FSDP2Strategy``) train one step with the class they name, which the run
    record keeps as its ``class_path`` section with the class's defaults. Seen failing with the CLI's
    string-to-section step left out: Lightning's ``ValueError: You selected an invalid strategy name:
    'lit_ablate.strategies.ddpstrategy'`` (and ``'fsdp2strategy'``)."""
    if form == "yaml_path":
        config = tmp_path / "strategy.yaml"
        config.write_text(yaml.safe_dump({"trainer": {"strategy": "lit_ablate.strategies.DDPStrategy"}}))
        record, expected = _fit(tmp_path, "--config", str(config)), "lit_ablate.strategies.DDPStrategy"
    else:
        record, expected = _fit(tmp_path, "--trainer.strategy", "FSDP2Strategy"), "lit_ablate.strategies.FSDP2Strategy"
    assert record["summary"]["status"] == "ok"
    strategy = record["config"]["trainer"]["strategy"]
    assert strategy["class_path"] == expected and strategy["init_args"], strategy


def test_init_args_given_after_a_string_keep_its_class(tmp_path: Path) -> None:
    """``--trainer.strategy.init_args.x`` after the string form configures the named class: on the command
    line (jsonargparse) and in a study, whose dotted override turns the base's string into its section
    rather than a section without a class. Seen failing with ``set_dotted`` replacing the string by
    ``{init_args: {dp_shard: 2}}`` (no class_path: the variant's strategy read as no strategy)."""
    base = {"trainer": {"strategy": "lit_ablate.strategies.HSDPStrategy"}}
    merged = with_overrides(base, {"trainer.strategy.init_args.dp_shard": 2})
    assert merged["trainer"]["strategy"] == {
        "class_path": "lit_ablate.strategies.HSDPStrategy",
        "init_args": {"dp_shard": 2},
    }
    view = RunConfig.of(merged).trainer.strategy
    assert view.cls is HSDPStrategy and view.requested_mesh_sizes.dp_shard == 2


def test_the_view_reads_the_class_a_string_names() -> None:
    """The config view (rules, preflight, the estimator, the planner) reads the class a string names, with
    the class's defaults as its options; Lightning's names keep their registry class, compared without
    case as Lightning compares them. Seen failing with the view reading only registry names (the path
    read as no strategy: ``requested_mesh_sizes`` None for FSDP2Strategy)."""

    def strategy(value: str):
        return RunConfig.of({"trainer": {"strategy": value}}).trainer.strategy

    fsdp2 = strategy("FSDP2Strategy")
    assert fsdp2.cls is FSDP2Strategy and fsdp2.name == "lit_ablate.strategies.FSDP2Strategy"
    assert fsdp2.requested_mesh_sizes.dp_shard == -1 and fsdp2.names_a_class
    assert isinstance(fsdp2.build(), FSDP2Strategy)
    assert strategy("lit_ablate.strategies.DDPStrategy").cls is DDPStrategy
    from lightning.pytorch.strategies import DDPStrategy as LightningDDP

    for name in ("ddp", "DDP"):
        assert strategy(name).cls is LightningDDP and not strategy(name).names_a_class
    with pytest.raises(ConfigError) as refused:
        strategy("lit_ablate.strategies.FSDP3Strategy").check_name()
    line = str(refused.value)
    assert line.startswith("trainer.strategy='lit_ablate.strategies.FSDP3Strategy': not a strategy")
    assert line.endswith("did you mean FSDP2Strategy?") and "\n" not in line
    with pytest.raises(ConfigError) as refused:
        strategy("zzz").check_name()  # close to nothing: both lists
    assert "'FSDP2Strategy'" in str(refused.value) and "ddp" in str(refused.value)
    with pytest.raises(ConfigError):
        strategy("lit_ablate.run_config.RunConfig").check_name()  # imports, but is no strategy


def test_a_study_variant_may_name_its_strategy_by_a_string(tmp_path: Path) -> None:
    """A study's variants set ``trainer.strategy`` to a path and to a short name: the planner resolves each
    as ``fit`` would and reads the class it names (one variable, nothing refused), so the run builds
    what the plan judged. Seen failing with the view reading only registry names: both variants read
    as no strategy, their mesh unchecked."""
    study = parse_study(
        {
            "name": "by_name",
            "base": str(QUICKSTART),
            "steps": 1,
            "vary": ["trainer.strategy"],
            "variants": [
                {"name": "ddp", "overrides": {"trainer.strategy": "lit_ablate.strategies.DDPStrategy"}},
                {"name": "fsdp2", "overrides": {"trainer.strategy": "FSDP2Strategy"}},
            ],
        }
    )
    runs = plan_study(study, tmp_path / "study")
    assert [(r.variant.name, r.invalid, r.skip_reason) for r in runs] == [("ddp", None, None), ("fsdp2", None, None)]
    assert [RunConfig.of(r.config).trainer.strategy.cls for r in runs] == [DDPStrategy, FSDP2Strategy]

"""Study spec parsing, dotted overrides, the single-variable check and the compatibility rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lit_ablate.ablation.launch import Launch
from lit_ablate.ablation.plan import plan_study
from lit_ablate.ablation.single_variable import check_single_variable
from lit_ablate.ablation.spec import load_study, parse_study
from lit_ablate.config_keys import flatten, get_dotted, set_dotted, with_overrides
from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.rules import Scope, first_refusal, registry, rule
from lit_ablate.run_config import RunConfig

BASE = {
    "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 100},
    "model": {"class_path": "m.M", "init_args": {"loss": "torch", "model": {"preset": "tiny-llama"}}},
    "data": {"init_args": {"batch_size": 8}},
}


def study(**changes):
    raw = {"name": "s", "base": BASE, "axes": {"model.init_args.loss": ["torch", "chunked"]}, "steps": 5}
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def refused_key(raw) -> str:
    with pytest.raises(ConfigError) as info:
        parse_study(raw)
    return info.value.key


# --- dotted keys -----------------------------------------------------------------------------
def test_dotted_set_get_flatten_round_trip():
    tree = {"a": {"b": 1}, "cb": [{"x": 1}, {"x": 2}]}
    set_dotted(tree, "a.c.d", 3)
    set_dotted(tree, "cb.1.x", 5)
    assert tree == {"a": {"b": 1, "c": {"d": 3}}, "cb": [{"x": 1}, {"x": 5}]}
    assert get_dotted(tree, "cb.1.x") == 5 and get_dotted(tree, "a.zz", "none") == "none"
    assert flatten(tree) == {"a.b": 1, "a.c.d": 3, "cb.0.x": 1, "cb.1.x": 5}
    with pytest.raises(KeyError, match=r"cb.7.x"):
        set_dotted(tree, "cb.7.x", 0)


def test_with_overrides_does_not_touch_the_base():
    merged = with_overrides(BASE, {"model.init_args.loss": "chunked"})
    assert merged["model"]["init_args"]["loss"] == "chunked"
    assert BASE["model"]["init_args"]["loss"] == "torch"


# --- expansion --------------------------------------------------------------------------------
def test_one_axis_names_variants_by_value_and_defaults_baseline_to_first():
    spec = parse_study(study())
    assert [v.name for v in spec.variants] == ["torch", "chunked"]
    assert spec.baseline == "torch" and spec.variables == ("model.init_args.loss",)
    assert spec.variants[1].overrides == {"model.init_args.loss": "chunked"}


def test_two_axes_make_a_grid_and_numeric_values_carry_their_key():
    spec = parse_study(
        study(
            axes={"trainer.devices": [1, 2], "data.init_args.seq_len": [64, 128, 256]}, baseline="devices=2,seq_len=64"
        )
    )
    assert len(spec.variants) == 6
    assert spec.variants[0].name == "devices=1,seq_len=64"
    assert spec.variant("devices=2,seq_len=256").axis_values == {"trainer.devices": 2, "data.init_args.seq_len": 256}
    assert spec.baseline == "devices=2,seq_len=64"


def test_baseline_may_be_named_by_its_axis_value():
    spec = parse_study(study(axes={"model.init_args.model.config.num_hidden_layers": [1, 2, 3]}, baseline=2))
    assert spec.baseline == "num_hidden_layers=2"


def test_explicit_variants_with_vary_and_per_variant_launch():
    spec = parse_study(
        study(
            axes=None,
            launch={"devices": 1, "accelerator": "cpu", "timeout_s": 60},
            vary=["trainer.devices", "data"],
            variants=[
                {"name": "one"},
                {"name": "two", "overrides": {"data.init_args.batch_size": 4}, "launch": {"devices": 2}},
            ],
        )
    )
    two = spec.variant("two")
    assert two.launch == Launch(devices=2, accelerator="cpu", timeout_s=60.0)
    config = spec.fit_config(two, seed=3, root_dir="/r")
    assert config["trainer"]["devices"] == 2 and config["data"]["init_args"]["batch_size"] == 4
    assert config["seed_everything"] == 3 and config["trainer"]["max_steps"] == 5
    assert config["trainer"]["default_root_dir"] == "/r"
    assert spec.fit_config(spec.variant("one"), 0, "/r")["trainer"]["devices"] == 1


def test_precedence_base_study_launch_variant_runner():
    spec = parse_study(
        study(
            axes=None,
            vary=["trainer.devices"],
            overrides={"trainer.devices": 8, "trainer.max_epochs": 1},
            launch={"devices": 4},
            variants=[
                {"name": "a"},
                {"name": "b", "overrides": {"trainer.devices": 2}},
                {"name": "c", "overrides": {"trainer.devices": 2}, "launch": {"devices": 3}},
            ],
        )
    )
    devices = {v.name: spec.fit_config(v, 0, "/r")["trainer"]["devices"] for v in spec.variants}
    assert devices == {"a": 4, "b": 2, "c": 3}
    assert spec.fit_config(spec.variants[0], 0, "/r")["trainer"]["max_epochs"] == 1


def test_relative_base_is_relative_to_the_study_file(tmp_path: Path):
    (tmp_path / "configs" / "studies").mkdir(parents=True)
    (tmp_path / "configs" / "base.yaml").write_text(yaml.safe_dump(BASE))
    study_file = tmp_path / "configs" / "studies" / "loss.yaml"
    study_file.write_text(yaml.safe_dump(study(base="../base.yaml", name=None)))
    spec = load_study(study_file)
    assert spec.name == "loss" and spec.base == BASE
    assert spec.base_path == (tmp_path / "configs" / "base.yaml").resolve()


# --- refusals name the key ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"axis": {"a": [1]}}, "axis"),
        ({"variants": [{"name": "x"}]}, "axes"),
        ({"axes": {"a": [1], "b": [2], "c": [3]}}, "axes"),
        ({"axes": {"model.init_args.loss": []}}, "axes.model.init_args.loss"),
        ({"base": "nowhere.yaml"}, "base"),
        ({"seeds": [0, 0]}, "seeds"),
        ({"seeds": "0"}, "seeds"),
        ({"warmup_steps": 5}, "warmup_steps"),
        ({"steps": 0}, "steps"),
        ({"baseline": "nope"}, "baseline"),
        ({"launch": {"devices": 0}}, "launch.devices"),
        ({"launch": {"gpus": 2}}, "launch.gpus"),
        ({"launch": {"timeout_s": -1}}, "launch.timeout_s"),
        ({"overrides": {"seed_everything": 1}}, "overrides.seed_everything"),
        ({"overrides": {"trainer.max_steps": 9}}, "overrides.trainer.max_steps"),
        ({"expect_equal_loss": {"rtol": -1}}, "expect_equal_loss.rtol"),
        ({"expect_equal_loss": {"tol": 1}}, "expect_equal_loss.tol"),
        ({"expect_equal_loss": {"across": "model.init_args.lr"}}, "expect_equal_loss.across"),
        ({"expect_equal_loss": {"approximate": ["nope"]}}, "expect_equal_loss.approximate"),
        ({"expect_equal_loss": {"approximate": "nope"}}, "expect_equal_loss.approximate"),
        ({"name": "a b"}, "name"),
        ({"speed": {"rounds": 0}}, "speed.rounds"),
        ({"speed": {"confidence": 1.2}}, "speed.confidence"),
        ({"speed": {"threshold": -0.1}}, "speed.threshold"),
        ({"speed": {"load_tolerance": 0}}, "speed.load_tolerance"),
        ({"speed": {"interleave": "blocks"}}, "speed.interleave"),
        ({"speed": {"rounds": 4, "block": 2}}, "speed.block"),
        ({"speed": {"interleave": "steps"}, "launch": {"executor": "slurm"}}, "speed.interleave"),
    ],
)
def test_mistakes_are_refused_naming_the_key(changes, key):
    assert refused_key(study(**changes)) == key


def test_variants_need_vary_and_every_override_under_it():
    variants = [
        {"name": "a"},
        {"name": "b", "overrides": {"model.init_args.loss": "chunked", "data.init_args.batch_size": 4}},
    ]
    assert refused_key(study(axes=None, variants=variants)) == "vary"
    key = refused_key(study(axes=None, variants=variants, vary=["model.init_args.loss"]))
    assert key == "variants.b.overrides.data.init_args.batch_size"
    assert refused_key(study(axes=None, variants=[{"name": "a"}, {"name": "a"}], vary=["x"])) == "variants"
    assert (
        refused_key(study(axes=None, variants=[{"name": "a", "launch": {"nodes": 2}}], vary=["x"]))
        == "variants[0].launch.nodes"
    )


def test_max_steps_override_is_allowed_for_the_study_without_steps():
    spec = parse_study(study(steps=None, overrides={"trainer.max_steps": 9}))
    assert spec.fit_config(spec.variants[0], 0, "/r")["trainer"]["max_steps"] == 9


# --- single-variable check ---------------------------------------------------------------------
def test_single_variable_check_names_the_undeclared_key():
    a = with_overrides(BASE, {"model.init_args.loss": "torch", "seed_everything": 0})
    b = with_overrides(BASE, {"model.init_args.loss": "chunked", "seed_everything": 1})
    check_single_variable({"a": a, "b": b}, ["model.init_args.loss"], ignored=["seed_everything"])
    b["data"]["init_args"]["batch_size"] = 4
    with pytest.raises(ConfigError) as info:
        check_single_variable({"a": a, "b": b}, ["model.init_args.loss"], ignored=["seed_everything"])
    assert info.value.key == "data.init_args.batch_size"
    assert info.value.value == {"a": 8, "b": 4}
    check_single_variable({"a": a, "b": b}, ["model.init_args.loss", "data"], ignored=["seed_everything"])


def test_plan_refuses_a_difference_that_only_appears_after_resolution(tmp_path: Path):
    """A default that one variant resolves differently (here: the micro-batch) is a second variable."""

    def resolve(args: list[str]) -> dict:
        config = yaml.safe_load(Path(args[1]).read_text())
        loss = config["model"]["init_args"]["loss"]
        config["data"]["init_args"].setdefault("micro_batch", 4 if loss == "chunked" else 8)
        return config

    spec = parse_study(study())
    with pytest.raises(ConfigError) as info:
        plan_study(spec, tmp_path, resolve)
    assert info.value.key == "data.init_args.micro_batch"


# --- compatibility -----------------------------------------------------------------------------
def skip_reason(config: dict, **trainer: object) -> str | None:
    """Why a local study skips a variant of ``config`` (``trainer`` values as its launch sets them)."""
    config = with_overrides(config, {f"trainer.{key}": value for key, value in trainer.items()})
    view = RunConfig.of(config, executor="local")
    return first_refusal(view, Scope.CONFIG, Scope.MACHINE, skips_variant=True)


def test_compatibility_rules_give_reasons():
    cpu = {"accelerator": "cpu"}
    assert "refuses CPU" in skip_reason({"trainer": {"strategy": "fsdp"}}, **cpu)
    assert skip_reason({"trainer": {"strategy": "ddp"}}, **cpu) is None
    assert "multi-node" not in (skip_reason({}, num_nodes=1) or "")
    assert "torchrun" in skip_reason({}, num_nodes=2)
    if not __import__("torch").cuda.is_available():
        assert "no CUDA device" in skip_reason({}, accelerator="gpu")
        reason = skip_reason({"model": {"init_args": {"loss": "liger"}}}, **cpu)
        assert reason.startswith("model.init_args.loss='liger'")
    assert skip_reason({"model": {"init_args": {"loss": "chunked"}}}, **cpu) is None
    flex = {"model": {"init_args": {"model": {"attn_implementation": "flex"}}}}
    if not __import__("torch").cuda.is_available():
        assert "flex attention trains only on CUDA" in skip_reason(flex, **cpu)
        fa2 = {"model": {"init_args": {"model": {"attn_implementation": "flash_attention_2"}}}}
        assert "needs CUDA" in skip_reason(fa2, **cpu)
    # an unknown name is the run's own error (recorded failed), not a property of this machine
    assert skip_reason({"model": {"init_args": {"loss": "nonexistent"}}}, **cpu) is None


def test_compatibility_is_one_registry(monkeypatch):
    registry.rules_for(Scope.CONFIG)  # the package's rules, registered
    assert set(registry.RULES) >= {"accelerator_present", "loss_backend_available", "strategy_accepts_cpu"}
    monkeypatch.setattr(registry, "RULES", {})

    @rule(Scope.CONFIG, skips_variant=True)
    def first(run):
        return None

    @rule(Scope.CONFIG, skips_variant=True)
    def second(run):
        return Refusal("x", run["x"], "is 1")

    @rule(Scope.CONFIG, skips_variant=True)
    def third(run):
        return Refusal("x", run["x"], "not reached")

    assert first_refusal({"x": 1}, Scope.CONFIG) == "x=1: is 1"

"""The typed view of a run config (``lit_ablate.run_config``), the mesh sizes as one value (``MeshSizes``) and
refusals as data (``Refusal``): what the rules, the estimator and the study planner read.

- The view reads the mesh sizes a strategy will be built with off its class, without building it: the
  same as the built strategy's ``requested_mesh_sizes`` for every shipped mesh strategy, with and
  without the sizes given, and for research code's subclass that passes ``**kwargs`` on.
- What a config leaves out reads as the named class's default: the raw YAML and the config
  ``lit-ablate fit`` resolves read the same.
- The estimator learns sizes and options without building a strategy.
- A rule's refusal is raised by ``fit`` as it is (key, value, fix), and shown by a study
  as the same line.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml

from lit_ablate.config_keys import with_overrides
from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.mesh_sizes import MeshSizes
from lit_ablate.models.losses.cross_entropy import loss_backend
from lit_ablate.models.losses.loss_choice import LossChoice
from lit_ablate.run_config import RunConfig
from lit_ablate.strategies import presets
from lit_ablate.strategies.mesh_parallel import MeshParallelStrategy
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


class KeywordsOnlyTensorParallel(presets.TensorParallelStrategy):
    """Research code's subclass that passes every argument on: its own signature names no size."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)


STRATEGIES = [
    (presets.FSDP2Strategy, {}),
    (presets.HSDPStrategy, {"dp_shard": 2}),
    (presets.TensorParallelStrategy, {}),
    (presets.TensorParallelStrategy, {"tp": 2, "dp_shard": 2}),
    (presets.ContextParallelStrategy, {}),
    (presets.ExpertParallelStrategy, {"dp_shard": 2}),
    (presets.ExpertTensorParallelStrategy, {"tp": 2, "ep": 2}),
    (presets.TensorContextParallelStrategy, {"tp": 2}),
    (presets.ExpertContextParallelStrategy, {"ep": 2}),
    (MeshParallelStrategy, {}),
    (MeshParallelStrategy, {"tp": 2, "cp": -1, "dp_shard": 1}),
    (PipelineParallelStrategy, {}),
    (PipelineParallelStrategy, {"tp": 2, "dp_shard": 2}),
    (KeywordsOnlyTensorParallel, {}),
]


def _strategy_config(cls: type, init_args: dict) -> dict:
    return {"trainer": {"strategy": {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}}}


@pytest.mark.parametrize(("cls", "init_args"), STRATEGIES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_view_reads_the_sizes_the_strategy_is_built_with(cls, init_args):
    """Seen failing with the sizes' defaults read from the class's own signature only (the old
    compatibility rule's way): the keyword-only subclass read tp 1 where the strategy builds tp -1."""
    view = RunConfig.of(_strategy_config(cls, init_args)).trainer.strategy
    assert view.requested_mesh_sizes == cls(**init_args).requested_mesh_sizes


def test_a_strategy_without_a_mesh_has_no_mesh_sizes_and_every_dimension_of_size_one():
    for strategy in ("ddp", "auto", {"class_path": "lit_ablate.strategies.DDPStrategy"}):
        view = RunConfig.of({"trainer": {"strategy": strategy}}).trainer.strategy
        assert view.requested_mesh_sizes is None and view.mesh_size("tp", 4) == 1


def test_mesh_sizes_are_one_frozen_value():
    """Resolution of -1 as the strategies resolve it (``tests/test_strategies_mesh.py`` checks the refusals)."""
    sizes = MeshSizes(dp_shard=-1, tp=2)
    assert sizes.on == ("dp_shard", "tp") and sizes == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": -1,
        "ep": 1,
        "cp": 1,
        "tp": 2,
    }
    resolved = sizes.resolved(8)
    assert (resolved.dp_shard, resolved.world_size, resolved.on) == (4, 8, ("dp_shard", "tp"))
    assert MeshSizes.of({"tp": 2}).resolved(2) == MeshSizes(tp=2) and hash(MeshSizes(tp=2)) == hash(
        MeshSizes.of({"tp": 2})
    )
    with pytest.raises(AttributeError):
        sizes.tp = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="resolve it"):
        _ = sizes.world_size
    with pytest.raises(ConfigError, match=r"init_args\.tp=0"):
        MeshSizes(tp=0)


def test_the_raw_yaml_and_the_resolved_config_read_the_same():
    """What the YAML leaves out reads as the class's default, so a study's merged YAML, a run record's
    resolved config and ``fit``'s parse agree. Seen failing with ``ClassChoice.option`` ignoring the
    class's defaults: both read ``cp_impl`` None where the strategy takes ``ring`` (a preset takes its
    technique's options as ``**kwargs``, whose defaults even the resolved config leaves out)."""
    from lit_ablate.fit_cli import resolve_fit_config

    strategy = "lit_ablate.strategies.ContextParallelStrategy"
    raw = with_overrides(
        yaml.safe_load(QUICKSTART.read_text()),
        {"trainer.devices": 2, "trainer.strategy": {"class_path": strategy}, "model.init_args.loss": "chunked"},
    )
    resolved = resolve_fit_config(
        [
            "--config",
            str(QUICKSTART),
            "--trainer.devices",
            "2",
            "--trainer.strategy.class_path",
            strategy,
            "--model.init_args.loss",
            "chunked",
        ]
    )
    views = [RunConfig.of(raw), RunConfig.of(resolved)]

    def read(run: RunConfig) -> tuple:
        strategy = run.trainer.strategy
        return (
            strategy.requested_mesh_sizes,
            strategy.mesh_size("cp", run.world_size),
            strategy.option("cp_impl"),
            strategy.option("cp_block_kernel"),
            strategy.short_name,
            run.model.loss,
            run.compute_dtype,
            run.model.attention,
            run.world_size,
            run.trainer.accumulation,
            run.data.seq_len,
            run.model.module.class_path,
        )

    assert read(views[0]) == read(views[1])
    assert read(views[0])[:3] == (MeshSizes(cp=-1), 2, "ring")


def test_the_estimator_builds_no_strategy_to_learn_sizes_and_options(monkeypatch):
    """Seen failing with ``tensor_parallel_of`` building the strategy to read ``sequence_parallel`` (as it
    did before): the build below raises."""
    from lit_ablate.estimate.from_config import training_shape_of
    from lit_ablate.strategies.mesh import MeshStrategy

    def built(*args, **kwargs):
        raise AssertionError("a strategy was built")

    monkeypatch.setattr(MeshStrategy, "__init__", built)
    base = yaml.safe_load(QUICKSTART.read_text())
    tensor = {"class_path": "lit_ablate.strategies.TensorParallelStrategy", "init_args": {"sequence_parallel": True}}
    shape = training_shape_of(with_overrides(base, {"trainer.devices": 2, "trainer.strategy": tensor}))
    assert (shape.tensor_parallel, shape.sequence_parallel) == (2, True)
    pipeline = {
        "class_path": "lit_ablate.strategies.PipelineParallelStrategy",
        "init_args": {"tp": 2, "microbatches": 4},
    }
    shape = training_shape_of(with_overrides(base, {"trainer.devices": 8, "trainer.strategy": pipeline}))
    assert (shape.pipeline_parallel, shape.tensor_parallel, shape.microbatches, shape.pipeline_schedule) == (
        4,
        2,
        4,
        "1f1b",
    )


def test_a_refusal_is_its_key_value_and_fix_and_the_line_a_study_shows():
    refusal = Refusal("model.init_args.loss", "liger", "use loss: chunked")
    assert refusal == "model.init_args.loss='liger': use loss: chunked" == str(refusal.error())
    error = refusal.error()
    assert (error.key, error.value, error.fix) == ("model.init_args.loss", "liger", "use loss: chunked")
    assert error.refusal == refusal and pickle.loads(pickle.dumps(refusal)).value == "liger"
    assert Refusal("data.init_args.format", "sft", "use format: preference", shown="sft") == (
        "data.init_args.format=sft: use format: preference"
    )
    with pytest.raises(AttributeError):
        refusal.key = "x"  # type: ignore[misc]


def test_fit_raises_a_rule_s_refusal_as_it_is(monkeypatch):
    """The key, value and fix a rule returns reach ``fit``'s error unchanged, even when the key is not where
    the value sits in the config and the fix holds a ``key=value:`` of its own. Seen failing with the old
    preflight, which parsed the rule's message back with a regular expression and re-read the value from the
    config: the value read None, and the fix began with the value's own ``'rowwise'}:``."""
    from lit_ablate.rules import Rule, Scope, check_run, registry

    refusal = Refusal("model.init_args.model.fp8", {"recipe": "rowwise"}, "trainer.devices=2: use 1 device, or tp: 1")
    registry.rules_for(Scope.CONFIG)  # the package's rules, registered
    monkeypatch.setitem(registry.RULES, "fp8_runs_here", Rule(lambda run: refusal, frozenset({Scope.MACHINE}), True))
    with pytest.raises(ConfigError) as error:
        check_run({"trainer": {"accelerator": "cpu"}})
    assert (error.value.key, error.value.value, error.value.fix) == (refusal.key, refusal.value, refusal.fix)


def test_the_loss_is_judged_from_its_name_or_its_built_backend():
    """Seen failing with the tensor-parallel step's own name table (torch and chunked only): a built liger
    backend was refused as 'LigerFusedLinearCrossEntropy', not as the 'liger' the config names."""
    from lit_ablate.models.losses.cross_entropy import LigerFusedLinearCrossEntropy

    chunked = LossChoice.of_backend(loss_backend("chunked", z_loss_weight=1e-4))
    assert chunked == LossChoice("chunked", {"z_loss_weight": 1e-4})
    chunked.check_tensor_parallel()
    with pytest.raises(ConfigError, match="z_loss_weight"):
        LossChoice("torch", {"z_loss_weight": 1e-4}).check_tensor_parallel()
    liger = object.__new__(LigerFusedLinearCrossEntropy)  # built without its CUDA check
    object.__setattr__(liger, "z_loss_weight", 0.0)
    with pytest.raises(ConfigError, match=r"model\.init_args\.loss='liger'"):
        LossChoice.of_backend(liger).check_tensor_parallel()
    assert RunConfig.of({}).model.loss == LossChoice("torch", {}) and not LossChoice("nonexistent").registered

"""The ``parallelism_4d`` study plans: five layouts of one model on 8 ranks, differing only in the strategy
and the micro-batch of a data-parallel group, each a runnable mesh that reads the same global batch.

Running it takes minutes (its CPU report is ``benchmarks/results/parallelism_4d/``); that the layouts
train the same model is asserted per mesh in ``tests/test_pipeline_mesh.py`` and the other
``test_strategies_*`` files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from lit_ablate.ablation.plan import plan_study
from lit_ablate.ablation.single_variable import check_single_variable
from lit_ablate.ablation.spec import RUNNER_KEYS, load_study
from lit_ablate.errors import ConfigError
from lit_ablate.fit_cli import resolve_fit_config
from lit_ablate.models.presets import preset_config

STUDY = Path(__file__).resolve().parents[1] / "configs" / "studies" / "parallelism_4d.yaml"
WORLD = 8
GLOBAL_BATCH = 8
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
BATCH_SHARING_DIMS = ("pp", "cp", "tp")
"""Mesh dimensions whose ranks read the same batch; the others read their own."""

pytestmark = pytest.mark.slow  # 5 config resolutions through LightningCLI: ~30 s on 2 loaded cores


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The study's spec, its planned runs and each variant's config as ``fit`` resolves it."""
    resolved: dict[str, dict[str, Any]] = {}

    def recording_resolver(args: list[str]) -> dict[str, Any]:
        config = resolve_fit_config(args)
        resolved[Path(args[-1]).stem] = config
        return config

    spec = load_study(STUDY)
    runs = plan_study(spec, tmp_path_factory.mktemp("parallelism_4d"), recording_resolver)
    return spec, runs, resolved


def _mesh(config: dict[str, Any]) -> dict[str, int]:
    """The resolved strategy's mesh sizes (1 where it does not set one)."""
    init_args = config["trainer"]["strategy"]["init_args"]
    return {dim: int(init_args.get(dim, 1)) for dim in MESH_DIMS}


def test_study_plans_five_runnable_layouts_on_eight_ranks(planned):
    """Catches a variant that does not resolve, is skipped here, or is dropped from the study. Seen failing
    with cp2_tp2_fsdp2 on TensorParallelStrategy (the parser refuses its ``cp``)."""
    spec, runs, _ = planned
    assert list(spec.variables) == ["trainer.strategy", "data.init_args.batch_size"]
    assert [r.variant.name for r in runs] == ["fsdp2", "tp2_fsdp4", "pp2_fsdp4", "pp2_tp2_fsdp2", "cp2_tp2_fsdp2"]
    assert [(r.variant.name, r.invalid, r.skip_reason) for r in runs if r.invalid or r.skip_reason] == []
    assert {r.view.world_size for r in runs} == {WORLD}


def test_every_layout_fills_the_world_and_reads_the_same_global_batch(planned):
    """Catches a mesh that does not multiply to 8 ranks, and a micro-batch that makes one variant train on
    more or fewer sequences per step than the others (then its loss curve differs for a reason other
    than the layout). Seen failing with pp2_fsdp4's batch_size set to 1 (global batch 4)."""
    _, _, resolved = planned
    model = preset_config("tiny-llama")
    for name, config in resolved.items():
        mesh = _mesh(config)
        assert math.prod(mesh.values()) == WORLD, name
        readers = WORLD // (mesh["pp"] * mesh["cp"] * mesh["tp"])
        assert readers * config["data"]["init_args"]["batch_size"] == GLOBAL_BATCH, name
        assert model["num_key_value_heads"] % mesh["tp"] == 0, name
        assert model["num_hidden_layers"] >= mesh["pp"], name
        assert config["data"]["init_args"]["seq_len"] % (2 * mesh["cp"]) == 0, name  # zigzag halves per cp rank


def test_single_variable_guard_accepts_the_study_and_would_refuse_an_undeclared_key(planned):
    """The guard accepted the study while planning; here it is shown live on the same resolved configs:
    without ``data.init_args.batch_size`` declared, it names that key (the variants' micro-batches differ,
    which only the global-batch check above makes a fair comparison)."""
    _, _, resolved = planned
    check_single_variable(resolved, ["trainer.strategy", "data.init_args.batch_size"], ignored=RUNNER_KEYS)
    with pytest.raises(ConfigError, match=r"data.init_args.batch_size"):
        check_single_variable(resolved, ["trainer.strategy"], ignored=RUNNER_KEYS)

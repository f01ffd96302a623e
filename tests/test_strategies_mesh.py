"""The mesh: sizes, the data-parallel rank the sampler gets, the FSDP sub-mesh; and clear refusals."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lit_ablate.commands.export import export_main
from lit_ablate.data import LMDataModule, SyntheticText
from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import resolve_mesh_sizes
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import (
    DDPStrategy,
    FSDP1Strategy,
    FSDP2Strategy,
    HSDPStrategy,
    MeshParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
    ZeRO1Strategy,
)
from lit_ablate.strategies.fsdp2 import FullyShardSteps
from lit_ablate.strategies.gpu_only import check_gpu_only_options
from lit_ablate.strategies.interface import state_sharding_of
from lit_ablate.strategies.state_sharding import StateSharding
from tests.distributed import run_ranks

QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.yaml"


def test_minus_one_takes_the_rest_of_the_ranks():
    assert resolve_mesh_sizes({"dp_replicate": 2, "dp_shard": -1}, 8) == {
        "pp": 1,
        "dp_replicate": 2,
        "dp_shard": 4,
        "ep": 1,
        "cp": 1,
        "tp": 1,
    }
    assert resolve_mesh_sizes({"dp_shard": 2, "tp": 2, "cp": -1}, 8)["cp"] == 2


@pytest.mark.parametrize(
    ("sizes", "world_size", "fragment"),
    [
        ({"dp_shard": 3}, 4, "multiply to 3 but the world size (devices x nodes) is 4"),
        ({"dp_replicate": 3, "dp_shard": -1}, 4, "does not divide the world size 4"),
        ({"dp_shard": -1, "tp": -1}, 4, "at most one mesh size may be -1"),
        ({"dp_shard": 0}, 4, "use a positive integer"),
    ],
)
def test_mesh_sizes_that_cannot_make_the_world_size_are_refused(sizes, world_size, fragment):
    with pytest.raises(ConfigError, match=r"trainer.strategy.init_args") as err:
        resolve_mesh_sizes(sizes, world_size)
    assert fragment in str(err.value)


def test_a_preset_refuses_a_dimension_it_does_not_take():
    """FSDP2Strategy takes no tp (a preset's signature is its schema); seen failing when presets passed
    every keyword on to MeshParallelStrategy (tp=2 accepted, then TP applied)."""
    with pytest.raises(ConfigError, match=r"init_args.tp=2: FSDP2Strategy does not take tp"):
        FSDP2Strategy(tp=2)
    assert TensorParallelStrategy(tp=2).requested_mesh_sizes["tp"] == 2
    assert MeshParallelStrategy(tp=2, cp=2, ep=2).requested_mesh_sizes == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": -1,
        "ep": 2,
        "cp": 2,
        "tp": 2,
    }


def test_a_preset_refuses_a_dimension_at_parse_time_in_one_line(capsys):
    """The parser reads a preset's signature: ``tp`` for FSDP2Strategy is refused before anything is built,
    as one line naming the key. Seen failing with the preset passing ``**kwargs`` straight on: the parser
    followed them into MeshParallelStrategy, accepted tp, and only the world-size check refused it later."""
    from lit_ablate.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "fit",
                "--config",
                str(QUICKSTART),
                "--trainer.strategy.class_path",
                "lit_ablate.strategies.FSDP2Strategy",
                "--trainer.strategy.init_args.tp",
                "2",
            ]
        )
    message = capsys.readouterr().err.strip() or str(exit_.value.code)
    assert "init_args.tp: not a parameter of lit_ablate.strategies.FSDP2Strategy" in message and "\n" not in message


def test_a_mesh_strategy_without_a_step_refuses_its_dimension():
    """Research code subclassing MeshStrategy directly gets the step it lacks named."""

    class FSDPOnly(FullyShardSteps):
        pass

    with pytest.raises(ConfigError, match=r"init_args.tp=2: FSDPOnly does not implement apply_tp"):
        FSDPOnly(tp=2)
    with pytest.raises(ConfigError, match="param_dtype='bf16'"):
        FSDP2Strategy(param_dtype="bf16")
    with pytest.raises(ConfigError, match="powersgd_start_iter=1"):
        DDPStrategy(comm_hook="powersgd", powersgd_start_iter=1)


class _TensorAndContextParallel(FullyShardSteps):
    """Pretends to implement TP and CP, to build meshes that use those dimensions."""

    def apply_tp(self, model: CausalLMWithLoss) -> None: ...

    def apply_cp(self, model: CausalLMWithLoss) -> None: ...


def _mesh_layout(rank: int, world_size: int) -> dict:
    layouts = {}
    for name, sizes in {
        "dp2_tp2": {"dp_shard": 2, "tp": 2},
        "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2},
        "dp2_cp2": {"dp_shard": 2, "cp": 2},
        "rep2_cp2": {"dp_replicate": 2, "dp_shard": 1, "cp": 2},
    }.items():
        strategy = _TensorAndContextParallel(**sizes)
        strategy.build_mesh("cpu", world_size)
        mesh = strategy.fsdp_mesh
        layouts[name] = {
            "sampler": strategy.distributed_sampler_kwargs,
            "fsdp_dims": list(mesh.mesh_dim_names),
            "fsdp_shape": list(mesh.shape),
        }
    return layouts


STEPS = (
    "apply_tp",
    "apply_ep",
    "apply_cp",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_expert_fsdp",
    "apply_fsdp",
)


def _steps_run(strategy_class: type, world_size: int, sizes: dict[str, int]) -> list[str]:
    """The steps ``apply_steps`` runs at these sizes, in order (each recorded, none applied)."""
    calls: list[str] = []
    recording = type(
        "Recording", (strategy_class,), {name: lambda self, model, name=name: calls.append(name) for name in STEPS}
    )
    strategy = recording(**sizes)
    strategy.mesh_sizes = strategy.requested_mesh_sizes.resolved(world_size)
    strategy.apply_steps(None)
    return calls


@pytest.mark.parametrize(
    ("strategy_class", "world_size", "sizes", "ran"),
    [
        (MeshParallelStrategy, 8, {"dp_shard": 1, "tp": 2, "ep": 2, "cp": 2}, STEPS),
        (MeshParallelStrategy, 4, {"dp_shard": 2, "cp": 2}, STEPS[2:5] + STEPS[6:]),
        (FSDP2Strategy, 2, {}, STEPS[3:5] + STEPS[6:]),
        (PipelineParallelStrategy, 4, {"pp": 2, "dp_shard": 2}, STEPS[3:5] + STEPS[6:]),
        (PipelineParallelStrategy, 4, {"pp": 2, "dp_replicate": 2}, STEPS[3:5]),  # whole stages, averaged after
    ],
    ids=["tp-ep-cp", "dp-cp", "fsdp2", "pp-dp_shard", "pp-dp_replicate"],
)
def test_one_ordered_list_runs_each_dimension_s_step_when_its_size_is_above_one(strategy_class, world_size, sizes, ran):
    """torchtitan's order, each dimension's step guarded by its size (checkpointing and compile read their
    options themselves, so a subclass's own step always runs). Seen failing with TP's guard dropped (TP
    recorded at tp 1) and with the experts' FSDP after the root's."""
    assert _steps_run(strategy_class, world_size, sizes) == list(ran)


def test_step_context_enters_each_active_dimension_s_context():
    """One context around Lightning's steps: TP's loss and CP's attention when their sizes are above 1,
    in that order. Seen failing with CP's guard reading tp."""
    entered: list[str] = []

    @contextmanager
    def context(name: str) -> Iterator[None]:
        entered.append(name)
        yield
        entered.append(f"/{name}")

    recording = type(
        "Recording",
        (MeshParallelStrategy,),
        {
            "vocabulary_parallel_loss": lambda self: context("tp"),
            "context_parallel_attention": lambda self: context("cp"),
        },
    )
    for sizes, world_size, expected in (
        ({"dp_shard": 1, "tp": 2, "cp": 2}, 4, ["tp", "cp", "/cp", "/tp"]),
        ({"dp_shard": 2, "cp": 2}, 4, ["cp", "/cp"]),
        ({}, 2, []),
    ):
        entered.clear()
        strategy = recording(**sizes)
        strategy.mesh_sizes = strategy.requested_mesh_sizes.resolved(world_size)
        with strategy.step_context():
            pass
        assert entered == expected, sizes


def test_sampler_gets_the_data_parallel_rank_and_fsdp_the_right_submesh():
    layouts = run_ranks(_mesh_layout, 4)
    # Tensor- and context-parallel peers (innermost dims) read the same batch.
    assert [r["dp2_tp2"]["sampler"] for r in layouts] == [{"num_replicas": 2, "rank": k} for k in (0, 0, 1, 1)]
    assert [r["dp2_cp2"]["sampler"] for r in layouts] == [{"num_replicas": 2, "rank": k} for k in (0, 0, 1, 1)]
    assert [r["hsdp2x2"]["sampler"]["rank"] for r in layouts] == [0, 1, 2, 3]
    first = layouts[0]
    assert (first["dp2_tp2"]["fsdp_dims"], first["dp2_tp2"]["fsdp_shape"]) == (["dp_shard"], [2])
    assert (first["hsdp2x2"]["fsdp_dims"], first["hsdp2x2"]["fsdp_shape"]) == (["dp_replicate", "dp_shard"], [2, 2])
    # Context-parallel ranks share the gradients of the same sequences: FSDP shards over them too.
    assert (first["dp2_cp2"]["fsdp_dims"], first["dp2_cp2"]["fsdp_shape"]) == (["dp_shard_cp"], [4])
    assert (first["rep2_cp2"]["fsdp_dims"], first["rep2_cp2"]["fsdp_shape"]) == (["dp_replicate", "cp"], [2, 2])


def _fit_one_step(strategy: pl.strategies.Strategy) -> None:
    module = CausalLM(ModelFactory(preset="tiny-llama"))
    data = LMDataModule(SyntheticText(num_documents=10), seq_len=16, batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (FSDP2Strategy(cpu_offload=True), "cpu_offload=True: CPU offload moves shards from a GPU to host memory"),
        (FSDP1Strategy(cpu_offload=True), "cpu_offload=True: CPU offload moves shards from a GPU to host memory"),
        (DDPStrategy(comm_hook="bf16"), "comm_hook='bf16': torch's bf16 compression hook needs NCCL"),
    ],
    ids=["fsdp2-offload", "fsdp1-offload", "ddp-bf16-hook"],
)
def test_gpu_only_options_fail_clearly_on_cpu_before_any_work(strategy, message):
    with pytest.raises(ConfigError) as err:
        _fit_one_step(strategy)
    assert message in str(err.value)


def test_gpu_only_options_are_judged_from_a_config_alone():
    """What the ablation runner's compatibility rule calls, before launching a variant."""
    check_gpu_only_options({"cpu_offload": True, "comm_hook": "bf16"}, "cuda")
    check_gpu_only_options({"cpu_offload": False, "comm_hook": "fp16"}, "cpu")
    with pytest.raises(ConfigError, match="cpu_offload"):
        check_gpu_only_options({"cpu_offload": True}, "cpu")


def test_state_sharding_per_strategy():
    assert state_sharding_of(DDPStrategy(), 8) == StateSharding(1, 1, 1)
    assert state_sharding_of(ZeRO1Strategy(), 8) == StateSharding(1, 1, 8)
    assert state_sharding_of(FSDP2Strategy(reshard_after_forward=False), 8) == StateSharding(
        8, 8, 8, gathered=1, fsdp_units=True
    )
    assert state_sharding_of(FSDP2Strategy(), 8) == StateSharding(8, 8, 8, fsdp_units=True)
    assert state_sharding_of(HSDPStrategy(dp_replicate=2), 8) == StateSharding(4, 4, 4, fsdp_units=True)
    assert state_sharding_of(FSDP1Strategy(sharding_strategy="SHARD_GRAD_OP"), 8) == StateSharding(8, 8, 8, gathered=1)
    assert state_sharding_of("deepspeed_stage_1", 8) == StateSharding(1, 1, 8)
    assert state_sharding_of("ddp", 8) == StateSharding(1, 1, 1)


def test_export_refuses_a_path_that_is_not_a_checkpoint(tmp_path, capsys):
    assert export_main(["--ckpt_path", str(tmp_path), "--output_dir", str(tmp_path / "hf")]) == 2
    assert "meta.pt" in capsys.readouterr().err


COMPILED_GRAPHS: list[object] = []


def _counting_backend(graph, example_inputs):
    """A ``torch.compile`` backend that counts the graphs it is given and runs them eagerly."""
    COMPILED_GRAPHS.append(graph)
    return graph.forward


def test_compile_backend_reaches_torch_compile():
    """``compile_layers`` compiles each decoder layer with the configured ``compile_backend``: a backend of
    the test's own receives the layers' graphs when the model runs (``aot_eager`` silently replaced by
    ``inductor`` would otherwise pass, only slower). Seen failing with ``apply_compile`` calling
    ``layer.compile()`` without the backend (no graph reached it)."""
    import torch
    from torch._dynamo import list_backends, register_backend

    from lit_ablate.models.losses.cross_entropy import loss_backend
    from lit_ablate.strategies import decoder_layers

    if "lit_ablate_counting" not in list_backends(exclude_tags=()):
        register_backend(_counting_backend, name="lit_ablate_counting")
    COMPILED_GRAPHS.clear()
    strategy = FSDP2Strategy(compile_layers=True, compile_backend="lit_ablate_counting")
    model = CausalLMWithLoss(ModelFactory(preset="tiny-llama").build(), loss_backend("torch"))
    strategy.apply_compile(model)
    tokens = torch.randint(0, 320, (1, 9))
    try:
        model({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    finally:
        torch._dynamo.reset()
    assert COMPILED_GRAPHS and all(layer._compiled_call_impl is not None for layer in decoder_layers(model))

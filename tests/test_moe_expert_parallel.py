"""``ExpertParallelStrategy`` end to end under a Lightning ``Trainer`` on 2 forked gloo ranks.

One rank group trains the tiny Qwen3-MoE three ways from seed 0 (module-scoped fixture): FSDP2
with all experts on every rank (no EP), EP=2 with all-to-all dispatch, EP=2 with all-reduce
dispatch. The ranks read different batches in all three, so per-rank losses must agree.
Tolerance: the same arithmetic in another reduction order, ``LOSS_ATOL = 2e-5`` on fp32 losses.
That holds only until rounding decides a top-k near-tie differently in the two layouts (here not
within ``STEPS``); the float64 gradient tests at the end prove the layouts equal on any CPU.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm
from torch.utils.data import DataLoader

from lit_ablate.callbacks.expert_load import ExpertLoadMonitor
from lit_ablate.data import LMDataModule, SyntheticText
from lit_ablate.errors import ConfigError
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss, decoder_layers
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.moe.blocks import MoEOptions, moe_blocks
from lit_ablate.models.moe.dispatch import AllReduceDispatcher, AllToAllDispatcher
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import ExpertParallelStrategy, FSDP2Strategy, MeshParallelStrategy
from lit_ablate.strategies.fsdp2 import shard_layers_then_root
from lit_ablate.strategies.gradient_clipping import clip_grad_norm_across_meshes
from tests.distributed import run_ranks
from tests.test_moe_expert_load import MoECausalLM

STEPS = 4
PROBE = {"input_ids": torch.arange(32).reshape(2, 16) % 300, "labels": (torch.arange(32).reshape(2, 16) + 1) % 300}
LOSS_ATOL = 2e-5
GRAD_RTOL = 1e-12
"""Float64 gradients of two layouts, relative to each tensor's largest element (measured: 4.2e-16)."""


class LossSeries(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # This rank's micro-batch mean (the backpropagated loss is scaled by StepObjective).
        self.losses.append((outputs["loss_sum"] / outputs["useful_tokens"]).item())


def fit(strategy: pl.strategies.Strategy, root: Path, devices: int = 2) -> dict:
    pl.seed_everything(0, verbose=False)
    module = MoECausalLM(MoEOptions(experts="grouped", load_balance_weight=0.01), learning_rate=1e-2)
    data = LMDataModule(SyntheticText(num_documents=60), seq_len=32, batch_size=2)
    series, load = LossSeries(), ExpertLoadMonitor(log_to_logger=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[series, load],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
        gradient_clip_val=1.0,
    )
    trainer.fit(module, data)
    loss_sum, useful = module.model(PROBE)
    (loss_sum / useful).backward()
    params = list(module.parameters())
    block = moe_blocks(module)[0]
    return {
        "losses": series.losses,
        "dispatcher": type(block.dispatcher).__name__,
        "experts_per_rank": getattr(block.dispatcher, "num_local", block.gate.num_experts),
        "experts": block.experts.gate_up_proj.shape[0],
        "raw_counts": {s: v["moe/layer0"][:-2] for s, v in load._raw.items()},
        "fractions": load.series["moe/layer0/expert_fraction"],
        "grad_norm": clip_grad_norm_across_meshes(params, float("inf")).item(),
        "torch_grad_norm": None
        if isinstance(strategy, ExpertParallelStrategy)
        else _full(get_total_norm([p.grad for p in params])).item(),
    }


def _full(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _three_ways(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    return {
        "no_ep": fit(FSDP2Strategy(), root / "fsdp2"),
        "all_to_all": fit(ExpertParallelStrategy(ep=2, dispatch="all_to_all"), root / "a2a"),
        "all_reduce": fit(ExpertParallelStrategy(ep=2, dispatch="all_reduce"), root / "ar"),
        "compiled": fit(
            ExpertParallelStrategy(ep=2, dispatch="all_to_all", compile_layers=True, compile_backend="aot_eager"),
            root / "compiled",
        ),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_three_ways, 2, str(tmp_path_factory.mktemp("ep")), init_process_group=False, timeout_s=300)


def _close(actual: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=0, atol=LOSS_ATOL)


def test_tiny_qwen3_moe_trains_under_expert_parallelism(runs) -> None:
    for run in runs:
        assert run["all_to_all"]["dispatcher"] == AllToAllDispatcher.__name__
        assert run["all_reduce"]["dispatcher"] == AllReduceDispatcher.__name__
        assert run["all_to_all"]["experts_per_rank"] == 4 and run["no_ep"]["experts_per_rank"] == 8
        assert run["all_to_all"]["experts"] == run["no_ep"]["experts"] == 8  # global shape, as in checkpoints
        losses = run["all_to_all"]["losses"]
        assert len(losses) == STEPS and losses[-1] < losses[0]
    assert runs[0]["all_to_all"]["losses"] != runs[1]["all_to_all"]["losses"]  # EP ranks read different batches


def test_expert_parallel_equals_no_expert_parallel(runs) -> None:
    for run in runs:
        _close(run["all_to_all"]["losses"], run["no_ep"]["losses"])


def test_gradient_norm_across_expert_and_dense_meshes(runs) -> None:
    """The clipping norm under EP (two meshes) equals torch's norm without EP (one mesh)."""
    for run in runs:
        assert run["no_ep"]["grad_norm"] == pytest.approx(run["no_ep"]["torch_grad_norm"], rel=1e-6)
        for mode in ("all_to_all", "all_reduce"):
            assert run[mode]["grad_norm"] == pytest.approx(run["no_ep"]["grad_norm"], rel=1e-4)


def test_compiled_layers_under_expert_parallelism_equal_no_expert_parallelism(runs) -> None:
    """Each rank compiles its decoder layers (``compile_layers``) around the all-to-all dispatch and the
    grouped experts. Seen failing (a dynamo error, before any step) when the experts recognised their
    DTensor weights by ``hasattr(w, "to_local")`` (dynamo answers False) and when float32
    ``_grouped_mm`` was traced (its compile-time kernel takes bfloat16 only). Both are errors of the
    tracing, so the layers compile with ``aot_eager`` (dynamo and AOTAutograd, no generated code: the
    float32 trace still fails, checked by planting it): inductor's cold C++ build made this fixture
    take 150 s instead of 50 on 2 cores. FSDP2's own compiled test keeps inductor."""
    for run in runs:
        _close(run["compiled"]["losses"], run["no_ep"]["losses"])
        assert run["compiled"]["grad_norm"] == pytest.approx(run["no_ep"]["grad_norm"], rel=1e-4)


def test_all_to_all_dispatch_equals_all_reduce_dispatch(runs) -> None:
    for run in runs:
        _close(run["all_reduce"]["losses"], run["all_to_all"]["losses"])


def test_expert_load_in_the_record_sums_all_ranks(runs) -> None:
    first, second = (run["all_to_all"] for run in runs)
    for step, fractions in first["fractions"].items():
        counts = [a + b for a, b in zip(first["raw_counts"][step], second["raw_counts"][step])]
        assert fractions == pytest.approx([c / sum(counts) for c in counts], abs=1e-12)
        assert second["fractions"][step] == fractions  # every rank holds the global view


def _ep_with_dp_shard(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    return {
        "no_ep": fit(FSDP2Strategy(), root / "fsdp2", devices=world_size)["losses"],
        "ep": fit(ExpertParallelStrategy(ep=2, dp_shard=2), root / "ep", devices=world_size)["losses"],
    }


def test_expert_parallel_composes_with_fsdp_sharding_of_the_experts(tmp_path) -> None:
    """4 ranks = dp_shard 2 x ep 2: each expert shard is FSDP-sharded over 2 ranks (sum reductions)."""
    for run in run_ranks(_ep_with_dp_shard, 4, str(tmp_path), init_process_group=False, timeout_s=300):
        _close(run["ep"], run["no_ep"])


def test_ep_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"dispatch='gather'"):
        ExpertParallelStrategy(dispatch="gather")
    with pytest.raises(ConfigError, match=r"ep=4: ep cannot exceed the world size \(2"):
        ExpertParallelStrategy(ep=4).build_mesh("cpu", 2)


def _ep_not_dividing_experts(rank: int, world_size: int) -> str:
    strategy = ExpertParallelStrategy(ep=3)
    strategy.build_mesh("cpu", world_size)
    module = MoECausalLM(MoEOptions())
    module.configure_model()
    with pytest.raises(ConfigError) as error:
        strategy.apply_ep(module.model)
    return str(error.value)


def test_ep_must_divide_the_number_of_experts() -> None:
    messages = run_ranks(_ep_not_dividing_experts, 3)
    assert "ep=3: the model has 8 experts per layer; use an ep that divides 8" in messages[0]


class Float64ModelFactory(ModelFactory):
    """The config's model in float64 (a test-only dtype). Two layouts then differ by ~1e-16, far below
    any top-k near-tie, so they route every token alike and agree to rounding (the router's softmax and
    the loss still round to float32, as in every dtype, from inputs that agree to ~1e-16)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float64


class StepGradients(Callback):
    """Every parameter's whole gradient as the optimizer gets it (after the step objective's rescaling)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.gradients = {
            name: _full(p.grad).detach().clone() for name, p in pl_module.named_parameters() if p.grad is not None
        }


def _unequal_batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank 0: 48 useful tokens; rank 1: 14 (prompt labels masked), so a per-rank normalisation shows."""
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(rank))
    labels = ids.roll(-1, 1)
    if rank == 1:
        labels[:, :17] = -100
    return {"input_ids": ids, "labels": labels}


class LayerUnitsOfItsOwn(ExpertParallelStrategy):
    """Research code that replaces the FSDP step without calling ``super()``: its own units (each decoder
    layer, then the root), with nothing about experts in it."""

    def apply_fsdp(self, model: CausalLMWithLoss) -> None:
        shard_layers_then_root(decoder_layers(model), model, self.fsdp_kwargs())


LAYOUTS = {
    "no_ep": (FSDP2Strategy, {}),
    "all_to_all": (ExpertParallelStrategy, {"ep": 2, "dispatch": "all_to_all"}),
    "all_reduce": (ExpertParallelStrategy, {"ep": 2, "dispatch": "all_reduce"}),
    "dp_shard_ep": (ExpertParallelStrategy, {"ep": 2, "dp_shard": 2}),
    "dp_replicate_ep": (MeshParallelStrategy, {"dp_replicate": 2, "ep": 2}),
    "own_fsdp_step": (LayerUnitsOfItsOwn, {"ep": 2}),
}
"""Strategy class and options of each layout the gradient tests compare (built inside the ranks)."""


def _one_step_gradients(rank: int, world_size: int, root: str, layouts: list[str]) -> dict | None:
    out = {}
    for name in layouts:
        strategy_class, options = LAYOUTS[name]
        pl.seed_everything(0, verbose=False)
        moe = MoEOptions(experts="grouped", load_balance_weight=0.01, z_loss_weight=0.001)
        module = CausalLM(Float64ModelFactory(preset="tiny-qwen3-moe", moe=moe), warmup_steps=0)
        gradients = StepGradients()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy_class(**options),
            max_steps=1,
            callbacks=[gradients],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            use_distributed_sampler=False,
            num_sanity_val_steps=0,
            default_root_dir=Path(root) / name,
        )
        trainer.fit(module, DataLoader([_unequal_batch(rank)], batch_size=None))
        out[name] = gradients.gradients
    return out if rank == 0 else None


def _assert_same_gradients(run: dict, reference: str, layouts: list[str]) -> None:
    for layout in layouts:
        assert run[layout].keys() == run[reference].keys()
        for name, expected in run[reference].items():
            difference = (run[layout][name] - expected).abs().max() / expected.abs().max()
            assert difference <= GRAD_RTOL, f"{layout} {name}: max |diff| {difference:.2e} of the largest element"


def test_expert_parallel_gradients_equal_no_expert_parallel_in_float64(tmp_path) -> None:
    """One step's gradient of every parameter under EP (both dispatches) equals FSDP2's without EP, in
    float64, with unequal useful tokens per rank and both router losses on.

    The float32 loss-curve tests above cannot prove it: rounding decides top-k near-ties (two router
    probabilities equal to the last bit), one token routed otherwise forks the runs, and Adam hides a
    gradient scale (x1.01 on one expert's gradient moved no loss of a 12-step study run by more than
    1 ulp; docs/moe.md). In float64 the layouts agree to 4.2e-16 of each tensor's largest element
    (GRAD_RTOL leaves x2000). Seen failing: with FSDP's divide factor on the experts as before (torch
    divides twice in float64: every expert gradient 0.5x), and with expert 0's weight gradient on
    rank 0 scaled by 1.01 (a value-preserving scale in ``RoutedExperts.forward``): 5.1e-3.
    """
    layouts = ["no_ep", "all_to_all", "all_reduce"]
    runs = run_ranks(_one_step_gradients, 2, str(tmp_path), layouts, init_process_group=False, timeout_s=300)
    _assert_same_gradients(runs[0], "no_ep", layouts[1:])


def test_a_strategy_replacing_apply_fsdp_keeps_its_experts_sharded(tmp_path) -> None:
    """The experts' FSDP is a step of its own (``apply_expert_fsdp``), not part of ``apply_fsdp``'s body:
    a subclass that replaces ``apply_fsdp`` without ``super()`` still trains EP's model, the same float64
    gradients as FSDP2 without EP. Seen failing with the experts' sharding back inside
    ``ExpertParallelSteps.apply_fsdp`` (the subclass's root unit met the experts' ``ep`` DTensors: "Cannot
    concatenate overlapping meshes"), while the presets' float64 EP test passed."""
    layouts = ["no_ep", "own_fsdp_step"]
    runs = run_ranks(_one_step_gradients, 2, str(tmp_path), layouts, init_process_group=False, timeout_s=300)
    _assert_same_gradients(runs[0], "no_ep", layouts[1:])


@pytest.mark.slow  # 4 gloo ranks on 2 cores, three fits (~50 s)
def test_expert_parallel_gradients_equal_no_expert_parallel_beside_dp_shard_and_dp_replicate(tmp_path) -> None:
    """The same float64 check on 4 ranks: ep 2 x dp_shard 2 (the experts' FSDP shard dimension holds 2
    ranks) and ep 2 x dp_replicate 2 (it holds 1: torch's one-rank path). Measured 5.0e-16. Seen failing
    with FSDP's divide factor applied to the experts as before: dp_replicate x ep expert gradients 0.25x."""
    layouts = ["no_ep", "dp_shard_ep", "dp_replicate_ep"]
    runs = run_ranks(_one_step_gradients, 4, str(tmp_path), layouts, init_process_group=False, timeout_s=600)
    _assert_same_gradients(runs[0], "no_ep", layouts[1:])

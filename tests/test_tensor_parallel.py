"""Tensor parallelism trains the same model as one process: tp=2 and tp=2 x dp_shard=2 (gloo ranks).

Each run builds a tiny model from seed 0, trains it a few plain SGD steps on a fixed batch of 4
sequences and compares the loss series and the final (gathered) weights with one process training
on the whole batch; tensor-parallel peers read the same rows, ``dp_shard`` ranks different ones.
Tolerances as in ``test_strategies_equivalence``, losses within 1e-5 (measured: <= 1e-6). SGD,
not AdamW: Adam divides near-zero gradients by their own size, so fp32 reduction-order noise (TP
sums row-parallel partial products in another order) grows step by step, and how fast depends on
the library's kernels: Qwen3 with sequence parallelism drifted to 4.7e-5 by the fourth AdamW step
under transformers 5.24 (1.2e-5 at lr 1e-2 before), with first-step losses and q/k-norm gradients
equal to 1e-9. SGD keeps that noise at its own size, so the tolerances test TP, not Adam.

Bugs these catch (each seen failing): Qwen3's per-head ``q_norm``/``k_norm`` gradients left partial
per TP rank (plan entries removed: grads off by ~3e-3, under tp alone and tp x cp); TP peers given
different rows (losses off by 0.8).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lit_ablate.callbacks.step_monitor import batch_replicas
from lit_ablate.data import LMDataModule, SyntheticText
from lit_ablate.errors import ConfigError
from lit_ablate.estimate.flops import count_parameters
from lit_ablate.estimate.memory import estimate_memory
from lit_ablate.estimate.shapes import TrainingShape, model_shape
from lit_ablate.mesh_sizes import resolve_mesh_sizes
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import loss_backend
from lit_ablate.models.moe.blocks import MoEOptions
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import (
    ExpertTensorParallelStrategy,
    MeshParallelStrategy,
    TensorContextParallelStrategy,
    TensorParallelStrategy,
)
from lit_ablate.strategies.interface import state_sharding_of
from tests.distributed import run_ranks
from tests.test_moe_expert_parallel import Float64ModelFactory
from tests.test_strategies_equivalence import PARAM_ATOL, fixed_batch, full_weights, mean_over_ranks, rows_of

STEPS = 4
LR = 0.2  # plain SGD: the tiny models' losses fall by 0.35-0.7 in 4 steps
LOSS_ATOL = 1e-5
GRAD_ATOL = 1e-6  # measured ~1e-7 (reduction order); a partial q/k-norm gradient is off by ~3e-3
NORM_GRADS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def build(preset: str, meta: bool = False, loss: str = "torch", **overrides) -> CausalLMWithLoss:
    torch.manual_seed(0)
    with torch.device("meta") if meta else nullcontext():
        lm = ModelFactory(preset=preset, config=overrides).build()
    return CausalLMWithLoss(lm, loss_backend(loss))


def train(model: torch.nn.Module, batch: dict, strategy: TensorParallelStrategy | None = None) -> dict:
    """SGD steps; the loss series (mean over ranks), and the q/k-norm gradients of the first step."""
    context = strategy.vocabulary_parallel_loss if strategy else nullcontext
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norm_grads = [], {}
    for step in range(STEPS):
        with context():
            loss_sum, useful = model(batch)
            loss = loss_sum / useful
            loss.backward()
        if step == 0:
            norm_grads = {name: _full(p.grad) for name, p in model.named_parameters() if name.endswith(NORM_GRADS)}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return {"losses": mean_over_ranks(losses), "norm_grads": norm_grads, "weights": full_weights(model)}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _tensor_parallel_run(rank: int, world_size: int, preset: str, strategy_kwargs: dict) -> dict:
    strategy = TensorParallelStrategy(**strategy_kwargs)
    strategy.build_mesh("cpu", world_size)
    model = strategy.parallelize(build(preset, meta=rank != 0))
    batch = rows_of(fixed_batch(), strategy.data_parallel_rank, strategy.data_parallel_size)
    if strategy.sequence_parallel:
        batch = strategy.sequence_parallel_batch(batch)
    result = train(model, batch, strategy)
    _group, group_size = strategy.gradient_mean_group
    result.update(
        sampler=strategy.distributed_sampler_kwargs,
        gradient_mean_size=group_size,
        batch_replicas=strategy.batch_replicas,
    )
    if rank:
        result["weights"] = {}
    return result


def _two_ranks(rank: int, world_size: int) -> dict:
    return {
        "llama": _tensor_parallel_run(rank, world_size, "tiny-llama", {}),
        "qwen3_sp": _tensor_parallel_run(rank, world_size, "tiny-qwen3", {"sequence_parallel": True}),
        "qwen3_moe_sp": _tensor_parallel_run(rank, world_size, "tiny-qwen3-moe", {"sequence_parallel": True}),
    }


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    """One process, the whole batch, per model family."""
    return {preset: train(build(preset), fixed_batch()) for preset in ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks, 2)


def assert_same_training(result: dict, reference: dict) -> None:
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=LOSS_ATOL
    )
    assert result["losses"][-1] < result["losses"][0] - 0.1, "the model did not train"
    assert sorted(result["weights"]) == sorted(reference["weights"])
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], weight, rtol=0, atol=PARAM_ATOL, msg=name)


def test_tp2_llama_equals_one_process(two_ranks, references):
    assert_same_training(two_ranks[0]["llama"], references["tiny-llama"])


def test_tp2_sequence_parallel_qwen3_equals_one_process(two_ranks, references):
    assert_same_training(two_ranks[0]["qwen3_sp"], references["tiny-qwen3"])


def test_tp2_sequence_parallel_qwen3_moe_equals_one_process(two_ranks, references):
    """The dense parts split, each MoE block whole on both TP ranks (gathered sequence in, slice out)."""
    assert_same_training(two_ranks[0]["qwen3_moe_sp"], references["tiny-qwen3-moe"])


def test_qwen3_q_k_norm_gradients_are_reduced_over_tp(two_ranks, references):
    """Each TP rank holds some heads, so these norms' gradients are partial sums (docs/platform.md)."""
    expected = references["tiny-qwen3"]["norm_grads"]
    assert len(expected) == 2 * 4  # q and k norm of each of the 4 layers
    for run in two_ranks:
        for name, grad in expected.items():
            torch.testing.assert_close(run["qwen3_sp"]["norm_grads"][name], grad, rtol=0, atol=GRAD_ATOL, msg=name)


def _four_ranks(rank: int, world_size: int) -> dict:
    return {
        "tp_dp": _tensor_parallel_run(
            rank, world_size, "tiny-qwen3", {"tp": 2, "dp_shard": 2, "sequence_parallel": True}
        ),
        "tp_cp": _tp_x_cp_gradients(rank, world_size),
    }


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_four_ranks, 4)


def test_tp2_x_dp_shard2_equals_one_process(references, four_ranks):
    """2-D: FSDP2 over dp_shard, TP inside; the TP peers read the same rows, dp_shard ranks different ones."""
    results = [run["tp_dp"] for run in four_ranks]
    assert_same_training(results[0], references["tiny-qwen3"])
    assert [r["sampler"]["rank"] for r in results] == [0, 0, 1, 1]  # ranks 0, 1 are one TP group
    assert {r["sampler"]["num_replicas"] for r in results} == {2}
    assert {r["gradient_mean_size"] for r in results} == {2}  # StepObjective counts tokens over dp, not tp
    assert {r["batch_replicas"] for r in results} == {2}  # throughput and MFU count a TP group's batch once


# ---------------------------------------------------------------- under a Lightning Trainer
class Seen(Callback):
    """Per step: the global token-mean loss, a checksum of the global batch and the gradient norm
    before clipping (from gathered gradients, not the strategy's norm); the gathered weights at the end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[int] = []
        self.norms: list[float] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.local_param_bytes = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # Lightning clips after this hook
        grads = [_full(p.grad) for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(torch.stack([g.float().square().sum() for g in grads]).sum().sqrt().item())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sums = torch.stack(
            [outputs["loss_sum"].detach().float(), outputs["useful_tokens"].float(), batch["input_ids"].sum().float()]
        )
        if trainer.world_size > 1:  # every rank's share (dp rows, cp slices); TP peers read the same tokens
            dist.all_reduce(sums)
            sums[2] /= batch_replicas(trainer)
        self.losses.append((sums[0] / sums[1]).item())
        self.batches.append(int(sums[2]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.weights = full_weights(pl_module)
        local = [p.to_local() if isinstance(p, DTensor) else p for p in pl_module.parameters()]
        self.local_param_bytes = sum(t.numel() * t.element_size() for t in local)


CLIP = 0.5  # below every step's gradient norm (asserted): clipping scales every step


def lightning_model(moe: bool) -> ModelFactory:
    """Tiny Qwen3, or tiny Qwen3-MoE on lit-ablate's grouped experts without the load-balancing loss
    (a statistic of each data-parallel rank's tokens, so not one process's) in float64: in float32 the
    reduction orders of TP and of one process decide top-k routing near-ties differently on some CPU
    kernels, after which AdamW's first updates move the experts' near-zero gradients' weights by whole
    steps (with ATen's AVX2 kernels, ``ATEN_CPU_CAPABILITY=avx2``, tp2_moe's step-3 loss was 5.5e-5 off,
    past the tolerance its AVX-512 run kept). In float64 no near-tie splits: measured on ATen's AVX-512,
    AVX2 and default kernels, both MoE runs hold the dense runs' tolerances (losses within 1.7e-6,
    pre-clip norms 1.9e-6 relative, weights 5.6e-5 at most: the router's softmax and the loss still
    round to float32)."""
    if moe:
        return Float64ModelFactory(preset="tiny-qwen3-moe", moe=MoEOptions(experts="grouped", load_balance_weight=0.0))
    return ModelFactory(preset="tiny-qwen3")


FIT_LR, FIT_STEPS = 1e-2, 3


def fit(strategy, devices: int, root: Path, batch_size: int = 2, moe: bool = False) -> Seen:
    pl.seed_everything(0, verbose=False)
    module = CausalLM(lightning_model(moe), learning_rate=FIT_LR, warmup_steps=1)
    data = LMDataModule(SyntheticText(num_documents=40), seq_len=32, batch_size=batch_size)
    seen = Seen()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=FIT_STEPS,
        callbacks=[seen],
        gradient_clip_val=CLIP,  # TP gradients live on two meshes: the strategy must clip by the global norm
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(module, data)
    return seen


def lightning_strategy(strategy_kwargs: dict) -> TensorParallelStrategy:
    if "cp" in strategy_kwargs:
        return TensorContextParallelStrategy(tp=2, **strategy_kwargs)
    if "ep" in strategy_kwargs:
        return ExpertTensorParallelStrategy(tp=2, sequence_parallel=True, **strategy_kwargs)
    return TensorParallelStrategy(tp=2, sequence_parallel=True, **strategy_kwargs)


def _lightning_tp(rank: int, world_size: int, root: str, strategy_kwargs: dict, moe: bool) -> dict:
    seen = fit(lightning_strategy(strategy_kwargs), world_size, Path(root), moe=moe)
    return {
        "losses": seen.losses,
        "batches": seen.batches,
        "norms": seen.norms,
        "weights": seen.weights if rank == 0 else {},
        "local_param_bytes": seen.local_param_bytes,
    }


LIGHTNING_RUNS = {
    "tp2": {},
    "tp2_x_dp_shard2": {"dp_shard": 2},
    "tp2_x_cp2": {"cp": 2},
    "tp2_x_dp_replicate2": {"dp_replicate": 2},
    "tp2_checkpointed_compiled": {
        "activation_checkpointing": "full",
        "compile_layers": True,
        "compile_backend": "aot_eager",
    },
    "tp2_moe": {},
    "tp2_x_ep2_moe": {"ep": 2},
}
"""Strategy arguments beside ``tp=2`` (``TensorParallelStrategy`` with sequence parallelism; with
``cp`` ``TensorContextParallelStrategy``; with ``ep`` ``ExpertTensorParallelStrategy`` with sequence
parallelism); the world size is 2 x dp_replicate x dp_shard x ep x cp. Runs named ``*_moe`` train
tiny Qwen3-MoE, the others tiny Qwen3."""


@pytest.mark.parametrize("name", list(LIGHTNING_RUNS))
def test_lightning_fit_with_tp2_equals_one_device(tmp_path, name):
    """The sampler gives both TP peers the batch one process reads (dp_shard ranks: their halves of
    it; cp ranks: their slices of each sequence, TensorContextParallelStrategy without SP); clipping
    and the loss context hold inside Lightning's loop. Every step is clipped, so the shared norm over
    the TP and FSDP meshes must be the global one: with FSDP's ``_StridedShard`` counted as
    replicated in ``clip_grad_norm_across_meshes`` (the bug that had clipping refused under
    tp x dp_shard and tp x cp) both 4-rank cases fail (seen: pre-clip norms off by 1.5e-3 and 1.0e-3
    from step 2; tp2_x_dp_shard2's losses by 1.2e-3 at step 3). HSDP (replicas of the TP x FSDP
    mesh) and layers checkpointed and compiled under TP (each rank compiles its own) go through the
    same pipeline and must train the same model: with compiled layers given the embedding's
    unwaited ``AsyncCollectiveTensor`` (before ``TensorParallelStrategy.apply_tp`` waited for it under compile)
    the embedding's gradient was zero and tp2_checkpointed_compiled failed (pre-clip norms 9.5 % low;
    it still fails so with the layers compiled by ``aot_eager``, the tracing without inductor's code
    generation, which this run uses: a cold inductor build made it 45 s instead of ~15).
    TP x EP (the ep ranks read different halves of the batch; tokens reach their experts among the
    ranks of one tp index) was seen failing with the ep ranks left out of StepObjective's W (pre-clip
    norms halved from step 1; the losses stay equal: Adam does not see a constant gradient scale).
    Each rank also holds the parameter bytes the memory estimate divides the model into: seen
    failing for both MoE runs with the experts divided by tp, which keeps them whole."""
    kwargs, moe = LIGHTNING_RUNS[name], name.endswith("_moe")
    data_parallel = kwargs.get("dp_replicate", 1) * kwargs.get("dp_shard", 1) * kwargs.get("ep", 1)
    reference = fit("auto", 1, tmp_path / "one", batch_size=2 * data_parallel, moe=moe)
    world_size = 2 * data_parallel * kwargs.get("cp", 1)
    ranks = run_ranks(
        _lightning_tp, world_size, str(tmp_path / "tp"), kwargs, moe, init_process_group=False, timeout_s=300
    )
    assert min(reference.norms) > CLIP, "clipping never scaled the gradients"
    for run in ranks:
        assert run["batches"] == reference.batches
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(reference.norms), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference.losses), rtol=0, atol=LOSS_ATOL)
    assert sorted(ranks[0]["weights"]) == sorted(reference.weights)
    for name, weight in reference.weights.items():
        difference = (ranks[0]["weights"][name] - weight).abs()
        assert difference.max() <= PARAM_ATOL and difference.mean() <= PARAM_ATOL, (
            name,
            difference.max(),
            difference.mean(),
        )
    lm = lightning_model(moe).build()
    training = TrainingShape(micro_batch=2, seq_len=32, param_bytes=next(lm.parameters()).element_size())
    estimate = estimate_memory(
        count_parameters(lm, lm.config),
        model_shape(lm.config),
        training,
        state_sharding_of(lightning_strategy(kwargs), world_size),
        world_size,
    )
    assert max(run["local_param_bytes"] for run in ranks) == pytest.approx(estimate.params, rel=0.02)


# ---------------------------------------------------------------- refusals, one process
def strategy_on(world_size: int, **kwargs) -> TensorParallelStrategy:
    strategy = TensorParallelStrategy(**kwargs)
    strategy.mesh_sizes = resolve_mesh_sizes(strategy.requested_mesh_sizes, world_size)
    return strategy


def test_what_tp_cannot_split_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer.strategy.init_args.tp"):
        strategy_on(2).check_model(build("tiny-llama", meta=True, num_key_value_heads=1))
    for model_kwargs in ({"loss": "chunked"}, {"tie_word_embeddings": True}):  # split since issue 29
        strategy_on(2).check_model(build("tiny-llama", meta=True, **model_kwargs))


def test_fused_kernel_losses_are_refused():
    """Liger and CCE take the whole LM-head weight (their kernels need CUDA: checked by name here)."""
    from lit_ablate.models.losses.loss_choice import check_tensor_parallel_loss

    for backend in ("liger", "cce"):
        with pytest.raises(ConfigError, match=r"model.init_args.loss.*use loss: chunked"):
            check_tensor_parallel_loss(backend)


def test_z_loss_is_refused_with_the_torch_backend_only():
    model = build("tiny-llama", meta=True)
    model.loss_fn = loss_backend("torch", z_loss_weight=1e-4)
    with pytest.raises(ConfigError, match="z_loss_weight"):
        strategy_on(2).check_model(model)
    model.loss_fn = loss_backend("chunked", z_loss_weight=1e-4)  # all-reduces the log-sum-exp
    strategy_on(2).check_model(model)


def test_sequence_parallel_makes_positions_explicit_and_keeps_only_padding_masks():
    strategy = strategy_on(2, sequence_parallel=True)
    batch = strategy.sequence_parallel_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    unpadded = strategy.sequence_parallel_batch({"input_ids": torch.zeros(2, 8), "attention_mask": torch.ones(2, 8)})
    assert "attention_mask" not in unpadded  # all ones: the decoder's causal mask is the same without it
    padded = torch.ones(2, 8)
    padded[1, 6:] = 0  # kept: whole_sequence_masks builds the whole sequence's mask from it
    assert (
        strategy.sequence_parallel_batch({"input_ids": torch.zeros(2, 8), "attention_mask": padded})["attention_mask"]
        is padded
    )
    with pytest.raises(ConfigError, match="not divisible by tp=2"):
        strategy.sequence_parallel_batch({"input_ids": torch.zeros(2, 7)})


def _tp_x_cp_gradients(rank: int, world_size: int) -> dict:
    strategy = TensorContextParallelStrategy(tp=2, cp=2)
    strategy.build_mesh("cpu", world_size)
    model = strategy.parallelize(build("tiny-qwen3", meta=rank != 0))
    batch = strategy.shard_batch(fixed_batch())  # this cp rank's slice of every sequence
    with strategy.context_parallel_attention(), strategy.vocabulary_parallel_loss():
        loss_sum, useful = model(batch)
        sums = torch.stack([loss_sum.detach(), useful.float()])
        dist.all_reduce(sums, group=strategy.device_mesh["cp"].get_group())
        # the global token mean; x cp undoes FSDP's averaging over the cp ranks (StepObjective's job in a fit)
        (loss_sum / sums[1] * strategy.mesh_sizes["cp"]).backward()
    return {"loss": (sums[0] / sums[1]).item(), "grads": {name: _full(p.grad) for name, p in model.named_parameters()}}


def test_tp2_x_cp2_gradients_equal_one_process(four_ranks):
    """4 ranks: cp=2 ranks share each sequence (ring attention over their TP rank's heads), tp=2 split
    the matrices. One step's loss and every gradient (q/k norms included) against one process."""
    reference = build("tiny-qwen3")
    loss_sum, useful = reference(fixed_batch())
    (loss_sum / useful).backward()
    for result in (run["tp_cp"] for run in four_ranks):
        assert result["loss"] == pytest.approx((loss_sum / useful).item(), abs=LOSS_ATOL)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(result["grads"][name], p.grad, rtol=0, atol=GRAD_ATOL, msg=name)


def test_tp_with_context_parallel_needs_a_strategy_that_takes_both():
    with pytest.raises(ConfigError, match=r"trainer.strategy.init_args.cp=2: TensorParallelStrategy does not take cp"):
        TensorParallelStrategy(tp=2, cp=2)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        MeshParallelStrategy(tp=2, cp=2, sequence_parallel=True)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        TensorContextParallelStrategy(tp=2, cp=2, sequence_parallel=True)


def test_a_config_s_tensor_parallelism_reaches_the_estimate():
    """tp: -1 resolves against the devices; weights, gradients and optimizer states are divided by tp,
    activations by less (the norms stay whole without sequence parallelism), and by more with it.
    Catches the estimate ignoring tp (it was equal to one rank's before this model)."""
    import yaml

    from lit_ablate.config_keys import with_overrides
    from lit_ablate.estimate.from_config import estimate_for_config, training_shape_of
    from tests.test_estimate_memory import QUICKSTART

    base = yaml.safe_load(QUICKSTART.read_text())

    def config(devices: int, sequence_parallel: bool = False) -> dict:
        strategy = {
            "class_path": "lit_ablate.strategies.TensorParallelStrategy",
            "init_args": {"tp": -1, "sequence_parallel": sequence_parallel},
        }
        return with_overrides(base, {"trainer.devices": devices, "trainer.strategy": strategy})

    shape = training_shape_of(config(2, sequence_parallel=True))
    assert (shape.tensor_parallel, shape.sequence_parallel) == (2, True)
    one, tp2, tp2_sp = (
        estimate_for_config(config(1)),
        estimate_for_config(config(2)),
        estimate_for_config(config(2, sequence_parallel=True)),
    )
    assert tp2.params == -(-one.params // 2) and tp2.optimizer == one.optimizer // 2
    assert one.activations / 2 < tp2.activations < one.activations
    assert tp2_sp.activations < tp2.activations


def test_a_study_skips_tensor_parallelism_with_a_fused_loss_up_front():
    """The study's rules give the strategy's own one-line reason."""
    from lit_ablate.rules import Scope, first_refusal
    from lit_ablate.rules.part_pairs import tensor_parallel_loss_fits

    def config(loss: str, tp: int = 2) -> dict:
        return {
            "trainer": {
                "accelerator": "cpu",
                "devices": 2,
                "strategy": {"class_path": "lit_ablate.strategies.TensorParallelStrategy", "init_args": {"tp": tp}},
            },
            "model": {"init_args": {"loss": loss}},
        }

    here = (Scope.CONFIG, Scope.MACHINE)
    reason = tensor_parallel_loss_fits(config("liger"))  # the rule alone: liger needs CUDA
    assert "model.init_args.loss" in reason and "use loss: chunked" in reason
    assert first_refusal(config("torch"), *here) is None
    assert first_refusal(config("chunked"), *here) is None
    assert tensor_parallel_loss_fits(config("liger", tp=1)) is None

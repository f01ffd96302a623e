"""The per-rank memory model against what a real step holds (tiny models, CPU, MemTracker)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lit_ablate.commands.estimate import estimate_main
from lit_ablate.estimate.flops import count_parameters
from lit_ablate.estimate.from_config import canonical_sharding, estimate_for_config, smallest_world_size
from lit_ablate.estimate.memory import activation_bytes, estimate_memory
from lit_ablate.estimate.shapes import TrainingShape, model_shape
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import loss_backend
from lit_ablate.strategies import FSDP2Strategy
from lit_ablate.strategies.state_sharding import REPLICATED, StateSharding

ACTIVATION_FACTOR = 1.15
"""The activation estimate is within this factor of MemTracker's peak (activations + temporaries)
either way. Measured agreement on these shapes is 0.3-5%; a missing term (the loss's logits, the
MLP's intermediates, the q/k norms) is 10-60% and fails."""
QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


CHUNK_TOKENS = 128


def build(preset: str, dtype: str = "float32", loss: str = "torch", **config) -> CausalLMWithLoss:
    torch.manual_seed(0)
    factory = ModelFactory(preset=preset, config=config, dtype=dtype)
    options = {"chunk_tokens": CHUNK_TOKENS} if loss == "chunked" else {}
    return CausalLMWithLoss(factory.build(), loss_backend(loss, **options))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    ("preset", "dtype"), [("tiny-llama", "float32"), ("tiny-qwen3", "bfloat16"), ("tiny-qwen3-moe", "float32")]
)
def test_state_bytes_match_the_tensors_exactly(preset: str, dtype: str):
    model = build(preset, dtype)
    training = TrainingShape(micro_batch=2, seq_len=16, param_bytes=torch.finfo(getattr(torch, dtype)).bits // 8)
    estimate = estimate_memory(
        count_parameters(model.lm, model.lm.config), model_shape(model.lm.config), training, REPLICATED, world_size=1
    )
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 300, (2, 16))
    model({"input_ids": ids, "labels": ids})[0].backward()
    optimizer.step()
    assert estimate.params == tensor_bytes(model.parameters())
    assert estimate.grads == tensor_bytes(p.grad for p in model.parameters())
    moments = [
        v for state in optimizer.state.values() for k, v in state.items() if k != "step"
    ]  # step: one scalar each
    assert estimate.optimizer == tensor_bytes(moments)
    assert estimate.transient == 0, "one process: no gathered layers, no DDP buckets"


def measured_activation_peak(model: CausalLMWithLoss, batch: int, seq: int) -> int:
    """MemTracker's peak of activations + temporaries over one forward and backward."""
    ids = torch.randint(0, 300, (batch, seq))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model({"input_ids": ids, "labels": ids})[0].backward()
    peak = {str(k).rsplit(".", 1)[-1]: v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items()}
    return peak["ACT"] + peak["TEMP"]


@pytest.mark.parametrize(
    ("preset", "checkpointing", "loss", "layers"),
    [
        ("tiny-llama", "none", "torch", 4),
        ("tiny-llama", "full", "torch", 4),
        ("tiny-llama", "selective", "torch", 4),
        ("tiny-qwen3", "none", "chunked", 2),
        ("tiny-qwen3-moe", "none", "torch", 2),
    ],
)
def test_activation_estimate_is_within_the_stated_factor_of_the_measured_peak(preset, checkpointing, loss, layers):
    batch, seq = 4, 128
    model = build(preset, loss=loss, num_hidden_layers=layers)
    FSDP2Strategy(activation_checkpointing=checkpointing, checkpoint_every=2).apply_activation_checkpointing(model)
    measured = measured_activation_peak(model, batch, seq)
    training = TrainingShape(
        micro_batch=batch, seq_len=seq, checkpointing=checkpointing, loss=loss, chunk_tokens=CHUNK_TOKENS
    )
    estimated = activation_bytes(model_shape(model.lm.config), training)
    assert 1 / ACTIVATION_FACTOR <= estimated / measured <= ACTIVATION_FACTOR, (estimated, measured)


def test_sharding_divides_state_and_adds_the_transients():
    model = build("tiny-llama")
    counts, shape = count_parameters(model.lm, model.lm.config), model_shape(model.lm.config)
    training = TrainingShape(micro_batch=1, seq_len=8)
    full = counts.total * 4
    ddp = estimate_memory(counts, shape, training, canonical_sharding("ddp", 4), 4)
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.transient) == (full, full, 2 * full, full)  # buckets
    zero2 = estimate_memory(counts, shape, training, canonical_sharding("zero2", 4), 4)
    assert (zero2.params, zero2.grads, zero2.optimizer) == (full, full // 4, 2 * full // 4)
    fsdp = estimate_memory(counts, shape, training, canonical_sharding("fsdp2", 4), 4)
    root = 2 * 320 * 128 + 128  # embeddings, LM head, final norm: gathered from forward to backward
    assert counts.total - shape.layers * shape.layer_params == root
    assert fsdp.params == full // 4 and fsdp.transient == (4 * shape.layer_params + root) * 4  # + 2 layers' grads
    assert shape.layer_params == sum(p.numel() for p in model.lm.model.layers[0].parameters())
    no_reshard = estimate_memory(counts, shape, training, canonical_sharding("fsdp2_no_reshard", 4), 4)
    assert no_reshard.params == full // 4 and no_reshard.transient == full + 2 * max(shape.layer_params, root) * 4
    assert canonical_sharding("hsdp", 16, gpus_per_node=8) == StateSharding(
        params=8, grads=8, optimizer=8, fsdp_units=True
    )
    # the smallest count whose per-rank total fits a budget between the 2- and 3-rank totals
    totals = {n: estimate_memory(counts, shape, training, canonical_sharding("fsdp2", n), n).total for n in (2, 3)}
    budget = (totals[2] + totals[3]) / 2
    fits = lambda n: estimate_memory(counts, shape, training, canonical_sharding("fsdp2", n), n).total <= budget  # noqa: E731
    assert smallest_world_size(fits, 64) == 3


def test_estimate_of_a_fit_config_and_the_command(capsys: pytest.CaptureFixture[str]):
    from lit_ablate.fit_cli import resolve_fit_config

    config = resolve_fit_config(["--config", str(QUICKSTART)])
    estimate = estimate_for_config(config)
    model = build("tiny-llama")
    assert estimate.params == tensor_bytes(model.parameters())
    # a GPU-only attention implementation does not stop the estimate on a machine without it
    config["model"]["init_args"]["model"]["attn_implementation"] = "flash_attention_2"
    assert estimate_for_config(config).params == estimate.params
    assert estimate_main(["--config", str(QUICKSTART), "--gpu_memory_gib", "0.05", "--max_gpus", "64"]) == 0
    out = capsys.readouterr().out
    assert "| fsdp2 |" in out and "| configured (auto) |" in out
    # 0.05 GiB x 0.9 is below one tiny-llama rank's total (~60 MiB): DDP never fits, FSDP2 never either
    # (activations alone exceed it), so both say none
    assert "| ddp |" in out and out.count("none up to 64") >= 2


# --- every category against a measured 2-rank step ------------------------------------------------
# (name, preset, model config overrides, loss options, strategy, strategy options): shapes the
# activation model was not calibrated on (a 16384-token vocabulary, q/k norms, MoE, checkpointing).
MEASURED_RUNS = [
    ("llama_ddp", "tiny-llama", {}, None, "DDPStrategy", {}),
    ("llama_zero1", "tiny-llama", {}, None, "ZeRO1Strategy", {}),
    ("llama_fsdp1", "tiny-llama", {"num_hidden_layers": 2}, None, "FSDP1Strategy", {}),
    ("qwen3_fsdp2_chunked", "tiny-qwen3", {"vocab_size": 16384}, {"chunk_tokens": 32}, "FSDP2Strategy", {}),
    ("moe_fsdp2_selective", "tiny-qwen3-moe", {}, None, "FSDP2Strategy", {"activation_checkpointing": "selective"}),
    ("llama_fsdp2_no_reshard", "tiny-llama", {}, None, "FSDP2Strategy", {"reshard_after_forward": False}),
    ("moe_ep", "tiny-qwen3-moe", {}, None, "ExpertParallelStrategy", {"ep": 2}),  # lit-ablate's grouped experts
    ("llama_fsdp2_fp8", "tiny-llama", {}, None, "FSDP2Strategy", {}),
    ("llama_fsdp2_fp8_all_gather", "tiny-llama", {}, None, "FSDP2Strategy", {}),
]
FP8_RUNS = {
    "llama_fsdp2_fp8": {"emulate": True},
    "llama_fsdp2_fp8_all_gather": {"emulate": True, "fsdp_all_gather": True},
}
"""The runs whose linear layers compute in fp8 (tensorwise, emulated on CPU as a GPU run computes it)."""
MICRO_BATCH, SEQ = 4, 32


def _measured_runs(rank: int, world_size: int, root: str) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lit_ablate import strategies
    from lit_ablate.callbacks import MemoryMonitor, RunRecorder
    from lit_ablate.models.fp8.conversion import Fp8Options
    from lit_ablate.models.moe.blocks import MoEOptions
    from lit_ablate.modules import CausalLM
    from tests.test_callbacks import _batches

    for name, preset, config, loss_options, strategy, options in MEASURED_RUNS:
        L.seed_everything(0)
        moe = MoEOptions(experts="grouped") if strategy == "ExpertParallelStrategy" else None
        fp8 = Fp8Options(**FP8_RUNS[name]) if name in FP8_RUNS else None
        module = CausalLM(
            ModelFactory(preset=preset, config=config, moe=moe, fp8=fp8),
            loss="chunked" if loss_options else "torch",
            loss_options=loss_options,
            warmup_steps=0,
        )
        trainer = L.Trainer(
            max_steps=3,
            accelerator="cpu",
            devices=world_size,
            strategy=getattr(strategies, strategy)(**options),
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[MemoryMonitor(), RunRecorder(path=f"{root}/{name}.json", warmup_steps=3)],
        )
        trainer.fit(module, DataLoader(_batches(3, MICRO_BATCH, masked_prefix=[0]), batch_size=None))


@pytest.fixture(scope="module")
def measured_breakdowns(tmp_path_factory) -> dict[str, dict]:
    import json

    from tests.distributed import run_ranks

    root = tmp_path_factory.mktemp("measured")
    run_ranks(_measured_runs, 2, str(root), init_process_group=False, timeout_s=600)
    return {
        name: json.loads((root / f"{name}.json").read_text())["summary"]["tensor_breakdown"]
        for name, *_ in MEASURED_RUNS
    }


@pytest.mark.slow
@pytest.mark.parametrize("run", MEASURED_RUNS, ids=[r[0] for r in MEASURED_RUNS])
def test_every_estimated_category_is_within_its_factor_of_the_measured_one(measured_breakdowns, run):
    """``AGREEMENT_FACTORS`` per category, against ``MemoryMonitor``'s tracked step on 2 ranks.
    Measured ratios (estimate / measured): state categories 0.965-1.0, activations 0.96-1.0,
    transient 0.97-1.83. Seen failing (each alone): the transient model of before this test (two
    gathered layers + one layer of gradients: the root's gathered embeddings/LM head and its full
    gradients twice were missing; 0.06 at a 16384-token vocabulary) and the chunked loss without
    its forward-formed LM-head gradient (activations 0.63), FSDP2 without resharding counted as
    full parameters instead of stored shards plus a gathered transient copy (params 2.0), and expert
    parallelism counted as FSDP2 gathering every layer's experts (transient 2.80: each rank holds
    its own experts, which nothing gathers at ep = world size), and fp8 all-gather counted as the
    plain gather (params 0.90: the 1-byte casts of two layers' shards it sends)."""
    from lit_ablate import strategies
    from lit_ablate.estimate.agreement import AGREEMENT_FACTORS, compare_with_measured
    from lit_ablate.strategies.interface import state_sharding_of

    name, preset, config, loss_options, strategy, options = run
    model = build(preset, **config)
    training = TrainingShape(
        micro_batch=MICRO_BATCH,
        seq_len=SEQ,
        loss="chunked" if loss_options else "torch",
        chunk_tokens=(loss_options or {}).get("chunk_tokens", 1024),
        checkpointing=options.get("activation_checkpointing", "none"),
        fp8_all_gather=FP8_RUNS.get(name, {}).get("fsdp_all_gather", False),
    )
    sharding = state_sharding_of(getattr(strategies, strategy)(**options), 2)
    estimate = estimate_memory(
        count_parameters(model.lm, model.lm.config), model_shape(model.lm.config), training, sharding, world_size=2
    )
    comparison = compare_with_measured(estimate, measured_breakdowns[name])
    assert set(comparison) == set(AGREEMENT_FACTORS)
    disagreeing = {c: round(r["ratio"], 3) if r["ratio"] else r for c, r in comparison.items() if not r["agrees"]}
    assert not disagreeing, disagreeing


def test_ddp_on_one_rank_counts_its_gradient_buckets():
    """torch's DDP fills its gradient buckets even on one rank (sft_accumulation's one-device DDP runs measured
    a 3.48 MB transient, the gradients' size, against an estimated 0); a single-device run has none. Seen
    failing with the buckets counted from two ranks only (transient 0)."""
    from lit_ablate.estimate.from_config import estimate_for_config
    from lit_ablate.fit_cli import resolve_fit_config

    quickstart = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
    ddp = estimate_for_config(
        resolve_fit_config(
            ["--config", quickstart, "--trainer.strategy.class_path", "lit_ablate.strategies.DDPStrategy"]
        )
    )
    single = estimate_for_config(resolve_fit_config(["--config", quickstart]))
    assert ddp.transient == ddp.grads > 0
    assert single.transient == 0


def _one_rank_fsdp2(rank: int, world_size: int, root: str) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lit_ablate.callbacks import MemoryMonitor, RunRecorder
    from lit_ablate.modules import CausalLM
    from lit_ablate.strategies import FSDP2Strategy
    from tests.test_callbacks import _batches

    L.seed_everything(0)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(),
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MemoryMonitor(), RunRecorder(path=f"{root}/run.json", warmup_steps=3)],
    )
    trainer.fit(
        CausalLM(ModelFactory(preset="tiny-llama"), warmup_steps=0),
        DataLoader(_batches(3, MICRO_BATCH, masked_prefix=[0]), batch_size=None),
    )


@pytest.mark.slow  # one gloo rank, ~10 s
def test_fsdp2_on_one_rank_counts_its_gathered_layers(tmp_path: Path):
    """FSDP2 wraps every layer even over one rank: it gathers each into a new buffer and copies its
    gradients for the reduce-scatter (dp_scaling's and context_parallel's one-rank runs measured a
    2.7 MiB transient against an estimated 0). Seen failing with the transient counted only when
    ``params`` divides by more than 1 (transient: est. 0 B vs the measured)."""
    import json

    from lit_ablate.estimate.agreement import compare_with_measured
    from lit_ablate.strategies import FSDP2Strategy
    from lit_ablate.strategies.interface import state_sharding_of
    from tests.distributed import run_ranks

    run_ranks(_one_rank_fsdp2, 1, str(tmp_path), init_process_group=False, timeout_s=300)
    breakdown = json.loads((tmp_path / "run.json").read_text())["summary"]["tensor_breakdown"]
    model = build("tiny-llama")
    estimate = estimate_memory(
        count_parameters(model.lm, model.lm.config),
        model_shape(model.lm.config),
        TrainingShape(micro_batch=MICRO_BATCH, seq_len=SEQ),
        state_sharding_of(FSDP2Strategy(), 1),
        world_size=1,
    )
    transient = compare_with_measured(estimate, breakdown)["transient"]
    assert transient["measured"] > 0 and estimate.transient > 0
    assert transient["agrees"], transient

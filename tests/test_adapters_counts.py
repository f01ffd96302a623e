"""Adapters and quantised bases measured honestly: parameter counts (run record), FLOPs with a frozen
base (what MFU divides), and the memory estimate (frozen weights, no gradients or optimizer states
for them, packed 4-bit storage, 8-bit optimizer states with their fp32 small tensors)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lit_ablate.callbacks import RunRecorder
from lit_ablate.estimate.flops import attention_shape, count_parameters
from lit_ablate.estimate.from_config import model_of
from lit_ablate.estimate.memory import estimate_memory, optimizer_state_bytes
from lit_ablate.estimate.shapes import TrainingShape
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from lit_ablate.strategies.state_sharding import REPLICATED
from tests.test_step_objective import micro_batches

LORA_R4 = 4 * 4 * (2 * 256 + 2 * 192 + 3 * 512)
"""LoRA r=4 on every linear layer of the tiny Llama: r x (in + out) summed (test_adapters)."""
LINEAR_WEIGHTS = 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384)
"""Weights of the 28 decoder linear layers (what QLoRA quantises; the LM head stays fp32)."""


def module(**options) -> CausalLM:
    pl.seed_everything(0, verbose=False)
    built = CausalLM(ModelFactory(preset="tiny-llama", **options), warmup_steps=0)
    built.configure_model()
    return built


@pytest.fixture(scope="module")
def full() -> CausalLM:
    return module()


def test_lora_counts_adapters_as_the_only_trainable_parameters(full):
    counts, base = module(adapter={"r": 4}).parameter_counts, full.parameter_counts
    assert counts.total == base.total + LORA_R4
    assert counts.trainable == counts.adapter == counts.trainable_matmul == LORA_R4
    assert counts.matmul == base.matmul + LORA_R4
    assert (base.trainable, base.adapter, base.trainable_matmul) == (base.total, 0, base.matmul)


def test_a_frozen_base_costs_4n_per_token_and_adapters_6n(full):
    """Full fine-tuning: 6 N; LoRA: the frozen base 4 N (forward + input gradients) + its adapters 6 N.
    Counting the adapted model as fully trainable (the bug) would claim 6 (N + N_adapter)."""
    lora = module(adapter={"r": 4})
    layers, heads, head_dim = attention_shape(lora.model.lm.config)
    attention = 12.0 * layers * heads * head_dim * 64
    base = full.parameter_counts.matmul
    assert full.flops_per_token(64) == 6 * base + attention
    assert lora.flops_per_token(64) == 4 * base + 6 * LORA_R4 + attention
    assert lora.flops_per_token(64) < 6 * (base + LORA_R4) + attention


def test_qlora_counts_packed_weights_as_the_weights_they_hold():
    lora, qlora = (
        module(adapter={"r": 4}).parameter_counts,
        module(adapter={"r": 4}, quantization={"bits": 4}).parameter_counts,
    )
    assert qlora.quantized == LINEAR_WEIGHTS
    assert (qlora.total, qlora.trainable, qlora.matmul) == (lora.total, lora.trainable, lora.matmul)
    # NF4 + double quantisation: 4 bits, an 8-bit scale per 64 weights, an fp32 scale per 256 scales,
    # plus two small code tables per layer (16 + 256 fp32 values) that the per-weight rate leaves out.
    per_weight = (4 + 8 / 64 + 32 / (64 * 256)) / 8
    tables = 28 * (16 + 256) * 4
    assert LINEAR_WEIGHTS * per_weight <= qlora.quantized_bytes <= LINEAR_WEIGHTS * per_weight + tables + 28 * 4


@pytest.mark.parametrize(
    "options",
    [
        {"adapter": {"r": 4}},
        {"adapter": {"r": 4}, "quantization": {"bits": 4}},
        {"adapter": {"r": 8, "target_modules": ["q_proj", "v_proj"]}},
    ],
)
def test_the_estimate_counts_a_config_like_the_built_model(options):
    """``lit-ablate estimate`` counts from a meta build (no weights, nothing quantised): the same
    counts as the model a run builds, except the per-layer code tables in the quantised bytes."""
    built = module(**options).parameter_counts
    estimated, _ = model_of({"model": {"init_args": {"model": {"preset": "tiny-llama", **options}}}})
    tables = 28 * (16 + 256 + 1) * 4 if "quantization" in options else 0
    assert abs(estimated.quantized_bytes - built.quantized_bytes) <= tables
    assert estimated.__class__(**{**vars(estimated), "quantized_bytes": built.quantized_bytes}) == built


def test_memory_estimate_of_lora_and_qlora(full):
    shape = TrainingShape(micro_batch=2, seq_len=64)
    _, model_shape = model_of({"model": {"init_args": {"model": {"preset": "tiny-llama"}}}})
    lora = module(adapter={"r": 4}).parameter_counts
    qlora = module(adapter={"r": 4}, quantization={"bits": 4}).parameter_counts
    full_fp = estimate_memory(full.parameter_counts, model_shape, shape, REPLICATED, 1)
    lora_fp = estimate_memory(lora, model_shape, shape, REPLICATED, 1)
    q = estimate_memory(qlora, model_shape, shape, REPLICATED, 1)
    assert full_fp.grads == full.parameter_counts.total * 4 and lora_fp.grads == q.grads == LORA_R4 * 4
    assert lora_fp.optimizer == q.optimizer == LORA_R4 * optimizer_state_bytes("adamw", 4)
    assert lora_fp.params == lora.total * 4
    assert q.params == (qlora.total - LINEAR_WEIGHTS) * 4 + qlora.quantized_bytes
    # 8-bit AdamW: every LoRA matrix of this model is under 4096 elements, so its states stay fp32.
    eight = estimate_memory(
        lora, model_shape, TrainingShape(micro_batch=2, seq_len=64, optimizer="adamw8bit"), REPLICATED, 1
    )
    assert lora.small_trainable == LORA_R4 and eight.optimizer == LORA_R4 * 8


def test_the_run_record_holds_total_trainable_and_adapter_counts(tmp_path):
    pl.seed_everything(0, verbose=False)
    lm = CausalLM(ModelFactory(preset="tiny-llama", adapter={"r": 4}), warmup_steps=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[RunRecorder(path=str(tmp_path / "run.json"), warmup_steps=1)],
    )
    trainer.fit(lm, DataLoader(micro_batches("reference"), batch_size=None))
    model = json.loads((tmp_path / "run.json").read_text())["model"]
    assert (model["trainable"], model["adapter"]) == (LORA_R4, LORA_R4)
    assert model["total"] == lm.parameter_counts.total and model["quantized"] == 0


def test_count_parameters_reads_a_quantised_model_without_options():
    built = module(adapter={"r": 4}, quantization={"bits": 8}).model.lm
    counts = count_parameters(built, built.config)
    assert (
        counts.quantized == LINEAR_WEIGHTS and counts.quantized_bytes >= LINEAR_WEIGHTS
    )  # int8: a byte each + row scales
    assert all(p.dtype == torch.int8 for n, p in built.named_parameters() if n.endswith("base_layer.weight"))


def test_memory_breakdown_splits_frozen_and_trainable_parameters(tmp_path):
    """A LoRA run's tracked tensor breakdown and per-step state bytes count the frozen base apart
    (``frozen_params``) from the trainable adapters (``params``, with the buffers), exactly; the
    estimator's params (both together) still agree with them. Seen failing with frozen parameters
    counted as ``params`` (the frozen bytes were 0)."""
    from lit_ablate.estimate.agreement import compare_with_measured
    from lit_ablate.estimate.from_config import estimate_for_config
    from lit_ablate.modules import CausalLM
    from tests.test_memory_categories import _fit

    module = CausalLM(
        ModelFactory(preset="tiny-llama", adapter={"r": 8, "target_modules": ["q_proj", "v_proj"]}), warmup_steps=0
    )
    record = _fit(str(tmp_path), "lora", 1, module=module)
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    frozen = nbytes(p for p in module.parameters() if not p.requires_grad)
    trainable = nbytes(p for p in module.parameters() if p.requires_grad)
    maxima = record["summary"]["tensor_breakdown"]["max"]
    assert maxima["frozen_params"] == frozen > 10 * trainable
    assert maxima["params"] == trainable + nbytes(module.buffers())
    assert all(
        s["memory_frozen_params_bytes"] == frozen and s["memory_params_bytes"] == trainable for s in record["steps"]
    )
    config = {
        "model": {
            "init_args": {
                "model": {"preset": "tiny-llama", "adapter": {"r": 8, "target_modules": ["q_proj", "v_proj"]}}
            }
        },
        "data": {"init_args": {"batch_size": 4, "seq_len": 16}},
    }
    assert compare_with_measured(estimate_for_config(config, 1), record["summary"]["tensor_breakdown"])["params"][
        "agrees"
    ]


def test_study_report_shows_trainable_parameters(tmp_path):
    """An adapter study's report has a trainable-parameter column (from the run records' counts),
    re-made here from the shipped moe_lora_fsdp1_vs_ep records."""
    import shutil
    from pathlib import Path

    from lit_ablate.ablation.report import load_runs, render_markdown
    from lit_ablate.ablation.summary import study_summary

    shipped = Path(__file__).parents[1] / "benchmarks" / "results" / "moe_lora_fsdp1_vs_ep"
    shutil.copytree(shipped, tmp_path / "study", ignore=shutil.ignore_patterns("*.png", "report.*"))
    table = render_markdown(study_summary(*load_runs(tmp_path / "study")))
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| variant"))
    column = lines[start].split(" | ").index("trainable params")
    rows = [line.split(" | ") for line in lines[start + 2 : start + 5]]
    assert len(rows) == 3 and all(row[column] == "98.3k" for row in rows)  # 98304 adapter weights of 1.56M

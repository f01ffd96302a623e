"""The seed's step shape makes the GPU wait for nothing it could avoid, proven on the CPU.

A GPU step is as fast as its kernels only while the host queues work ahead of the device: every
read of a device value into Python, every compile and every graph break inside a step stalls it.
Each is a count, not a time, and a CPU run shows every one of them (``KernelProfile``:
``lit_ablate.callbacks.host_syncs`` counts the operators that make the host wait for the device on
CUDA). Here Qwen3's architecture at a small width trains on rows packed from documents of varying
lengths (each row as long as its batch's longest: a new width and a new mix of lengths every step),
with compiled decoder layers and the default callbacks (throughput, MFU, memory, the run record, the
progress bar), and over ``STEPS`` steps after ``WARMUP`` the step has no recompile, no graph break
(over the whole fit: the sequence dimension is marked dynamic, so the first compile serves every
width) and, over the last ``PROFILED`` of them, no host sync, but the one read it makes on purpose,
once per optimizer step: the step clock's read of the step before (its end event and sums, which the
device finished a step ago).

The layers compile with ``aot_eager`` (dynamo and AOTAutograd, where graph breaks and recompiles
come from; inductor's code generation is not what is checked, and cold it costs a minute per fit).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lit_ablate.callbacks import KernelProfile, MemoryMonitor, MFUMonitor, RunRecorder, ThroughputMonitor
from lit_ablate.callbacks.step_clock import STEP_READ
from lit_ablate.data import (
    ArithmeticPreference,
    LMDataModule,
    PackingCollator,
    PreferencePackingCollator,
    SyntheticText,
)
from lit_ablate.models import compiled_layers
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss, decoder_layers
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.loss_choice import LossChoice
from lit_ablate.modules import DPO, CausalLM
from lit_ablate.modules import causal_lm as causal_lm_module
from lit_ablate.terminal import QuietProgressBar

WARMUP, STEPS, PROFILED = 3, 50, 10
"""``STEPS`` steps of varying widths after ``WARMUP``, the last ``PROFILED`` of them under torch's profiler:
a sync a step makes shows in every step, and reading the profile back costs about 0.2 s of CPU per
profiled step here (10 s of the test at 50), so the profile covers the last ten. Compiles, recompiles
and graph breaks are counted over the whole fit."""
LIGER_STEPS = 20
"""The Liger step's: each runs Liger's kernels in Triton's interpreter, one program at a time in Python
(~0.45 s a step: 50 steps cost its test 42 s, 20 cost 28). Its rows are packed from shorter documents
over smaller windows (``packed_documents``), so these steps still bring a new width nearly every step (11
in 23); the dense, MoE and DPO steps are checked over ``STEPS``."""
QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
QWEN3_MOE = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
}
ONE_READ = {STEP_READ: 1.0}
"""The host reads of a step: the step clock's, once per optimizer step."""
LIGER_SYNCS = {"aten::item": 1.0, "aten::equal": 1.0}
"""Liger-Kernel's own (0.8.5), once per micro-batch: its fused linear cross-entropy reads the count of
counted labels in its forward (``.item()``) and compares the incoming gradient with 1 in its backward
(``torch.equal``). Not lit-ablate's to remove; named so that any other shows."""


def packed_documents(
    rows: int = 2, seq_len: int = 128, static_shape: bool = False, window: int = 64, median_sentences: float = 2.0
) -> LMDataModule:
    """``rows`` rows of at most ``seq_len`` tokens per batch, packed first-fit-decreasing (over ``window``
    documents at a time) from synthetic documents of log-normal lengths; each batch as wide as its longest
    row, or ``seq_len`` wide with ``static_shape``."""
    source = SyntheticText(num_documents=600, seed=0, median_sentences=median_sentences, length_sigma=1.0)
    collator = PackingCollator(strategy="ffd", window=window, static_shape=static_shape)
    return LMDataModule(source, format="documents", seq_len=seq_len, batch_size=rows, collator=collator)


def packed_pairs() -> LMDataModule:
    source = ArithmeticPreference(num_examples=600, median_shots=1.0)
    collator = PreferencePackingCollator(max_tokens=256, window=64, static_shape=False)
    return LMDataModule(source, format="preference", seq_len=64, batch_size=1, collator=collator)


def step_counts(
    tmp_path: Path, module: CausalLM, data: LMDataModule, precision: str = "32-true", steps: int = STEPS
) -> dict[str, Any]:
    """``steps`` steps after ``WARMUP`` of ``module`` on ``data``, the last ``PROFILED`` profiled: the run
    record's ``profile`` and its per-step tokens (how many distinct row widths the steps had). Compiled
    code of earlier fits in this process is forgotten first: a layer class compiled before would make
    this fit's first compile of the same frame count as a recompile."""
    torch._dynamo.reset()
    L.seed_everything(0)
    trainer = L.Trainer(
        max_steps=WARMUP + steps,
        accelerator="cpu",
        precision=precision,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        logger=False,  # a logger adds Lightning's read of the logged loss, once every log_every_n_steps
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[
            ThroughputMonitor(),
            MFUMonitor(ceiling_tflops=1.0),  # given: no sweep before the first step, no re-measure inside one
            MemoryMonitor(),
            QuietProgressBar(),
            KernelProfile(start_step=WARMUP + steps - PROFILED + 1, num_steps=PROFILED),
            RunRecorder(path=str(tmp_path / "run.json"), warmup_steps=WARMUP),
        ],
    )
    trainer.fit(module, datamodule=data)
    record = json.loads((tmp_path / "run.json").read_text())
    tokens = {round(s["tokens_per_sec"] * s["step_time_s"]) for s in record["steps"]}
    return {**record["profile"], "distinct_tokens_per_step": len(tokens)}


def assert_no_stall(profile: dict[str, Any], sync_ops: dict[str, float] | None = None) -> None:
    compiled = profile["compile"]
    assert profile["profiled_steps"] == PROFILED and profile["distinct_tokens_per_step"] >= 10
    assert (compiled["graph_breaks"], compiled["recompiles"]) == (0, 0), compiled
    assert compiled["compiles"] == compiled["unique_graphs"] == 1, compiled  # one graph: the layer, once
    assert profile["sync_ops_per_step"] == (sync_ops or {})
    assert profile["host_reads_per_step"] == ONE_READ


@pytest.fixture
def aot_eager_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CausalLM(compile=True)``'s layers traced by dynamo and AOTAutograd without inductor's code."""
    monkeypatch.setattr(
        causal_lm_module,
        "compile_decoder_layers",
        functools.partial(compiled_layers.compile_decoder_layers, backend="aot_eager"),
    )


@pytest.mark.slow
def test_the_dense_packed_step_has_no_recompile_graph_break_or_host_sync(tmp_path, aot_eager_layers):
    """``sdpa_packed`` (the mask of each batch built once, outside the layers) and the ``chunked`` loss.
    Seen failing with a planted ``int(units)`` in ``StepObjective.backward_loss`` (``{'aten::item': 1.0}``
    per step) and with a planted shape specialisation: the batch's ``document_lengths`` (a Python list)
    handed to the layers and read by the mask (a guard on its length: 7 recompiles, then torch's cache
    limit). Before the changes it came with, the same counts showed transformers' own mask
    preprocessing (its detection of packed rows: ``aten::is_nonzero``, once per step), the loss logged
    for the progress bar (``aten::item``, once per step) and AdamW's for-loop on the CPU (its step
    counts read: 24 per step)."""
    module = CausalLM(
        ModelFactory(config=QWEN3, attn_implementation="sdpa_packed"), loss="chunked", compile=True, warmup_steps=0
    )
    assert_no_stall(step_counts(tmp_path, module, packed_documents()))


@pytest.mark.slow
def test_the_moe_step_with_grouped_experts_has_no_recompile_graph_break_or_host_sync(tmp_path, aot_eager_layers):
    """Qwen3-MoE with ``grouped`` experts (``torch._grouped_mm``, group offsets on the device) in bf16
    (in fp32 the CPU's grouped matmul runs eagerly beside the compiled layer: a graph break that a GPU,
    in bf16, does not have), router losses on. Before the change it came with, the expert counts summed
    inside the compiled layer showed as a recompile (a guard on ``_load is None``)."""
    factory = ModelFactory(
        config=QWEN3_MOE,
        attn_implementation="sdpa_packed",
        dtype="bfloat16",
        moe={"experts": "grouped", "z_loss_weight": 0.001},
    )
    module = CausalLM(factory, loss="chunked", compile=True, warmup_steps=0)
    assert_no_stall(step_counts(tmp_path, module, packed_documents(), precision="bf16-true"))


@pytest.mark.slow
def test_the_packed_dpo_step_has_no_recompile_graph_break_or_host_sync(tmp_path, aot_eager_layers):
    """Packed preference pairs, a frozen reference, chunked log-probs."""
    module = DPO(ModelFactory(config=QWEN3, attn_implementation="sdpa_packed"), logprobs="chunked", compile=True)
    assert_no_stall(step_counts(tmp_path, module, packed_pairs()))


def test_the_flex_forward_has_no_recompile_graph_break_or_host_sync_after_warm_up():
    """``flex`` trains on CUDA only (a CPU has no flex backward): here its forward, through compiled
    layers, on rows of the seed's static width with a new mix of documents each time. The ``BlockMask``
    is built once per forward from the documents. Its warm-up compiles more than once: the ``kernels``
    package that transformers wraps attention with (0.19) leaves a context variable set after the first
    compiled call, whose guard then fails once; after it, nothing compiles again."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    from lit_ablate.callbacks.host_syncs import count_host_syncs

    lm = ModelFactory(config=QWEN3, attn_implementation="flex").build()
    model = CausalLMWithLoss(lm, LossChoice("chunked", {}).build())
    compiled_layers.compile_decoder_layers(decoder_layers(model), lm.base_model, backend="aot_eager")
    data = packed_documents(static_shape=True)
    data.setup("fit")
    batches = iter(data.train_dataloader())
    with torch.no_grad():
        for _ in range(WARMUP):
            model(next(batches))
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        for _ in range(STEPS - PROFILED):
            model(next(batches))
        with profile(activities=[ProfilerActivity.CPU]) as window:
            for _ in range(PROFILED):
                model(next(batches))
    assert counters["stats"]["unique_graphs"] == graphs and sum(counters["graph_break"].values()) == breaks
    syncs = count_host_syncs(window.events())
    assert (syncs.by_operator, syncs.declared) == ({}, {})


LIGER_SCRIPT = """
import lit_ablate  # first: under the opt-in it sets TRITON_INTERPRET before triton loads
import functools, json, sys, pathlib
from lit_ablate.models import compiled_layers
from lit_ablate.modules import causal_lm
from tests.test_step_stalls import LIGER_STEPS, QWEN3, packed_documents, step_counts
from lit_ablate.models.factory import ModelFactory
causal_lm.compile_decoder_layers = functools.partial(compiled_layers.compile_decoder_layers, backend="aot_eager")
module = causal_lm.CausalLM(ModelFactory(config=QWEN3, attn_implementation="sdpa_packed"), loss="liger",
                            compile=True, warmup_steps=0)
data = packed_documents(rows=1, seq_len=64, window=8, median_sentences=1.0)  # 11 widths in 23 steps
print(json.dumps(step_counts(pathlib.Path(sys.argv[1]), module, data, steps=LIGER_STEPS)))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in ("triton", "liger_kernel")),
    reason="liger-kernel and triton not installed: pip install 'lit-ablate[kernels-cpu]'",
)
def test_the_liger_step_has_only_liger_s_own_host_syncs(tmp_path):
    """Liger's fused linear cross-entropy through Triton's interpreter (a fresh process: the interpreter
    must be on before triton loads; one row of at most 64 tokens per step, the interpreter running one
    program at a time in Python): nothing of lit-ablate's syncs; Liger's own two per micro-batch
    (``LIGER_SYNCS``) are counted, by name."""
    result = subprocess.run(
        [sys.executable, "-c", LIGER_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "LIT_ABLATE_TRITON_INTERPRET": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_no_stall(json.loads(result.stdout.splitlines()[-1]), LIGER_SYNCS)


@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clipping bites; clipping does not
def test_clipping_across_meshes_reads_nothing_back_and_clips_as_torch_does(max_norm):
    """A mesh strategy's clipping (``clip_grad_norm_across_meshes``; here one process's plain gradients)
    keeps the norm and the scale on the device and scales as torch's ``clip_grad_norm_`` does (within one
    float rounding: the squares add up in another order). Seen failing with the scale decided on the
    host (``float(total)``: ``{'aten::item': 1}``)."""
    from torch.profiler import ProfilerActivity, profile

    from lit_ablate.callbacks.host_syncs import count_host_syncs
    from lit_ablate.strategies.gradient_clipping import clip_grad_norm_across_meshes

    ours, theirs = ([torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(5))] for _ in range(2))
    for mine, reference in zip(ours, theirs):
        mine.grad = reference.grad = torch.randn(mine.shape, generator=torch.Generator().manual_seed(mine.numel()))
        reference.grad = reference.grad.clone()
    with profile(activities=[ProfilerActivity.CPU]) as window:
        norm = clip_grad_norm_across_meshes(ours, max_norm)
    assert count_host_syncs(window.events()).by_operator == {}
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(theirs, max_norm), rtol=1e-6, atol=0)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_the_dense_packed_step_makes_the_host_wait_only_for_a_step_the_device_finished(tmp_path):
    """On CUDA (eager layers: a cold compile would not fit the lane's limit): no operator that syncs,
    the one declared read per step, and of CUDA's own waits at most one event wait per step (the step
    clock's, should the profiler not place it inside its declared range) and the profiler's own device
    synchronisation at the window's end; never a stream synchronisation or a blocking copy (what a
    ``.item()`` or a ``.tolist()`` of a device tensor costs)."""
    module = CausalLM(ModelFactory(config=QWEN3, attn_implementation="sdpa_packed"), loss="chunked", warmup_steps=0)
    L.seed_everything(0)
    trainer = L.Trainer(
        max_steps=WARMUP + 10,
        accelerator="gpu",
        devices=1,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[
            ThroughputMonitor(),
            MFUMonitor(ceiling_tflops=1.0),
            MemoryMonitor(),
            KernelProfile(start_step=WARMUP + 1, num_steps=10),
            RunRecorder(path=str(tmp_path / "run.json"), warmup_steps=WARMUP),
        ],
    )
    trainer.fit(module, datamodule=packed_documents())
    profile = json.loads((tmp_path / "run.json").read_text())["profile"]
    assert (profile["sync_ops_per_step"], profile["host_reads_per_step"]) == ({}, ONE_READ)
    waits = profile["host_syncs_per_step"]
    assert set(waits) <= {"cudaEventSynchronize", "cudaDeviceSynchronize"}, waits
    assert waits.get("cudaEventSynchronize", 0) <= 1 and waits.get("cudaDeviceSynchronize", 0) <= 0.1, waits

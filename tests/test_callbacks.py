"""Measurement callbacks and the run record, on a tiny model with an in-memory loader."""

import gc
import json
import time
import weakref

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_ablate.callbacks import MemoryMonitor, MFUMonitor, RunRecorder, ThroughputMonitor
from lit_ablate.estimate.peaks import peak_tflops_of
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.modules import CausalLM

SEQ = 32


def _batches(n: int, batch_size: int, masked_prefix: list[int]) -> list[dict]:
    """Batches whose rows have a different number of masked (prompt) positions each."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, 259, (batch_size, SEQ), generator=gen)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = IGNORE_INDEX
        labels[:, : masked_prefix[i % len(masked_prefix)]] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def _fit(tmp_path, callbacks, batches, accumulate=1, module=None, max_steps=4, lr=3e-3, recorder=None):
    L.seed_everything(0)
    module = module or CausalLM(ModelFactory(preset="tiny-llama"), learning_rate=lr, warmup_steps=0)
    recorder = recorder or RunRecorder(path=str(tmp_path / "run.json"), warmup_steps=1)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        accumulate_grad_batches=accumulate,
        callbacks=[*callbacks, recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return json.loads((tmp_path / "run.json").read_text()), module


def test_throughput_counts_processed_and_useful_tokens_per_optimizer_step(tmp_path):
    batches = _batches(8, 2, masked_prefix=[0, 10])
    record, _ = _fit(tmp_path, [ThroughputMonitor()], batches, accumulate=2)
    assert [s["step"] for s in record["steps"]] == [1, 2, 3, 4]
    for s in record["steps"]:
        i = 2 * (s["step"] - 1)
        useful = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches[i : i + 2])
        assert s["tokens_per_sec"] * s["step_time_s"] == pytest.approx(2 * 2 * SEQ)
        assert s["useful_tokens_per_sec"] * s["step_time_s"] == pytest.approx(useful)
    summary = record["summary"]
    assert summary["status"] == "ok" and summary["tokens_per_sec"]["n"] == 3  # step 1 is warm-up
    assert summary["tokens_per_sec"]["min"] <= summary["tokens_per_sec"]["median"] <= summary["tokens_per_sec"]["max"]


def test_monitor_values_reach_the_lightning_logger_every_n_steps(tmp_path):
    """Monitors write to the loggers once per step (honouring ``log_every_n_steps``), the same
    values as in the run record."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(0)
    module = CausalLM(ModelFactory(preset="tiny-llama"), warmup_steps=0)
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=[ThroughputMonitor(), RunRecorder(path=str(tmp_path / "run.json"))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(_batches(4, 2, masked_prefix=[0]), batch_size=None))
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as metrics:
        rows = list(csv.DictReader(metrics))
    logged = {
        int(r["step"]): float(r["ThroughputMonitor/step_time_s"])
        for r in rows
        if r.get("ThroughputMonitor/step_time_s")
    }
    recorded = {s["step"]: s["step_time_s"] for s in json.loads((tmp_path / "run.json").read_text())["steps"]}
    assert logged == {step: pytest.approx(recorded[step]) for step in (2, 4)}


def test_recorded_loss_is_exact_token_average_across_micro_batches(tmp_path):
    """With a negligible learning rate the weights stay put, so each step's recorded loss must be
    the reference CE over all useful tokens of its micro-batches (not a mean of micro-batch means)."""
    batches = _batches(4, 2, masked_prefix=[0, 25])
    record, module = _fit(tmp_path, [], batches, accumulate=2, max_steps=2, lr=1e-12)
    lm = module.model.lm
    for s in record["steps"]:
        micro = batches[2 * (s["step"] - 1) : 2 * s["step"]]
        logits = torch.cat([lm(input_ids=b["input_ids"]).logits.flatten(0, 1) for b in micro]).detach()
        labels = torch.cat([b["labels"].flatten() for b in micro])
        reference = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
        assert s["loss"] == pytest.approx(reference.item(), rel=1e-5)


def test_mfu_is_null_on_cpu_without_a_peak_and_exact_with_one(tmp_path, recwarn):
    batches = _batches(4, 2, masked_prefix=[0])
    record, _ = _fit(tmp_path, [MFUMonitor()], batches)
    assert all(s["mfu"] is None for s in record["steps"]) and record["summary"]["mfu"] is None
    assert record["summary"]["mfu_peak"].startswith("unavailable: no peak is known for device type 'cpu'")
    assert not [w for w in recwarn if "MFU" in str(w.message)]  # expected on a CPU: recorded, not warned

    record, module = _fit(tmp_path, [MFUMonitor(peak_tflops=1.0), ThroughputMonitor()], batches)
    flops_per_step = module.flops_per_token(SEQ) * 2 * SEQ
    for s in record["steps"]:
        assert s["mfu"] * s["step_time_s"] * 1e12 == pytest.approx(flops_per_step)


def test_mfu_counts_real_tokens_only_and_fp8_follows_the_config(tmp_path):
    """Padding positions are not model FLOPs; an fp8 run is never divided by a bf16 peak, and it
    is the config (the module's fp8 switch), not a callback flag, that says so."""
    batches = _batches(4, 2, masked_prefix=[0])
    for b in batches:
        b["document_lengths"] = [SEQ, SEQ // 2]  # the second row: half of it is padding
    record, module = _fit(tmp_path, [MFUMonitor(peak_tflops=1.0), ThroughputMonitor()], batches)
    flops_per_step = module.flops_per_token(SEQ) * SEQ + module.flops_per_token(SEQ // 2) * SEQ // 2
    for s in record["steps"]:
        assert s["mfu"] * s["step_time_s"] * 1e12 == pytest.approx(flops_per_step)

    class Fp8LM(CausalLM):
        computes_in_fp8 = True

    with pytest.warns(UserWarning, match="fp8"):
        record, _ = _fit(tmp_path, [MFUMonitor()], batches, module=Fp8LM(ModelFactory(preset="tiny-llama")))
    assert record["summary"]["mfu"] is None and "fp8" in record["summary"]["mfu_peak"]


class _SlowBatches(torch.utils.data.Dataset):
    """Batches that take ``delay`` seconds each to produce: a slow collator."""

    def __init__(self, batches: list[dict], delay: float) -> None:
        self.batches, self.delay = batches, delay

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        time.sleep(self.delay)
        return self.batches[i]


def test_step_time_includes_every_micro_batch_fetch_and_data_wait_shows_it(tmp_path):
    """The clock runs from one optimizer step's end to the next: a step of two micro-batches pays
    for fetching both (the old clock opened after the first was fetched), and ``data_wait_s``
    shows that part. Lower bounds only: sleeping guarantees at least ``delay``."""
    delay = 0.05
    L.seed_everything(0)
    module = CausalLM(ModelFactory(preset="tiny-llama"), warmup_steps=0)
    recorder = RunRecorder(path=str(tmp_path / "run.json"), warmup_steps=1)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        accumulate_grad_batches=2,
        callbacks=[ThroughputMonitor(), recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(_SlowBatches(_batches(6, 2, masked_prefix=[0]), delay), batch_size=None))
    record = json.loads((tmp_path / "run.json").read_text())
    for s in record["steps"]:
        assert s["data_wait_s"] >= 2 * delay and s["step_time_s"] > s["data_wait_s"]
    assert 0 < record["summary"]["data_wait_share"] < 1


def test_console_and_record_summarise_the_same_warmup(tmp_path):
    monitor = ThroughputMonitor()
    _fit(tmp_path, [monitor], _batches(4, 2, masked_prefix=[0]))
    assert monitor.warmup_steps == 1  # the recorder's (``_fit`` sets recorder.warmup_steps=1)
    assert "median after 1 warm-up steps" in monitor.summary_line()


def test_peak_table_knows_plain_h200_and_prefers_specific_names():
    assert peak_tflops_of("NVIDIA H200") == 989.0
    assert peak_tflops_of("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_of("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_of("NVIDIA GB200") == 2500.0
    assert peak_tflops_of("Intel Xeon") is None


def test_memory_monitor_measures_cpu_peak_and_labels_it(tmp_path):
    """On CPU the CUDA allocator peak is a silent 0 (docs/platform.md); the monitor must measure the
    process peak instead and say so."""
    if not torch.cuda.is_available():
        assert torch.cuda.max_memory_allocated() == 0  # the trap itself
    record, module = _fit(tmp_path, [MemoryMonitor()], _batches(4, 2, masked_prefix=[0]))
    assert record["summary"]["memory_method"] == "cpu_process_peak_rss"
    params = sum(p.numel() * 4 for p in module.parameters())
    for s in record["steps"]:
        assert s["memory_params_bytes"] == params
        assert s["memory_optimizer_bytes"] == pytest.approx(2 * params, rel=0.01)  # AdamW: two moments
        assert s["memory_peak_bytes"] > s["memory_params_bytes"] + s["memory_grads_bytes"]
    assert record["summary"]["peak_memory_bytes"] == max(s["memory_peak_bytes"] for s in record["steps"])


class _FailingModule(CausalLM):
    def __init__(self, error: BaseException) -> None:
        super().__init__(ModelFactory(preset="tiny-llama"), warmup_steps=0)
        self.error = error

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise self.error
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("error", "status"), [(RuntimeError("boom"), "error"), (torch.OutOfMemoryError("out of memory"), "oom")]
)
def test_failed_run_still_writes_its_record(tmp_path, error, status):
    with pytest.raises(type(error)):
        _fit(tmp_path, [ThroughputMonitor()], _batches(4, 2, masked_prefix=[0]), module=_FailingModule(error))
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["summary"]["status"] == status
    assert str(error) in record["summary"]["message"]
    assert [s["step"] for s in record["steps"]] == [1, 2]
    assert record["steps"][-1]["loss"] is not None


def test_record_says_running_while_training(tmp_path):
    seen = []

    class Peek(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(json.loads((tmp_path / "run.json").read_text())["summary"]["status"])

    record, _ = _fit(tmp_path, [Peek()], _batches(4, 2, masked_prefix=[0]), max_steps=2)
    assert seen == ["running", "running"] and record["summary"]["status"] == "ok"
    assert record["environment"]["world_size"] == 1 and record["model"]["total"] > 0


class _Ballast(L.Callback):
    """Rank 1 holds an extra 256 MiB during every step: the largest peak is not rank 0's."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1:
            self.ballast = torch.ones(64 * 2**20)  # 256 MiB, touched so it is resident

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ballast = None


def _two_rank_memory(rank: int, world_size: int, path: str) -> None:
    L.seed_everything(0)
    module = CausalLM(ModelFactory(preset="tiny-llama"), warmup_steps=0)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        use_distributed_sampler=False,
        callbacks=[_Ballast(), MemoryMonitor(), RunRecorder(path=path, warmup_steps=1)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(_batches(3, 2, masked_prefix=[0]), batch_size=None))


def test_memory_peak_is_the_largest_over_ranks_and_each_rank_is_kept(tmp_path):
    from tests.distributed import run_ranks

    path = tmp_path / "run.json"
    run_ranks(_two_rank_memory, 2, str(path), init_process_group=False, timeout_s=300)
    record = json.loads(path.read_text())
    for s in record["steps"]:
        rank0, rank1 = s["memory_peak_bytes_per_rank"]
        assert rank1 > rank0 + 200 * 2**20  # the ballast is seen on rank 1 ...
        assert s["memory_peak_bytes"] == rank1  # ... and is the step's peak, though rank 0 writes the record
    assert record["summary"]["peak_memory_bytes"] == max(record["summary"]["peak_memory_bytes_per_rank"])


def test_a_finished_fit_leaves_neither_its_trainer_alive_nor_the_heap_frozen(tmp_path):
    """Once a fit is over and its objects dropped, a collection frees the trainer (and with it the
    model and any process groups: left to the interpreter's shutdown, gloo's threads aborted a rank
    that had finished), and ``MemoryMonitor``'s tensor tracking left nothing frozen (``gc.freeze``
    around it keeps its collection small). Seen failing with the step clock holding its monitors
    strongly (``RUNNING_CLOCKS``' value reached its own key: clock, monitor, module, trainer), and with
    the freeze not undone."""
    recorder = RunRecorder(path=str(tmp_path / "run.json"), warmup_steps=3)
    monitors = [ThroughputMonitor(), MemoryMonitor()]
    record, module = _fit(tmp_path, monitors, _batches(4, 2, [0]), recorder=recorder)
    assert "_tracked_peak" in monitors[1].series and record["summary"]["status"] == "ok"  # a step was tracked
    assert gc.get_freeze_count() == 0
    trainer = weakref.ref(module.trainer)
    del module, monitors, recorder
    gc.collect()
    assert trainer() is None

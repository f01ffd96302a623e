"""``storage: auto`` (the default) and the hub source's revision.

Seen failing with a bug put in, one at a time:
- ``choose_storage`` returning ``memory`` whatever the size: the large file stays in memory and
  the run record says memory (``test_auto_caches_a_large_file_source_and_records_why``);
- the size compared with ``>`` against a threshold in bytes taken as MB (``size / 1e6 >= ...``):
  the sizes at the boundary go the wrong way (``test_the_threshold_is_in_bytes_and_inclusive``);
- ``HubDataset`` not passing ``revision`` to ``load_dataset``: the call check fails; its size taken
  from ``dataset_size`` before the split's ``num_bytes``: the split check fails.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest

from lit_ablate.data import ArithmeticSFT, HubDataset, LMDataModule, LocalFiles, SyntheticText, storage_choice
from lit_ablate.data.token_cache import cache_key
from lit_ablate.data.tokenizers import load_tokenizer
from tests.test_data_cache import _Quiet


def _jsonl(path, rows: int) -> str:
    path.write_text("".join(json.dumps({"text": f"document number {i} of the corpus."}) + "\n" for i in range(rows)))
    return str(path)


def test_auto_caches_a_large_file_source_and_records_why(tmp_path, monkeypatch):
    from lit_ablate.callbacks import RunRecorder
    from lit_ablate.record import read_record

    monkeypatch.setattr(storage_choice, "AUTO_CACHE_BYTES", 2000)
    large = _jsonl(tmp_path / "large.jsonl", 100)  # ~4.5 kB
    dm = LMDataModule(LocalFiles(large), seq_len=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
    assert dm.storage == "auto"  # the default
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[RunRecorder(path=str(tmp_path / "run.json"))],
    )
    trainer.fit(_Quiet(), datamodule=dm)
    data = read_record(tmp_path / "run.json")["data"]
    assert data["storage"] == "cache" and data["storage_requested"] == "auto" and data["cache_hit"] is False
    assert "LocalFiles reads 0.0 MiB, at least" in data["storage_reason"]
    assert data["cache_path"].startswith(str(tmp_path / "cache"))


@pytest.mark.parametrize("source", [SyntheticText(num_documents=30), ArithmeticSFT(num_examples=30)])
def test_auto_keeps_generated_sources_in_memory(source, tmp_path, monkeypatch):
    monkeypatch.setattr(storage_choice, "AUTO_CACHE_BYTES", 1)
    dm = LMDataModule(
        source, format="documents" if isinstance(source, SyntheticText) else "sft", cache_dir=str(tmp_path / "cache")
    )
    dm.setup()
    assert dm.setup_record["storage"] == "memory" and dm.setup_record["cache_path"] is None
    assert "generates its rows in code" in dm.setup_record["storage_reason"]


def test_the_threshold_is_in_bytes_and_inclusive(tmp_path, monkeypatch):
    path = _jsonl(tmp_path / "c.jsonl", 50)
    size = LocalFiles(path).stored_bytes()
    assert size == (tmp_path / "c.jsonl").stat().st_size
    for threshold, want in ((size, "cache"), (size + 1, "memory")):
        monkeypatch.setattr(storage_choice, "AUTO_CACHE_BYTES", threshold)
        assert storage_choice.choose_storage(LocalFiles(path))[0] == want


def test_an_explicit_storage_is_recorded_as_set_in_the_config(tmp_path):
    dm = LMDataModule(LocalFiles(_jsonl(tmp_path / "c.jsonl", 50)), storage="memory")
    dm.setup()
    assert dm.setup_record | {"seconds": 0} == {
        "storage": "memory",
        "storage_requested": "memory",
        "storage_reason": "set in the config",
        "seconds": 0,
        "cache_hit": None,
        "examples": dm.setup_record["examples"],
        "cache_path": None,
    }


def _fake_builder(splits: dict | None, dataset_size: int | None):
    info = SimpleNamespace(splits=splits, dataset_size=dataset_size)
    return lambda *args, **kwargs: SimpleNamespace(info=info, args=args, kwargs=kwargs)


def test_a_hub_source_is_sized_by_its_split_else_cached(monkeypatch):
    import datasets

    hub = HubDataset("someone/corpus", split="train", revision="abc123")
    monkeypatch.setattr(
        datasets, "load_dataset_builder", _fake_builder({"train": SimpleNamespace(num_bytes=1000)}, dataset_size=10**12)
    )
    assert hub.stored_bytes() == 1000 and storage_choice.choose_storage(hub)[0] == "memory"
    monkeypatch.setattr(datasets, "load_dataset_builder", _fake_builder({}, dataset_size=10**9))
    assert storage_choice.choose_storage(hub)[0] == "cache"
    monkeypatch.setattr(datasets, "load_dataset_builder", _fake_builder(None, dataset_size=None))
    storage, why = storage_choice.choose_storage(hub)
    assert storage == "cache" and "cannot tell its size" in why


def test_a_hub_source_reads_and_keys_its_revision(monkeypatch):
    import datasets

    calls = []

    def load_dataset(*args, **kwargs):
        calls.append(kwargs)
        raise LookupError("no network in tests")  # the call is what this checks

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    hub = HubDataset("someone/corpus", revision="abc123")
    for rows in (hub.stream_rows(), iter(hub)):
        with pytest.raises(LookupError):
            next(rows)
    assert [call.get("revision") for call in calls] == ["abc123", "abc123"]
    tokenizer = load_tokenizer("byte")
    keys = {
        cache_key(HubDataset("someone/corpus", revision=r), tokenizer, "pretrain", 16, "truncate")[0]
        for r in (None, "abc123", "def456")
    }
    assert len(keys) == 3

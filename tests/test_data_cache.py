"""The token cache (``storage: cache``): the same examples and batches as the in-memory path, a new
entry whenever an input of its key changes, one builder among ranks that start together, and the
data set-up in the run record.

Seen failing with a bug put in, one at a time:
- the pretrain windows' labels cut from the stream without the shift (``stream[:cut]``), or the
  tokens after a batch's last full window not carried into the next batch: the equivalence test
  fails for ``pretrain`` (the test builds in batches of 16 rows so that the carry matters);
- ``seq_len`` left out of the key: its invalidation case reuses the stale entry;
- the re-check after the lock removed: both ranks build and the second rename onto the finished
  entry raises on rank 0.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

import lit_ablate
from lit_ablate.data import (
    ArithmeticPreference,
    ArithmeticSFT,
    LMDataModule,
    LocalFiles,
    PackingCollator,
    PreferencePackingCollator,
    SyntheticText,
    token_cache,
)
from lit_ablate.data.sources import DataSource
from lit_ablate.errors import ConfigError
from tests.distributed import _forkserver, run_ranks
from tests.test_data import _tiny_hf_tokenizer

CASES = {  # format -> (source, collator or None for padding)
    "pretrain": (SyntheticText(num_documents=120, seed=2), None),
    "documents": (SyntheticText(num_documents=120, seed=2), PackingCollator(max_tokens=96)),
    "sft": (ArithmeticSFT(num_examples=150, seed=1), None),
    "preference": (ArithmeticPreference(num_examples=120, median_shots=2, seed=3), PreferencePackingCollator()),
}


def _setup(tmp_path, fmt: str, **kwargs) -> LMDataModule:
    source, collator = CASES[fmt]
    options = {
        "source": source,
        "format": fmt,
        "seq_len": 40,
        "batch_size": 3,
        "val_examples": 5,
        "collator": collator,
        "cache_dir": str(tmp_path),
        **kwargs,
    }
    dm = LMDataModule(**options)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("fmt", list(CASES))
def test_cached_examples_and_batches_equal_the_in_memory_ones(fmt, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "BATCH_ROWS", 16)  # several build batches: carry-over and renumbering
    memory = _setup(tmp_path, fmt, storage="memory")
    cached = _setup(tmp_path, fmt, storage="cache")
    assert cached.setup_record["cache_hit"] is False and memory.setup_record["cache_hit"] is None
    for ours, reference in ((cached.train_set, memory.train_set), (cached.val_set, memory.val_set)):
        assert len(ours) == len(reference) > 0 and list(ours.lengths) == list(reference.lengths)
        for got, want in zip(ours.examples, reference.examples, strict=True):
            assert got.keys() == want.keys()
            for key in want:
                assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    memory_batches, cached_batches = list(memory.train_dataloader()), list(cached.train_dataloader())
    assert len(cached_batches) == len(memory_batches) > 0
    for got, want in zip(cached_batches, memory_batches):  # ids, labels, masks / positions, pair keys
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    again = _setup(tmp_path, fmt, storage="cache")
    assert (
        again.setup_record["cache_hit"] is True
        and again.setup_record["cache_path"] == cached.setup_record["cache_path"]
    )


def test_a_mixed_sft_file_read_as_a_stream_caches_the_in_memory_examples(tmp_path):
    rows = [
        {"prompt": "1+1=", "response": "2"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"prompt": "late column ", "response": "ok", "source": 3},
    ] * 4
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    built = {}
    for storage in ("memory", "cache"):
        built[storage] = LMDataModule(
            LocalFiles(str(path)), format="sft", seq_len=64, storage=storage, cache_dir=str(tmp_path / "cache")
        )
        built[storage].setup()
    for got, want in zip(built["cache"].train_set.examples, built["memory"].train_set.examples, strict=True):
        assert all(torch.equal(got[key], want[key]) for key in want)


def test_a_bad_line_stops_the_build_naming_it(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=r"line 2 of .*bad.jsonl is not valid JSON"):
        LMDataModule(LocalFiles(str(path)), format="documents", storage="cache", cache_dir=str(tmp_path)).setup()
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []  # no entry and no temporary left


@pytest.mark.slow  # a worker pool on 2 loaded cores: 8-25 s
def test_tokenize_workers_build_the_same_entry(tmp_path, monkeypatch):
    _forkserver()  # workers fork from the test session's preloaded forkserver (else each imports torch: ~7 s)
    monkeypatch.setattr(token_cache, "BATCH_ROWS", 16)
    inline = _setup(tmp_path / "a", "sft", storage="cache")
    pooled = _setup(tmp_path / "b", "sft", storage="cache", tokenize_workers=2)
    for name in ("input_ids", "labels", "lengths", "offsets"):
        a, b = (os.path.join(dm.setup_record["cache_path"], f"{name}.bin") for dm in (inline, pooled))
        assert Path(a).read_bytes() == Path(b).read_bytes(), name


def _write_corpus(path, text: str = "alpha beta gamma delta\n") -> str:
    path.write_text(text * 40)
    return str(path)


def _change_file(path: str) -> None:
    """Same size, new contents and modification time: what an edited corpus looks like."""
    with open(path, "r+") as f:
        f.write("ALPHA")
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


@pytest.mark.parametrize("change", ["source", "tokenizer", "format", "seq_len", "overlong", "version"])
def test_each_key_input_invalidates_the_entry(change, tmp_path, monkeypatch):
    corpus = _write_corpus(tmp_path / "corpus.txt")
    options = {
        "source": LocalFiles(corpus),
        "format": "documents",
        "seq_len": 32,
        "overlong": "truncate",
        "storage": "cache",
        "cache_dir": str(tmp_path / "cache"),
    }

    def setup(**changes) -> LMDataModule:
        dm = LMDataModule(**(options | changes))
        dm.setup("fit")
        return dm

    first = setup()
    assert first.setup_record["cache_hit"] is False and setup().setup_record["cache_hit"] is True
    if change == "source":
        _change_file(corpus)
        changed = setup(source=LocalFiles(corpus))
    elif change == "tokenizer":
        changed = setup(tokenizer=_tiny_hf_tokenizer(tmp_path / "tok"))
    elif change == "version":
        monkeypatch.setattr(lit_ablate, "__version__", lit_ablate.__version__ + ".post1")
        changed = setup()
    else:
        changed = setup(**{change: {"format": "pretrain", "seq_len": 40, "overlong": "reject"}[change]})
    assert changed.setup_record["cache_hit"] is False
    assert changed.setup_record["cache_path"] != first.setup_record["cache_path"]
    if change == "source":  # and the new entry holds the new text
        assert changed.train_set[0]["input_ids"][1:6].tolist() == list(b"ALPHA")


def test_a_retrained_tokenizer_at_the_same_path_is_another_entry(tmp_path):
    corpus = _write_corpus(tmp_path / "corpus.txt", "what is two plus two\n")
    tokenizer = _tiny_hf_tokenizer(tmp_path / "tok")
    first = LMDataModule(
        LocalFiles(corpus), format="documents", tokenizer=tokenizer, storage="cache", cache_dir=str(tmp_path / "cache")
    )
    first.setup()
    (tmp_path / "tok" / "tokenizer.json").write_text(
        (tmp_path / "tok" / "tokenizer.json").read_text().replace('"two"', '"TWO"')
    )
    second = LMDataModule(
        LocalFiles(corpus), format="documents", tokenizer=tokenizer, storage="cache", cache_dir=str(tmp_path / "cache")
    )
    second.setup()
    assert second.setup_record["cache_hit"] is False


@pytest.mark.parametrize(
    ("key", "value", "storage"),
    [("storage", "disk", "disk"), ("tokenize_workers", -1, "auto"), ("tokenize_workers", 2, "memory")],
)
def test_bad_storage_options_name_the_key(key, value, storage):
    with pytest.raises(ConfigError, match=rf"data\.init_args\.{key}={value!r}"):
        LMDataModule(SyntheticText(num_documents=4), **{"storage": storage, key: value})


def test_cache_dir_comes_from_the_config_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(token_cache.CACHE_DIR_ENV, str(tmp_path / "env"))
    assert token_cache.cache_root(None) == tmp_path / "env"
    assert token_cache.cache_root(str(tmp_path / "config")) == tmp_path / "config"
    monkeypatch.delenv(token_cache.CACHE_DIR_ENV)
    assert token_cache.cache_root(None) == token_cache.Path(os.path.expanduser("~/.cache/lit_ablate/data"))


class SlowText(DataSource):
    """A corpus that takes a moment to read, so that two ranks starting together overlap in set-up."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __iter__(self) -> Iterator[dict]:
        time.sleep(self.delay_s)
        yield from SyntheticText(num_documents=50, seed=5)


def _setup_together(rank: int, world_size: int, cache_dir: str) -> dict:
    dist.barrier()  # both ranks find no entry, then race for it
    dm = LMDataModule(SlowText(delay_s=0.5), seq_len=16, storage="cache", cache_dir=cache_dir)
    dm.setup("fit")
    return {
        "hit": int(dm.setup_record["cache_hit"]),
        "path": dm.setup_record["cache_path"],
        "first": dm.train_set[0]["input_ids"],
        "count": len(dm.train_set),
    }


def test_two_ranks_starting_together_build_the_entry_once(tmp_path):
    results = run_ranks(_setup_together, 2, str(tmp_path))
    assert sorted(r["hit"] for r in results) == [0, 1]  # one built, the other waited and read it
    assert results[0]["path"] == results[1]["path"] and results[0]["count"] == results[1]["count"]
    assert torch.equal(results[0]["first"], results[1]["first"])
    entries = [p for p in os.listdir(tmp_path) if not p.endswith(".lock")]
    assert len(entries) == 1  # no temporary directory left behind


class _Quiet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch, batch_idx):
        return self.weight * batch["input_ids"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_run_record_carries_the_data_setup(tmp_path):
    from lit_ablate.callbacks import RunRecorder
    from lit_ablate.record import read_record

    dm = LMDataModule(
        SyntheticText(num_documents=40), seq_len=16, batch_size=2, storage="cache", cache_dir=str(tmp_path / "cache")
    )
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
    assert data["storage"] == "cache" and data["cache_hit"] is False and data["examples"] == len(dm.train_set)
    assert data["seconds"] > 0 and data["cache_path"].startswith(str(tmp_path / "cache"))

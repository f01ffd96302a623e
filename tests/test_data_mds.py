"""``MDSShards``: MosaicML MDS shards, as ``streaming.MDSWriter`` wrote them (``tests/data/mds/``,
plain and zstd), read by lit-ablate's own reader, through every storage.

Seen failing with a bug put in, one at a time: the variable-size columns' size header skipped (each
column read from the wrong offset: 5 of 9 tests fail); the sample offsets read
as relative to the data instead of absolute (7 of 9 tests fail); a pre-tokenised row given an
``eos`` like a text row (the token-stream test fails); the shard files left out of the fingerprint
(the cache test reuses a stale cache).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lit_ablate.data import LMDataModule, LocalFiles, MDSShards, PaddingCollator, build_examples
from lit_ablate.data.stream_slot import StreamRecipe
from lit_ablate.data.streaming import StreamingExamples
from lit_ablate.data.token_cache import cache_key
from lit_ablate.data.tokenizers import ByteTokenizer
from lit_ablate.errors import ConfigError
from tests.data.mds.write_fixture import documents
from tests.test_data import _BatchRecorder
from tests.test_data_streaming import _sequences

FIXTURES = Path(__file__).parent / "data" / "mds"


@pytest.mark.parametrize("folder", ["plain", "zstd"])
def test_rows_are_the_documents_mdswriter_wrote(folder):
    assert [row["text"] for row in MDSShards(str(FIXTURES / folder))] == documents()
    tokens = [row["input_ids"] for row in MDSShards(str(FIXTURES / folder), tokens_field="tokens")]
    assert tokens == [list(text.encode()) for text in documents()]
    assert len(list(MDSShards(str(FIXTURES / folder), max_rows=4))) == 4


@pytest.mark.parametrize("fmt", ["pretrain", "documents"])
def test_examples_equal_those_of_the_same_text_from_a_jsonl_file(tmp_path, fmt):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents()))
    ours = build_examples(MDSShards(str(FIXTURES / "plain")), ByteTokenizer(), fmt, 32, "truncate")
    reference = build_examples(LocalFiles(str(jsonl)), ByteTokenizer(), fmt, 32, "truncate")
    assert len(ours) == len(reference) > 0
    for a, b in zip(ours, reference):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pretokenised_rows_are_one_stream_as_stored():
    """No tokenising and no eos added: a token column holds what the pipeline that wrote it decided."""
    examples = build_examples(
        MDSShards(str(FIXTURES / "zstd"), tokens_field="tokens"), ByteTokenizer(), "pretrain", 16, "truncate"
    )
    stream = [t for text in documents() for t in text.encode()]
    assert [e["input_ids"].tolist() for e in examples] == [stream[s : s + 16] for s in range(0, len(stream) - 16, 16)]


def test_two_ranks_of_two_workers_see_every_row_once_per_epoch():
    collator = PaddingCollator()
    collator.bind(256, 64)
    seen = Counter()
    recipe = StreamRecipe(MDSShards(str(FIXTURES / "plain")), ByteTokenizer(), "documents", 64, "truncate", epochs=1)
    for rank in range(2):
        dataset = StreamingExamples(recipe, 1, rank=rank, num_replicas=2)
        seen.update(_sequences(DataLoader(dataset, batch_size=1, collate_fn=collator, num_workers=2)))
    reference = build_examples(MDSShards(str(FIXTURES / "plain")), ByteTokenizer(), "documents", 64, "truncate")
    assert seen == Counter(tuple(e["input_ids"].tolist()) for e in reference)


def _fit(root, max_steps: int, ckpt_path: str | None = None) -> list[torch.Tensor]:
    module = _BatchRecorder()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
        num_sanity_val_steps=0,
    )
    dm = LMDataModule(
        MDSShards(str(FIXTURES / "zstd")), format="documents", seq_len=64, batch_size=2, num_workers=2, storage="stream"
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module.seen


def test_lightning_resume_of_an_mds_stream_continues_exactly(tmp_path):
    uninterrupted = _fit(tmp_path / "a", max_steps=7)  # 5 batches of 2 per epoch: crosses an epoch boundary
    _fit(tmp_path / "b", max_steps=3)
    (checkpoint,) = (tmp_path / "b").glob("*.ckpt")
    resumed = _fit(tmp_path / "c", max_steps=7, ckpt_path=str(checkpoint))
    assert len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[3:], strict=True))


@pytest.mark.parametrize("max_rows", [None, 7])
def test_a_resumed_part_decodes_only_the_samples_after_its_position(monkeypatch, max_rows):
    """Resuming at every position of every part gives the rows that followed, and decodes only them.
    Catches a resume that counts rows from the part's start again (the default ``counted_rows``: every
    earlier sample decoded a second time; seen failing on the decode count) and an off-by-one in the
    sample offset (rows shifted by one)."""
    from lit_ablate.data import mds_source

    source = MDSShards(str(FIXTURES / "zstd"), max_rows=max_rows)
    decoded = []
    decode = mds_source._decode_column
    monkeypatch.setattr(mds_source, "_decode_column", lambda *a: decoded.append(1) or decode(*a))
    for part in range(source.stream_shards()):
        whole = list(source.stream_part(part))
        for cut in range(len(whole)):
            decoded.clear()
            rest = list(source.stream_part(part, whole[cut][1]))
            assert rest == whole[cut + 1 :]
            assert len(decoded) == len(rest)


def test_a_changed_shard_changes_the_cache_key(tmp_path):
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(FIXTURES / "plain", folder)
    key = cache_key(MDSShards(str(folder)), ByteTokenizer(), "pretrain", 32, "truncate")
    shard = folder / "shard.00001.mds"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert cache_key(MDSShards(str(folder)), ByteTokenizer(), "pretrain", 32, "truncate") != key


def test_bad_configs_are_one_line_naming_the_key(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"source\.init_args\.path=.*no MDS index\.json"):
        MDSShards(str(tmp_path))
    with pytest.raises(ConfigError, match=r"source\.init_args\.text_field='body': no such column; the shards have"):
        MDSShards(str(FIXTURES / "plain"), text_field="body")
    with pytest.raises(ConfigError, match=r"source\.init_args\.tokens_dtype='float32'"):
        MDSShards(str(FIXTURES / "plain"), tokens_field="tokens", tokens_dtype="float32")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # the mds extra not installed
    with pytest.raises(
        ConfigError,
        match=r"zstd-compressed shards needs zstandard, which is not installed here: "
        r"pip install 'lit-ablate\[mds\]'",
    ):
        MDSShards(str(FIXTURES / "zstd"))

"""Streams split the work, not the reads: each rank and worker of a stream reads only its own files or
shards, and every row is read exactly once per epoch, also when the parts do not divide the slots.

Seen failing with a bug put in, one at a time:
- ``slot_reads`` sharing a part among too many slots (``every = slots`` when parts < slots): rows of
  the shared part are missed (``test_slot_reads_give_every_row_to_exactly_one_slot`` and the 3-file case);
- a slot reading every part (``range(shards)``) instead of its own: the reads check of
  ``test_two_ranks_of_two_workers_read_only_their_own_files`` fails.
"""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from lit_ablate.data import HubDataset, LocalFiles, streaming
from lit_ablate.data.stream_slot import StreamRecipe
from lit_ablate.data.streaming import StreamingExamples, slot_reads
from lit_ablate.data.tokenizers import load_tokenizer


@pytest.mark.parametrize("shards", range(1, 10))
@pytest.mark.parametrize("slots", range(1, 9))
def test_slot_reads_give_every_row_to_exactly_one_slot(shards, slots):
    rows = 7
    read = Counter()
    for slot in range(slots):
        for part, every, first in slot_reads(shards, slots, slot):
            read.update((part, row) for row in range(rows) if row % every == first)
    assert read == Counter({(part, row): 1 for part in range(shards) for row in range(rows)})
    if shards >= slots:  # whole parts: no part opened by two slots
        parts = [part for slot in range(slots) for part, _, _ in slot_reads(shards, slots, slot)]
        assert sorted(parts) == list(range(shards))


def _files(tmp_path, count: int) -> str:
    for f in range(count):
        rows = [{"text": f"file {f} row {r} " + "x" * (r % 5)} for r in range(6 + f)]  # unequal files
        (tmp_path / f"part{f}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(tmp_path / "*.jsonl")


@pytest.mark.parametrize(
    ("files", "reads"),
    [
        (5, {0: [0, 4], 1: [1], 2: [2], 3: [3]}),  # more files than slots, not a multiple: slot 0 reads two
        (3, {0: [0], 1: [1], 2: [2], 3: [0]}),  # fewer files than slots: slots 0 and 3 share file 0 by row
        (4, {0: [0], 1: [1], 2: [2], 3: [3]}),
    ],
)
def test_two_ranks_of_two_workers_read_only_their_own_files(files, reads, tmp_path, monkeypatch):
    source = LocalFiles(_files(tmp_path, files))
    tokenizer = load_tokenizer("byte")
    opened: list[int] = []
    part_rows = source.stream_part
    monkeypatch.setattr(
        source, "stream_part", lambda index, after=None: opened.append(index) or part_rows(index, after)
    )

    def examples(rank: int, ranks: int, worker: int, workers: int) -> list[tuple[int, ...]]:
        monkeypatch.setattr(streaming, "get_worker_info", lambda: SimpleNamespace(id=worker, num_workers=workers))
        recipe = StreamRecipe(source, tokenizer, "documents", 64, "truncate", epochs=1)
        dataset = StreamingExamples(recipe, batch_size=1, rank=rank, num_replicas=ranks)
        return [tuple(e["input_ids"].tolist()) for e in dataset]

    every_row = Counter(examples(0, 1, 0, 1))  # one slot reads all parts
    assert sum(every_row.values()) == sum(6 + f for f in range(files)) and max(every_row.values()) == 1
    seen: Counter = Counter()
    for rank in range(2):
        for worker in range(2):
            opened.clear()
            seen.update(examples(rank, 2, worker, 2))
            assert opened == reads[rank * 2 + worker], (rank, worker)
    assert seen == every_row


def test_a_hub_source_streams_its_shards_apart(tmp_path, monkeypatch):
    import datasets

    local = LocalFiles(_files(tmp_path, 2))
    per_file = [[row["text"] for row in local.stream_shard(index)] for index in range(2)]
    real = datasets.load_dataset
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda *args, **kwargs: real("json", data_files=local.files, split="train", streaming=True),
    )  # a hub dataset of two files
    hub = HubDataset("someone/corpus")
    assert hub.stream_shards() == 2 and len(per_file[0]) == 6 and len(per_file[1]) == 7
    assert [[row["text"] for row in hub.stream_shard(index)] for index in range(2)] == per_file

"""Packing for streams: each slot packs its own examples into rows exactly as the in-memory packer
packs the same examples, every example is in one row once over 2 ranks x 2 workers, and a resumed
packed stream continues exactly.

Seen failing with a bug put in, one at a time:
- ``StreamPacking.keeps`` ignoring ``overlong: reject`` (rejected examples counted into the window):
  ``test_a_slot_packs_its_examples_as_the_in_memory_packer_does[reject-*]`` fails (other windows,
  rows with overlong examples);
- ``_Packed`` marking a row served mid-window with the state after the window instead of the
  window's start: ``test_a_resumed_packed_stream_continues_exactly`` fails for positions inside a
  window;
- ``StreamingBatches`` not passing the collator's packing on (``packing=None``): the exactly-once
  test fails (rows are single examples, ``position_ids`` missing);
- ``load_state_dict`` not comparing the saved packing:
  ``test_a_stream_resumes_only_with_the_packing_it_was_saved_with``.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from lit_ablate.data import LocalFiles, PackingCollator, build_examples
from lit_ablate.data.datamodule import ExampleDataset
from lit_ablate.data.sampler import Sharding
from lit_ablate.data.stream_slot import SlotStream, StreamRecipe
from lit_ablate.data.streaming import STREAM_STATE, StreamBatchCollate, StreamingBatches, slot_reads
from lit_ablate.data.tokenizers import ByteTokenizer
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX

SEQ_LEN, MAX_TOKENS, WINDOW = 64, 48, 7


def _corpus(tmp_path, files: int = 1, rows: int = 60) -> str:
    rng = random.Random(3)
    for f in range(files):
        lines = [json.dumps({"text": f"doc {f}.{r} " + "ab" * rng.randint(0, 30)}) + "\n" for r in range(rows)]
        (tmp_path / f"docs{f}.jsonl").write_text("".join(lines))
    return str(tmp_path / "docs*.jsonl")


def _recipe(source, **options) -> StreamRecipe:
    return StreamRecipe(source, ByteTokenizer(), "documents", SEQ_LEN, "truncate", **options)


def _collator(strategy: str = "ffd", overlong: str = "truncate") -> PackingCollator:
    collator = PackingCollator(max_tokens=MAX_TOKENS, strategy=strategy, window=WINDOW, overlong=overlong)
    collator.bind(ByteTokenizer().pad_id, SEQ_LEN)
    return collator


def _documents(batch: dict) -> list[tuple[int, ...]]:
    """The examples of a packed batch, cut where ``position_ids`` restart (padding segments dropped)."""
    docs = []
    for ids, positions, labels in zip(batch["input_ids"], batch["position_ids"], batch["labels"]):
        starts = [*(positions == 0).nonzero().flatten().tolist(), len(ids)]
        for begin, end in itertools.pairwise(starts):
            if (labels[begin:end] != IGNORE_INDEX).any():
                docs.append(tuple(ids[begin:end].tolist()))
    return docs


def test_two_ranks_of_two_workers_pack_every_example_once(tmp_path):
    path = _corpus(tmp_path, files=3)  # 3 files for 4 slots: one file shared by row
    collator = _collator()
    seen: Counter = Counter()
    for rank in range(2):
        recipe = _recipe(LocalFiles(path), epochs=1, packing=collator.stream_packing())
        dataset = StreamingBatches(recipe, 2, rank=rank, num_replicas=2)
        for batch in DataLoader(dataset, batch_size=None, collate_fn=StreamBatchCollate(collator), num_workers=2):
            assert batch["input_ids"].shape[1] <= MAX_TOKENS
            seen.update(_documents(batch))
    reference = build_examples(LocalFiles(path), ByteTokenizer(), "documents", SEQ_LEN, "truncate")
    assert seen == Counter(tuple(e["input_ids"][:MAX_TOKENS].tolist()) for e in reference)


def _slot_examples(source, slot: int, slots: int) -> list[dict]:
    return list(
        SlotStream(
            _recipe(source, epochs=1),
            slot,
            slots,
            slot_reads(source.stream_shards(), slots, slot),
        )
    )


def _tokens(row: list[dict]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(e["input_ids"].tolist()) for e in row)


@pytest.mark.parametrize("strategy", ["ffd", "greedy"])
@pytest.mark.parametrize("overlong", ["truncate", "reject"])
def test_a_slot_packs_its_examples_as_the_in_memory_packer_does(tmp_path, strategy, overlong):
    source = LocalFiles(_corpus(tmp_path))
    collator = _collator(strategy, overlong)
    for slot in range(4):
        examples = _slot_examples(source, slot, 4)
        dataset = ExampleDataset(examples)
        sampler = collator.sampler(dataset, dataset.lengths, Sharding(shuffle=False, batch_size=2))
        in_memory = [[examples[i] for i in row] for row in sampler.epoch_rows()]
        streamed = list(
            SlotStream(
                _recipe(source, packing=collator.stream_packing(), epochs=1),
                slot,
                4,
                slot_reads(1, 4, slot),
            )
        )
        assert [_tokens(r) for r in streamed] == [_tokens(r) for r in in_memory] and len(in_memory) > WINDOW // 2
        if overlong == "reject":
            assert all(len(e["input_ids"]) <= MAX_TOKENS for row in streamed for e in row)
        for start in range(0, len(streamed), 2):
            got, want = collator(streamed[start : start + 2]), collator(in_memory[start : start + 2])
            for key in ("input_ids", "labels", "position_ids", "cu_seqlens"):
                assert torch.equal(got[key], want[key]), key
            assert got["document_lengths"] == want["document_lengths"]
            assert (got["labels"][:, -1] == IGNORE_INDEX).all()  # no label crosses a row's end
            ends = got["cu_seqlens"][1:].long() - 1  # each document's last position predicts nothing
            assert (got["labels"].flatten()[ends] == IGNORE_INDEX).all()


@pytest.mark.parametrize("shuffle_buffer", [0, 5])
def test_a_resumed_packed_stream_continues_exactly(tmp_path, shuffle_buffer):
    source = LocalFiles(_corpus(tmp_path, rows=30))
    collator = _collator()

    def stream(skip: int = 0, positions=None) -> StreamingBatches:
        recipe = _recipe(
            source,
            epochs=2,
            shuffle_buffer=shuffle_buffer,
            seed=1,
            packing=collator.stream_packing(),
        )
        return StreamingBatches(recipe, 2, skip_batches=skip, positions=positions)

    whole = [collator(items) for items, _ in stream()]
    assert len(whole) > 8
    for consumed in range(1, len(whole)):  # inside windows, at their ends, across the epoch
        positions = dict(position for _, (_, position) in zip(range(consumed), stream()))
        resumed = [collator(items) for items, _ in stream(consumed, positions)]
        assert len(resumed) == len(whole) - consumed, consumed
        for got, want in zip(resumed, whole[consumed:]):
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(
                got["position_ids"], want["position_ids"]
            )


def test_a_packed_batch_carries_its_slot_state(tmp_path):
    collator = _collator()
    dataset = StreamingBatches(_recipe(LocalFiles(_corpus(tmp_path)), epochs=1, packing=collator.stream_packing()), 2)
    batch = next(iter(DataLoader(dataset, batch_size=None, collate_fn=StreamBatchCollate(collator))))
    slot, state = batch[STREAM_STATE]
    assert slot == 0 and state["epoch"] == 0 and state["items"]["rows_served"] == 2  # two rows of the first window


@pytest.mark.parametrize("saved", [None, PackingCollator(max_tokens=MAX_TOKENS, window=WINDOW + 1)])
def test_a_stream_resumes_only_with_the_packing_it_was_saved_with(tmp_path, saved):
    """Another window (or padding) would pack other rows than the saved positions point into."""
    from lit_ablate.data import LMDataModule
    from lit_ablate.errors import ConfigError

    def data_module(collator) -> LMDataModule:
        return LMDataModule(
            LocalFiles(_corpus(tmp_path)), format="documents", seq_len=SEQ_LEN, storage="stream", collator=collator
        )

    state = data_module(saved).state_dict()
    with pytest.raises(ConfigError, match=r"data.init_args.collator"):
        data_module(PackingCollator(max_tokens=MAX_TOKENS, window=WINDOW)).load_state_dict(state)
    data_module(saved).load_state_dict(state)  # the same settings resume

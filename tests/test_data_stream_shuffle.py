"""A stream's shuffle buffer: seeded by (seed, epoch, slot), a permutation of the slot's examples,
and exact on resume.

Seen failing with a bug put in, one at a time:
- the buffer's generator seeded without the epoch: every epoch has the same order
  (``test_a_buffer_shuffles_each_epoch_of_a_slot_differently``);
- the generator left unseeded (``random.Random()``): the resumed stream continues with other
  examples (``test_a_resumed_shuffled_stream_continues_with_the_next_examples``);
- the buffer's examples left out of the slot's state (a resumed buffer starts empty): the resumed
  stream continues with other examples (the same test).
"""

from __future__ import annotations

import json

import pytest

from lit_ablate.data import LMDataModule, LocalFiles, SyntheticText
from lit_ablate.data.stream_slot import SlotStream, StreamRecipe
from lit_ablate.data.streaming import StreamingBatches
from lit_ablate.data.tokenizers import load_tokenizer
from lit_ablate.errors import ConfigError


def _stream(tmp_path, skip_batches: int = 0, positions=None, **recipe) -> StreamingBatches:
    path = tmp_path / "docs.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(40)))
    recipe = StreamRecipe(LocalFiles(str(path)), load_tokenizer("byte"), "documents", 32, "truncate", **recipe)
    return StreamingBatches(recipe, batch_size=2, skip_batches=skip_batches, positions=positions)


def _ids(stream: StreamingBatches) -> list[tuple[int, ...]]:
    return [tuple(e["input_ids"].tolist()) for batch, _ in stream for e in batch]


def _states(stream: StreamingBatches, batches: int) -> dict:
    """The slot's state after its first ``batches`` batches (one slot: no DataLoader workers)."""
    return dict(position for _, (_, position) in zip(range(batches), stream))


def test_a_buffer_shuffles_each_epoch_of_a_slot_differently(tmp_path):
    plain = _ids(_stream(tmp_path, epochs=1))
    two_epochs = _ids(_stream(tmp_path, epochs=2, shuffle_buffer=8, seed=3))
    first, second = two_epochs[:40], two_epochs[40:]
    assert sorted(first) == sorted(second) == sorted(plain) and len(set(plain)) == 40
    assert first != plain and second != first
    assert _ids(_stream(tmp_path, epochs=1, shuffle_buffer=8, seed=3)) == first  # a pure function of the seed
    assert _ids(_stream(tmp_path, epochs=1, shuffle_buffer=8, seed=4)) != first


def test_the_buffer_holds_at_most_its_size():
    source = SyntheticText(num_documents=30)
    pulled = []
    rows = source.stream_part
    source.stream_part = lambda index, after=None: ((pulled.append(row) or row, p) for row, p in rows(index, after))
    stream = iter(
        SlotStream(
            StreamRecipe(source, load_tokenizer("byte"), "documents", 4096, "truncate", shuffle_buffer=5, epochs=1),
            0,
            1,
            [(0, 1, 0)],
        )
    )
    first = next(stream)
    assert len(pulled) == 6  # the 6th example displaced the first served
    everything = [first, *stream]
    assert sorted(tuple(e["input_ids"].tolist()) for e in everything) == sorted(
        tuple(e["input_ids"].tolist())
        for e in SlotStream(
            StreamRecipe(source, load_tokenizer("byte"), "documents", 4096, "truncate", epochs=1), 0, 1, [(0, 1, 0)]
        )
    )


def test_a_resumed_shuffled_stream_continues_with_the_next_examples(tmp_path):
    whole = _ids(_stream(tmp_path, epochs=2, shuffle_buffer=8, seed=1))
    for batches in (3, 17, 20, 27):  # 17: while the first epoch's buffer drains
        positions = _states(_stream(tmp_path, epochs=2, shuffle_buffer=8, seed=1), batches)
        resumed = _ids(_stream(tmp_path, epochs=2, shuffle_buffer=8, seed=1, skip_batches=batches, positions=positions))
        assert resumed == whole[batches * 2 :], batches


def test_a_shuffle_buffer_is_for_streams_only(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match=r"data.init_args.shuffle_buffer=8"):
        LMDataModule(LocalFiles(str(path)), storage="cache", shuffle_buffer=8)


@pytest.mark.parametrize(("shuffle", "buffer"), [(True, 8), (False, 0)])
def test_the_data_module_gives_its_stream_the_buffer_and_seed(tmp_path, shuffle, buffer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "x"}\n')
    dm = LMDataModule(
        LocalFiles(str(path)), format="documents", storage="stream", shuffle_buffer=8, seed=3, shuffle=shuffle
    )
    dataset = dm.train_dataloader().dataset
    assert (dataset.recipe.shuffle_buffer, dataset.recipe.seed) == (buffer, 3)

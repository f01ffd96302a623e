"""A stream's shuffle buffer: seeded by (seed, epoch, slot), a permutation of the slot's examples,
and exact on resume.

Seen failing with a bug put in, one at a time:
- the buffer's generator seeded without the epoch: every epoch has the same order
  (``test_a_buffer_shuffles_each_epoch_of_a_slot_differently``);
- the generator left unseeded (``random.Random()``): the resumed stream continues with other
  examples (``test_a_resumed_shuffled_stream_continues_with_the_next_examples``).
"""

from __future__ import annotations

import json

import pytest

from lit_ablate.data import LMDataModule, LocalFiles
from lit_ablate.data.streaming import StreamingExamples, shuffled_through_buffer
from lit_ablate.data.tokenizers import load_tokenizer
from lit_ablate.errors import ConfigError


def _stream(tmp_path, **kwargs) -> StreamingExamples:
    path = tmp_path / "docs.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(40)))
    return StreamingExamples(LocalFiles(str(path)), load_tokenizer("byte"), "documents", 32, "truncate",
                             batch_size=2, **kwargs)


def _ids(examples) -> list[tuple[int, ...]]:
    return [tuple(e["input_ids"].tolist()) for e in examples]


def test_a_buffer_shuffles_each_epoch_of_a_slot_differently(tmp_path):
    plain = _ids(_stream(tmp_path, epochs=1))
    two_epochs = _ids(_stream(tmp_path, epochs=2, shuffle_buffer=8, seed=3))
    first, second = two_epochs[:40], two_epochs[40:]
    assert sorted(first) == sorted(second) == sorted(plain) and len(set(plain)) == 40
    assert first != plain and second != first
    assert _ids(_stream(tmp_path, epochs=1, shuffle_buffer=8, seed=3)) == first  # a pure function of the seed
    assert _ids(_stream(tmp_path, epochs=1, shuffle_buffer=8, seed=4)) != first


def test_the_buffer_holds_at_most_its_size():
    pulled = []

    def source():
        for i in range(30):
            pulled.append(i)
            yield i

    import random

    out = shuffled_through_buffer(source(), 5, random.Random(0))
    first = next(out)
    assert len(pulled) == 6 and first in range(6)  # the 6th example displaced the first yielded
    assert sorted([first, *out]) == list(range(30))


def test_a_resumed_shuffled_stream_continues_with_the_next_examples(tmp_path):
    whole = _ids(_stream(tmp_path, epochs=2, shuffle_buffer=8, seed=1))
    for batches in (3, 20, 27):
        resumed = _ids(_stream(tmp_path, epochs=2, shuffle_buffer=8, seed=1, skip_batches=batches))
        assert resumed == whole[batches * 2 :], batches


def test_a_shuffle_buffer_is_for_streams_only(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match="data.init_args.shuffle_buffer=8"):
        LMDataModule(LocalFiles(str(path)), storage="cache", shuffle_buffer=8)


@pytest.mark.parametrize(("shuffle", "buffer"), [(True, 8), (False, 0)])
def test_the_data_module_gives_its_stream_the_buffer_and_seed(tmp_path, shuffle, buffer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "x"}\n')
    dm = LMDataModule(LocalFiles(str(path)), format="documents", storage="stream", shuffle_buffer=8, seed=3,
                      shuffle=shuffle)
    dataset = dm.train_dataloader().dataset
    assert (dataset.shuffle_buffer, dataset.seed) == (buffer, 3)

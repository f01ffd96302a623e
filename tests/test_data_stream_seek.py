"""A resumed stream seeks to each slot's saved position: it reads and tokenises only what remains of
the epoch (plus the one row, row group, ``datasets`` batch or packing window in progress), and its
batches equal the uninterrupted run's. Part readers give the rows ``datasets`` gives and resume from
every position they report.

Seen failing with a bug put in, one at a time:
- the old re-read path (each resumed slot starting its epoch again from the start, without its state,
  and skipping the examples its consumed batches held): the batches still match, but
  ``test_a_resumed_stream_reads_only_what_remains`` fails on the rows read and tokenised;
- ``line_rows`` ignoring the saved byte offset (reading the file from its start and dropping rows
  up to the position by count): ``test_a_resumed_stream_reads_only_what_remains[jsonl*]`` fails on
  the lines parsed;
- ``_Examples`` marking a ``pretrain`` window mid-row with the state after the row (the carried
  tokens of the row lost): ``[pretrain]`` resumes give other windows;
- ``datasets_rows`` yielding the position after a batch for every row of it: the hub resume test
  skips rows.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from lit_ablate.data import HubDataset, LocalFiles, PackingCollator, PaddingCollator, sources, stream_parts
from lit_ablate.data.stream_slot import StreamRecipe
from lit_ablate.data.streaming import StreamingBatches
from lit_ablate.data.tokenizers import ByteTokenizer

SEQ_LEN = 48


class _CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the texts it encodes."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return super().encode(text)


def _jsonl(tmp_path, files: int, rows: int = 40, longest: int = 40) -> str:
    rng = random.Random(5)
    for f in range(files):
        lines = [json.dumps({"text": f"row {f}.{r} " + "xy" * rng.randint(0, longest)}) + "\n" for r in range(rows)]
        (tmp_path / f"part{f}.jsonl").write_text("".join(lines))
    return str(tmp_path / "part*.jsonl")


def _parquet(tmp_path, rows: int = 40) -> str:
    import pyarrow
    import pyarrow.parquet

    rng = random.Random(5)
    table = pyarrow.table({"text": [f"row {r} " + "xy" * rng.randint(0, 40) for r in range(rows)]})
    pyarrow.parquet.write_table(table, tmp_path / "corpus.parquet", row_group_size=6)
    return str(tmp_path / "corpus.parquet")


class _Reads:
    """Counts the rows a source's parts hand out and the JSON lines parsed to make them."""

    def __init__(self, source, monkeypatch) -> None:
        self.rows = self.lines = 0
        part, parse = source.stream_part, stream_parts._json_row

        def counted_part(index, after=None):
            for row, position in part(index, after):
                self.rows += 1
                yield row, position

        def counted_parse(*args):
            self.lines += 1
            return parse(*args)

        monkeypatch.setattr(source, "stream_part", counted_part)
        monkeypatch.setattr(stream_parts, "_json_row", counted_parse)


CASES = {  # name: (corpus, format, packing, shuffle buffer, rows the resumed slot may read again)
    "jsonl-files": (lambda p: _jsonl(p, 2), "documents", False, 0, 1),
    "jsonl-one-file": (lambda p: _jsonl(p, 1, rows=80), "documents", False, 0, 1),  # shared by row with rank 0
    "pretrain": (lambda p: _jsonl(p, 1, rows=24, longest=120), "pretrain", False, 0, 1),  # rows of 1-5 windows
    "packed": (lambda p: _jsonl(p, 2), "documents", True, 0, 5),
    "buffered": (lambda p: _jsonl(p, 2), "documents", False, 6, 1),  # the buffer's examples come from the state
    "parquet": (_parquet, "documents", False, 0, 6),
}


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_stream_reads_only_what_remains(tmp_path, monkeypatch, case):
    corpus, fmt, packed, buffer, again = CASES[case]
    source = LocalFiles(corpus(tmp_path))
    collator = PackingCollator(max_tokens=SEQ_LEN, window=5) if packed else PaddingCollator()
    collator.bind(0, SEQ_LEN)
    reads = _Reads(source, monkeypatch)
    tokenizer = _CountingTokenizer()

    def stream(skip: int = 0, positions=None) -> StreamingBatches:  # one slot of 2 ranks: rank 1's
        recipe = StreamRecipe(
            source,
            tokenizer,
            fmt,
            SEQ_LEN,
            "truncate",
            epochs=1,
            shuffle_buffer=buffer,
            seed=2,
            packing=collator.stream_packing() if packed else None,
        )
        return StreamingBatches(recipe, 2, rank=1, num_replicas=2, skip_batches=skip, positions=positions)

    whole, read_by = [], []  # the batches, and the rows read when each was made
    for items, _ in stream():
        whole.append(collator(items))
        read_by.append(reads.rows)
    total_rows = reads.rows
    assert len(whole) >= 6
    for consumed in range(1, len(whole)):
        positions = dict(position for _, (_, position) in zip(range(consumed), stream()))
        reads.rows = reads.lines = tokenizer.encoded = 0
        resumed = [collator(items) for items, _ in stream(consumed, positions)]
        assert len(resumed) == len(whole) - consumed
        for got, want in zip(resumed, whole[consumed:]):
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])
        remaining = total_rows - read_by[consumed - 1]
        assert reads.rows <= remaining + again, (consumed, reads.rows, remaining)
        assert tokenizer.encoded <= remaining + again
        if source.files[0].endswith(".jsonl"):  # no line parsed to be dropped: the reader seeked
            assert reads.lines == reads.rows


@pytest.mark.parametrize(
    "lines",
    [
        b'{"text": "a"}\n\n{"text": "b", "n": 1}\n   \n{"text": "\\u00e9t\\u00e9"}',  # blank lines, no final newline
        b'\xef\xbb\xbf{"text": "bom"}\n{"text": "x"}\n',
    ],
)
def test_jsonl_rows_are_the_rows_datasets_reads_and_resume_anywhere(tmp_path, lines):
    from datasets import load_dataset

    path = tmp_path / "rows.jsonl"
    path.write_bytes(lines)
    rows = list(stream_parts.line_rows([str(path)], True, None, None))
    expected = [row["text"] for row in load_dataset("json", data_files=str(path), split="train")]
    assert [row["text"] for row, _ in rows] == expected
    for index, (_, position) in enumerate(rows):
        assert list(stream_parts.line_rows([str(path)], True, position, None)) == rows[index + 1 :]


def test_text_lines_split_as_datasets_splits_them_and_resume_anywhere(tmp_path):
    from datasets import load_dataset

    path = tmp_path / "lines.txt"
    path.write_bytes("one\r\ntwo\rthree\n\nfour\r\r\nfive été\r".encode())
    rows = list(stream_parts.line_rows([str(path)], False, None, None))
    expected = [row["text"] for row in load_dataset("text", data_files=str(path), split="train")]
    assert [row["text"] for row, _ in rows] == expected == ["one", "two", "three", "", "four", "", "five été"]
    for index, (_, position) in enumerate(rows):
        assert list(stream_parts.line_rows([str(path)], False, position, None)) == rows[index + 1 :]
    capped = list(stream_parts.line_rows([str(path)], False, rows[1][1], 4))  # max_rows counts over the part
    assert [row["text"] for row, _ in capped] == ["three", ""]


def test_parquet_rows_resume_inside_a_row_group(tmp_path):
    from datasets import load_dataset

    path = _parquet(tmp_path, rows=20)
    rows = list(stream_parts.parquet_rows([path], None, None))
    assert [row["text"] for row, _ in rows] == [
        row["text"] for row in load_dataset("parquet", data_files=path, split="train")
    ]
    for index, (_, position) in enumerate(rows):
        assert list(stream_parts.parquet_rows([path], position, None)) == rows[index + 1 :]


def test_a_hub_stream_resumes_from_datasets_state(tmp_path, monkeypatch):
    import datasets

    local = LocalFiles(_jsonl(tmp_path, 2, rows=11))
    per_file = [[row["text"] for row in local.stream_shard(part)] for part in range(2)]
    real = datasets.load_dataset
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda *args, **kwargs: real("json", data_files=local.files, split="train", streaming=True),
    )  # a hub dataset of two files
    monkeypatch.setattr(sources, "_STREAM_BATCH", 4)
    hub = HubDataset("someone/corpus")
    assert hub.stream_shards() == 2
    for part in range(2):
        rows = list(hub.stream_part(part))
        assert [row["text"] for row, _ in rows] == per_file[part]
        for index, (_, position) in enumerate(rows):
            rest = [row["text"] for row, _ in hub.stream_part(part, position)]
            assert rest == [row["text"] for row, _ in rows[index + 1 :]], (part, index)

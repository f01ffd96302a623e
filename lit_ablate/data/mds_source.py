"""``MDSShards``: rows of a MosaicML MDS dataset, the shard format the seed studies trained from.

MDS (``streaming``'s ``MDSWriter``, llm-foundry's converters) is a folder with an ``index.json``
listing shard files; each shard holds its sample count, the byte offsets of its samples, and per
sample the sizes of its variable-size columns followed by the encoded columns. lit-ablate reads that
format itself instead of through mosaicml-streaming: the library pins ``transformers<5`` and
imports torchvision, so it cannot be installed beside lit-ablate's stack. The reader is small
(below) and is tested on shards written by ``MDSWriter`` itself (``tests/data/mds/``).

A shard is read whole when its turn comes (shards are bounded by the writer's ``size_limit``, 64 MB
by default), samples in index order, so every worker and rank reads the same rows in the same
order and ``storage: stream`` shards them by row number, resumes them exactly, and never holds more
than one shard per worker; ``memory`` and ``cache`` read them once. zstd-compressed shards (MDS's
``compression: zstd``) are decompressed in memory with the ``zstandard`` package (the ``mds``
extra); other compressions are refused with the fix.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from lit_ablate.data.formats import TOKENS_FIELD
from lit_ablate.data.sources import DataSource, Row
from lit_ablate.data.stream_parts import Position
from lit_ablate.errors import ConfigError
from lit_ablate.extras import require

_KEY = "data.init_args.source.init_args"
_SCALARS = {
    name: np.dtype(name)
    for name in (
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
_NDARRAY_DTYPES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
"""MDS's one-byte codes of an ``ndarray`` column's value dtype (when the encoding does not fix it)."""


class MDSShards(DataSource):
    """Rows from a local MDS dataset folder (its ``index.json`` and shard files).

    Choose it to train from the shards an existing MDS pipeline wrote. A text column gives
    ``text`` rows (every format tokenises them); a token column gives pre-tokenised rows
    (``input_ids``, used as stored: llm-foundry's packs already hold their separators), which the
    ``pretrain`` and ``documents`` formats take without tokenising.

    Args:
        path: the folder holding ``index.json`` (written by ``streaming.MDSWriter``).
        text_field: the ``str`` column yielded as ``text``.
        tokens_field: instead of text, the column of token ids (an ``ndarray`` of integers, or
            ``bytes`` read as ``tokens_dtype``) yielded as ``input_ids``.
        tokens_dtype: the integer dtype of a ``bytes`` token column (llm-foundry wrote ``int64``).
        max_rows: read at most this many rows (None = all).
    """

    def __init__(
        self,
        path: str,
        text_field: str = "text",
        tokens_field: str | None = None,
        tokens_dtype: str = "int64",
        max_rows: int | None = None,
    ) -> None:
        index_path = os.path.join(path, "index.json")
        if not os.path.isfile(index_path):
            raise ConfigError(f"{_KEY}.path", path, "no MDS index.json there: give the folder MDSWriter wrote")
        with open(index_path) as f:
            self.shards = json.load(f)["shards"]
        field = tokens_field or text_field
        for shard in self.shards:
            if shard.get("format") != "mds":
                raise ConfigError(
                    f"{_KEY}.path", path, f"shard format {shard.get('format')!r}: only 'mds' shards are read"
                )
            if shard.get("compression") not in (None, "zstd"):
                raise ConfigError(
                    f"{_KEY}.path",
                    path,
                    f"{shard['compression']} compression: re-write the shards uncompressed or with zstd",
                )
            if field not in shard["column_names"]:
                key = "tokens_field" if tokens_field else "text_field"
                raise ConfigError(f"{_KEY}.{key}", field, f"no such column; the shards have {shard['column_names']}")
        if tokens_dtype not in _SCALARS or not np.issubdtype(_SCALARS[tokens_dtype], np.integer):
            raise ConfigError(f"{_KEY}.tokens_dtype", tokens_dtype, "use an integer dtype such as int64 or uint32")
        if any(s.get("compression") == "zstd" for s in self.shards):
            _zstd_decompressor()  # fails early when the extra is missing
        self.path, self.text_field, self.tokens_field = path, text_field, tokens_field
        self.tokens_dtype, self.max_rows = tokens_dtype, max_rows

    def fingerprint(self) -> dict[str, Any]:
        """Its arguments and every shard file's name, size and modification time."""
        stats = [
            (name, os.stat(p).st_size, os.stat(p).st_mtime_ns)
            for name, p in ((name, os.path.join(self.path, name)) for name in self._files())
        ]
        return {**super().fingerprint(), "files": stats}

    def stored_bytes(self) -> int:
        """The shard files' total size."""
        return sum(os.path.getsize(os.path.join(self.path, name)) for name in self._files())

    def num_rows(self) -> int:
        """The samples the index lists (at most ``max_rows``)."""
        rows = sum(int(s["samples"]) for s in self.shards)
        return rows if self.max_rows is None else min(rows, self.max_rows)

    def __iter__(self) -> Iterator[Row]:
        rows = itertools.chain.from_iterable(self._shard_rows(shard) for shard in self.shards)
        return itertools.islice(rows, self.max_rows)  # max_rows None: all

    def stream_shards(self) -> int:
        """One part per shard (one part with ``max_rows``, which counts rows over all shards)."""
        return len(self.shards) if self.max_rows is None else 1

    def stream_shard(self, index: int) -> Iterator[Row]:
        return self._shard_rows(self.shards[index]) if self.stream_shards() > 1 else iter(self)

    def stream_part(self, index: int, after: Position = None) -> Iterator[tuple[Row, Position]]:
        """A position is ``(shard, its samples read, rows read)``: a resumed part starts decoding at
        the next sample (its shard file is read whole, as always), never at the part's start."""
        shards = [index] if self.stream_shards() > 1 else list(range(len(self.shards)))
        first, done, count = after or (shards[0], 0, 0)
        if self.max_rows is not None and count >= self.max_rows:
            return
        for shard in (s for s in shards if s >= first):
            start = done if shard == first else 0
            for number, row in enumerate(self._shard_rows(self.shards[shard], start), start=start + 1):
                count += 1
                yield row, (shard, number, count)
                if self.max_rows is not None and count >= self.max_rows:  # before decoding one more
                    return

    def _shard_rows(self, shard: dict[str, Any], start: int = 0) -> Iterator[Row]:
        field = self.tokens_field or self.text_field
        columns = list(zip(shard["column_names"], shard["column_encodings"], shard["column_sizes"]))
        for sample in _samples(self._shard_bytes(shard), start):
            value = _decode_column(sample, columns, field)
            if self.tokens_field is None:
                yield {"text": value}
            else:
                tokens = np.frombuffer(value, _SCALARS[self.tokens_dtype]) if isinstance(value, bytes) else value
                yield {TOKENS_FIELD: [int(t) for t in tokens]}

    def _files(self) -> list[str]:
        return [(s["zip_data"] or s["raw_data"])["basename"] for s in self.shards]

    def _shard_bytes(self, shard: dict[str, Any]) -> bytes:
        compressed = shard.get("compression") == "zstd"
        with open(
            os.path.join(self.path, (shard["zip_data"] if compressed else shard["raw_data"])["basename"]), "rb"
        ) as f:
            data = f.read()
        return _zstd_decompressor()(data) if compressed else data


def _samples(shard: bytes, start: int = 0) -> Iterator[bytes]:
    """Each sample's bytes from sample ``start`` on: a shard starts with its sample count and
    ``count + 1`` absolute offsets (uint32)."""
    count = int(np.frombuffer(shard[:4], np.uint32)[0])
    offsets = np.frombuffer(shard[4 : 8 + 4 * count], np.uint32)
    for begin, end in zip(offsets[start:-1], offsets[start + 1 :]):
        yield shard[begin:end]


def _decode_column(sample: bytes, columns: list[tuple[str, str, int | None]], wanted: str) -> Any:
    """Column ``wanted`` of one sample: the variable-size columns' sizes (uint32 each) come first."""
    variable = [name for name, _, size in columns if size is None]
    sizes = dict(zip(variable, np.frombuffer(sample[: 4 * len(variable)], np.uint32).tolist()))
    start = 4 * len(variable)
    for name, encoding, size in columns:
        length = size if size is not None else sizes[name]
        if name == wanted:
            return _decode(encoding, sample[start : start + length])
        start += length
    raise KeyError(wanted)


def _decode(encoding: str, data: bytes) -> Any:
    """The MDS encodings a text or token column uses: ``str``, ``bytes``, ``int``, a scalar dtype,
    ``json``, and ``ndarray[:dtype[:shape]]`` (what is not fixed by the encoding leads the data)."""
    if encoding == "str":
        return data.decode("utf-8")
    if encoding == "bytes":
        return data
    if encoding == "json":
        return json.loads(data.decode("utf-8"))
    if encoding == "int":
        return int(np.frombuffer(data, np.int64)[0])
    if encoding in _SCALARS:
        return np.frombuffer(data, _SCALARS[encoding])[0].item()
    if encoding.startswith("ndarray"):
        return _decode_ndarray(encoding, data)
    raise ConfigError(
        f"{_KEY}.path",
        encoding,
        "an MDS column encoding lit-ablate does not read; use str, bytes, "
        "int, json or ndarray for the text or token column",
    )


def _decode_ndarray(encoding: str, data: bytes) -> np.ndarray:
    parts = encoding.split(":")
    index = 0
    if len(parts) > 1:
        dtype = parts[1]
    else:
        dtype, index = _NDARRAY_DTYPES[data[0]], 1
    if len(parts) > 2:
        shape = tuple(int(d) for d in parts[2].split(","))
    else:  # one byte: ndim << 2 | the shape's dtype code (uint8, 16, 32, 64), then the shape
        ndim, width = data[index] >> 2, 2 ** (data[index] & 3)
        shape = tuple(int(d) for d in np.frombuffer(data[index + 1 : index + 1 + ndim * width], f"<u{width}"))
        index += 1 + ndim * width
    return np.frombuffer(data[index:], dtype).reshape(shape)


def _zstd_decompressor() -> Callable[[bytes], bytes]:
    require("zstandard", f"{_KEY}.path", "zstd", "reading zstd-compressed shards")
    import zstandard

    return zstandard.ZstdDecompressor().decompress

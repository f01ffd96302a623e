"""The token cache: a data set tokenised once into flat int32 files read with ``pread``, shared by every rank
and every run that uses the same data settings.

An entry is a directory ``<cache_dir>/<format>-<key>/``:

- ``input_ids.bin``, ``labels.bin``: int32 tokens and shifted labels of all examples back to back;
- ``lengths.bin`` (int32) and ``offsets.bin`` (int64, one more than the examples): where each
  example starts and how long it is;
- preference pairs also ``chosen_tokens.bin`` and ``prompt_tokens.bin`` (int32);
- ``meta.json``: the key's inputs (readable), the counts, what overlong handling did.

The key is a hash of everything that decides the examples: the source's fingerprint (its class
and arguments; for files each path, size and modification time), the tokenizer's identity, the
format, ``seq_len``, ``overlong``, lit-ablate's version and this layout's version. The split into
training and validation examples and the order (seed, shuffle) are not in the key: they are
applied on top of a cache entry, so runs that differ only there share it.

One process builds an entry: it holds an exclusive ``flock`` on ``<entry>.lock`` while it writes
into a temporary directory, then renames that into place (atomic on one file system). Other
processes (the other ranks, concurrent runs of a study) wait on the lock and then open the entry.
Rows are tokenised in batches, in this process or in ``workers`` processes (started by
``forkserver``, never by forking a process that may hold threads); the main process writes the
results in the source's order, so the entry is the same whatever the number of workers.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import secrets
import shutil
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

import lit_ablate
from lit_ablate.data.build_progress import BuildProgress
from lit_ablate.data.formats import (
    Example,
    Overlong,
    check_stream_length,
    iter_examples,
    pretrain_stream,
    report_overlong,
)
from lit_ablate.data.preference import iter_preference_examples, report_preference_overlong
from lit_ablate.data.sources import DataSource, Row
from lit_ablate.data.tokenizers import Tokenizer
from lit_ablate.errors import ConfigError

CACHE_DIR_ENV = "LIT_ABLATE_DATA_CACHE"
"""Environment variable naming the cache directory when the config gives none."""
DEFAULT_CACHE_DIR = "~/.cache/lit_ablate/data"
LAYOUT_VERSION = 4
"""The version of the code that decides an entry's bytes: tokenisation, formats, how rows are read and
the on-disk layout. Part of the key beside lit-ablate's release version (which a code change between
releases does not move), so an entry is never read by code that would have built other bytes. Bump it
with any change to that code: ``tests/test_data_cache_version.py`` pins a hash of its source to this
number and fails until both are updated."""
BATCH_ROWS = 1000
"""Rows tokenised per batch (per task of a worker)."""
_PAIR_FIELDS = ("chosen_tokens", "prompt_tokens")


def cache_root(cache_dir: str | None) -> Path:
    """``cache_dir``, else ``$LIT_ABLATE_DATA_CACHE``, else ``~/.cache/lit_ablate/data``."""
    return Path(os.path.expanduser(cache_dir or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR))


def cache_key(source: DataSource, tokenizer: Tokenizer, fmt: str, seq_len: int, overlong: Overlong) -> tuple[str, dict]:
    """``(entry name, key inputs)``: the name changes whenever any input that decides the examples does."""
    inputs = {
        "source": source.fingerprint(),
        "tokenizer": tokenizer.identity(),
        "format": fmt,
        "seq_len": seq_len,
        "overlong": overlong,
        "lit_ablate": lit_ablate.__version__,
        "layout": LAYOUT_VERSION,
    }
    try:
        text = json.dumps(inputs, sort_keys=True)
    except TypeError as err:
        raise ConfigError(
            "data.init_args.source",
            type(source).__name__,
            f"its arguments cannot key the token cache ({err}); give the source a fingerprint() "
            "of plain values, or use storage: memory",
        ) from err
    return f"{fmt}-{hashlib.sha256(text.encode()).hexdigest()[:24]}", inputs


class TokenStore:
    """A cache entry opened read-only. An example is read from the files when asked for (two small
    ``pread`` calls), so a rank holds nothing per example but its length: not memory-mapped, since
    mapped file pages count in the rank's resident set, and the kernel maps far more than the
    pages of one example around each read (measured: 168 random examples of a 64 MB file mapped
    44 MB). The pages stay in the shared page cache, read by every rank and run alike."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.meta = json.loads((directory / "meta.json").read_text())
        self.preference = self.meta["format"] == "preference"
        self.lengths = np.fromfile(directory / "lengths.bin", dtype=np.int32)
        self.pair = (
            {name: np.fromfile(directory / f"{name}.bin", dtype=np.int32) for name in _PAIR_FIELDS}
            if self.preference
            else {}
        )
        self._files: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.lengths)

    def _read(self, name: str, dtype: type, start: int, count: int) -> np.ndarray:
        if name not in self._files:
            self._files[name] = os.open(self.directory / f"{name}.bin", os.O_RDONLY)
        size = np.dtype(dtype).itemsize
        return np.frombuffer(os.pread(self._files[name], count * size, start * size), dtype=dtype)

    def example(self, index: int) -> Example:
        """The example as the in-memory path builds it (int64 tensors; pairs with their 0-d fields)."""
        start, end = (int(x) for x in self._read("offsets", np.int64, index, 2))
        example = {
            name: torch.from_numpy(self._read(name, np.int32, start, end - start).astype(np.int64))
            for name in ("input_ids", "labels")
        }
        if self.preference:
            example |= {name: torch.tensor(int(values[index])) for name, values in self.pair.items()}
            example["pair_index"] = torch.tensor(index)
        return example

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}}  # a process that unpickles it opens its own files

    def __del__(self) -> None:
        for fd in getattr(self, "_files", {}).values():
            os.close(fd)


class CachedExampleDataset(Dataset):
    """The examples of a ``TokenStore`` minus a held-out set (training), or only the held-out set
    (validation). Items are as ``ExampleDataset``'s: an index, or a tuple of indices (a packed row).
    Memory: the lengths as one int32 array and the held-out indices; nothing per example besides."""

    def __init__(self, store: TokenStore, held_out: np.ndarray, keep_held_out: bool) -> None:
        self.store = store
        held_out = np.sort(np.asarray(held_out, dtype=np.int64))
        if keep_held_out:
            self._map, self.lengths = held_out, np.asarray(store.lengths[held_out])
        else:  # item i is store index i + (held-out indices at or before it): one search in a small array
            self._map = None
            self.lengths = np.delete(store.lengths, held_out) if len(held_out) else store.lengths
            self._shift = held_out - np.arange(len(held_out))

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def examples(self) -> _LazyExamples:
        """The examples as a read-on-demand sequence (what ``ExampleDataset.examples`` is as a list)."""
        return _LazyExamples(self)

    def _index(self, item: int) -> int:
        if item < 0 or item >= len(self):
            raise IndexError(item)
        if self._map is not None:
            return int(self._map[item])
        return item + int(np.searchsorted(self._shift, item, side="right"))

    def __getitem__(self, item: int | tuple[int, ...]) -> Example | list[Example]:
        if isinstance(item, tuple):
            return [self.store.example(self._index(i)) for i in item]
        return self.store.example(self._index(item))


class _LazyExamples(Sequence):
    def __init__(self, dataset: CachedExampleDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: int) -> Example:  # type: ignore[override]  (no slices)
        return self.dataset[item]


def open_or_build(
    cache_dir: str | None,
    source: DataSource,
    tokenizer: Tokenizer,
    fmt: str,
    seq_len: int,
    overlong: Overlong,
    workers: int = 0,
) -> tuple[TokenStore, bool]:
    """``(store, hit)``: the entry for these settings, built first if it does not exist (``hit`` False
    only in the process that built it). Overlong handling is logged as the in-memory path logs it."""
    root = cache_root(cache_dir)
    name, inputs = cache_key(source, tokenizer, fmt, seq_len, overlong)
    entry = root / name
    hit = entry.is_dir()
    if not hit:
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root / f"{name}.lock"):
            hit = entry.is_dir()  # another process built it while this one waited
            if not hit:
                _build(entry, inputs, source, tokenizer, fmt, seq_len, overlong, workers)
    store = TokenStore(entry)
    counts = Counter(store.meta["counts"])
    if fmt == "preference":
        report_preference_overlong(counts, seq_len, overlong, kept=len(store))
    elif fmt != "pretrain":
        report_overlong(fmt, counts, seq_len, overlong, kept=len(store))
    return store, hit


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _build(
    entry: Path,
    inputs: dict,
    source: DataSource,
    tokenizer: Tokenizer,
    fmt: str,
    seq_len: int,
    overlong: Overlong,
    workers: int,
) -> None:
    """Tokenise ``source`` into a temporary directory next to ``entry``, then rename it into place."""
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    progress = BuildProgress(entry.name, source.num_rows)
    tmp.mkdir()
    try:
        writer = _Writer(tmp, fmt, seq_len)
        args = (tokenizer, fmt, seq_len, overlong)
        batches = _batches(source, BATCH_ROWS)
        if workers > 0:
            context = multiprocessing.get_context("forkserver")
            with context.Pool(workers, initializer=_init_worker, initargs=args) as pool:
                for chunk in pool.imap(_tokenise_in_worker, batches):
                    progress.update(writer.add(chunk), writer.tokens)
        else:
            for rows, first_row in batches:
                progress.update(writer.add(_tokenise(rows, first_row, *args)), writer.tokens)
        writer.close()
        counts = writer.counts
        if fmt == "pretrain":
            check_stream_length(writer.stream_tokens, seq_len)
        elif fmt == "preference":
            report_preference_overlong(Counter(), seq_len, overlong, kept=writer.examples)
        else:
            report_overlong(fmt, Counter(), seq_len, overlong, kept=writer.examples)
        meta = {
            "format": fmt,
            "examples": writer.examples,
            "tokens": writer.tokens,
            "counts": dict(counts),
            "key": inputs,
            "built_s": progress.elapsed(),
            "workers": workers,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        os.rename(tmp, entry)
    finally:
        progress.close()
        if tmp.exists():
            shutil.rmtree(tmp)


def _batches(source: DataSource, batch_rows: int) -> Iterator[tuple[list[Row], int]]:
    """``(rows, number of the first row)`` in the source's order, ``batch_rows`` at a time. Read as a
    stream: ``LocalFiles`` would otherwise first convert the whole corpus into ``datasets``' own
    Arrow cache (a second full copy on disk) before the first row is tokenised."""
    rows, first = source.stream_rows(), 1
    while batch := list(islice(rows, batch_rows)):
        yield batch, first
        first += len(batch)


_worker_args: tuple = ()


def _init_worker(*args: Any) -> None:
    global _worker_args
    _worker_args = args


def _tokenise_in_worker(job: tuple[list[Row], int]) -> dict[str, Any]:
    return _tokenise(*job, *_worker_args)


def _tokenise(
    rows: list[Row], first_row: int, tokenizer: Tokenizer, fmt: str, seq_len: int, overlong: Overlong
) -> dict[str, Any]:
    """One batch of rows as numpy arrays: the token stream (``pretrain``) or the examples, with counts."""
    counts: Counter[str] = Counter()
    if fmt == "pretrain":
        return {
            "stream": np.asarray(pretrain_stream(rows, tokenizer), dtype=np.int32),
            "rows": len(rows),
            "counts": counts,
        }
    if fmt == "preference":
        examples = list(iter_preference_examples(rows, tokenizer, seq_len, overlong, counts, first_row))
    else:
        examples = list(iter_examples(rows, tokenizer, fmt, seq_len, overlong, counts, first_row))
    chunk: dict[str, Any] = {
        "rows": len(rows),
        "counts": counts,
        "lengths": np.array([len(e["input_ids"]) for e in examples], dtype=np.int32),
    }
    for name in ("input_ids", "labels"):
        chunk[name] = (
            np.concatenate([e[name].numpy() for e in examples]).astype(np.int32) if examples else np.zeros(0, np.int32)
        )
    if fmt == "preference":
        chunk |= {name: np.array([int(e[name]) for e in examples], dtype=np.int32) for name in _PAIR_FIELDS}
    return chunk


class _Writer:
    """Appends batches to the entry's files in order; ``pretrain`` cuts the stream into windows here,
    carrying the tokens after the last full window over to the next batch."""

    def __init__(self, directory: Path, fmt: str, seq_len: int) -> None:
        names = ["input_ids", "labels", "lengths", *(_PAIR_FIELDS if fmt == "preference" else ())]
        self.directory, self.fmt, self.seq_len = directory, fmt, seq_len
        self.files = {name: open(directory / f"{name}.bin", "wb") for name in names}  # noqa: SIM115 (closed in close())
        self.examples = self.tokens = self.stream_tokens = 0
        self.counts: Counter[str] = Counter()
        self._carry = np.zeros(0, np.int32)

    def add(self, chunk: dict[str, Any]) -> int:
        """Write one batch; returns its number of rows."""
        rows = chunk["rows"]
        self.counts.update(chunk["counts"])
        if self.fmt == "pretrain":
            self.stream_tokens += len(chunk["stream"])
            stream = np.concatenate([self._carry, chunk["stream"]])
            windows = max(0, (len(stream) - 1) // self.seq_len)
            cut = windows * self.seq_len
            chunk = {
                "input_ids": stream[:cut],
                "labels": stream[1 : cut + 1],
                "lengths": np.full(windows, self.seq_len, np.int32),
            }
            self._carry = stream[cut:]
        for name, f in self.files.items():
            f.write(np.ascontiguousarray(chunk[name], dtype=np.int32).tobytes())
        self.examples += len(chunk["lengths"])
        self.tokens += len(chunk["input_ids"])
        return rows

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        lengths = (
            np.memmap(self.directory / "lengths.bin", dtype=np.int32, mode="r", shape=(self.examples,))
            if self.examples
            else np.zeros(0, np.int32)
        )
        offsets = np.memmap(self.directory / "offsets.bin", dtype=np.int64, mode="w+", shape=(self.examples + 1,))
        offsets[0] = 0
        np.cumsum(lengths, out=offsets[1:])
        offsets.flush()
        del offsets

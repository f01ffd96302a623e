"""Data sources: where raw examples come from, before tokenisation.

A source is an iterable of dicts, named by ``class_path`` under ``data.init_args.source``:
``{"text": ...}`` rows for pretraining, ``{"prompt": ..., "response": ...}`` or
``{"messages": [{"role", "content"}, ...]}`` rows for SFT. Files are read with ``datasets``; the
synthetic sources generate deterministic corpora offline, so tests and CPU studies need no network.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from lit_ablate.data.stream_parts import (
    Position,
    Row,
    UnreadableRow,
    counted_rows,
    datasets_rows,
    line_rows,
    parquet_rows,
)
from lit_ablate.errors import ConfigError

_SOURCE_KEY = "data.init_args.source.init_args"
_JSON_BUILDER_LOGGER = "datasets.packaged_modules.json.json"
_STREAM_BATCH = 1000  # rows per Arrow batch read from a stream
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


class DataSource(ABC):
    """An iterable of raw example rows; iterating twice yields the same rows in the same order."""

    @abstractmethod
    def __iter__(self) -> Iterator[Row]: ...

    def stream_rows(self) -> Iterator[Row]:
        """The same rows, read without materialising the data set (``storage: stream``): file and
        hub sources read through ``datasets`` streaming; generated sources are streams already."""
        return iter(self)

    def stream_shards(self) -> int:
        """How many parts a stream can read apart from each other (files, shards): each slot of a
        stream then reads only its own parts (``streaming.py``). 1: one stream, read by every slot."""
        return 1

    def stream_shard(self, index: int) -> Iterator[Row]:
        """The rows of part ``index`` of ``stream_shards()``, in the source's order (the parts, one
        after another, are ``stream_rows()``)."""
        return self.stream_rows()

    def stream_part(self, index: int, after: Position = None) -> Iterator[tuple[Row, Position]]:
        """Part ``index``'s rows, each with the position after it; ``after``: continue from such a
        position (a resumed stream, ``stream_parts.py``). This default counts rows, so resuming reads
        the part's earlier rows again (not tokenised): sources that can seek override it."""
        return counted_rows(self.stream_shard(index), after)

    def stored_bytes(self) -> int | None:
        """The size of the stored data it reads (files, a hub download), for ``storage: auto``
        (``storage_choice.py``): 0 for rows generated in code (this default), None when a stored
        source cannot tell."""
        return 0

    def num_rows(self) -> int | None:
        """How many rows it yields, when cheap to know (the build's progress bar shows the time left
        from it); None: unknown."""
        return None

    def fingerprint(self) -> dict[str, Any]:
        """What decides its rows, for the token cache's key: the class and its arguments (another
        source in an argument by its own fingerprint). A source whose rows depend on anything else
        (files, a server) must add it, as ``LocalFiles`` adds each file's size and modification time."""
        return {
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "args": {k: v.fingerprint() if isinstance(v, DataSource) else v for k, v in sorted(vars(self).items())},
        }


class SyntheticText(DataSource):
    """A deterministic pretraining corpus with learnable structure, generated offline.

    Documents are sentences from a tiny grammar (``the red cat sees the small dog.``) and
    counting runs (``three four five six``); a model learns both quickly, so loss curves are
    meaningful. Document length in sentences is log-normal: ``median_sentences`` sets the median
    and ``length_sigma`` the skew (0 = every document the same length; 1 gives a long tail, the
    shape that makes packing pay off).

    Args:
        num_documents: how many documents.
        seed: the corpus is a pure function of the arguments.
        median_sentences: median document length in sentences.
        length_sigma: log-normal sigma of the length distribution.
        max_sentences: cap on one document's length.
    """

    _ADJECTIVES = ("red", "small", "old", "quick", "green", "tall", "quiet", "bright")
    _NOUNS = ("cat", "dog", "bird", "tree", "river", "house", "child", "stone")
    _VERBS = ("sees", "likes", "finds", "follows", "hears", "holds")
    _NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")

    def __init__(
        self,
        num_documents: int = 1000,
        seed: int = 0,
        median_sentences: float = 4.0,
        length_sigma: float = 0.8,
        max_sentences: int = 200,
    ) -> None:
        if num_documents <= 0:
            raise ConfigError(f"{_SOURCE_KEY}.num_documents", num_documents, "use a positive number of documents")
        if median_sentences <= 0 or length_sigma < 0 or max_sentences <= 0:
            raise ConfigError(
                f"{_SOURCE_KEY}.median_sentences",
                (median_sentences, length_sigma, max_sentences),
                "median_sentences and max_sentences must be > 0, length_sigma >= 0",
            )
        self.num_documents, self.seed = num_documents, seed
        self.median_sentences, self.length_sigma, self.max_sentences = median_sentences, length_sigma, max_sentences

    def num_rows(self) -> int:
        return self.num_documents

    def __iter__(self) -> Iterator[Row]:
        rng = random.Random(self.seed)
        for _ in range(self.num_documents):
            length = rng.lognormvariate(math.log(self.median_sentences), self.length_sigma)
            sentences = [self._sentence(rng) for _ in range(min(self.max_sentences, max(1, round(length))))]
            yield {"text": " ".join(sentences)}

    def _sentence(self, rng: random.Random) -> str:
        if rng.random() < 0.3:
            start = rng.randrange(len(self._NUMBERS) - 3)
            return " ".join(self._NUMBERS[start : start + rng.randint(3, len(self._NUMBERS) - start)]) + "."
        a, b = rng.choice(self._ADJECTIVES), rng.choice(self._ADJECTIVES)
        n, m, v = rng.choice(self._NOUNS), rng.choice(self._NOUNS), rng.choice(self._VERBS)
        return f"the {a} {n} {v} the {b} {m}."


class ArithmeticSFT(DataSource):
    """Prompt/response pairs whose answers are checkable: ``{"prompt": "12+7=", "response": "19"}``.

    Choose it for SFT tests and studies: the response is a function of the prompt, so a trained
    model's accuracy is measurable (``ExactMatchEvaluator``), and loss masking mistakes show up as
    a loss that cannot fall. The problems are distinct, so a held-out split (``val_examples``)
    asks only problems the model never trained on: its accuracy measures arithmetic learned, not
    answers memorised.

    Args:
        num_examples: how many distinct problems; at most ``(max_operand + 1)**2 * len(operators)``.
        max_operand: operands are drawn from ``[0, max_operand]``.
        operators: which of ``+``, ``-``, ``*`` to draw from.
        seed: the pairs are a pure function of the arguments.
        pad_operands: write each operand with as many digits as ``max_operand`` (``12+07=``), so a
            digit's place value is fixed by its position: a tiny model then learns multi-digit
            addition in a fraction of the steps it needs to find the places of ``12+7=``.
    """

    _APPLY: ClassVar[dict[str, Callable[[int, int], int]]] = {
        "+": lambda a, b: a + b,
        "-": lambda a, b: a - b,
        "*": lambda a, b: a * b,
    }

    def __init__(
        self,
        num_examples: int = 1000,
        max_operand: int = 99,
        operators: str = "+-",
        seed: int = 0,
        pad_operands: bool = False,
    ) -> None:
        if num_examples <= 0:
            raise ConfigError(f"{_SOURCE_KEY}.num_examples", num_examples, "use a positive number of examples")
        if max_operand < 0:
            raise ConfigError(f"{_SOURCE_KEY}.max_operand", max_operand, "use a non-negative bound")
        if not operators or set(operators) - set(self._APPLY):
            raise ConfigError(f"{_SOURCE_KEY}.operators", operators, "use a non-empty string of '+', '-', '*'")
        operators = "".join(dict.fromkeys(operators))
        problems = (max_operand + 1) ** 2 * len(operators)
        if num_examples > problems:
            raise ConfigError(
                f"{_SOURCE_KEY}.num_examples",
                num_examples,
                f"max_operand={max_operand} with operators {operators!r} gives only {problems} distinct "
                "problems; ask for fewer or raise max_operand",
            )
        self.num_examples, self.max_operand, self.operators, self.seed = num_examples, max_operand, operators, seed
        self.width = len(str(max_operand)) if pad_operands else 0

    def num_rows(self) -> int:
        return self.num_examples

    def __iter__(self) -> Iterator[Row]:
        rng = random.Random(self.seed)
        side = self.max_operand + 1
        for problem in rng.sample(range(side * side * len(self.operators)), self.num_examples):
            operator, pair = divmod(problem, side * side)
            a, b = divmod(pair, side)
            op = self.operators[operator]
            yield {"prompt": f"{a:0{self.width}d}{op}{b:0{self.width}d}=", "response": str(self._APPLY[op](a, b))}


class LocalFiles(DataSource):
    """Rows from local ``.jsonl``/``.json``, ``.parquet`` or ``.txt`` files, read with ``datasets``.

    ``.txt`` files give one row per line. Choose it for your own corpora; it works offline.

    Args:
        path: a file, a directory (all files of one supported type in it) or a glob pattern.
        text_field: the column holding pretraining text; it is yielded as ``text``.
        max_rows: read at most this many rows (None = all).
    """

    def __init__(self, path: str, text_field: str = "text", max_rows: int | None = None) -> None:
        pattern = os.path.join(path, "*") if os.path.isdir(path) else path
        self.files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
        if not self.files:
            raise ConfigError(f"{_SOURCE_KEY}.path", path, "no such file: give an existing file, directory or glob")
        kinds = {os.path.splitext(f)[1].lower() for f in self.files}
        if len(kinds) != 1 or not kinds <= set(_FILE_BUILDERS):
            raise ConfigError(
                f"{_SOURCE_KEY}.path",
                path,
                f"files must all have one extension among {sorted(_FILE_BUILDERS)}, got {sorted(kinds)}",
            )
        empty = [f for f in self.files if os.path.getsize(f) == 0]
        if empty:
            raise ConfigError(f"{_SOURCE_KEY}.path", path, f"the dataset has no rows: {empty[0]} is empty")
        self.builder = _FILE_BUILDERS[kinds.pop()]
        self.path, self.text_field, self.max_rows = path, text_field, max_rows

    def fingerprint(self) -> dict[str, Any]:
        """Its arguments and every file's path, size and modification time: a changed file changes it."""
        stats = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in self.files]
        return {**super().fingerprint(), "files": stats}

    def stored_bytes(self) -> int:
        """The files' total size (all of it, even with ``max_rows``)."""
        return sum(os.path.getsize(f) for f in self.files)

    def num_rows(self) -> int | None:
        """Lines of ``.jsonl``/``.txt`` files (counted: about a second per GB), rows of ``.parquet``
        files (their metadata); None for ``.json``. At most ``max_rows``."""
        if self.builder == "parquet":
            import pyarrow.parquet

            rows = sum(pyarrow.parquet.ParquetFile(f).metadata.num_rows for f in self.files)
        elif self.files[0].lower().endswith(".json"):
            return None
        else:
            rows = sum(_count_lines(f) for f in self.files)
        return rows if self.max_rows is None else min(rows, self.max_rows)

    def __iter__(self) -> Iterator[Row]:
        from datasets import load_dataset
        from datasets.exceptions import DatasetGenerationError

        try:
            with _quiet_local_load():
                dataset = load_dataset(self.builder, data_files=self.files, split="train")
        except (DatasetGenerationError, ValueError) as err:  # ValueError: pandas' or pyarrow's (ArrowInvalid)
            # parse error of a line datasets re-reads with a nested field (a truncated ``{"response": {``)
            raise ConfigError(f"{_SOURCE_KEY}.path", self.path, _unreadable(self.files, err)) from err
        yield from _rows(dataset, self.text_field, self.max_rows, f"{_SOURCE_KEY}.path", self.path)

    def stream_rows(self) -> Iterator[Row]:
        return self._stream(self.files)

    def stream_shards(self) -> int:
        """One part per file (one part with ``max_rows``, which counts rows over all files)."""
        return len(self.files) if self.max_rows is None else 1

    def stream_shard(self, index: int) -> Iterator[Row]:
        return self._stream(self.files[index : index + 1]) if self.stream_shards() > 1 else self.stream_rows()

    def stream_part(self, index: int, after: Position = None) -> Iterator[tuple[Row, Position]]:
        """JSONL and text files resume at a byte offset, Parquet at a row group; ``.json`` (one
        document) by counting rows."""
        files = self.files[index : index + 1] if self.stream_shards() > 1 else self.files
        kind = os.path.splitext(files[0])[1].lower()
        if kind == ".json":
            yield from super().stream_part(index, after)
            return
        rows = (
            parquet_rows(files, after, self.max_rows)
            if kind == ".parquet"
            else line_rows(files, kind == ".jsonl", after, self.max_rows)
        )
        try:
            for row, position in rows:
                yield _with_text(row, self.text_field), position
        except UnreadableRow as err:
            raise ConfigError(f"{_SOURCE_KEY}.path", self.path, str(err)) from None

    def _stream(self, files: list[str]) -> Iterator[Row]:
        from datasets import load_dataset

        with _quiet_local_load():
            dataset = load_dataset(self.builder, data_files=files, split="train", streaming=True)
            try:
                yield from _streamed_rows(dataset, self.text_field, self.max_rows)
            except ValueError as err:  # pyarrow's parse errors (ArrowInvalid), met only when the bad line is read
                raise ConfigError(f"{_SOURCE_KEY}.path", self.path, _unreadable(files, err)) from err


def _count_lines(file: str) -> int:
    """Lines of a text file, the last one counted without its newline too."""
    lines, last = 0, b"\n"
    with open(file, "rb") as f:
        while block := f.read(1 << 24):
            lines, last = lines + block.count(b"\n"), block[-1:]
    return lines + (last != b"\n")


@contextmanager
def _quiet_local_load() -> Iterator[None]:
    """``datasets`` reading local files, without its "Generating train split" bars (the in-memory
    sizes this data module tokenises read in well under a second) and without the JSON builder's
    own log of a parse error it raises right after (``_unreadable`` reports that once, by line)."""
    import datasets

    bars_were_off = datasets.are_progress_bars_disabled()
    json_log = logging.getLogger(_JSON_BUILDER_LOGGER)
    level = json_log.level
    datasets.disable_progress_bars()
    json_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        json_log.setLevel(level)
        if not bars_were_off:
            datasets.enable_progress_bars()


def _unreadable(files: list[str], error: Exception) -> str:
    """Why ``datasets`` could not read ``files``: for JSON, the first bad line by file and line number
    (``datasets`` only says "an error occurred"), found by re-reading the files on this error path."""
    for file in files:
        if bad := _first_bad_json_line(file):
            return f"{bad}; fix or remove that line"
    cause = error.__cause__ or error
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return f"datasets could not read it ({type(cause).__name__}: {first}); check the files"


def _first_bad_json_line(file: str) -> str | None:
    """``line N of FILE is not ...`` for the first line of a ``.jsonl`` that is not a JSON object (or
    the position of the error in a ``.json``); None for other files or when every line parses."""
    kind = os.path.splitext(file)[1].lower()
    if kind not in (".json", ".jsonl"):
        return None
    with open(file, "rb") as f:
        if kind == ".json":
            try:
                json.loads(f.read())
            except ValueError as bad:  # json.JSONDecodeError, or UnicodeDecodeError
                return f"line {getattr(bad, 'lineno', 1)} of {file} is not valid JSON ({getattr(bad, 'msg', bad)})"
            return None
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as bad:
                cut = " at its end: the line is cut short" if getattr(bad, "pos", -1) >= len(line.rstrip()) else ""
                return f"line {number} of {file} is not valid JSON ({getattr(bad, 'msg', bad)}{cut})"
            if not isinstance(value, dict):
                return f"line {number} of {file} is a JSON {type(value).__name__}, not an object"
    return None


class HubDataset(DataSource):
    """Rows of a Hugging Face Hub dataset via ``datasets.load_dataset`` (needs the network once,
    then the local cache).

    Args:
        name: the dataset name, e.g. ``roneneldan/TinyStories``.
        split: which split.
        subset: the dataset configuration name, if it has several.
        text_field: the column holding pretraining text; it is yielded as ``text``.
        max_rows: read at most this many rows (None = all).
        revision: the dataset repository's branch, tag or commit (None: its main branch, which can
            change under a run). Part of the token cache's key: pin a commit to make a cached entry
            mean one version of the data.
    """

    def __init__(
        self,
        name: str,
        split: str = "train",
        subset: str | None = None,
        text_field: str = "text",
        max_rows: int | None = None,
        revision: str | None = None,
    ) -> None:
        self.name, self.split, self.subset, self.text_field, self.max_rows = name, split, subset, text_field, max_rows
        self.revision = revision

    def stored_bytes(self) -> int | None:
        """The split's size as the dataset's info gives it (its Arrow bytes, else the whole data set's),
        None when the info has neither."""
        from datasets import load_dataset_builder

        info = load_dataset_builder(self.name, self.subset, revision=self.revision).info
        split = (info.splits or {}).get(self.split)
        return (split.num_bytes if split is not None else None) or info.dataset_size or None

    def __iter__(self) -> Iterator[Row]:
        from datasets import load_dataset

        dataset = load_dataset(self.name, self.subset, split=self.split, revision=self.revision)
        yield from _rows(dataset, self.text_field, self.max_rows, f"{_SOURCE_KEY}.name", self.name)

    def stream_rows(self) -> Iterator[Row]:
        yield from _streamed_rows(self._streamed(), self.text_field, self.max_rows)

    def stream_shards(self) -> int:
        """The streamed dataset's shards (its files; ``datasets``' ``num_shards``), 1 with ``max_rows``."""
        return self._streamed().num_shards if self.max_rows is None else 1

    def stream_shard(self, index: int) -> Iterator[Row]:
        dataset = self._streamed()
        if self.max_rows is not None or dataset.num_shards == 1:
            yield from self.stream_rows()
            return
        yield from _streamed_rows(dataset.shard(num_shards=dataset.num_shards, index=index), self.text_field, None)

    def stream_part(self, index: int, after: Position = None) -> Iterator[tuple[Row, Position]]:
        """Resumes from ``datasets``' ``state_dict()`` of the streamed shard (``stream_parts.py``)."""
        dataset = self._streamed()
        if self.max_rows is None and dataset.num_shards > 1:
            dataset = dataset.shard(num_shards=dataset.num_shards, index=index)
        for row, position in datasets_rows(dataset, after, _STREAM_BATCH, self.max_rows):
            yield _with_text(row, self.text_field), position

    def _streamed(self) -> Any:
        from datasets import load_dataset

        return load_dataset(self.name, self.subset, split=self.split, streaming=True, revision=self.revision)


def _streamed_rows(dataset: Any, text_field: str, max_rows: int | None) -> Iterator[Row]:
    """A streamed dataset's rows with ``text_field`` renamed to ``text`` (no length or columns to check up front).

    Read through ``iter(batch_size=...)``: iterating the dataset itself inside a DataLoader worker
    would shard it over the workers by file (``datasets`` does that by itself), and the stream
    shards by row (``streaming.py``)."""
    rows = (
        dict(zip(batch, values)) for batch in dataset.iter(batch_size=_STREAM_BATCH) for values in zip(*batch.values())
    )
    yield from _renamed(rows, text_field, max_rows)


def _with_text(row: Row, text_field: str) -> Row:
    """The row with ``text_field`` renamed to ``text`` (``_renamed``, one row at a time)."""
    if text_field != "text" and text_field in row:
        row["text"] = row.pop(text_field)
    return row


def _rows(dataset: Any, text_field: str, max_rows: int | None, key: str, value: str) -> Iterator[Row]:
    """The dataset's rows with ``text_field`` renamed to ``text``; empty datasets are a config error."""
    if len(dataset) == 0:
        raise ConfigError(key, value, "the dataset has no rows; point it at non-empty data")
    if text_field not in dataset.column_names and not {"prompt", "messages"} & set(dataset.column_names):
        raise ConfigError(
            f"{_SOURCE_KEY}.text_field", text_field, f"not a column; the columns are {dataset.column_names}"
        )
    yield from _renamed(dataset, text_field, max_rows)


def _renamed(rows: Iterable[Row], text_field: str, max_rows: int | None) -> Iterator[Row]:
    """The first ``max_rows`` rows (all when None), ``text_field`` renamed to ``text``."""
    for i, row in enumerate(rows):
        if max_rows is not None and i >= max_rows:
            return
        if text_field != "text" and text_field in row:
            row["text"] = row.pop(text_field)
        yield row

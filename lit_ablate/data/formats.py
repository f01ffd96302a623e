"""Formats: how raw rows become training examples (token ids + labels already shifted).

An example is ``{"input_ids": LongTensor[L], "labels": LongTensor[L]}`` with ``labels[t]`` the
target of position ``t`` (the next token) or ``-100`` for no loss. The last position of every
example has no target, so no label ever predicts across an example boundary: packing examples
side by side can never leak a document into another's loss.

- ``pretrain``: documents joined with ``eos`` separators and cut into ``seq_len``-token windows,
  every position labelled (nanoGPT-style: the window's targets are the next ``seq_len`` tokens
  of the stream; a final partial window is dropped). All examples are ``seq_len`` long.
- ``documents``: one example per document (``bos`` + text + ``eos``), of varying length: the
  pretraining format to pair with packing.
- ``sft``: ``prompt``/``response`` rows or chat ``messages``; only response (assistant) tokens
  and the closing ``eos`` are labelled.

Examples longer than ``seq_len`` follow ``overlong``: ``truncate`` keeps the first ``seq_len``
tokens (an SFT response may lose its end and its ``eos``; an example left with no labelled token
is dropped), ``reject`` drops the example. Either way the count is logged once. ``truncate`` is
the default because it keeps every document's start; pick ``reject`` for SFT when a clipped
answer would teach the model to stop mid-sentence.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor

from lit_ablate.data.sources import Row
from lit_ablate.data.tokenizers import Tokenizer
from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX

log = logging.getLogger(__name__)

SOURCE_ROWS_KEY = "data.init_args.source"
TOKENS_FIELD = "input_ids"
"""A row's pre-tokenised ids (``MDSShards`` with ``tokens_field``): ``pretrain`` and ``documents`` use
them as stored instead of tokenising ``text``."""
"""Where bad rows come from, as the config names it (row numbers count from 1 in the source's order)."""
Format = Literal["pretrain", "documents", "sft"]
BOS_FIRST_FORMATS: tuple[str, ...] = ("documents", "sft", "preference")
"""Formats whose examples start with the tokenizer's BOS token (``pretrain`` windows start anywhere
in the token stream): ``generate`` starts a prompt the same way."""
Overlong = Literal["truncate", "reject"]
Example = dict[str, Tensor]
OVERLONG_CHOICES = ("truncate", "reject")


def example_from_tokens(ids: Sequence[int], is_target: Sequence[bool]) -> Example:
    """Input ids and shifted labels: ``labels[t] = ids[t+1]`` where ``is_target[t+1]``, else -100."""
    labels = [nxt if target else IGNORE_INDEX for nxt, target in zip(ids[1:], is_target[1:])] + [IGNORE_INDEX]
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}


def fit_length(example: Example, max_tokens: int, overlong: Overlong) -> Example | None:
    """The example if it fits in ``max_tokens``; else truncated (None if no label survives) or None."""
    if len(example["input_ids"]) <= max_tokens:
        return example
    if overlong == "reject":
        return None
    labels = example["labels"][:max_tokens].clone()
    labels[-1] = IGNORE_INDEX  # the last kept position's target was cut off
    if not (labels != IGNORE_INDEX).any():
        return None
    return {"input_ids": example["input_ids"][:max_tokens], "labels": labels}


def build_examples(
    rows: Iterable[Row], tokenizer: Tokenizer, fmt: Format, seq_len: int, overlong: Overlong
) -> list[Example]:
    """All examples of ``rows`` in ``fmt``; logs how many were too long and what happened to them."""
    if fmt == "pretrain":
        return _pretrain_windows(rows, tokenizer, seq_len)
    counts: Counter[str] = Counter()
    examples = list(iter_examples(rows, tokenizer, fmt, seq_len, overlong, counts))
    report_overlong(fmt, counts, seq_len, overlong, kept=len(examples))
    return examples


def iter_examples(
    rows: Iterable[Row],
    tokenizer: Tokenizer,
    fmt: Format,
    seq_len: int,
    overlong: Overlong,
    counts: Counter[str],
    first_row: int = 1,
) -> Iterator[Example]:
    """The ``documents`` or ``sft`` examples of ``rows`` one at a time, adding to ``counts`` the rows
    (``total``), the ``overlong`` examples and those ``dropped``. ``first_row`` numbers the rows in
    error messages when ``rows`` is a batch of a larger source (the token cache builds in batches)."""
    token_rows = _document_tokens(rows, tokenizer) if fmt == "documents" else _sft_tokens(rows, tokenizer, first_row)
    for ids, is_target in token_rows:
        counts["total"] += 1
        example = example_from_tokens(ids, is_target)
        fitted = fit_length(example, seq_len, overlong)
        counts["overlong"] += fitted is not example
        counts["dropped"] += fitted is None
        if fitted is not None:
            yield fitted


def report_overlong(fmt: Format, counts: Counter[str], seq_len: int, overlong: Overlong, kept: int) -> None:
    """Log once what ``overlong`` did (``iter_examples``' counts); no example kept is a config error."""
    if counts["overlong"]:
        log.warning(
            "data (format=%s): %d of %d examples were longer than seq_len=%d; overlong=%s %s",
            fmt,
            counts["overlong"],
            counts["total"],
            seq_len,
            overlong,
            _overlong_outcome(overlong, counts["overlong"], counts["dropped"], seq_len),
        )
    if not kept:
        raise ConfigError(
            "data.init_args.overlong", overlong, f"no {fmt} example fits seq_len={seq_len}; raise seq_len"
        )


def _overlong_outcome(overlong: Overlong, overlong_count: int, dropped: int, seq_len: int) -> str:
    """What happened to the overlong examples, in words: truncation drops those left with no label."""
    if overlong == "reject":
        return "dropped them"
    kept = f"kept the first {seq_len} tokens of {overlong_count - dropped}"
    return f"{kept} and dropped {dropped} with no labelled token left" if dropped else kept


def pretrain_stream(rows: Iterable[Row], tokenizer: Tokenizer) -> list[int]:
    """The ``pretrain`` token stream: every document's tokens followed by ``eos``."""
    stream: list[int] = []
    for row in rows:
        stream += document_ids(row, tokenizer)
    return stream


def document_ids(row: Row, tokenizer: Tokenizer) -> list[int]:
    """A pretraining row's tokens: its ``text`` encoded and followed by ``eos``, or its pre-tokenised
    ``input_ids`` as stored (packs written by a tokenising pipeline already hold their separators)."""
    if TOKENS_FIELD in row:
        return list(row[TOKENS_FIELD])
    return [*tokenizer.encode(_text(row)), tokenizer.eos_id]


def check_stream_length(tokens: int, seq_len: int) -> None:
    """A stream too short for one window (it needs ``seq_len + 1`` tokens) is a config error."""
    if tokens < seq_len + 1:
        raise ConfigError(
            "data.init_args.seq_len", seq_len, f"the corpus has only {tokens} tokens; lower seq_len or add data"
        )


def _pretrain_windows(rows: Iterable[Row], tokenizer: Tokenizer, seq_len: int) -> list[Example]:
    stream = pretrain_stream(rows, tokenizer)
    check_stream_length(len(stream), seq_len)
    tokens = torch.tensor(stream, dtype=torch.long)
    starts = range(0, len(stream) - seq_len, seq_len)
    return [{"input_ids": tokens[s : s + seq_len], "labels": tokens[s + 1 : s + seq_len + 1]} for s in starts]


def _document_tokens(rows: Iterable[Row], tokenizer: Tokenizer) -> Iterable[tuple[list[int], list[bool]]]:
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    for row in rows:
        ids = (
            list(row[TOKENS_FIELD]) if TOKENS_FIELD in row else bos + tokenizer.encode(_text(row)) + [tokenizer.eos_id]
        )
        yield ids, [True] * len(ids)


def _sft_tokens(
    rows: Iterable[Row], tokenizer: Tokenizer, first_row: int = 1
) -> Iterable[tuple[list[int], list[bool]]]:
    """A file may mix chat rows and prompt/response rows: ``datasets`` gives every row every column,
    so the form of a row is the one whose fields are not None."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    for number, row in enumerate(rows, start=first_row):
        if row.get("messages") is not None:
            yield tokenizer.chat(_checked_messages(row["messages"], number))
        elif isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
            prompt = bos + tokenizer.encode(row["prompt"])
            response = [*tokenizer.encode(row["response"]), tokenizer.eos_id]
            yield prompt + response, [False] * len(prompt) + [True] * len(response)
        else:
            present = sorted(k for k, v in row.items() if v is not None)
            raise ConfigError(
                f"{SOURCE_ROWS_KEY} row {number}",
                present,
                "an sft row needs 'prompt' and 'response' strings, or 'messages'; fix or remove the row",
            )


def _checked_messages(messages: object, number: int) -> list[dict[str, str]]:
    """The row's chat messages, each with a string ``role`` and ``content`` (JSON ``null`` is not text)."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            f"{SOURCE_ROWS_KEY} row {number} messages", messages, "give a non-empty list of {role, content} messages"
        )
    for index, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ConfigError(
                f"{SOURCE_ROWS_KEY} row {number} messages[{index}]",
                message,
                "every chat message needs a string 'role' and a string 'content'; fix or remove the row",
            )
    return messages


def _text(row: Row) -> str:
    if not isinstance(row.get("text"), str):
        raise ConfigError(
            "data.init_args.format", "pretrain", f"pretraining rows need a 'text' field; got {sorted(row)}"
        )
    return row["text"]

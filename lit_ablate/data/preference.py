"""The ``preference`` format: ``{prompt, chosen, rejected}`` rows become preference pairs.

Rows come in two forms:

- text: ``prompt``, ``chosen`` and ``rejected`` strings. A sequence is ``bos`` + prompt +
  response + ``eos`` (TRL appends ``eos`` the same way), tokenised in parts so the prompt/response
  boundary is exact.
- chat: ``chosen`` and ``rejected`` are message lists (complete conversations sharing their
  prefix, as in HH-RLHF or UltraFeedback), or assistant-only lists beside a ``prompt`` message
  list (TRL's conversational form). The response is the last assistant turn as the tokenizer's
  chat rendering marks it trainable; everything before it must be the same tokens in both.

A pair is one ``Example`` holding both sequences back to back, so that every sampler and packer
keeps them together (the same row, the same micro-batch)::

    input_ids   prompt + chosen, then prompt + rejected      (LongTensor)
    labels      shifted; -100 on prompt tokens               (LongTensor)
    chosen_tokens   where the rejected sequence starts        (0-d LongTensor)
    prompt_tokens   the prompt's length                       (0-d LongTensor)
    pair_index      the pair's position in the whole data set (0-d LongTensor; for precomputed
                    reference log-probabilities)

Each sequence must fit ``seq_len``. ``overlong: truncate`` first cuts the prompt from its start
(the end, next to the responses, is kept; at least one token stays), then cuts both responses
to what is left (a cut response loses its ``eos``); ``reject`` drops the pair. Pairs whose
responses are equal after truncation are dropped (they carry no preference). One warning line
gives the counts. Bad rows (a missing field, an empty response, chosen equal to rejected, chat
forms that do not share a prefix) stop set-up with one line naming the row.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import torch

from lit_ablate.data.formats import SOURCE_ROWS_KEY, Example, Overlong, example_from_tokens
from lit_ablate.data.sources import Row
from lit_ablate.data.tokenizers import Tokenizer
from lit_ablate.errors import ConfigError

log = logging.getLogger(__name__)

PreferenceFormat = Literal["preference"]
PAIR_FIELDS = ("prompt", "chosen", "rejected")


def pair_example(prompt: Sequence[int], chosen: Sequence[int], rejected: Sequence[int], index: int) -> Example:
    """The pair as one example (see the module docstring); responses end with their ``eos`` if kept."""
    sequences = [
        example_from_tokens([*prompt, *response], [False] * len(prompt) + [True] * len(response))
        for response in (chosen, rejected)
    ]
    return {
        "input_ids": torch.cat([s["input_ids"] for s in sequences]),
        "labels": torch.cat([s["labels"] for s in sequences]),
        "chosen_tokens": torch.tensor(len(prompt) + len(chosen)),
        "prompt_tokens": torch.tensor(len(prompt)),
        "pair_index": torch.tensor(index),
    }


def split_pair(pair: Example) -> tuple[Example, Example]:
    """The chosen and the rejected sequence, each a plain example (prompt + response)."""
    cut = int(pair["chosen_tokens"])
    return (
        {"input_ids": pair["input_ids"][:cut], "labels": pair["labels"][:cut]},
        {"input_ids": pair["input_ids"][cut:], "labels": pair["labels"][cut:]},
    )


def shared_prefix_split(pair: Example) -> tuple[int, tuple[Example, Example]]:
    """``(prefix length, (chosen branch, rejected branch))`` for prefix sharing.

    The prompt's last token is where both responses' first labels sit (it predicts their first
    token), so it opens each branch: the shared prefix is the prompt minus that token, and each
    branch, after attending to the prefix, sees exactly what its unshared sequence sees.
    """
    split = max(int(pair["prompt_tokens"]) - 1, 0)
    chosen, rejected = split_pair(pair)
    branches = tuple({"input_ids": s["input_ids"][split:], "labels": s["labels"][split:]} for s in (chosen, rejected))
    return split, branches


def shared_pair_tokens(pair: Example) -> int:
    """Tokens the pair occupies with a shared prefix: prompt once, plus one repeated token."""
    return len(pair["input_ids"]) - max(int(pair["prompt_tokens"]) - 1, 0)


def build_preference_examples(
    rows: Iterable[Row], tokenizer: Tokenizer, seq_len: int, overlong: Overlong
) -> list[Example]:
    """All pairs of ``rows``; logs what overlong handling did, with counts."""
    counts: Counter[str] = Counter()
    examples = list(iter_preference_examples(rows, tokenizer, seq_len, overlong, counts))
    report_preference_overlong(counts, seq_len, overlong, kept=len(examples))
    return examples


def iter_preference_examples(
    rows: Iterable[Row],
    tokenizer: Tokenizer,
    seq_len: int,
    overlong: Overlong,
    counts: Counter[str],
    first_row: int = 1,
) -> Iterator[Example]:
    """The pairs of ``rows`` one at a time, adding what overlong handling did to ``counts``.
    ``pair_index`` counts the pairs kept from these rows; ``first_row`` numbers the rows in errors
    (the token cache builds in batches and renumbers the pairs)."""
    kept = 0
    for number, row in enumerate(rows, start=first_row):
        counts["total"] += 1
        prompt, chosen, rejected_ids = _pair_tokens(row, number, tokenizer)
        longest = max(len(chosen), len(rejected_ids))
        if len(prompt) + longest > seq_len:
            counts["overlong"] += 1
            if overlong == "reject":
                counts["rejected"] += 1
                continue
            keep = max(1, seq_len - longest)
            if keep < len(prompt):
                prompt = prompt[-keep:]
                counts["prompt_cut"] += 1
            room = seq_len - len(prompt)
            if longest > room:
                chosen, rejected_ids = chosen[:room], rejected_ids[:room]
                counts["responses_cut"] += 1
            if chosen == rejected_ids:
                counts["equal_after_cut"] += 1
                continue
        yield pair_example(prompt, chosen, rejected_ids, kept)
        kept += 1


def report_preference_overlong(counts: Counter[str], seq_len: int, overlong: Overlong, kept: int) -> None:
    """Log once what ``overlong`` did (``iter_preference_examples``' counts); no pair kept is a config error."""
    if counts["overlong"]:
        log.warning(
            "data (format=preference): %d of %d pairs had a sequence longer than seq_len=%d; overlong=%s: "
            "%d prompts cut from the start, %d pairs' responses cut at the end, %d pairs dropped as too long, "
            "%d dropped because their cut responses became equal",
            counts["overlong"],
            counts["total"],
            seq_len,
            overlong,
            counts["prompt_cut"],
            counts["responses_cut"],
            counts["rejected"],
            counts["equal_after_cut"],
        )
    if not kept:
        raise ConfigError("data.init_args.seq_len", seq_len, "no preference pair fits it; raise seq_len")


def _pair_tokens(row: Row, number: int, tokenizer: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    """``(prompt, chosen, rejected)`` token ids of one row, or a ConfigError naming the row."""
    where = f"{SOURCE_ROWS_KEY} row {number}"
    if isinstance(row.get("chosen"), list) or isinstance(row.get("rejected"), list):
        prompt, chosen, rejected = _chat_pair(row, where, tokenizer)
    else:
        missing = [k for k in PAIR_FIELDS if not isinstance(row.get(k), str)]
        if missing:
            present = sorted(k for k, v in row.items() if v is not None)
            raise ConfigError(
                where,
                present,
                f"a preference row needs 'prompt', 'chosen' and 'rejected' strings "
                f"(or chat message lists); {missing} missing or not text; fix or remove the row",
            )
        for key in ("chosen", "rejected"):
            if not row[key]:
                raise ConfigError(
                    f"{where} {key}", row[key], "an empty response teaches nothing; fix or remove the row"
                )
        bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        prompt = bos + tokenizer.encode(row["prompt"])
        chosen, rejected = ([*tokenizer.encode(row[k]), tokenizer.eos_id] for k in ("chosen", "rejected"))
    if chosen == rejected:
        raise ConfigError(
            f"{where} chosen",
            row.get("chosen"),
            "chosen equals rejected: the pair states no preference; fix or remove the row",
        )
    return prompt, chosen, rejected


def _chat_pair(row: Row, where: str, tokenizer: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    prefix = row.get("prompt")
    if prefix is not None and not isinstance(prefix, list):
        raise ConfigError(
            f"{where} prompt",
            prefix,
            "with chat chosen/rejected lists, give the prompt as a message "
            "list too (or leave it out and put the whole conversation in chosen and rejected)",
        )
    parts = {}
    for key in ("chosen", "rejected"):
        messages = row.get(key)
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{where} {key}", messages, "give a non-empty message list; fix or remove the row")
        conversation = [*(prefix or []), *messages]
        if not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in conversation
        ):
            raise ConfigError(f"{where} {key}", messages, "every chat message needs a string 'role' and 'content'")
        if conversation[-1]["role"] != "assistant" or not conversation[-1]["content"]:
            raise ConfigError(
                f"{where} {key}",
                conversation[-1],
                "the conversation must end with a non-empty assistant message (the response); fix or remove the row",
            )
        ids, trainable = tokenizer.chat(conversation)
        start, end = _last_trainable_run(trainable)
        parts[key] = (ids[:start], ids[start:end])
    (prompt_c, chosen), (prompt_r, rejected) = parts["chosen"], parts["rejected"]
    if prompt_c != prompt_r:
        raise ConfigError(
            where,
            _shared_messages(row),
            "chosen and rejected must be the same conversation up to the last assistant turn; fix or remove the row",
        )
    return prompt_c, chosen, rejected


def _last_trainable_run(trainable: Sequence[bool]) -> tuple[int, int]:
    """``[start, end)`` of the last run of trainable tokens: the final assistant turn."""
    end = len(trainable)
    while end and not trainable[end - 1]:
        end -= 1
    start = end
    while start and trainable[start - 1]:
        start -= 1
    return start, end


def _shared_messages(row: Row) -> Any:
    return {k: len(row[k]) for k in ("chosen", "rejected") if isinstance(row.get(k), list)}

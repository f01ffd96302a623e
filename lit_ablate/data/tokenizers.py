"""Tokenizers behind one small interface: the built-in byte tokenizer or any Hugging Face one.

The rest of the data layer only ever sees ``Tokenizer``: ids for text, the special ids, and the
chat rendering of SFT messages as token ids plus a per-token "train on this" flag. The byte
tokenizer needs no download, so tests, the quickstart and CPU studies run offline.
"""

from __future__ import annotations

import hashlib
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from lit_ablate.errors import ConfigError
from lit_ablate.path_checks import looks_local

TOKENIZER_KEY = "data.init_args.tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""Files one of which a Hugging Face tokenizer folder holds (fast, config, sentencepiece, BPE, WordPiece)."""

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

ChatMessages = Sequence[Mapping[str, str]]


class Tokenizer(ABC):
    """What the data layer needs from a tokenizer.

    Attributes:
        spec: the string it was loaded from (``"byte"`` or an HF path/name); saved in checkpoints.
        vocab_size: ids are in ``[0, vocab_size)``; the model's vocabulary must cover it.
        pad_id, eos_id, bos_id: special ids (``bos_id`` is None when the tokenizer has none).
    """

    spec: str
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""

    def identity(self) -> str:
        """What decides its ids, for the token cache's key: a tokenizer that would encode any text
        differently must give another identity (the built-in byte tokenizer is fixed by its code,
        which the cache key covers through lit-ablate's version)."""
        return self.spec

    @abstractmethod
    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Write it as a Hugging Face tokenizer folder: ``AutoTokenizer.from_pretrained`` loads it
        offline, with the same ids and special tokens (what ``lit-ablate export`` ships)."""

    def chat(self, messages: ChatMessages) -> tuple[list[int], list[bool]]:
        """``(ids, trainable)`` for a conversation: ``trainable[i]`` is True on assistant tokens.

        The built-in template: ``bos``, then per message ``<role>\\n`` + content + a newline, except
        that an assistant turn ends with ``eos`` (trained on, so the model learns to stop).
        """
        ids = [self.bos_id] if self.bos_id is not None else []
        trainable = [False] * len(ids)
        for message in messages:
            header = self.encode(f"<{message['role']}>\n")
            ids += header
            trainable += [False] * len(header)
            is_reply = message["role"] == "assistant"
            body = self.encode(message["content"]) + ([self.eos_id] if is_reply else self.encode("\n"))
            ids += body
            trainable += [is_reply] * len(body)
        return ids, trainable


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then ``pad=256``, ``bos=257``, ``eos=258``; vocabulary 259.

    Choose it for offline runs, tests and tiny models: no download, no training, lossless.
    """

    def __init__(self) -> None:
        self.spec = "byte"
        self.pad_id, self.bos_id, self.eos_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        self.hf.save_pretrained(directory)

    @cached_property
    def hf(self) -> PreTrainedTokenizerBase:
        """The same tokenizer built with the ``tokenizers`` library: a byte-level BPE without merges
        whose vocabulary maps byte ``b`` to id ``b`` (in GPT-2's printable byte alphabet), then the
        special tokens at 256..258. ``encode(text, add_special_tokens=False)`` equals ``encode``;
        with special tokens it prepends ``<bos>`` as the documents and SFT formats do. As in any HF
        tokenizer, text that spells ``<pad>``/``<bos>``/``<eos>`` encodes to that special id unless
        ``split_special_tokens=True`` (then it is bytes, as here). Its chat template renders
        ``Tokenizer.chat``'s conversation format."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as RustTokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_to_char = bytes_to_unicode()
        tokenizer = RustTokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()  # invalid UTF-8 decodes to U+FFFD, as in decode()
        specials = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
        tokenizer.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", self.bos_id)]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            pad_token="<pad>",
            bos_token="<bos>",
            eos_token="<eos>",
            chat_template=CHAT_TEMPLATE,
        )


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<' + message['role'] + '>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>\\n' }}{% endif %}"
)
"""``Tokenizer.chat``'s built-in conversation format as a Hugging Face (Jinja) chat template."""


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer (``AutoTokenizer``): a local directory works offline, a hub name
    needs the network. Conversations use the tokenizer's own chat template when it has one."""

    def __init__(self, spec: str, key: str = TOKENIZER_KEY) -> None:
        from transformers import AutoTokenizer

        fix = (
            "give a folder saved by save_pretrained (lit-ablate export writes one), a hub name (needs network) or byte"
        )
        path = Path(spec).expanduser()
        if path.is_file():
            raise ConfigError(key, spec, f"a file, not a tokenizer folder; {fix}")
        if path.is_dir() and not any((path / name).exists() for name in TOKENIZER_FILES):
            raise ConfigError(
                key, spec, f"the folder holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...); {fix}"
            )
        if not path.exists() and looks_local(spec):
            raise ConfigError(key, spec, f"no such folder; {fix}")
        try:
            self.hf = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(key, spec, f"transformers could not load it ({reason}); {fix}") from err
        self.spec = spec
        if self.hf.eos_token_id is None:
            raise ConfigError(key, spec, "the tokenizer has no eos token; pick one that defines it")
        self.eos_id = int(self.hf.eos_token_id)
        self.bos_id = None if self.hf.bos_token_id is None else int(self.hf.bos_token_id)
        if self.hf.pad_token_id is None:
            log.warning(
                "tokenizer %s has no pad token: padding with eos id %d (padding is masked, never a label)",
                spec,
                self.eos_id,
            )
        self.pad_id = self.eos_id if self.hf.pad_token_id is None else int(self.hf.pad_token_id)
        self.vocab_size = len(self.hf)

    def identity(self) -> str:
        """The spec and a hash of the tokenizer's full definition (vocabulary, merges, normalizer,
        special tokens, chat template): a tokenizer retrained at the same path is another identity."""
        definition = (
            self.hf.backend_tokenizer.to_str() if self.hf.is_fast else repr(sorted(self.hf.get_vocab().items()))
        )
        parts = [definition, str(self.hf.chat_template), repr((self.pad_id, self.bos_id, self.eos_id))]
        return f"{self.spec}@{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}"

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        self.hf.save_pretrained(directory)

    def chat(self, messages: ChatMessages) -> tuple[list[int], list[bool]]:
        """With a chat template: render the conversation, then mark each assistant turn by the text
        it adds after the generation prompt. Each segment is tokenised separately so the mask
        boundaries are exact; the template must render a prefix of the conversation as a prefix."""
        if not self.hf.chat_template:
            return super().chat(messages)
        text = self._render(messages, generation_prompt=False)
        cuts: list[tuple[int, bool]] = []  # (end offset in text, trainable)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], generation_prompt=True)
            upto_reply = self._render(messages[: i + 1], generation_prompt=False)
            if not (upto_reply.startswith(prompt) and text.startswith(upto_reply)):
                raise ConfigError(
                    "data.init_args.tokenizer",
                    self.spec,
                    "its chat template is not prefix-stable; use prompt/response data",
                )
            cuts += [(len(prompt), False), (len(upto_reply), True)]
        cuts.append((len(text), False))
        ids: list[int] = []
        trainable: list[bool] = []
        offset = 0
        for end, is_reply in cuts:
            segment = self.encode(text[offset:end]) if end > offset else []
            ids += segment
            trainable += [is_reply] * len(segment)
            offset = max(offset, end)
        return ids, trainable

    def _render(self, messages: ChatMessages, generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def load_tokenizer(spec: str, key: str = TOKENIZER_KEY) -> Tokenizer:
    """``"byte"`` -> ``ByteTokenizer``; anything else -> ``HFTokenizer(spec)`` (a path or hub name).
    ``key``: what a refusal names (``generate`` and ``export`` take ``--tokenizer``)."""
    if not spec:
        raise ConfigError(key, spec, "use 'byte' or a Hugging Face tokenizer path/name")
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec, key)

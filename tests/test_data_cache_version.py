"""The token cache's key moves with the code that decides an entry's bytes.

``LAYOUT_VERSION`` is part of the key; this pins a hash of the source of every function that decides
what an entry holds (tokenisation, formats, row reading, the writer and reader) to it, so changing
that code without bumping the version fails here, and a bumped version is a new key.

Seen failing with a bug put in, one at a time: a blank line added inside
``formats.example_from_tokens`` (the pin fails until LAYOUT_VERSION and PINNED are bumped);
``"layout"`` left out of ``cache_key``'s inputs (the key test reuses the old name).
"""

from __future__ import annotations

import hashlib
import inspect

import lit_ablate
from lit_ablate.data import SyntheticText, formats, mds_source, preference, sources, token_cache, tokenizers

CODE_DECIDING_THE_BYTES = (
    formats.example_from_tokens,
    formats.fit_length,
    formats.iter_examples,
    formats.pretrain_stream,
    formats.document_ids,
    formats._document_tokens,
    formats._sft_tokens,
    formats._checked_messages,
    formats._text,
    preference.pair_example,
    preference.iter_preference_examples,
    preference._pair_tokens,
    preference._chat_pair,
    preference._last_trainable_run,
    preference._shared_messages,
    tokenizers.Tokenizer,
    tokenizers.ByteTokenizer,
    tokenizers.HFTokenizer,
    sources._streamed_rows,
    sources._renamed,
    sources.LocalFiles.stream_rows,
    sources.LocalFiles._stream,
    sources.HubDataset.stream_rows,
    sources.HubDataset._streamed,
    mds_source.MDSShards.__iter__,
    mds_source.MDSShards._shard_rows,
    mds_source._samples,
    mds_source._decode_column,
    mds_source._decode,
    mds_source._decode_ndarray,
    token_cache._batches,
    token_cache._tokenise,
    token_cache._Writer,
    token_cache.TokenStore.example,
)
PINNED = {
    1: "76f48ad3ef2fc129",
    2: "06c92d307114bd4f",  # rows read by part (streams by shard)
    3: "7f0171f2301c5010",  # MDS samples read from an offset (a resumed stream)
    # HFTokenizer refuses a path without a tokenizer (bytes unchanged, the pin covers the class); re-pinned,
    # not yet landed, after ruff format changed the layout of the source (its syntax tree is unchanged) and
    # ruff's RUF005 wrote ``[*ids, eos]`` for ``ids + [eos]`` in formats and preference (the same lists)
    4: "200789e22adea150",
}
"""Every LAYOUT_VERSION -> the hash of CODE_DECIDING_THE_BYTES it was set for (old pins stay: the history)."""


def _code_hash() -> str:
    return hashlib.sha256("\0".join(inspect.getsource(f) for f in CODE_DECIDING_THE_BYTES).encode()).hexdigest()[:16]


def test_the_layout_version_is_bumped_with_the_code_that_decides_an_entrys_bytes():
    digest = _code_hash()
    version = token_cache.LAYOUT_VERSION
    assert sorted(PINNED) == list(range(1, version + 1)), "PINNED keeps one hash per LAYOUT_VERSION, 1 to the current"
    assert PINNED[version] == digest, (
        f"the code that decides a token cache entry's bytes changed (hash {digest}) but LAYOUT_VERSION is still "
        f"{version}: bump it to {version + 1} in lit_ablate/data/token_cache.py and add PINNED[{version + 1}] = "
        f"{digest!r} here"
    )


def test_the_key_holds_the_release_and_the_layout_version(monkeypatch):
    tokenizer = tokenizers.load_tokenizer("byte")
    source = SyntheticText(num_documents=5)

    def key() -> str:
        return token_cache.cache_key(source, tokenizer, "pretrain", 16, "truncate")[0]

    before = key()
    monkeypatch.setattr(token_cache, "LAYOUT_VERSION", token_cache.LAYOUT_VERSION + 1)
    bumped = key()
    monkeypatch.setattr(lit_ablate, "__version__", "9.9.9")
    released = key()
    assert len({before, bumped, released}) == 3

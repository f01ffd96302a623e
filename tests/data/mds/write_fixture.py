"""Writes the MDS fixtures beside this file with mosaicml-streaming's own ``MDSWriter``, so the
reader's tests read the real format, not one lit-ablate wrote itself. Run by hand where
``streaming`` imports (it is not a dependency: it pins ``transformers<5`` and imports torchvision):

    python tests/data/mds/write_fixture.py

Ten documents of the synthetic grammar, a ``str`` text column, the same text's bytes as an
``ndarray:uint32`` token column (byte-tokenizer ids) and an ``int`` id, in shards of a few samples,
uncompressed (``plain/``) and zstd-compressed (``zstd/``).
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = {"text": "str", "tokens": "ndarray:uint32", "id": "int"}


def documents() -> list[str]:
    return [f"document {i}: " + "the red cat sees the small dog. " * (1 + i % 3) for i in range(10)]


if __name__ == "__main__":
    import numpy as np
    from streaming import MDSWriter

    for folder, compression in (("plain", None), ("zstd", "zstd")):
        with MDSWriter(out=str(HERE / folder), columns=COLUMNS, compression=compression, size_limit=1500) as writer:
            for i, text in enumerate(documents()):
                writer.write(
                    {"text": text, "tokens": np.frombuffer(text.encode(), np.uint8).astype(np.uint32), "id": i}
                )

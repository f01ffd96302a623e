"""Data set-up at scale: time and peak memory per rank of the in-memory path.

Run by hand (never in CI):  python benchmarks/data_setup.py [--mb 8 32] [--seq-len 128]

The script writes a generated JSONL corpus of each size in ``--mb`` (documents of sentences from
``SyntheticText``'s grammar, log-normal lengths) to a temporary directory, then runs
``LMDataModule.setup`` (``LocalFiles`` source, byte tokenizer, ``pretrain`` format) in a fresh
Python process per measurement, as one rank of a run would, and reads that process's peak
resident set (``ru_maxrss``) before and after set-up and one epoch's first 20 batches. The data
layer's memory is the growth over the process's peak after imports.

Each process measures one path:

- ``memory``: today's path, every example a Python-held tensor in every rank.

The defaults (8 and 32 MB) run in about a minute on an idle 2-core machine; the issue's "few
hundred MB" is ``--mb 64 256`` (the in-memory path then needs ~5 GB per rank and minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCHES = 20


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSONL corpus of about ``megabytes`` MB; returns its size in bytes."""
    from lit_ablate.data import SyntheticText

    sentences = [row["text"] for row in SyntheticText(num_documents=2000, seed=seed, median_sentences=1, length_sigma=0)]
    rng = random.Random(seed)
    target, written = int(megabytes * 1e6), 0
    with open(path, "w") as f:
        while written < target:
            count = max(1, min(400, round(rng.lognormvariate(math.log(12), 1.0))))
            line = json.dumps({"text": " ".join(rng.choices(sentences, k=count))}) + "\n"
            f.write(line)
            written += len(line)
    return written


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(path: str, mode: str, seq_len: int) -> dict[str, float]:
    """One rank's set-up of ``path`` by ``mode``, in this (fresh) process."""
    from lit_ablate.data import LMDataModule, LocalFiles

    before = _max_rss_mib()
    start = time.perf_counter()
    dm = LMDataModule(LocalFiles(path), format="pretrain", seq_len=seq_len, batch_size=8)
    dm.setup("fit")
    setup_s = time.perf_counter() - start
    loader = iter(dm.train_dataloader())
    tokens = sum(int(next(loader)["input_ids"].numel()) for _ in range(BATCHES))
    return {"setup_s": setup_s, "rss_before_mib": before, "rss_peak_mib": _max_rss_mib(),
            "examples": len(dm.train_set), "batch_tokens": tokens}


def run_child(path: Path, mode: str, seq_len: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--corpus", str(path), "--seq-len", str(seq_len)],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def slope_mib_per_gib(sizes_mb: list[float], growth_mib: list[float]) -> float:
    """Least-squares slope of memory growth over corpus size, in MiB per GiB of corpus."""
    xs = [s * 1e6 / 2**30 for s in sizes_mb]
    mx, my = sum(xs) / len(xs), sum(growth_mib) / len(growth_mib)
    return sum((x - mx) * (y - my) for x, y in zip(xs, growth_mib)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[8, 32], help="corpus sizes in MB (two or more)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--child", choices=["memory"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.corpus, args.child, args.seq_len)))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="data_setup-") as tmp:
        for mb in args.mb:
            corpus = Path(tmp) / f"corpus_{mb:g}mb.jsonl"
            size = generate_corpus(corpus, mb)
            result = run_child(corpus, "memory", args.seq_len)
            growth = result["rss_peak_mib"] - result["rss_before_mib"]
            rows.append((size / 1e6, "memory", result, growth))
            print(f"{size / 1e6:7.1f} MB  memory  set-up {result['setup_s']:7.2f} s  peak RSS {result['rss_peak_mib']:8.0f} MiB"
                  f"  (+{growth:.0f} MiB over imports)  {result['examples']} examples", flush=True)
    memory = [r for r in rows if r[1] == "memory"]
    if len(memory) >= 2:
        print(f"RESULT data_rss_mib_per_gib_corpus_memory={slope_mib_per_gib([r[0] for r in memory], [r[3] for r in memory]):.0f}")
        per_mb = sum(r[2]["setup_s"] for r in memory) / sum(r[0] for r in memory)
        print(f"RESULT data_setup_s_per_mb_memory={per_mb:.3f}")


if __name__ == "__main__":
    main()

"""Data set-up at scale: time and peak memory per rank, in-memory path vs token cache.

Run by hand (never in CI):  python benchmarks/data_setup.py [--mb 64 256] [--seq-len 128] [--memory-up-to-mb 64]

The script writes a generated JSONL corpus of each size in ``--mb`` (documents of sentences from
``SyntheticText``'s grammar, log-normal lengths) to a temporary directory, then runs
``LMDataModule.setup`` (``LocalFiles`` source, byte tokenizer, ``pretrain`` format) in a fresh
Python process per measurement, as one rank of a run would, and reads that process's peak
resident set (``VmHWM``) before and after set-up and one epoch's first 20 batches. The data
layer's memory is the growth over the process's peak after imports; the private (anonymous) RSS
at the end is shown too.

Each process measures one path:

- ``memory``: ``storage: memory``, every example a Python-held tensor in every rank;
- ``build``: ``storage: cache`` with an empty cache directory (tokenise and write the entry);
- ``hit``: ``storage: cache`` again (what every other rank and run of a study pays).

The in-memory path is measured only for corpora up to ``--memory-up-to-mb`` (default 64: it costs
about 28 GiB of RSS per GiB of text, ~7 GiB at 256 MB). Then the largest corpus is built again with
``--workers`` tokenising processes, for tokens/s of tokenisation with 1 vs N processes. The
defaults (64 and 256 MB) take about 5 minutes on an idle 2-core machine (``--skip-memory``
measures only the cache).

Last lines: ``RESULT data_setup_cache_hit_ratio=<hit set-up / in-memory set-up, largest corpus measured in memory>``,
``RESULT data_rss_mib_per_gib_corpus=<slope of the cache hit's RSS growth over corpus size>`` (and
the in-memory path's slope), ``RESULT data_tokenise_tokens_per_s_workers_<N>=...``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
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


def _status_mib(field: str) -> float:
    """A ``/proc/self/status`` field in MiB. ``VmHWM`` (peak RSS) rather than ``ru_maxrss``, which a
    child process inherits from its parent; ``RssAnon``: the private part (not mapped file pages,
    which are shared with every rank reading the same cache and which the kernel can drop)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(f"{field}:"))
    return int(line.split()[1]) / 1024


def measure(path: str, mode: str, seq_len: int, cache_dir: str, workers: int) -> dict[str, float]:
    """One rank's set-up of ``path`` by ``mode``, in this (fresh) process."""
    from lit_ablate.data import LMDataModule, LocalFiles

    before = _status_mib("VmHWM")
    start = time.perf_counter()
    storage = "memory" if mode == "memory" else "cache"
    dm = LMDataModule(LocalFiles(path), format="pretrain", seq_len=seq_len, batch_size=8, storage=storage,
                      cache_dir=cache_dir, tokenize_workers=workers)
    dm.setup("fit")
    setup_s = time.perf_counter() - start
    loader = iter(dm.train_dataloader())
    tokens = sum(int(next(loader)["input_ids"].numel()) for _ in range(BATCHES))
    if mode != "memory" and dm.setup_record["cache_hit"] != (mode == "hit"):
        raise RuntimeError(f"{mode}: expected cache_hit={mode == 'hit'}, got {dm.setup_record}")
    return {"setup_s": setup_s, "rss_before_mib": before, "rss_peak_mib": _status_mib("VmHWM"),
            "anon_after_mib": _status_mib("RssAnon"),
            "examples": len(dm.train_set), "tokens": int(sum(dm.train_set.lengths)), "batch_tokens": tokens}


def run_child(path: Path, mode: str, seq_len: int, cache_dir: Path, workers: int = 0) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--corpus", str(path), "--seq-len", str(seq_len),
         "--cache-dir", str(cache_dir), "--workers", str(workers)],
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
    parser.add_argument("--mb", type=float, nargs="+", default=[64, 256], help="corpus sizes in MB (two or more)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2, help="tokenising processes for the 1-vs-N comparison")
    parser.add_argument("--skip-memory", action="store_true", help="measure only the token cache")
    parser.add_argument("--memory-up-to-mb", type=float, default=64, help="measure the in-memory path up to this size")
    parser.add_argument("--child", choices=["memory", "build", "hit"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.corpus, args.child, args.seq_len, args.cache_dir, args.workers)))
        return
    rows: dict[tuple[str, float], dict] = {}
    modes = ["build", "hit"] if args.skip_memory else ["memory", "build", "hit"]
    print(f"{'corpus':>9} {'path':>7} {'set-up s':>9} {'peak RSS MiB':>13} {'+ over imports':>15} {'anon MiB':>9} "
          f"{'examples':>9}")
    with tempfile.TemporaryDirectory(prefix="data_setup-") as tmp:
        for mb in args.mb:
            corpus = Path(tmp) / f"corpus_{mb:g}mb.jsonl"
            size = generate_corpus(corpus, mb) / 1e6
            for mode in modes:
                if mode == "memory" and mb > args.memory_up_to_mb:
                    continue
                result = run_child(corpus, mode, args.seq_len, Path(tmp) / f"cache_{mb:g}")
                result["growth_mib"] = result["rss_peak_mib"] - result["rss_before_mib"]
                rows[mode, size] = result
                print(f"{size:7.1f}MB {mode:>7} {result['setup_s']:9.2f} {result['rss_peak_mib']:13.0f} "
                      f"{result['growth_mib']:15.0f} {result['anon_after_mib']:9.0f} {result['examples']:9d}", flush=True)
        largest = max(size for _, size in rows)
        speeds = {1: rows["build", largest]["tokens"] / rows["build", largest]["setup_s"]}
        result = run_child(Path(tmp) / f"corpus_{max(args.mb):g}mb.jsonl", "build", args.seq_len,
                           Path(tmp) / "cache_workers", args.workers)
        speeds[args.workers] = result["tokens"] / result["setup_s"]
        for workers, speed in speeds.items():
            print(f"tokenise + write, {workers} process(es): {speed:,.0f} tokens/s")
    sizes = sorted({size for _, size in rows})
    in_memory = [size for mode, size in rows if mode == "memory"]
    if in_memory:
        ratio = rows["hit", max(in_memory)]["setup_s"] / rows["memory", max(in_memory)]["setup_s"]
        print(f"RESULT data_setup_cache_hit_ratio={ratio:.4f}")
    if len(sizes) >= 2:
        for mode, name in (("hit", "data_rss_mib_per_gib_corpus"), ("memory", "data_rss_mib_per_gib_corpus_memory")):
            measured = [size for size in sizes if (mode, size) in rows]
            if len(measured) >= 2:
                slope = slope_mib_per_gib(measured, [rows[mode, size]["growth_mib"] for size in measured])
                print(f"RESULT {name}={slope:.0f}")
    for workers, speed in speeds.items():
        print(f"RESULT data_tokenise_tokens_per_s_workers_{workers}={speed:.0f}")


if __name__ == "__main__":
    main()

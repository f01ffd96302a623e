"""Data set-up at scale: time and peak memory per rank, in-memory path vs token cache vs stream.

Run by hand (CI runs it only at a smoke size, tests/test_benchmarks.py):
    python benchmarks/data_setup.py [--mb 16 256] [--seq-len 128] [--memory-up-to-mb 16]

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
- ``hit``: ``storage: cache`` again (what every other rank and run of a study pays);
- ``stream`` (largest corpus only): ``storage: stream`` reads ``--stream-batches`` batches, then a
  second data module resumes from the first's state (as from a checkpoint) and serves its next
  batch, which must equal the first's next batch: the time to that batch is what a resume costs.

The in-memory path is measured only for corpora up to ``--memory-up-to-mb`` (default 16: it costs
about 28 GiB of RSS per GiB of text, ~7 GiB at 256 MB, and ~1 s per MB). Then the largest corpus is
built again with ``--workers`` tokenising processes (not with ``--workers 1``), for tokens/s of tokenisation with 1 vs N
processes. The defaults (16 and 256 MB) take about 4 minutes on a 2-core machine; the table and the
results are written to ``--out`` (``benchmarks/results/data_setup/``: ``results.md``, ``results.json``).

Last lines: ``RESULT data_setup_cache_hit_ratio=<hit set-up / in-memory set-up, largest corpus measured in memory>``,
``RESULT data_rss_mib_per_gib_corpus=<slope of the cache hit's RSS growth over corpus size>`` (and
the in-memory path's slope), ``RESULT data_tokenise_tokens_per_s_workers_<N>=...``,
``RESULT data_stream_resume_s=<seconds to the first batch after a resume>`` and
``RESULT data_stream_read_s=<seconds the stream took to read the batches the resume skipped>``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
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

    sentences = [
        row["text"] for row in SyntheticText(num_documents=2000, seed=seed, median_sentences=1, length_sigma=0)
    ]
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
    dm = LMDataModule(
        LocalFiles(path),
        format="pretrain",
        seq_len=seq_len,
        batch_size=8,
        storage=storage,
        cache_dir=cache_dir,
        tokenize_workers=workers,
    )
    dm.setup("fit")
    setup_s = time.perf_counter() - start
    loader = iter(dm.train_dataloader())
    tokens = sum(int(next(loader)["input_ids"].numel()) for _ in range(BATCHES))
    if mode != "memory" and dm.setup_record["cache_hit"] != (mode == "hit"):
        raise RuntimeError(f"{mode}: expected cache_hit={mode == 'hit'}, got {dm.setup_record}")
    return {
        "setup_s": setup_s,
        "rss_before_mib": before,
        "rss_peak_mib": _status_mib("VmHWM"),
        "anon_after_mib": _status_mib("RssAnon"),
        "examples": len(dm.train_set),
        "tokens": int(sum(dm.train_set.lengths)),
        "batch_tokens": tokens,
    }


def measure_stream(path: str, seq_len: int, batches: int) -> dict[str, float]:
    """Read ``batches`` batches of a stream, then resume a second data module from the first's state."""
    import torch

    from lit_ablate.data import LMDataModule, LocalFiles
    from lit_ablate.data.streaming import STREAM_STATE

    def data_module() -> LMDataModule:
        dm = LMDataModule(LocalFiles(path), format="pretrain", seq_len=seq_len, batch_size=8, storage="stream")
        dm.setup("fit")
        return dm

    before = _status_mib("VmHWM")
    first = data_module()
    start = time.perf_counter()
    loader = iter(first.train_dataloader())
    positions = dict(next(loader).pop(STREAM_STATE) for _ in range(batches))
    read_s = time.perf_counter() - start
    following = next(loader)
    state = first.state_dict() | {
        "items_consumed": batches * first.batch_size,
        "stream_positions": positions,
    }  # as a checkpoint holds it
    start = time.perf_counter()
    resumed = data_module()
    resumed.load_state_dict(state)
    resumed_batch = next(iter(resumed.train_dataloader()))
    resume_s = time.perf_counter() - start
    if not torch.equal(resumed_batch["input_ids"], following["input_ids"]):
        raise RuntimeError("the resumed stream's first batch differs from the uninterrupted stream's next batch")
    return {
        "setup_s": read_s,
        "resume_s": resume_s,
        "rss_before_mib": before,
        "rss_peak_mib": _status_mib("VmHWM"),
        "anon_after_mib": _status_mib("RssAnon"),
        "examples": batches * 8,
        "tokens": batches * 8 * seq_len,
        "batch_tokens": int(following["input_ids"].numel()),
    }


def run_child(
    path: Path, mode: str, seq_len: int, cache_dir: Path, workers: int = 0, stream_batches: int = 0
) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--corpus",
            str(path),
            "--seq-len",
            str(seq_len),
            "--cache-dir",
            str(cache_dir),
            "--workers",
            str(workers),
            "--stream-batches",
            str(stream_batches),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def slope_mib_per_gib(sizes_mb: list[float], growth_mib: list[float]) -> float:
    """Least-squares slope of memory growth over corpus size, in MiB per GiB of corpus."""
    xs = [s * 1e6 / 2**30 for s in sizes_mb]
    mx, my = sum(xs) / len(xs), sum(growth_mib) / len(growth_mib)
    return sum((x - mx) * (y - my) for x, y in zip(xs, growth_mib)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[16, 256], help="corpus sizes in MB (two or more)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--workers", type=int, default=2, help="tokenising processes for the 1-vs-N comparison (1: none)"
    )
    parser.add_argument("--skip-memory", action="store_true", help="measure only the token cache and the stream")
    parser.add_argument("--memory-up-to-mb", type=float, default=16, help="measure the in-memory path up to this size")
    parser.add_argument("--stream-batches", type=int, default=50000, help="batches a stream reads before it is resumed")
    parser.add_argument(
        "--out",
        default=str(Path(__file__).parent / "results" / "data_setup"),
        help="folder for results.md and results.json ('' writes nothing)",
    )
    parser.add_argument("--child", choices=["memory", "build", "hit", "stream"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "stream":
        print(json.dumps(measure_stream(args.corpus, args.seq_len, args.stream_batches)))
        return
    if args.child:
        print(json.dumps(measure(args.corpus, args.child, args.seq_len, args.cache_dir, args.workers)))
        return
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    rows: dict[tuple[str, float], dict] = {}
    modes = ["build", "hit"] if args.skip_memory else ["memory", "build", "hit"]
    table = [
        "| corpus | path | set-up s | peak RSS MiB | + over imports MiB | private RSS MiB | examples |",
        "|---|---|---|---|---|---|---|",
    ]
    print(
        f"{'corpus':>9} {'path':>7} {'set-up s':>9} {'peak RSS MiB':>13} {'+ over imports':>15} {'anon MiB':>9} "
        f"{'examples':>9}"
    )

    def record(mode: str, size: float, result: dict) -> None:
        result["growth_mib"] = result["rss_peak_mib"] - result["rss_before_mib"]
        rows[mode, size] = result
        print(
            f"{size:7.1f}MB {mode:>7} {result['setup_s']:9.2f} {result['rss_peak_mib']:13.0f} "
            f"{result['growth_mib']:15.0f} {result['anon_after_mib']:9.0f} {result['examples']:9d}",
            flush=True,
        )
        table.append(
            f"| {size:.0f} MB | {mode} | {result['setup_s']:.2f} | {result['rss_peak_mib']:.0f} | "
            f"{result['growth_mib']:.0f} | {result['anon_after_mib']:.0f} | {result['examples']:,} |"
        )

    with tempfile.TemporaryDirectory(prefix="data_setup-") as tmp:
        for mb in args.mb:
            corpus = Path(tmp) / f"corpus_{mb:g}mb.jsonl"
            size = generate_corpus(corpus, mb) / 1e6
            for mode in modes:
                if mode == "memory" and mb > args.memory_up_to_mb:
                    continue
                record(mode, size, run_child(corpus, mode, args.seq_len, Path(tmp) / f"cache_{mb:g}"))
        largest = max(size for _, size in rows)
        corpus = Path(tmp) / f"corpus_{max(args.mb):g}mb.jsonl"
        record(
            "stream", largest, run_child(corpus, "stream", args.seq_len, Path(tmp), stream_batches=args.stream_batches)
        )
        speeds = {1: rows["build", largest]["tokens"] / rows["build", largest]["setup_s"]}
        if args.workers > 1:  # the build above was the 1-process one
            result = run_child(corpus, "build", args.seq_len, Path(tmp) / "cache_workers", args.workers)
            speeds[args.workers] = result["tokens"] / result["setup_s"]
        for workers, speed in speeds.items():
            print(f"tokenise + write, {workers} process(es): {speed:,.0f} tokens/s")
    results: dict[str, float] = {}
    sizes = sorted({size for mode, size in rows if mode != "stream"})
    in_memory = [size for mode, size in rows if mode == "memory"]
    if in_memory:
        results["data_setup_cache_hit_ratio"] = (
            rows["hit", max(in_memory)]["setup_s"] / rows["memory", max(in_memory)]["setup_s"]
        )
    if len(sizes) >= 2:
        for mode, name in (("hit", "data_rss_mib_per_gib_corpus"), ("memory", "data_rss_mib_per_gib_corpus_memory")):
            measured = [size for size in sizes if (mode, size) in rows]
            if len(measured) >= 2:
                results[name] = slope_mib_per_gib(measured, [rows[mode, size]["growth_mib"] for size in measured])
    for workers, speed in speeds.items():
        results[f"data_tokenise_tokens_per_s_workers_{workers}"] = speed
    results["data_stream_read_s"] = rows["stream", largest]["setup_s"]
    results["data_stream_resume_s"] = rows["stream", largest]["resume_s"]
    for name, value in results.items():
        print(f"RESULT {name}={_number(value)}")
    wall_s = time.perf_counter() - started
    print(f"wall time {wall_s:.0f} s")
    if args.out:
        write_results(Path(args.out), args, table, results, rows, wall_s, load_before)


def _number(value: float) -> str:
    """Four decimals below 1, two up to 100, none above."""
    return f"{value:.4f}" if value < 1 else f"{value:.2f}" if value <= 100 else f"{value:.0f}"


def write_results(
    out: Path,
    args: argparse.Namespace,
    table: list[str],
    results: dict[str, float],
    rows: dict[tuple[str, float], dict],
    wall_s: float,
    load_before: float,
) -> None:
    """``results.md`` (the table and the results, with how they were measured) and ``results.json``."""
    out.mkdir(parents=True, exist_ok=True)
    when = datetime.date.today().isoformat()
    command = "python benchmarks/data_setup.py " + " ".join(sys.argv[1:])
    stream = next(result for (mode, _), result in rows.items() if mode == "stream")
    lines = [
        f"# data_setup ({when}, {os.cpu_count()} CPUs, load average {load_before:.1f} at the start, "
        f"{wall_s:.0f} s in all)",
        "",
        f"`{command.strip()}`: `pretrain`, byte tokenizer, `seq_len` "
        f"{args.seq_len}, one fresh process per row; the stream row's set-up is the time to read "
        f"{args.stream_batches} batches of 8, and a resume after them took {stream['resume_s'] * 1000:.1f} ms to "
        "its first batch (equal to the uninterrupted stream's next batch).",
        "",
        *table,
        "",
        "```",
        *(f"RESULT {name}={_number(value)}" for name, value in results.items()),
        "```",
        "",
    ]
    (out / "results.md").write_text("\n".join(lines))
    payload = {
        "date": when,
        "command": command.strip(),
        "wall_s": wall_s,
        "load_average_at_start": load_before,
        "results": results,
        "rows": [{"mode": mode, "corpus_mb": size, **result} for (mode, size), result in rows.items()],
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()

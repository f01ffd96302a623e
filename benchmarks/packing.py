"""Useful tokens per second, padding vs packing, on a skewed length distribution.

Run by hand (never in CI):  python benchmarks/packing.py [--device cuda] [--max-len 4096]

The same examples (log-normal lengths with a long tail, capped at ``--max-len``) go through one
forward+backward of a tiny model per batch, once padded (``PaddingCollator``, ``--batch-size``
examples per batch, padded to the longest) and once packed (``PackingCollator`` rows of
``--max-len`` tokens, FFD and greedy, ``--rows`` rows per batch). Every layout sees each example
exactly once, so useful tokens (labels that count) are identical and the ratio of times is the
ratio of useful tokens/s. Layouts alternate repeat by repeat (side by side in one run); the
median repeat is reported, by wall-clock and by this process's CPU time (robust to other jobs on
a shared machine). The defaults (200 examples, median 64, tail to 1024: the issue's 4k
scaled down 4x) take ~40 s on an idle 2-core CPU and a few minutes on a loaded one; on a GPU try
``--device cuda --examples 2000 --median 400 --max-len 4096 --batch-size 4 --rows 4`` (bf16).
The last lines are ``RESULT packing_speedup=<FFD-packed over padded useful tokens/s, CPU time>``
and the same for greedy packing.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch

from lit_ablate.data import PackingCollator, PaddingCollator, example_from_tokens, pack
from lit_ablate.data.collate import Collator
from lit_ablate.errors import ConfigError
from lit_ablate.models.attention import check_attention_backend
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses import IGNORE_INDEX, loss_backend

Batches = list[dict]


def skewed_examples(n: int, median: int, sigma: float, max_len: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` documents with log-normal lengths (median ``median``, capped at ``max_len``)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = min(max_len, max(2, round(rng.lognormvariate(math.log(median), sigma))))
        ids = [rng.randrange(256) for _ in range(length)]
        examples.append(example_from_tokens(ids, [True] * length))
    return examples


def padded_batches(examples: list, batch_size: int) -> Batches:
    collator = _bound(PaddingCollator())
    return [collator(examples[i : i + batch_size]) for i in range(0, len(examples), batch_size)]


def packed_batches(examples: list, max_len: int, rows_per_batch: int, strategy: str) -> Batches:
    collator = _bound(PackingCollator(max_tokens=max_len, strategy=strategy))
    rows = pack(list(range(len(examples))), [len(e["input_ids"]) for e in examples], max_len, strategy, window=1000)
    return [
        collator([[examples[i] for i in row] for row in rows[r : r + rows_per_batch]])
        for r in range(0, len(rows), rows_per_batch)
    ]


def _bound(collator: Collator) -> Collator:
    collator.bind(pad_id=256, seq_len=1 << 30)
    return collator


def run_epoch(model: CausalLMWithLoss, batches: Batches, device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of forward+backward over all batches."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss_sum, useful = model(batch)
        (loss_sum / useful).backward()
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--median", type=int, default=64, help="median length in tokens")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma (the tail's weight)")
    parser.add_argument("--max-len", type=int, default=1024, help="longest example = packed row capacity")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per padded batch")
    parser.add_argument("--rows", type=int, default=2, help="packed rows per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--packed-attention", default=None, help="default: fa_varlen on CUDA if installed, else sdpa_packed")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    packed_attention = args.packed_attention or _best_packed_attention(device)
    examples = skewed_examples(args.examples, args.median, args.sigma, args.max_len, seed=0)
    layouts: dict[str, tuple[str, Batches]] = {
        "padding": ("sdpa", padded_batches(examples, args.batch_size)),
        "packing greedy": (packed_attention, packed_batches(examples, args.max_len, args.rows, "greedy")),
        "packing ffd": (packed_attention, packed_batches(examples, args.max_len, args.rows, "ffd")),
    }
    models = {name: _model(args.preset, dtype, attn, device) for name, (attn, _) in layouts.items()}
    useful = sum(int((e["labels"] != IGNORE_INDEX).sum()) for e in examples)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in layouts}
    for name, (_, batches) in layouts.items():  # warm-up: first-call costs out of the measurement
        run_epoch(models[name], batches[:1], device)
    for _ in range(args.repeats):
        for name, (_, batches) in layouts.items():
            times[name].append(run_epoch(models[name], batches, device))

    lengths = [len(e["input_ids"]) for e in examples]
    print(f"\n{len(examples)} examples, lengths median {statistics.median(lengths):.0f} / mean {statistics.mean(lengths):.0f}"
          f" / max {max(lengths)}, {useful} useful tokens; {args.preset} {dtype} on {device.type}; "
          f"median of {args.repeats} repeats\n")
    print("| layout | attention | batches | processed tokens | useful/processed | wall s | useful tok/s (wall) "
          "| CPU s | useful tok/s (CPU) | speedup (CPU) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rates: dict[str, float] = {}
    for name, (attn, batches) in layouts.items():
        processed = sum(b["input_ids"].numel() for b in batches)
        wall = statistics.median(t[0] for t in times[name])
        cpu = statistics.median(t[1] for t in times[name])
        rates[name] = useful / cpu
        print(f"| {name} | {attn} | {len(batches)} | {processed} | {useful / processed:.1%} | {wall:.2f} | "
              f"{useful / wall:,.0f} | {cpu:.2f} | {useful / cpu:,.0f} | {rates[name] / rates['padding']:.2f}x |")
    print()
    print(f"RESULT packing_speedup={rates['packing ffd'] / rates['padding']:.2f}")
    print(f"RESULT greedy_packing_speedup={rates['packing greedy'] / rates['padding']:.2f}")


def _best_packed_attention(device: torch.device) -> str:
    """The fastest packed backend that trains here (each one that cannot is named, not skipped silently)."""
    if device.type == "cuda":
        for name in ("fa_varlen", "flex"):
            if _runs(name):
                return name
    return "sdpa_packed"


def _runs(name: str) -> bool:
    try:
        check_attention_backend(name, training=True)
    except ConfigError as err:
        print(f"note: {err}")
        return False
    return True


def _model(preset: str, dtype: str, attn: str, device: torch.device) -> CausalLMWithLoss:
    torch.manual_seed(0)
    lm = ModelFactory(preset=preset, dtype=dtype, attn_implementation=attn).build().to(device)
    return CausalLMWithLoss(lm, loss_backend("torch"))


if __name__ == "__main__":
    main()

"""Useful tokens per second, padding vs packing, on a skewed length distribution.

Run by hand (CI runs it only at a smoke size, tests/test_benchmarks.py):
    python benchmarks/packing.py [--device cuda] [--max-len 4096]

The same examples (log-normal lengths with a long tail, capped at ``--max-len``) go through one
forward+backward of a tiny model per batch, in four layouts:

- padding, arrival order: ``--batch-size`` examples per batch as they come, padded to the longest
  (``PaddingCollator``);
- padding, length-grouped: what transformers users get with ``group_by_length``: a shuffled order
  cut into megabatches of 50 batches, each sorted by length, so a batch holds examples of similar
  length (the idea of transformers' ``LengthGroupedSampler``, written here; at the default 200
  examples one megabatch holds them all, so it is a full sort: grouping's best case);
- packing, greedy and FFD: ``PackingCollator`` rows of ``--max-len`` tokens, ``--rows`` rows per
  batch, with ``sdpa_packed`` attention (documents kept apart).

Every layout sees each example exactly once, so useful tokens (labels that count) are identical
and the ratio of times is the ratio of useful tokens/s. The timed region is the whole data path of
an epoch plus the model: the layout's plan (the order for grouping, the bin packing for packing),
collating every batch, and forward+backward; the data part is also shown on its own. On a GPU,
packed rows have one static shape (``--max-len`` tokens, ``static_shape``), so a compiled kernel
(flex) compiles once, not once per row width; on a CPU they are as wide as their longest row
(``--static-shape`` / ``--no-static-shape`` choose). Each layout is warmed up, measured
``--repeats`` times (the median counts) and its row printed at once, with a ``RESULT`` line as
soon as the row and its baseline exist: a run cut short by a time limit keeps every row it finished.
Times are wall-clock and this process's CPU time (robust to other jobs on a shared machine), with
one torch thread by default (``--threads``: with two, idle threads spin while other jobs hold the
cores, which adds CPU time that is not the layout's). The defaults (200 examples, median 64, tail to
1024: the issue's 4k scaled down 4x; 2 repeats) take about 45 s of CPU, under a minute on an idle
2-core machine and a few on a loaded one. On a GPU (bf16; speedups by wall time, since the host
thread waits for the device) the GPU lane runs a Qwen3-0.6B shape at 8 of its layers,
``--preset qwen3-0.6b --layers 8 --examples 160 --median 400 --max-len 4096 --batch-size 4 --rows 2
--packed-attention torch_varlen flex sdpa_packed``: each further packed backend adds an FFD row. The
RESULT lines are ``packing_speedup=<FFD-packed over arrival-order padding, useful tokens/s>``,
``packing_speedup_vs_grouped=<FFD-packed over length-grouped padding>``, greedy packing's
speedup over arrival-order padding, and ``packing_speedup_<backend>`` for each further backend.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kernels_here import fastest_packed_attention
from model_shapes import model_config, shape_names

from lit_ablate.data import PackingCollator, PaddingCollator, example_from_tokens, pack
from lit_ablate.data.collate import Collator
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX, loss_backend

Plan = list[list]  # the items of each batch: examples (padding) or rows of examples (packing)
MEGABATCH_BATCHES = 50  # transformers' LengthGroupedSampler default (megabatch_mult)


def skewed_examples(n: int, median: int, sigma: float, max_len: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` documents with log-normal lengths (median ``median``, capped at ``max_len``)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = min(max_len, max(2, round(rng.lognormvariate(math.log(median), sigma))))
        ids = [rng.randrange(256) for _ in range(length)]
        examples.append(example_from_tokens(ids, [True] * length))
    return examples


def _batches(items: list, per_batch: int) -> Plan:
    return [items[i : i + per_batch] for i in range(0, len(items), per_batch)]


def arrival_order_plan(examples: list, batch_size: int) -> Plan:
    return _batches(examples, batch_size)


def length_grouped_order(lengths: list[int], batch_size: int, seed: int) -> list[int]:
    """A shuffled order in which consecutive ``batch_size`` examples have similar lengths: the
    permutation is cut into megabatches of ``MEGABATCH_BATCHES`` batches, each sorted longest first
    (transformers' ``group_by_length`` idea; it also swaps the longest example to the very front,
    which only moves one example and is left out here)."""
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    size = MEGABATCH_BATCHES * batch_size
    return [
        i
        for start in range(0, len(order), size)
        for i in sorted(order[start : start + size], key=lambda i: -lengths[i])
    ]


def length_grouped_plan(examples: list, batch_size: int) -> Plan:
    order = length_grouped_order([len(e["input_ids"]) for e in examples], batch_size, seed=0)
    return _batches([examples[i] for i in order], batch_size)


def packed_plan(examples: list, max_len: int, rows_per_batch: int, strategy: str) -> Plan:
    rows = pack(list(range(len(examples))), [len(e["input_ids"]) for e in examples], max_len, strategy, window=1000)
    return _batches([[examples[i] for i in row] for row in rows], rows_per_batch)


def _bound(collator: Collator) -> Collator:
    collator.bind(pad_id=256, seq_len=1 << 30)
    return collator


@dataclass
class Layout:
    """How one row of the table turns examples into batches, and the attention it trains with."""

    attention: str
    plan: Callable[[], Plan]
    collator: Collator


@dataclass
class Epoch:
    wall: float  # seconds: plan + collation + forward/backward
    cpu: float  # this process's CPU seconds, same region
    data_cpu: float  # CPU seconds of the plan and collation alone
    processed: int  # tokens through the model, padding included
    useful: int  # tokens whose labels count: the same in every layout, or it saw other examples
    batches: int


def run_epoch(model: CausalLMWithLoss, layout: Layout, device: torch.device, limit: int | None = None) -> Epoch:
    """One pass over the examples: plan, then collate and forward+backward each batch, all timed."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    plan = layout.plan()[:limit]
    data_cpu, processed, useful_tokens = time.process_time() - cpu, 0, 0
    for items in plan:
        collating = time.process_time()
        batch = layout.collator(items)
        data_cpu += time.process_time() - collating
        processed += batch["input_ids"].numel()
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss_sum, useful = model(batch)
        (loss_sum / useful).backward()
        useful_tokens = useful_tokens + useful
    sync()
    return Epoch(
        time.perf_counter() - wall, time.process_time() - cpu, data_cpu, processed, int(useful_tokens), len(plan)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--median", type=int, default=64, help="median length in tokens")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma (the tail's weight)")
    parser.add_argument("--max-len", type=int, default=1024, help="longest example = packed row capacity")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per padded batch")
    parser.add_argument("--rows", type=int, default=2, help="packed rows per batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--preset",
        default="tiny-llama",
        choices=shape_names(),
        help="a tiny preset or a real shape (benchmarks/model_shapes.py: qwen3-0.6b on a GPU)",
    )
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--static-shape",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pad packed rows to --max-len (default: on a GPU, where compiled kernels need one shape)",
    )
    parser.add_argument(
        "--packed-attention",
        nargs="+",
        default=None,
        help="packed backends; the first packs greedy and FFD rows, each further one FFD rows "
        "(default: the fastest that trains here, benchmarks/kernels_here.py; sdpa_packed on CPU)",
    )
    args = parser.parse_args()

    device = torch.device(args.device)
    static = device.type == "cuda" if args.static_shape is None else args.static_shape
    torch.set_num_threads(args.threads)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    default_attention = fastest_packed_attention() if device.type == "cuda" else "sdpa_packed"
    packed_attention, *other_attention = args.packed_attention or [default_attention]
    model = model_config(args.preset, args.layers)
    examples = skewed_examples(args.examples, args.median, args.sigma, args.max_len, seed=0)
    padding = _bound(PaddingCollator())
    layouts: dict[str, Layout] = {
        "padding, arrival order": Layout("sdpa", lambda: arrival_order_plan(examples, args.batch_size), padding),
        "padding, length-grouped": Layout("sdpa", lambda: length_grouped_plan(examples, args.batch_size), padding),
        **{
            f"packing {strategy}": Layout(
                packed_attention,
                functools.partial(packed_plan, examples, args.max_len, args.rows, strategy),
                _bound(PackingCollator(max_tokens=args.max_len, strategy=strategy, static_shape=static)),
            )
            for strategy in ("greedy", "ffd")
        },
        **{
            f"packing ffd, {attention}": Layout(
                attention,
                functools.partial(packed_plan, examples, args.max_len, args.rows, "ffd"),
                _bound(PackingCollator(max_tokens=args.max_len, strategy="ffd", static_shape=static)),
            )
            for attention in other_attention
        },
    }
    useful = sum(int((e["labels"] != IGNORE_INDEX).sum()) for e in examples)
    lengths = [len(e["input_ids"]) for e in examples]
    clock = "wall" if device.type == "cuda" else "CPU"  # a GPU's host thread waits in synchronize: wall time
    print(
        f"\n{len(examples)} examples, lengths median {statistics.median(lengths):.0f} "
        f"/ mean {statistics.mean(lengths):.0f} / max {max(lengths)}, {useful} useful tokens; "
        f"{args.preset} ({model['num_hidden_layers']} layers) {dtype} on {device.type}, "
        f"{args.threads} torch thread(s); median of {args.repeats} repeats; every row's time includes its "
        "plan and collation; speedup: useful tokens/s over padding in arrival order\n",
        flush=True,
    )
    print(
        "| layout | attention | batches | processed tokens | useful/processed | wall s | useful tok/s (wall) "
        f"| CPU s | of which data | useful tok/s (CPU) | speedup ({clock}) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rates: dict[str, float] = {}
    for name, layout in layouts.items():
        model_here = _model(model, dtype, layout.attention, device)
        run_epoch(model_here, layout, device, limit=1)  # warm-up: first-call and compile costs out of the measurement
        epochs = [run_epoch(model_here, layout, device) for _ in range(args.repeats)]
        if any(e.useful != useful for e in epochs):
            raise SystemExit(f"{name} trained on {epochs[0].useful} useful tokens, not {useful}: not the same examples")
        del model_here
        wall = statistics.median(e.wall for e in epochs)
        cpu = statistics.median(e.cpu for e in epochs)
        data = statistics.median(e.data_cpu for e in epochs)
        rates[name] = useful / (wall if clock == "wall" else cpu)
        baseline = rates[next(iter(layouts))]
        print(
            f"| {name} | {layout.attention} | {epochs[0].batches} | {epochs[0].processed} | "
            f"{useful / epochs[0].processed:.1%} | {wall:.2f} | {useful / wall:,.0f} | {cpu:.2f} | {data:.3f} | "
            f"{useful / cpu:,.0f} | {rates[name] / baseline:.2f}x |",
            flush=True,
        )
        for result, (over, under) in RESULTS.items():
            if name in (over, under) and over in rates and under in rates:
                print(f"RESULT {result}={rates[over] / rates[under]:.2f}", flush=True)
        if name.startswith("packing ffd, "):
            print(f"RESULT packing_speedup_{layout.attention}={rates[name] / baseline:.2f}", flush=True)
        if name == "packing ffd":
            print(f"RESULT packing_attention={packed_attention}\nRESULT packing_useful_tokens_per_s={rates[name]:.0f}")
    print(
        "\npacking_speedup_vs_grouped compares FFD packing with length-grouped padding, the baseline transformers users"
    )
    print("get from group_by_length.")


RESULTS = {
    "packing_speedup": ("packing ffd", "padding, arrival order"),
    "packing_speedup_vs_grouped": ("packing ffd", "padding, length-grouped"),
    "greedy_packing_speedup": ("packing greedy", "padding, arrival order"),
}
"""RESULT name -> (layout, the layout it is divided by)."""


def _model(config: dict, dtype: str, attn: str, device: torch.device) -> CausalLMWithLoss:
    torch.manual_seed(0)
    lm = ModelFactory(config=config, dtype=dtype, attn_implementation=attn).build().to(device)
    return CausalLMWithLoss(lm, loss_backend("torch"))


if __name__ == "__main__":
    main()

"""Useful tokens/s of DPO training steps by batch layout: padded, packed, prefix-shared.

Run by hand (CI runs it only at a smoke size, tests/test_benchmarks.py):
    python benchmarks/dpo_packing.py [--pairs 256] [--repeats 3]

Every layout processes the very same pairs (one pass over ``--pairs`` pairs of
``ArithmeticPreference``), so every layout trains on the same useful tokens (response tokens of
both sequences of each pair) and the speed ratio is a ratio of times. One step = the policy's
forward and backward and the frozen reference's forward (``DPO.pair_losses``, fp32, transformers'
sdpa attention; packed rows get their documents from ``position_ids``, shared rows their branch
mask). The model is the tiny Llama preset widened to ``--hidden 512`` (4 layers, ~13M
parameters): at the preset's 128, attention over 768-token packed rows is about a third of the
FLOPs (12 L H d S against 6 N per token), far more than in the billion-parameter models packing is
for, and packing then gains less (1.77x measured at 128, the same data). Layouts:

- ``padded``: TRL's layout, 8 pairs = 16 rows padded to the longest sequence;
- ``packed_batch``: the same 8 pairs per step in rows of <= ``2 x seq_len`` tokens (no padding);
- ``multipacked``: first-fit decreasing over all pairs into rows of ``max_tokens``, 2 rows per step;
- ``multipacked_shared``: the same with each prompt computed once (prefix sharing).

Two data sets: *skewed* (log-normal number of worked examples before each question: a long tail
of long prompts, the shape where padding wastes most) and *long prompts* (many worked examples,
short answers: where prefix sharing saves most). Time is this process's CPU time with one torch
thread (other jobs share this machine's cores; wall time would measure them too), the median
over ``--repeats`` interleaved passes.

``RESULT dpo_packing_speedup`` = multipacked over padded on the skewed data (goal >= 1.8);
``RESULT dpo_packing_batch_speedup`` = packed_batch over padded (same pairs per step);
``RESULT dpo_prefix_sharing_speedup`` = multipacked_shared over multipacked on long prompts.

Measured on the 2-core CPU (``--pairs 64 --repeats 2``, hidden 512)::

    skewed        padded 1.00x, packed_batch 1.85x, multipacked 2.48x, multipacked_shared 4.69x
    long_prompts  padded 1.00x, packed_batch 0.88x, multipacked 1.15x, multipacked_shared 2.14x
    RESULT dpo_packing_speedup=2.48
    RESULT dpo_packing_batch_speedup=1.85
    RESULT dpo_prefix_sharing_speedup=1.86

(On long prompts a pair fills most of a row, so packing saves little; packing a padded batch's
pairs there is slower than padding: the same tokens, with transformers' packed-document mask.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lit_ablate.data import (
    ArithmeticPreference,
    ExampleDataset,
    LMDataModule,
    PreferencePackingCollator,
    PreferencePaddingCollator,
    Sharding,
)
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import DPO

SEQ_LEN = 384
PAIRS_PER_STEP = 8
MAX_TOKENS = 2 * SEQ_LEN
ROWS_PER_STEP = 2
HIDDEN = 512
DATASETS = {  # ArithmeticPreference options
    "skewed": {"median_shots": 3.0, "shots_sigma": 1.2, "max_shots": 40},
    "long_prompts": {"median_shots": 30.0, "shots_sigma": 0.2, "max_shots": 40},
}


def pairs_of(count: int, options: dict) -> list[dict]:
    data = LMDataModule(
        ArithmeticPreference(num_examples=count, max_operand=99, **options),
        format="preference",
        seq_len=SEQ_LEN,
        shuffle=False,
    )
    data.setup()
    return data.train_set.examples


def layouts(pairs: list[dict]) -> dict[str, list[dict]]:
    """Each layout's batches over exactly ``pairs``."""
    padded = PreferencePaddingCollator()
    padded.bind(256, SEQ_LEN)
    batches = {"padded": [padded(pairs[i : i + PAIRS_PER_STEP]) for i in range(0, len(pairs), PAIRS_PER_STEP)]}
    within = PreferencePackingCollator(within_batch=True)
    within.bind(256, SEQ_LEN)
    batches["packed_batch"] = [within(pairs[i : i + PAIRS_PER_STEP]) for i in range(0, len(pairs), PAIRS_PER_STEP)]
    for name, shared in (("multipacked", False), ("multipacked_shared", True)):
        collator = PreferencePackingCollator(max_tokens=MAX_TOKENS, prefix_sharing=shared)
        collator.bind(256, SEQ_LEN)
        dataset = ExampleDataset(pairs)
        sharding = Sharding(shuffle=False, batch_size=ROWS_PER_STEP)
        rows = collator.sampler(dataset, dataset.lengths, sharding).rank_items()
        batches[name] = [
            collator([dataset[row] for row in rows[i : i + ROWS_PER_STEP]]) for i in range(0, len(rows), ROWS_PER_STEP)
        ]
    return batches


def run_pass(dpo: DPO, batches: list[dict]) -> float:
    """CPU seconds of forward + backward over every batch."""
    start = time.process_time()
    for batch in batches:
        result, _, _ = dpo.pair_losses(batch)
        result.losses.mean().backward()
        dpo.model.zero_grad(set_to_none=True)
    return time.process_time() - start


def model_of(hidden: int) -> ModelFactory:
    """The tiny Llama preset widened to ``hidden`` (head dim 32, MLP 3x hidden)."""
    shape = {
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": hidden // 32,
        "num_key_value_heads": max(1, hidden // 64),
    }
    return ModelFactory(preset="tiny-llama", config=shape, attn_implementation="sdpa")


def measure(name: str, count: int, repeats: int, hidden: int) -> dict[str, dict[str, float]]:
    pairs = pairs_of(count, DATASETS[name])
    batches = layouts(pairs)
    torch.manual_seed(0)
    dpo = DPO(model_of(hidden))
    dpo.configure_model()
    useful = sum(int((b["labels"] != -100).sum()) for b in batches["padded"])
    for layout in batches.values():  # warm-up: allocator and kernels, once per layout
        run_pass(dpo, layout[:2])
    seconds: dict[str, list[float]] = {layout: [] for layout in batches}
    for _ in range(repeats):
        for layout, layout_batches in batches.items():
            assert sum(int((b["labels"] != -100).sum()) for b in layout_batches) == useful  # same useful tokens
            seconds[layout].append(run_pass(dpo, layout_batches))
    processed = {
        layout: sum(b["input_ids"].numel() for b in layout_batches) for layout, layout_batches in batches.items()
    }
    return {
        layout: {
            "seconds": statistics.median(times),
            "useful_per_s": useful / statistics.median(times),
            "processed": processed[layout],
            "useful": useful,
            "steps": len(batches[layout]),
        }
        for layout, times in seconds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=256, help="pairs per data set (one pass each)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes per layout")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="model width (128 = the tiny-llama preset)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {name: measure(name, args.pairs, args.repeats, args.hidden) for name in DATASETS}
    for name, rows in results.items():
        base = rows["padded"]["useful_per_s"]
        print(
            f"\n{name}: {args.pairs} pairs, {rows['padded']['useful']} useful tokens, seq_len {SEQ_LEN}, "
            f"hidden {args.hidden}\n"
        )
        print("| layout | steps | processed tokens | useful share | CPU s | useful tokens/s | × padded |")
        print("|---|---|---|---|---|---|---|")
        for layout, row in rows.items():
            print(
                f"| {layout} | {row['steps']} | {row['processed']} | {row['useful'] / row['processed']:.1%} | "
                f"{row['seconds']:.1f} | {row['useful_per_s']:.0f} | {row['useful_per_s'] / base:.2f} |"
            )
    skewed, long = results["skewed"], results["long_prompts"]
    print(
        f"\nRESULT dpo_packing_speedup={skewed['multipacked']['useful_per_s'] / skewed['padded']['useful_per_s']:.2f}"
    )
    print(
        "RESULT dpo_packing_batch_speedup="
        f"{skewed['packed_batch']['useful_per_s'] / skewed['padded']['useful_per_s']:.2f}"
    )
    print(
        "RESULT dpo_prefix_sharing_speedup="
        f"{long['multipacked_shared']['useful_per_s'] / long['multipacked']['useful_per_s']:.2f}"
    )


if __name__ == "__main__":
    main()

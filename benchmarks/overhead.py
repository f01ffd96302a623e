"""Framework overhead: the same training step in a hand-written loop and through `lit-ablate fit`.

Both sides train the quickstart model (tiny-llama, 8 x 128 tokens, AdamW, warm-up + cosine,
gradient clipping) on the same data, and both are timed the same way: the interval between
the starts of consecutive steps, so data loading, logging and every callback the CLI adds are
inside the window. Runs alternate (hand, lit, hand, lit, ...) to spread machine noise evenly,
and the headline ratio compares each side's best run (its lowest median step): noise from other
jobs on a shared machine only ever adds time, so the best run is the closest to the real cost.

The default clock is this process's CPU time with one torch thread: framework overhead is CPU
work, and CPU time does not count the time other jobs hold the core, which on a shared 2-core
machine moves wall-clock medians by 20 %. ``--clock wall --threads 2`` times wall clock instead
(use it on a quiet or GPU machine).

    python benchmarks/overhead.py [--steps 60] [--repeats 5] [--clock cpu|wall] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from lit_ablate.cli import LitAblateCLI
from lit_ablate.modules.optim import decay_groups, decay_names, warmup_cosine

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
WARMUP = 5
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


class StepStarts(L.Callback):
    """The clock's time at the start of every training batch."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.times.append(clock())


def _cli(steps: int, root: str) -> LitAblateCLI:
    return LitAblateCLI(args=["--config", QUICKSTART, "--trainer.max_steps", str(steps),
                              "--trainer.default_root_dir", root, "--trainer.limit_val_batches", "0",
                              "--trainer.enable_progress_bar", "false"], run=False)


def median_interval(times: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1 :]))


def lit_ablate_step(steps: int) -> float:
    with tempfile.TemporaryDirectory() as root:
        cli = _cli(steps, root)
        timer = StepStarts()
        cli.trainer.callbacks.append(timer)
        cli.trainer.fit(cli.model, cli.datamodule)
    return median_interval(timer.times)


def hand_written_step(steps: int) -> float:
    with tempfile.TemporaryDirectory() as root:
        cli = _cli(steps, root)  # only to build the same model and data from the same config
    module, data = cli.model, cli.datamodule
    L.seed_everything(0)
    module.configure_model()
    data.setup("fit")
    model, hp = module.model, module.hparams
    optimizer = torch.optim.AdamW(decay_groups(model, decay_names(model, model.lm.get_input_embeddings().weight), hp.weight_decay),
                                  lr=hp.learning_rate, betas=hp.betas)
    scheduler = warmup_cosine(optimizer, hp.warmup_steps, steps, hp.min_lr_ratio)
    times: list[float] = []
    batches = iter(data.train_dataloader())
    for _ in range(steps):
        times.append(clock())
        batch = next(batches)
        loss_sum, useful = model(batch)
        (loss_sum / useful.clamp(min=1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    times.append(clock())
    return median_interval(times)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    hand, lit = [], []
    for _ in range(args.repeats):
        hand.append(hand_written_step(args.steps))
        lit.append(lit_ablate_step(args.steps))
    print(f"\nclock: {args.clock}, torch threads: {args.threads}, {args.steps} steps, {args.repeats} runs per side")
    print("\n| loop | best median step (ms) | median of runs (ms) | runs (ms) |\n|---|---|---|---|")
    for name, runs in (("hand-written PyTorch", hand), ("lit-ablate fit", lit)):
        shown = ", ".join(f"{x * 1e3:.2f}" for x in runs)
        print(f"| {name} | {min(runs) * 1e3:.2f} | {statistics.median(runs) * 1e3:.2f} | {shown} |")
    print(f"\nmedian-of-runs ratio: {statistics.median(lit) / statistics.median(hand):.3f}")
    print(f"RESULT overhead_ratio={min(lit) / min(hand):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Where a resumed run's data continues, whatever the layout that saved it.

``ShardedSampler`` deals the epoch's items (examples, packed rows or pairs) to ``W`` data-parallel
ranks in turn, so after ``k`` micro-batches of ``b`` items on each rank the run has consumed exactly
the epoch's first ``W * k * b`` items, and ``W`` ranks with batch ``b`` and accumulation ``A`` train on
the same items, step by step, as any other layout with the same global batch ``W * b * A``. A
checkpoint therefore keeps the *global* position (items consumed in the epoch) and the global batch;
a run on another number of data-parallel ranks resumes at the same item, each rank skipping its
share. A changed global batch would train on other steps' data and another objective, so it is
refused, naming the key that keeps it. A stream (``storage: stream``) saves each rank's slots'
own positions, which do not move to other ranks: it resumes on the ranks it was saved with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lit_ablate.errors import ConfigError


@dataclass(frozen=True)
class DataLayout:
    """How a run reads its data: data-parallel ranks, micro-batch per rank, micro-batches per step."""

    data_parallel_size: int
    batch_size: int
    accumulation: int = 1

    @property
    def global_batch(self) -> int:
        """Items per optimizer step over every data-parallel rank."""
        return self.data_parallel_size * self.batch_size * self.accumulation

    def describe(self) -> str:
        return (
            f"{self.global_batch} ({self.data_parallel_size} data-parallel rank(s) x batch_size "
            f"{self.batch_size} x accumulate_grad_batches {self.accumulation})"
        )


def check_resumable(saved: Mapping[str, Any], layout: DataLayout, stream: bool) -> None:
    """Raise ``ConfigError`` when a run laid out as ``layout`` cannot continue the data ``saved`` (the
    data module's checkpoint state): another global batch (the fix names the batch size, or else the
    accumulation, that keeps it), or a stream on other data-parallel ranks."""
    global_batch, ranks = saved.get("global_batch"), saved.get("data_parallel_size")
    if stream and ranks is not None and ranks != layout.data_parallel_size:
        raise ConfigError(
            "data.init_args.storage",
            "stream",
            f"a stream resumes each rank's own position, saved on {ranks} data-parallel rank(s), and this run "
            f"has {layout.data_parallel_size}: resume it on {ranks}, or train with storage: cache, whose "
            "position moves to any number of ranks",
        )
    if global_batch is None or global_batch == layout.global_batch:
        return
    ranks_and_steps = layout.data_parallel_size * layout.accumulation
    ranks_and_rows = layout.data_parallel_size * layout.batch_size
    if global_batch % ranks_and_steps == 0:
        key, value, fix = "data.init_args.batch_size", layout.batch_size, f"use {global_batch // ranks_and_steps}"
    elif global_batch % ranks_and_rows == 0:
        key, value = "trainer.accumulate_grad_batches", layout.accumulation
        fix = f"use {global_batch // ranks_and_rows}"
    else:
        key, value = "data.init_args.batch_size", layout.batch_size
        fix = f"no batch_size fits {layout.data_parallel_size} data-parallel rank(s): resume on a number dividing it"
    raise ConfigError(
        key,
        value,
        f"{fix} to keep the checkpoint's global batch of {global_batch} items per optimizer step; this run's "
        f"would be {layout.describe()}, which trains other steps on other data",
    )


def rank_items_consumed(saved: Mapping[str, Any], layout: DataLayout) -> int:
    """How many of its items each of ``layout``'s data-parallel ranks skips to continue ``saved``'s epoch
    (a checkpoint from before the position was global counted one rank's micro-batches: it resumes on the
    layout that saved it, as it always did)."""
    if "items_consumed" in saved:
        items = int(saved["items_consumed"])
    else:
        items = int(saved["batches_consumed"]) * layout.batch_size * layout.data_parallel_size
    if items % (layout.data_parallel_size * layout.batch_size):
        raise ConfigError(
            "data.init_args.batch_size",
            layout.batch_size,
            f"the checkpoint stopped after {items} items of its epoch, which {layout.data_parallel_size} "
            f"data-parallel rank(s) of {layout.batch_size} cannot split into whole micro-batches; keep the "
            f"checkpoint's global batch of {saved.get('global_batch')}",
        )
    return items // layout.data_parallel_size


def continue_unfinished_epoch(checkpoint: dict[str, Any]) -> None:
    """Make a checkpoint saved when a run stopped mid-epoch (``max_steps``) resume that epoch.

    Lightning counts an epoch as processed just before ``on_train_epoch_end``, which also runs when
    ``max_steps`` stops the loop mid-epoch, and a checkpoint saved in that hook (``ModelCheckpoint``'s
    ``save_on_train_epoch_end``, the shipped configs' ``last.ckpt``) then resumes at the *next* epoch: another
    shuffle, the saved position ignored. Where the epoch's last batch was not reached, the count is set
    back (``epoch_progress``'s ``processed``), as in a checkpoint saved after that step's batch, so the run
    continues the epoch from its saved position as the uninterrupted run does."""
    loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    if loop.get("epoch_loop.batch_progress", {}).get("is_last_batch", True):
        return
    for counts in loop.get("epoch_progress", {}).values():  # total and current
        if counts["processed"] == counts["completed"] + 1:
            counts["processed"] = counts["completed"]

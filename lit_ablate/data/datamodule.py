"""``LMDataModule``: source -> tokenizer -> format -> examples -> sampler -> collator -> batches.

Examples are tokenised at ``setup`` (deterministic, so every data-parallel rank has the same list),
by one of two storages: ``memory`` tokenises in every rank of every run and holds each example as
a tensor (the sizes CPU studies and tests use), ``cache`` tokenises once into files read with ``pread``
that every rank and run with the same data settings reuses (``token_cache.py``); ``auto``, the
default, picks one of the two by the size of what the source reads (``storage_choice.py``). A third,
``stream``, never materialises the data and tokenises in the DataLoader's workers (``streaming.py``).
Sharding over data-parallel ranks, per-epoch shuffling and exact mid-epoch resume live in the sampler; the
layout of a batch (padding or packing) lives in the collator.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from lit_ablate.data.collate import Collator, PaddingCollator
from lit_ablate.data.formats import OVERLONG_CHOICES, Example, Format, Overlong, build_examples
from lit_ablate.data.packing import PackingCollator, StreamPacking
from lit_ablate.data.preference import PreferenceFormat, build_preference_examples
from lit_ablate.data.preference_collate import PreferenceCollator, PreferencePaddingCollator
from lit_ablate.data.resume_position import DataLayout, check_resumable, rank_items_consumed
from lit_ablate.data.sampler import ShardedSampler, Sharding
from lit_ablate.data.sources import DataSource
from lit_ablate.data.storage_choice import choose_storage
from lit_ablate.data.stream_slot import StreamRecipe
from lit_ablate.data.streaming import STREAM_STATE, StreamBatchCollate, StreamingBatches
from lit_ablate.data.token_cache import CachedExampleDataset, open_or_build
from lit_ablate.data.tokenizers import load_tokenizer
from lit_ablate.errors import ConfigError

FORMATS = ("pretrain", "documents", "sft", "preference")
Storage = Literal["auto", "memory", "cache", "stream"]
STORAGES = ("auto", "memory", "cache", "stream")


class ExampleDataset(Dataset):
    """Tokenised examples; an item is an index (one example) or a tuple of indices (a packed row)."""

    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples
        self.lengths = [len(e["input_ids"]) for e in examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, item: int | tuple[int, ...]) -> Example | list[Example]:
        if isinstance(item, tuple):
            return [self.examples[i] for i in item]
        return self.examples[item]


class LMDataModule(pl.LightningDataModule):
    """Language-model data for pretraining or SFT, padded or packed, sharded over data-parallel ranks.

    Args:
        source: where rows come from (``SyntheticText``, ``ArithmeticSFT``, ``LocalFiles``, ``HubDataset``).
        format: ``pretrain`` (concatenate and cut into ``seq_len`` windows), ``documents`` (one
            example per document, for packing), ``sft`` (loss on responses only) or
            ``preference`` (chosen/rejected pairs for ``DPO``; ``lit_ablate.data.preference``).
        tokenizer: ``"byte"`` (built in, offline) or a Hugging Face tokenizer path or name.
        seq_len: the longest example, in tokens (``preference``: the longest prompt + response).
        batch_size: micro-batch per data-parallel rank (examples or pairs, or packed rows when packing).
        num_workers: DataLoader worker processes.
        collator: how examples become batches; default ``PaddingCollator()`` (``preference``:
            ``PreferencePaddingCollator()``; a preference format needs a preference collator).
        val_examples: hold out this many examples (chosen by ``seed``) for validation and ``test``.
        shuffle: shuffle training examples each epoch (by ``seed`` and epoch).
        seed: the data order's seed, independent of the model's.
        overlong: what to do with examples longer than ``seq_len``: ``truncate`` or ``reject``.
        storage: ``auto`` (the default: ``cache`` for a source reading ``AUTO_CACHE_BYTES`` (16 MiB) of
            files or hub data or more, or one that cannot tell its size; else ``memory``) or ``memory``
            (tokenise in every rank, hold examples as tensors: up to tens of MB of text) or
            ``cache`` (tokenise once into files read with ``pread`` shared by every rank and run;
            per-rank memory does not grow with the corpus beyond one int32 length per example) or
            ``stream`` (tokenise on the fly in the ``num_workers`` DataLoader workers, endless
            epochs: set ``trainer.max_steps``; no held-out split; each worker packs its own examples
            with ``PackingCollator``; resumes at each worker's saved position: ``streaming.py``).
        cache_dir: where ``cache`` keeps its entries; default ``$LIT_ABLATE_DATA_CACHE``, else
            ``~/.cache/lit_ablate/data``.
        shuffle_buffer: ``stream`` only: shuffle each slot's examples through a buffer of this many
            (seeded by ``seed``, the epoch and the slot; exact on resume; 0: source order).
        tokenize_workers: processes that tokenise while a ``cache`` entry is built (0: this one;
            ``auto`` uses them when it chooses the cache).
    """

    def __init__(
        self,
        source: DataSource,
        format: Format | PreferenceFormat = "pretrain",
        tokenizer: str = "byte",
        seq_len: int = 128,
        batch_size: int = 8,
        num_workers: int = 0,
        collator: Collator | None = None,
        val_examples: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        overlong: Overlong = "truncate",
        storage: Storage = "auto",
        cache_dir: str | None = None,
        tokenize_workers: int = 0,
        shuffle_buffer: int = 0,
    ) -> None:
        super().__init__()
        for key, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if value <= 0:
                raise ConfigError(f"data.init_args.{key}", value, "use a positive integer")
        for key, value in (("num_workers", num_workers), ("val_examples", val_examples)):
            if value < 0:
                raise ConfigError(f"data.init_args.{key}", value, "use 0 or more")
        if format not in FORMATS:
            raise ConfigError("data.init_args.format", format, f"choose one of {FORMATS}")
        if overlong not in OVERLONG_CHOICES:
            raise ConfigError("data.init_args.overlong", overlong, f"choose one of {OVERLONG_CHOICES}")
        if storage not in STORAGES:
            raise ConfigError("data.init_args.storage", storage, f"choose one of {STORAGES}")
        if tokenize_workers < 0 or (tokenize_workers and storage not in ("cache", "auto")):
            raise ConfigError(
                "data.init_args.tokenize_workers",
                tokenize_workers,
                "use 0 (this process) or more, and only with storage: cache or auto (a stream tokenises in "
                "num_workers; memory in the rank itself)",
            )
        if storage == "stream" and (
            format == "preference"
            or val_examples
            or not isinstance(collator, (PaddingCollator, PackingCollator, type(None)))
        ):
            raise ConfigError(
                "data.init_args.storage",
                storage,
                "a stream serves pretrain/documents/sft examples with PaddingCollator or PackingCollator "
                "and no val_examples (preference pairs and a held-out split need the whole data set): "
                "use storage: cache",
            )
        if shuffle_buffer < 0 or (shuffle_buffer and storage != "stream"):
            raise ConfigError(
                "data.init_args.shuffle_buffer",
                shuffle_buffer,
                "use 0, or a positive size with storage: stream (memory and cache shuffle the whole "
                "data set with shuffle: true)",
            )
        self.storage, self.cache_dir, self.tokenize_workers = storage, cache_dir, tokenize_workers
        self.shuffle_buffer = shuffle_buffer
        self.source, self.format, self.seq_len, self.batch_size = source, format, seq_len, batch_size
        self.num_workers, self.val_examples, self.shuffle, self.seed, self.overlong = (
            num_workers,
            val_examples,
            shuffle,
            seed,
            overlong,
        )
        self.tokenizer = load_tokenizer(tokenizer)
        preference = format == "preference"
        if collator is None:
            collator = PreferencePaddingCollator() if preference else PaddingCollator()
        if preference != isinstance(collator, PreferenceCollator):
            raise ConfigError(
                "data.init_args.collator",
                type(collator).__name__,
                "format preference needs PreferencePaddingCollator or PreferencePackingCollator, and "
                "other formats need PaddingCollator or PackingCollator",
            )
        self.collator = collator
        self.collator.bind(self.tokenizer.pad_id, seq_len)
        self.train_set: ExampleDataset | CachedExampleDataset | None = None
        self.val_set: ExampleDataset | CachedExampleDataset | None = None
        self.setup_record: dict[str, Any] | None = None
        """How set-up went (``storage`` as chosen, ``storage_requested``, ``storage_reason``, ``seconds``,
        ``cache_hit``, ``cache_path``, ``examples``): the run record's ``data``."""
        self._epoch, self._batches_consumed = 0, 0
        self._resumed: dict[str, Any] | None = None
        """The data state a checkpoint saved, until the next training dataloader continues from it."""
        self._stream_positions: dict[int, Any] = {}
        """Each stream slot's state after its last consumed batch (``STREAM_STATE``), for checkpoints."""

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        storage, reason = choose_storage(self.source) if self.storage == "auto" else (self.storage, "set in the config")
        chosen = {"storage": storage, "storage_requested": self.storage, "storage_reason": reason}
        if storage == "stream":
            self.setup_record = chosen | {"seconds": 0.0, "cache_hit": None, "examples": None, "cache_path": None}
            return
        start = time.perf_counter()
        store, hit, examples = None, None, []
        if storage == "cache":
            store, hit = open_or_build(
                self.cache_dir,
                self.source,
                self.tokenizer,
                self.format,
                self.seq_len,
                self.overlong,
                workers=self.tokenize_workers,
            )
        elif self.format == "preference":
            examples = build_preference_examples(self.source, self.tokenizer, self.seq_len, self.overlong)
        else:
            examples = build_examples(self.source, self.tokenizer, self.format, self.seq_len, self.overlong)
        count = len(store) if store is not None else len(examples)
        if self.val_examples >= count:
            raise ConfigError(
                "data.init_args.val_examples", self.val_examples, f"hold out fewer than the {count} examples"
            )
        held_out = (
            torch.randperm(count, generator=torch.Generator().manual_seed(self.seed))[: self.val_examples].tolist()
            if self.val_examples
            else []
        )
        if store is not None:
            self.train_set = CachedExampleDataset(store, np.array(held_out, dtype=np.int64), keep_held_out=False)
            self.val_set = CachedExampleDataset(store, np.array(held_out, dtype=np.int64), keep_held_out=True)
        else:
            held = set(held_out)
            self.train_set = ExampleDataset([e for i, e in enumerate(examples) if i not in held])
            self.val_set = ExampleDataset([e for i, e in enumerate(examples) if i in held])
        seconds = time.perf_counter() - start
        self.setup_record = chosen | {
            "seconds": seconds,
            "cache_hit": hit,
            "examples": count,
            "cache_path": str(store.directory) if store is not None else None,
        }
        if store is not None or seconds >= 10:
            how = "" if store is None else f" (token cache {'hit' if hit else 'built'}: {store.directory})"
            how += f"; storage: auto: {reason}" if self.storage == "auto" else ""
            rank_zero_info(f"data: {count} {self.format} examples in {seconds:.1f} s{how}")

    def train_dataloader(self) -> DataLoader:
        if self.storage == "stream":
            return self._stream_loader()
        sampler = self._sampler(self.train_set, shuffle=self.shuffle, drop_last=True)
        if self._resumed is not None:
            sampler.resume(self._epoch, self._resume_items())
        return self._loader(self.train_set, sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_set:
            return []
        return self._loader(self.val_set, self._sampler(self.val_set, shuffle=False, drop_last=False), drop_last=False)

    def test_dataloader(self) -> DataLoader | list:
        """The held-out examples again: ``lit-ablate test`` reports the final model on them (give
        a data config with another source for a test set apart from validation)."""
        return self.val_dataloader()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Counts consumed training batches (in the main process) for exact resume, and keeps a
        stream slot's position from its batch."""
        position = batch.pop(STREAM_STATE, None) if isinstance(batch, dict) else None
        if self.trainer is not None and self.trainer.training:
            if self.trainer.current_epoch != self._epoch:
                self._epoch, self._batches_consumed = self.trainer.current_epoch, 0
            self._batches_consumed += 1
            if position is not None:
                slot, state = position
                self._stream_positions[slot] = state
        return batch

    def layout(self) -> DataLayout:
        """This run's data-parallel ranks, micro-batch and accumulation (``resume_position``)."""
        accumulation = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        return DataLayout(self._replicas()["num_replicas"], self.batch_size, accumulation)

    def state_dict(self) -> dict[str, Any]:
        """The data position in global terms (items of the epoch consumed over every data-parallel rank)
        and the global batch, so a run on another layout continues it (``resume_position``)."""
        layout = self.layout()
        state = {
            "epoch": self._epoch,
            "items_consumed": self._batches_consumed * self.batch_size * layout.data_parallel_size,
            "global_batch": layout.global_batch,
            "data_parallel_size": layout.data_parallel_size,
            "tokenizer": self.tokenizer.spec,
            "seed": self.seed,
            "format": self.format,
        }
        if self.storage != "stream":
            return state
        return state | {
            "stream_workers": self.num_workers,
            "stream_shuffle_buffer": self.shuffle_buffer,
            "stream_packing": self._stream_packing_spec(),
            "stream_positions": self._all_stream_positions(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next training dataloader skips the batches this state had consumed."""
        if state_dict["tokenizer"] != self.tokenizer.spec:
            raise ConfigError(
                "data.init_args.tokenizer",
                self.tokenizer.spec,
                f"the checkpoint was trained with {state_dict['tokenizer']!r}; use it",
            )
        if self.storage == "stream" and state_dict.get("stream_workers") != self.num_workers:
            raise ConfigError(
                "data.init_args.num_workers",
                self.num_workers,
                f"a stream resumes exactly only with the workers it was saved with: use "
                f"{state_dict.get('stream_workers')}",
            )
        if self.storage == "stream" and state_dict.get("stream_shuffle_buffer", 0) != self.shuffle_buffer:
            raise ConfigError(
                "data.init_args.shuffle_buffer",
                self.shuffle_buffer,
                f"a stream resumes exactly only with the shuffle buffer it was saved with: use "
                f"{state_dict.get('stream_shuffle_buffer', 0)}",
            )
        if self.storage == "stream" and state_dict.get("stream_packing") != self._stream_packing_spec():
            raise ConfigError(
                "data.init_args.collator",
                self._stream_packing_spec(),
                f"a stream resumes exactly only with the packing it was saved with: use "
                f"{state_dict.get('stream_packing')} (max_tokens, strategy, window, overlong; None: padding)",
            )
        check_resumable(state_dict, self.layout(), stream=self.storage == "stream")
        self._epoch, self._resumed = state_dict["epoch"], dict(state_dict)
        self._stream_positions = dict(state_dict.get("stream_positions", {}))

    def _resume_items(self) -> int:
        """This rank's items to skip in the resumed epoch (once), counting its micro-batches from there."""
        items = rank_items_consumed(self._resumed, self.layout())
        self._batches_consumed, self._resumed = items // self.batch_size, None
        return items

    def _stream_packing(self) -> StreamPacking | None:
        """How each stream slot packs (None: one example per row): the collator's settings."""
        return self.collator.stream_packing() if isinstance(self.collator, PackingCollator) else None

    def _stream_packing_spec(self) -> tuple | None:
        """``_stream_packing`` as a plain tuple, as checkpoints hold it."""
        packing = self._stream_packing()
        return None if packing is None else dataclasses.astuple(packing)

    def _all_stream_positions(self) -> dict[int, Any]:
        """Every rank's slot positions: a checkpoint is written by rank 0, and each rank resumes its own
        slots from it. ``state_dict`` runs on every rank when Lightning saves (``dump_checkpoint``)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return dict(self._stream_positions)
        gathered: list[dict[int, Any]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, self._stream_positions)
        return {slot: state for positions in gathered for slot, state in positions.items()}

    def _replicas(self) -> dict[str, int]:
        strategy = self.trainer.strategy if self.trainer is not None else None
        if isinstance(strategy, ParallelStrategy):  # Lightning's interface for the sampler's replicas
            return dict(strategy.distributed_sampler_kwargs)
        return {"num_replicas": 1, "rank": 0}

    def _stream_loader(self) -> DataLoader:
        """This rank's stream, resumed after the batches a checkpoint had consumed."""
        max_steps = getattr(self.trainer, "max_steps", None)
        if max_steps is not None and max_steps < 0:
            raise ConfigError("trainer.max_steps", max_steps, "a stream has no epoch end: set trainer.max_steps")
        skip = self._resume_items() // self.batch_size if self._resumed is not None else 0
        recipe = StreamRecipe(
            self.source,
            self.tokenizer,
            self.format,
            self.seq_len,
            self.overlong,
            shuffle_buffer=self.shuffle_buffer if self.shuffle else 0,
            seed=self.seed,
            packing=self._stream_packing(),
        )
        positions = dict(self._stream_positions) if skip else None
        dataset = StreamingBatches(recipe, self.batch_size, **self._replicas(), skip_batches=skip, positions=positions)
        return DataLoader(
            dataset, batch_size=None, collate_fn=StreamBatchCollate(self.collator), num_workers=self.num_workers
        )

    def _sampler(self, dataset: ExampleDataset, shuffle: bool, drop_last: bool) -> ShardedSampler:
        sharding = Sharding(
            **self._replicas(), shuffle=shuffle, seed=self.seed, drop_last=drop_last, batch_size=self.batch_size
        )
        return self.collator.sampler(dataset, dataset.lengths, sharding)

    def _loader(self, dataset: ExampleDataset, sampler: ShardedSampler, drop_last: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self.collator,
            num_workers=self.num_workers,
            drop_last=drop_last,
        )

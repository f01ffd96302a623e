"""The CP step of the mesh strategy: every sequence split over the mesh's ``cp`` ranks (``ContextParallelSteps``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import ConfigError
from lit_ablate.models.attention.block_kernels import (
    BLOCK_KERNELS,
    KERNEL_KEY,
    BlockKernel,
    BlockKernelName,
    block_kernel,
)
from lit_ablate.models.attention.context_parallel import (
    CONTEXT_PARALLEL_ATTRIBUTE,
    CONTEXT_PARALLEL_BACKENDS,
    ContextParallelGroup,
)
from lit_ablate.models.attention.sequence_layout import LAYOUTS, LayoutName, SequenceLayout
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss, decoder_layers
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.strategies.fsdp2 import FullyShardSteps
from lit_ablate.strategies.mesh import STRATEGY_OPTIONS_KEY

ContextParallelImpl = Literal["ring", "allgather"]
SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")
"""Batch keys holding one value per token (``[B, T]``): each rank keeps its slice of them."""
WHOLE_BATCH_SEGMENT_KEYS = ("cu_seqlens", "max_seqlen")
"""The packer's document boundaries over the whole flattened batch: wrong for a slice, so dropped
(context-parallel attention reads documents from ``position_ids``)."""


class ContextParallelSteps(FullyShardSteps):
    """Context parallelism: the ``cp`` ranks share each batch, each holding a slice of every sequence.

    Choose it when one sequence's activations do not fit a device (long context): activations and
    attention work per rank shrink by ``cp``, at the price of exchanging keys and values in every
    attention layer. Each batch is cut along the sequence on the device, after the collator shifted
    the labels on the whole sequence; ``position_ids`` are made explicit (packed documents keep
    theirs), so rotary embeddings and document boundaries stay those of the whole sequence. While
    the strategy runs a step (forward and backward; validation, test and predict steps: CP's part of
    ``step_context``), the model's attention is the context-parallel backend ``cp_impl``; outside
    steps (generation) it is the configured one. Parameters are FSDP2-sharded over ``dp_shard x cp``
    (HSDP with ``dp_replicate``); the step's gradients are the global token mean over every rank
    (``StepObjective`` counts each shard's labels, and undoes FSDP's division by ``cp``), so the
    run trains the same model as one process on the whole batch.

    A length that is not a multiple of the layout's chunks (``cp``, or ``2 cp`` for zigzag) is
    padded at the end of each row by the strategy: the appended tokens carry no label and, being
    last, are seen by no real token, so every real token's loss is exactly unchanged; they count as
    processed (not useful) tokens, like a collator's padding. An error instead would stop a run
    whenever a dynamically padded or packed batch happened to have an odd length.

    The step of ``MeshParallelStrategy`` that runs when ``cp > 1`` (``ContextParallelStrategy`` is its preset).

    Args:
        cp_impl: ``ring`` (K/V passed rank to rank, point to point, overlapped with the block
            computation) or ``allgather`` (one all-gather of K/V per layer, reduce-scatter of
            dK/dV in backward; more memory, fewer messages).
        cp_block_kernel: what computes each (query chunk, key chunk) block of either: ``sdpa``
            (torch's ops: ATen's flash op on CPU, the memory-efficient op on CUDA; runs
            everywhere), ``flash_attn`` (the flash-attn package on CUDA in bf16/fp16, for blocks
            without a document or padding mask; ``sdpa`` for those) or ``flex`` (flex_attention
            on CUDA, documents included). See ``lit_ablate.models.attention.block_kernels``.
        cp_layout: ``zigzag`` (each rank holds a head and a tail chunk: equal causal attention
            work on every rank) or ``contiguous`` (rank r holds the r-th slice: the last rank does
            ``2 cp - 1`` times the attention work of the first).
        **kwargs: the mesh sizes and the other steps' options (``MeshParallelStrategy``).
    """

    def __init__(
        self,
        cp_impl: ContextParallelImpl = "ring",
        cp_layout: LayoutName = "zigzag",
        cp_block_kernel: BlockKernelName = "sdpa",
        **kwargs: Any,
    ) -> None:
        if cp_impl not in CONTEXT_PARALLEL_BACKENDS:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.cp_impl", cp_impl, f"choose one of {sorted(CONTEXT_PARALLEL_BACKENDS)}"
            )
        if cp_layout not in LAYOUTS:
            raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.cp_layout", cp_layout, f"choose one of {list(LAYOUTS)}")
        if cp_block_kernel not in BLOCK_KERNELS:
            raise ConfigError(KERNEL_KEY, cp_block_kernel, f"choose one of {list(BLOCK_KERNELS)}")
        super().__init__(**kwargs)
        self.cp_impl = cp_impl
        self.cp_layout = cp_layout
        self.cp_block_kernel = cp_block_kernel
        self._cp_models: list[CausalLMWithLoss] = []
        self._cp_kernels: list[BlockKernel] = []

    def setup_environment(self) -> None:
        if self.requested_mesh_sizes.cp != 1:
            block_kernel(self.cp_block_kernel, self.root_device)  # refused here, before any work
        super().setup_environment()

    @property
    def splits_sequences(self) -> bool:
        """Whether the context-parallel step is on (``cp > 1``): it shards batches and switches attention."""
        return self.mesh_sizes is not None and self.mesh_sizes.cp > 1

    @property
    def layout(self) -> SequenceLayout:
        """How each sequence is split over the ``cp`` ranks (the mesh must exist)."""
        return SequenceLayout(self.cp_layout, self.mesh_sizes.cp)

    @property
    def cp_rank(self) -> int:
        return self.device_mesh["cp"].get_local_rank()

    @property
    def fallbacks(self) -> list[str]:
        """The block kernels' fallbacks (flash_attn's masked blocks on the memory-efficient op)."""
        return [line for kernel in self._cp_kernels for line in kernel.fallbacks()]

    @property
    def flops_share(self) -> float:
        """The share of a batch's model FLOPs this rank computes, besides tensor parallelism: the
        ``cp`` ranks share one batch, and ``MFUMonitor`` counts each rank's ``1 / cp`` of it."""
        return 1.0 / self.mesh_sizes.cp

    # ---------------------------------------------------------------- the step
    def apply_cp(self, model: CausalLMWithLoss) -> None:
        """Attach the ``cp`` group and layout to every attention module (read by the ``ring`` and
        ``allgather`` backends), and remember the model so steps switch its attention to ``cp_impl``."""
        group = self.device_mesh["cp"].get_group()
        kernel = block_kernel(self.cp_block_kernel, torch.device(self.device_mesh.device_type))
        self._cp_kernels.append(kernel)
        context = ContextParallelGroup(group, self.layout, self.cp_rank, kernel)
        for module in attention_modules(model):
            setattr(module, CONTEXT_PARALLEL_ATTRIBUTE, context)
        self._cp_models.append(model)

    # ---------------------------------------------------------------- batches and steps
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.shard_batch(batch) if self.splits_sequences else batch

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's slice of every sequence of ``batch`` (see the class docstring).

        ``document_lengths`` stays whole: FLOPs are counted on the whole batch (each document's
        attention spans all its tokens) and ``MFUMonitor`` takes this rank's ``flops_share``. A batch
        without them (a custom collator's) gets its whole rows' lengths: counted from the slice, a
        rank's FLOPs would be divided by ``cp`` twice.
        """
        if not isinstance(batch, dict) or batch.get("input_ids") is None or batch.get("labels") is None:
            raise ConfigError(
                TRAINER_STRATEGY_KEY,
                type(self).__name__,
                "context parallelism shards batches with input_ids and (already shifted) labels, "
                "as lit-ablate's collators make them; use another strategy for this module",
            )
        rows, length = batch["input_ids"].shape
        for key, value in batch.items():
            if key not in SEQUENCE_KEYS and torch.is_tensor(value) and value.shape[:2] == (rows, length):
                raise ConfigError(
                    TRAINER_STRATEGY_KEY,
                    type(self).__name__,
                    f"the batch has another per-token tensor, {key!r}: a module that reduces per "
                    "sequence (DPO's sequence log-probs) would see each rank's partial sums; context "
                    f"parallelism supports language-model batches ({', '.join(SEQUENCE_KEYS)})",
                )
        sequences = {key: batch[key] for key in SEQUENCE_KEYS if batch.get(key) is not None}
        if "position_ids" not in sequences:
            sequences["position_ids"] = torch.arange(length, device=batch["input_ids"].device).expand(rows, length)
        layout = self.layout
        extra = -length % layout.num_chunks
        if extra:
            sequences = pad_sequence_end(sequences, extra)
        sharded = {key: value for key, value in batch.items() if key not in WHOLE_BATCH_SEGMENT_KEYS}
        sharded.setdefault("document_lengths", [length] * rows)
        sharded.update({key: layout.shard(value, self.cp_rank, dim=1) for key, value in sequences.items()})
        return sharded

    @contextmanager
    def context_parallel_attention(self) -> Iterator[None]:
        """Within: the parallelised models attend with ``cp_impl`` (a step on sharded batches;
        ``step_context`` enters it around Lightning's steps)."""
        configs = [(model.lm.config, model.lm.config._attn_implementation) for model in self._cp_models]
        for config, _ in configs:
            config._attn_implementation = self.cp_impl
        try:
            yield
        finally:
            for config, name in configs:
                config._attn_implementation = name


def attention_modules(model: CausalLMWithLoss) -> list[nn.Module]:
    """The attention modules of the decoder layers: those declaring ``is_causal``, which
    transformers' attention integrations read from the module they are called with."""
    modules = [m for layer in decoder_layers(model) for m in layer.modules() if hasattr(m, "is_causal")]
    if not modules:
        raise ConfigError(
            "model",
            type(model.lm).__name__,
            "context parallelism found no attention module (one declaring is_causal) in the decoder layers",
        )
    return modules


def pad_sequence_end(sequences: dict[str, torch.Tensor], extra: int) -> dict[str, torch.Tensor]:
    """``extra`` tokens appended to every row: no label, positions continuing, masked out as padding."""
    fill = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
    out = {}
    for key, value in sequences.items():
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, extra + 1, device=value.device)
        else:
            tail = value.new_full((value.shape[0], extra), fill[key])
        out[key] = torch.cat([value, tail], dim=1)
    return out

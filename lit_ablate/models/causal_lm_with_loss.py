"""A Hugging Face causal LM and its loss in one ``nn.Module``.

The loss backends read the LM-head weight directly (fused kernels never build logits), so the
loss must run inside the same ``forward`` as the model: a sharding wrapper (FSDP2's root) gathers
the parameters it owns for exactly the duration of that forward. This module is what strategies
parallelise; it holds no parallelism itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lit_ablate.errors import ConfigError
from lit_ablate.models.attention.backends import PREPARED_MASKS
from lit_ablate.models.compiled_layers import SEQUENCE_DIM, mark_sequence_dynamic
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX, LossBackend

# Batch keys the decoder consumes; everything else in a batch is bookkeeping (labels, counts).
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")
# Attention backends that take a packed batch's segments (``cu_seq_lens_*``/``max_length_*``).
SEGMENT_BACKENDS = ("fa_varlen", "torch_varlen")


class CausalLMWithLoss(nn.Module):
    """Decoder + LM head + loss backend; ``forward(batch)`` returns the summed token loss.

    Attributes:
        lm: the Hugging Face ``...ForCausalLM`` model (``save_pretrained``, ``generate`` work on it).
        loss_fn: a ``LossBackend``; ``z_loss_weight`` adds ``w * logsumexp(logits)^2`` per token.
    """

    def __init__(self, lm: PreTrainedModel, loss_fn: LossBackend) -> None:
        super().__init__()
        self.lm = lm
        self.loss_fn = loss_fn

    @property
    def decoder_layer_types(self) -> tuple[type[nn.Module], ...]:
        """The decoder-layer classes (from HF ``_no_split_modules``): the units strategies wrap."""
        names = set(getattr(self.lm, "_no_split_modules", None) or ())
        return tuple({type(m) for m in self.lm.modules() if type(m).__name__ in names})

    def forward(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Returns ``(loss_sum, useful_tokens)``: fp32 sum of CE over labels != -100, and their count.

        ``use_cache=False`` always: transformers only derives per-document attention from
        ``position_ids`` when no cache exists, so a packed batch would otherwise leak across
        documents (docs/platform.md#packed-position_ids-leak-across-documents-with-a-kv-cache).
        """
        return self.head_outputs(self.hidden_states(batch), batch)

    def head_outputs(self, hidden: Tensor, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """What ``forward`` returns, from the decoder's last hidden states of the batch (a pipeline's
        last stage computes it from the hidden states it receives)."""
        head = self.lm.get_output_embeddings()
        labels = batch["labels"].reshape(-1)
        loss_sum = self.loss_fn(hidden.reshape(-1, hidden.shape[-1]), head.weight, labels, head.bias)
        return loss_sum, (labels != IGNORE_INDEX).sum()

    def hidden_states(self, batch: dict[str, Any]) -> Tensor:
        """The decoder's last hidden states ``[B, T, H]`` for the batch's model inputs; with a backend of
        ``PREPARED_MASKS``, under the batch's mask built once here (the sequence dimensions of the
        positions and mask marked dynamic for compiled layers: ``compiled_layers``)."""
        inputs = {k: batch[k] for k in MODEL_INPUT_KEYS if batch.get(k) is not None}
        prepare = PREPARED_MASKS.get(self.lm.config._attn_implementation)
        if prepare is not None:
            rows, length = batch["input_ids"].shape
            positions = inputs.get("position_ids")
            mask = prepare(positions, inputs.get("attention_mask"), rows, length, batch["input_ids"].device)
            inputs["attention_mask"] = mark_sequence_dynamic(mask, 2, 3) if isinstance(mask, Tensor) else mask
            if positions is not None:
                mark_sequence_dynamic(positions, SEQUENCE_DIM)
        if batch.get("cu_seqlens") is not None and self.lm.config._attn_implementation in SEGMENT_BACKENDS:
            # The packer's document boundaries, so the kernel need not find them (a host sync).
            cu, longest = mark_sequence_dynamic(batch["cu_seqlens"], 0), int(batch["max_seqlen"])
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return self.lm.base_model(**inputs, use_cache=False).last_hidden_state

    @torch.no_grad()
    def logits(self, input_ids: Tensor, **inputs: Tensor) -> Tensor:
        """Full logits, for evaluation and equivalence tests (training never calls this)."""
        return self.lm(input_ids=input_ids, use_cache=False, **inputs).logits


def decoder_layers(model: CausalLMWithLoss) -> list[nn.Module]:
    """The decoder layers, in order: the units that checkpointing, compile and FSDP act on."""
    types = model.decoder_layer_types
    layers = [m for m in model.modules() if types and isinstance(m, types)]
    if not layers:
        raise ConfigError(
            "model",
            type(model.lm).__name__,
            "the model declares no decoder-layer classes (Hugging Face `_no_split_modules`); "
            "compile and the mesh strategies need them to know what to wrap",
        )
    return layers

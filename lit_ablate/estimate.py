"""Analytical FLOPs per token and parameter counts.

Modules report FLOPs from here; ``MFUMonitor`` divides by a peak. Counts come from the built
(or meta-device) model itself, so any Hugging Face architecture is counted without a per-family
formula. Conventions (torchtitan's, stated so numbers are comparable across techniques):

- training FLOPs per token = ``6 * N_matmul + 12 * L * H * d_head * S``: 2 FLOPs per multiply-add
  in the forward, twice that in the backward; the second term is attention's ``QK^T`` and ``AV``
  over a full ``S x S`` score matrix (no discount for causal masking, no recompute counted);
- ``N_matmul`` is the active parameter count minus the input-embedding table (a lookup, not a
  matmul). With tied embeddings the same table *is* the LM head, a real matmul, so it is counted;
- MoE: expert parameters count ``top_k / num_experts`` of their size — only routed experts run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig


@dataclass(frozen=True)
class ParameterCounts:
    """What a model holds and what one token touches."""

    total: int
    embedding: int
    """The input-embedding table (a lookup)."""
    experts: int
    """Parameters of routed experts (0 for a dense model)."""
    active: int
    """Parameters one token uses: ``total`` with experts scaled by ``top_k / num_experts``."""
    matmul: int
    """Active parameters that take part in a matmul: what ``6 * N`` counts."""


def _is_experts(module: nn.Module) -> bool:
    """Routed-expert containers hold every expert's weights (HF ``...Experts``, ours alike)."""
    return type(module).__name__.endswith("Experts")


def _experts_per_token(config: PretrainedConfig) -> tuple[int, int]:
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    return int(num_experts), int(getattr(config, "num_experts_per_tok", 0) or 0)


def count_parameters(model: nn.Module, config: PretrainedConfig) -> ParameterCounts:
    """Counts for a built model (``meta`` device is fine: only shapes are read)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    experts = sum(p.numel() for m in model.modules() if _is_experts(m) for p in m.parameters(recurse=False))
    num_experts, top_k = _experts_per_token(config)
    inactive = experts - (experts * top_k // num_experts if num_experts else experts)
    active = total - inactive
    matmul = active - (0 if tied else embed.numel())
    return ParameterCounts(total=total, embedding=embed.numel(), experts=experts, active=active, matmul=matmul)


def attention_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(attention layers, query heads, head dim)`` from a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, head_dim


def flops_per_token(counts: ParameterCounts, config: PretrainedConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token for sequences of ``seq_len`` tokens."""
    layers, heads, head_dim = attention_shape(config)
    return 6.0 * counts.matmul + 12.0 * layers * heads * head_dim * seq_len


def count_parameters_of_config(config: PretrainedConfig) -> ParameterCounts:
    """Counts for a config without allocating weights (the model is built on ``meta``)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return count_parameters(model, config)

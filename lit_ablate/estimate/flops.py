"""Analytical FLOPs per token and parameter counts.

Modules report FLOPs from here; ``MFUMonitor`` divides by a peak. Counts come from the built
(or meta-device) model itself, so any Hugging Face architecture is counted without a per-family
formula. Conventions (torchtitan's, stated so numbers are comparable across techniques):

- training FLOPs per token = ``6 * N_matmul + 12 * L * H * d_head * S``: 2 FLOPs per multiply-add
  in the forward, twice that in the backward; the second term is attention's ``QK^T`` and ``AV``
  over a full ``S x S`` score matrix (no discount for causal masking, no recompute counted);
- ``N_matmul`` is the active parameter count minus the input-embedding table (a lookup, not a
  matmul). With tied embeddings the same table *is* the LM head, a real matmul, so it is counted;
- MoE: expert parameters count ``top_k / num_experts`` of their size — only routed experts run;
- a frozen base (adapters, ``lit_ablate.models.adapters.lora``) needs no weight gradients: a frozen matmul
  costs ``4 N`` per token (forward 2N + the input gradient 2N that reaches earlier adapters), a
  trainable one ``6 N``, so ``6 * N_matmul`` becomes ``6 * N_trainable_matmul + 4 * N_frozen_matmul``
  (LoRA's own matrices are trainable matmuls). Dequantising a 4/8-bit base (QLoRA) and DoRA's
  weight norms are elementwise overhead, not model FLOPs, and are not counted (as recompute is not).
- DPO (``lit_ablate.modules.DPO``) trains on both sequences of each pair (a micro-batch of ``P`` pairs
  is ``2 P`` sequences); a frozen or adapter-disabled reference adds a forward (``2 N`` per token, a
  third of a training step: ``preference_flops_factor``); a precomputed one ran once before training.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

SMALL_TENSOR_ELEMENTS = 4096
"""bitsandbytes' 8-bit optimizers keep the states of tensors under this many elements in fp32."""


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
    trainable: int
    """Parameters that get gradients and optimizer states (``total`` unless the base is frozen)."""
    adapter: int
    """Adapter weights (LoRA matrices, DoRA magnitudes, trainable copies of ``modules_to_save``)."""
    trainable_matmul: int
    """Trainable parameters that take part in a matmul (``6 N``; the rest of ``matmul`` costs ``4 N``)."""
    quantized: int
    """Frozen base weights stored quantised (bitsandbytes 4/8-bit), counted as weights, not bytes."""
    quantized_bytes: int
    """Their storage: packed weights plus scales."""
    small_trainable: int
    """Trainable parameters in tensors under 4096 elements, whose 8-bit optimizer states stay fp32."""


def _is_experts(module: nn.Module) -> bool:
    """Routed-expert containers hold every expert's weights (HF ``...Experts``, ours alike)."""
    return type(module).__name__.endswith("Experts")


def _experts_per_token(config: PretrainedConfig) -> tuple[int, int]:
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    return int(num_experts), int(getattr(config, "num_experts_per_tok", 0) or 0)


def count_parameters(model: nn.Module, config: PretrainedConfig, quantization: Any = None) -> ParameterCounts:
    """Counts for a built model (``meta`` device is fine: only shapes are read).

    A quantised model counts each packed weight as the weights it holds. ``quantization``
    (``QuantizationOptions``) describes a model not quantised yet (a ``meta`` build for the
    estimate): the linear layers it would quantise are counted as quantised.
    """
    from lit_ablate.models.adapters.lora import adapter_parameter_names
    from lit_ablate.models.adapters.quantization import is_quantized, quantized_linear_names

    names = adapter_parameter_names(model)
    stored = [(p, _quantized_weights(p)) for p in model.parameters() if is_quantized(p)]
    if stored:
        quantized = sum(n for _, n in stored)
        quantized_bytes = sum(_quantized_bytes(p) for p, _ in stored)
    elif quantization is not None:  # the base layers quantize_linears replaces before adapters are injected
        quantized = sum(
            model.get_submodule(n).weight.numel()
            for n in quantized_linear_names(model, quantization)
            if f"{n}.weight" not in names
        )
        quantized_bytes = int(quantized * quantization.bits_per_weight / 8)
    else:
        quantized = quantized_bytes = 0
    total = sum(p.numel() for p in model.parameters() if not is_quantized(p)) + sum(n for _, n in stored)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    experts = sum(p.numel() for m in model.modules() if _is_experts(m) for p in m.parameters(recurse=False))
    num_experts, top_k = _experts_per_token(config)
    active_experts = experts * top_k // num_experts if num_experts else 0
    expert_lora = _expert_lora_parameters(model)
    active = total - (experts - active_experts) - expert_lora
    matmul = active - (0 if tied else embed.numel())
    trainable_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = sum(p.numel() for _, p in trainable_params)
    trainable_matmul = (
        matmul
        if trainable == total
        else sum(p.numel() for _, p in trainable_params if p.ndim >= 2 and (tied or p is not embed))
        - expert_lora
        + (active_experts if expert_lora else 0)
    )
    return ParameterCounts(
        total=total,
        embedding=embed.numel(),
        experts=experts,
        active=active,
        matmul=matmul,
        trainable=trainable,
        adapter=sum(p.numel() for n, p in model.named_parameters() if n in names),
        trainable_matmul=trainable_matmul,
        quantized=quantized,
        quantized_bytes=quantized_bytes,
        small_trainable=sum(p.numel() for _, p in trainable_params if p.numel() < SMALL_TENSOR_ELEMENTS),
    )


def _expert_lora_parameters(model: nn.Module) -> int:
    """Parameters of LoRA on routed experts: lit-ablate's ``ExpertLoRA`` (``models.expert_adapters``)
    and peft's ``ParamWrapper`` (``target_parameters`` on transformers' stacked experts). Both are
    merged into the expert weights once per forward (peft through a cached parametrization), not
    applied per token; the adapted expert weights then get a full weight gradient: 6 N on the active
    experts."""
    adapters = {id(p): p for m in model.modules() if type(m).__name__ == "ExpertLoRA" for p in m.parameters()}
    adapters |= {
        id(p): p
        for m in model.modules()
        if type(m).__name__ == "ParamWrapper"
        for name, p in m.named_parameters()
        if "lora_" in name
    }
    return sum(p.numel() for p in adapters.values())


def _quantized_weights(param: torch.Tensor) -> int:
    """Weights a bitsandbytes parameter holds: its 4-bit ``quant_state`` knows the unpacked shape."""
    state = getattr(param, "quant_state", None)
    return state.shape.numel() if state is not None and state.shape is not None else param.numel()


def _quantized_bytes(param: torch.Tensor) -> int:
    """Storage of a bitsandbytes parameter: packed codes, plus a 4-bit weight's scales (nested too)."""
    state = getattr(param, "quant_state", None)
    scales = (
        []
        if state is None
        else [state.absmax, state.code] + ([state.state2.absmax, state.state2.code] if state.nested else [])
    )
    return param.numel() * param.element_size() + sum(t.numel() * t.element_size() for t in scales)


def attention_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(attention layers, query heads, head dim)`` from a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, head_dim


def flops_per_token(counts: ParameterCounts, config: PretrainedConfig, seq_len: float) -> float:
    """Training (forward + backward) FLOPs per token at context ``seq_len`` (see ``batch_model_flops``)."""
    layers, heads, head_dim = attention_shape(config)
    frozen = counts.matmul - counts.trainable_matmul
    return 6.0 * counts.trainable_matmul + 4.0 * frozen + 12.0 * layers * heads * head_dim * seq_len


REFERENCE_FORWARD_SHARE = 1 / 3
"""A forward pass is a third of a training step's FLOPs (2N of 6N, and 4 of 12 attention units)."""
REFERENCES_RUN_EACH_STEP = ("frozen", "adapter")
"""DPO references computed by a forward in every step (their FLOPs count)."""


def preference_flops_factor(reference: str) -> float:
    """DPO's model FLOPs per policy training FLOP with ``reference`` (frozen/adapter: one more forward)."""
    return 1 + REFERENCE_FORWARD_SHARE if reference in REFERENCES_RUN_EACH_STEP else 1.0


def batch_model_flops(batch: Mapping[str, Any], flops_per_token: Callable[[float], float]) -> float:
    """Model FLOPs of one batch: each document's real tokens at its own context; padding counts nothing.

    ``document_lengths`` (a host-side list the collators attach: one entry per padded row's
    example, or per packed row's document) gives the lengths without reading a device tensor, so
    no host synchronisation happens inside a step. Since ``flops_per_token`` is linear in the
    context, this equals ``flops_per_token(sum(len^2) / sum(len)) * sum(len)``: the token-weighted
    mean context, which is what keeps packed rows from claiming attention across documents. A
    batch without ``document_lengths`` counts every position as a token of a row-long document.
    """
    lengths = batch.get("document_lengths")
    if lengths is None:
        rows, width = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
        lengths = [width] * rows
    tokens = sum(lengths)
    return flops_per_token(sum(n * n for n in lengths) / tokens) * tokens if tokens else 0.0


def count_parameters_of_config(config: PretrainedConfig) -> ParameterCounts:
    """Counts for a config without allocating weights (the model is built on ``meta``)."""
    return count_parameters(meta_model(config), config)


def meta_model(config: PretrainedConfig) -> nn.Module:
    """``config``'s model on the ``meta`` device, with eager attention: sizes do not depend on the
    attention implementation, and a GPU-only one (flash_attention_2) would refuse to build here."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")

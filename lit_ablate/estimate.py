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
- a frozen base (adapters, ``lit_ablate.models.adapters``) needs no weight gradients: a frozen matmul
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
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PretrainedConfig

from lit_ablate.ablation.dotted import get_dotted

if TYPE_CHECKING:
    from lit_ablate.strategies.state_sharding import StateSharding


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
    from lit_ablate.models.adapters import adapter_parameter_names
    from lit_ablate.models.quantization import is_quantized, quantized_linear_names
    from lit_ablate.modules.optim import SMALL_TENSOR_ELEMENTS

    names = adapter_parameter_names(model)
    stored = [(p, _quantized_weights(p)) for p in model.parameters() if is_quantized(p)]
    if stored:
        quantized = sum(n for _, n in stored)
        quantized_bytes = sum(_quantized_bytes(p) for p, _ in stored)
    elif quantization is not None:  # the base layers quantize_linears replaces before adapters are injected
        quantized = sum(model.get_submodule(n).weight.numel() for n in quantized_linear_names(model, quantization)
                        if f"{n}.weight" not in names)  # fmt: skip
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
    trainable_matmul = matmul if trainable == total else sum(
        p.numel() for _, p in trainable_params if p.ndim >= 2 and (tied or p is not embed)) - expert_lora + (
        active_experts if expert_lora else 0)  # fmt: skip
    return ParameterCounts(
        total=total, embedding=embed.numel(), experts=experts, active=active, matmul=matmul, trainable=trainable,
        adapter=sum(p.numel() for n, p in model.named_parameters() if n in names),
        trainable_matmul=trainable_matmul, quantized=quantized, quantized_bytes=quantized_bytes,
        small_trainable=sum(p.numel() for _, p in trainable_params if p.numel() < SMALL_TENSOR_ELEMENTS),
    )  # fmt: skip


def _expert_lora_parameters(model: nn.Module) -> int:
    """Parameters of LoRA on routed experts: lit-ablate's ``ExpertLoRA`` (``models.expert_adapters``)
    and peft's ``ParamWrapper`` (``target_parameters`` on transformers' stacked experts). Both are
    merged into the expert weights once per forward (peft through a cached parametrization), not
    applied per token; the adapted expert weights then get a full weight gradient: 6 N on the active
    experts."""
    adapters = {id(p): p for m in model.modules() if type(m).__name__ == "ExpertLoRA" for p in m.parameters()}
    adapters |= {id(p): p for m in model.modules() if type(m).__name__ == "ParamWrapper"
                 for name, p in m.named_parameters() if "lora_" in name}
    return sum(p.numel() for p in adapters.values())


def _quantized_weights(param: torch.Tensor) -> int:
    """Weights a bitsandbytes parameter holds: its 4-bit ``quant_state`` knows the unpacked shape."""
    state = getattr(param, "quant_state", None)
    return state.shape.numel() if state is not None and state.shape is not None else param.numel()


def _quantized_bytes(param: torch.Tensor) -> int:
    """Storage of a bitsandbytes parameter: packed codes, plus a 4-bit weight's scales (nested too)."""
    state = getattr(param, "quant_state", None)
    scales = [] if state is None else [state.absmax, state.code] + ([state.state2.absmax, state.state2.code] if state.nested else [])
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


# --- per-rank memory ------------------------------------------------------------------------------
# Bytes one rank holds at the peak of a training step: parameters, gradients and optimizer states
# (divided by the strategy's sharding), activations saved for backward (not divided by data
# parallelism), and the transient copies a strategy makes (gathered layers, DDP's gradient buckets).
# The activation model counts the tensors autograd saves per token; it was calibrated against
# torch's MemTracker on CPU for Llama/Qwen3(-MoE) shapes with SDPA (tests/test_estimate_memory.py).

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum", "adamw8bit")
CHECKPOINTING = ("none", "full", "selective")
LOSS_LOGIT_COPIES = {"torch": 3.0, "chunked": 1.0, "liger": 0.0, "cce": 0.0, "liger_dpo": 3.0}
"""fp32 ``[tokens, vocab]`` tensors alive at the loss's peak: torch keeps logits, log-softmax and the
logits' gradient; chunked one chunk's (softmax and its gradient are formed in place; half-precision
weights add the chunk's half-precision logits and gradient, ``HALF_CHUNK_COPIES``: measured
against the liger_vs_cce study at a 32768 vocabulary); the fused kernels keep small blocks only
(not counted). Liger's fused DPO (``liger_dpo``) runs ``torch.func`` on ``2 x chunk_pairs`` whole
sequences at a time: their fp32 logits, log-softmax and gradient (``chunk_tokens`` = those tokens)."""
HALF_CHUNK_COPIES = 0.5
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The sizes the activation model reads, taken from a transformers config and its (meta) model."""

    layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    vocab: int
    heads: int
    qk_norm: bool
    experts: int
    experts_per_token: int
    expert_intermediate: int
    shared_expert_intermediate: int
    layer_params: int
    """Parameters of the largest decoder layer: what a sharded strategy gathers at a time."""


@dataclass(frozen=True)
class TrainingShape:
    """What a run's memory depends on besides its model and its sharding.

    Args:
        micro_batch: sequences per rank per forward.
        seq_len: tokens per sequence.
        param_bytes: bytes per stored parameter (and gradient): 4 for fp32, 2 for bf16.
        activation_bytes: bytes per saved activation: 2 under bf16/fp16 (mixed or true), else 4.
        optimizer: ``adamw``/``adam`` (two states in the parameter dtype), ``sgd``,
            ``sgd_momentum`` (one state), ``adamw8bit`` (two 1-byte states).
        checkpointing: ``none``, ``full`` (every decoder layer) or ``selective`` (every
            ``checkpoint_every``-th layer), as the mesh strategies apply it.
        loss: the loss backend (how many ``[tokens, vocab]`` fp32 copies it keeps).
        chunk_tokens: the chunked loss's token chunk.
        loss_grad_in_forward: the chunked loss forms its gradients in the forward (its default, as
            Liger always does), so they are held until the backward.
        attention: the attention backend; ``eager`` saves the ``[heads, seq]`` scores per token.
        gradient_as_bucket_view: DDP without a second gradient copy in its buckets.
        fp8_all_gather: FSDP2 all-gathers the decoder layers' linear weights in fp8
            (``model.fp8.fsdp_all_gather``): the gathered layers take 1 byte per weight, and the
            two layers being gathered hold a 1-byte cast of this rank's shard beside it.
            fp8 otherwise changes no category here: torchao's ``Float8Linear`` saves its input and
            weight for backward in their own precision, and its fp8 casts are short temporaries.
        context_parallel: ranks each sequence is split over (``ContextParallelStrategy``'s cp).
        context_parallel_impl: ``ring`` or ``allgather`` (what the exchange keeps in memory).
        tensor_parallel: ranks each matrix is split over (``TensorParallelStrategy``'s tp): the
            heads, the MLP width and the loss's vocabulary columns per rank are divided by it.
        sequence_parallel: the residual stream (the norms' activations) is split by ``tp`` too.
        reference: DPO's reference model (``none`` for a language model): ``frozen`` keeps a second
            copy of the parameters, sharded like them, without gradients or optimizer states;
            ``precomputed`` (two fp32 numbers per pair) and ``adapter`` (the same weights) add nothing.
        pipeline_parallel: pipeline ranks (``PipelineParallelStrategy``'s pp); above 1, ``micro_batch``
            is the rows a step reads, run as ``microbatches`` pieces under ``pipeline_schedule``
            (``gpipe``, ``1f1b`` or ``interleaved_1f1b``), and the memory is the largest rank's
            (``pipeline_stage_estimates``).
        pipeline_stages_per_rank: stages each pipeline rank holds (``interleaved_1f1b``'s ``stages_per_rank``).
        split_points: the stages' first decoder layers after the first stage; None: balanced by
            parameter count as the strategy balances them.
    """

    micro_batch: int
    seq_len: int
    param_bytes: int = 4
    activation_bytes: int = 4
    optimizer: str = "adamw"
    checkpointing: str = "none"
    checkpoint_every: int = 2
    loss: str = "torch"
    chunk_tokens: int = 1024
    loss_grad_in_forward: bool = True
    attention: str = "sdpa"
    gradient_as_bucket_view: bool = False
    fp8_all_gather: bool = False
    context_parallel: int = 1
    context_parallel_impl: str = "ring"
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    reference: str = "none"
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_stages_per_rank: int = 1
    microbatches: int = 1
    split_points: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        from lit_ablate.errors import ConfigError

        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("--optimizer", self.optimizer, f"choose one of {list(OPTIMIZERS)}")
        if self.checkpointing not in CHECKPOINTING:
            raise ConfigError("activation_checkpointing", self.checkpointing, f"choose one of {list(CHECKPOINTING)}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes at the peak of a step, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    """Gathered layers of a sharded strategy, or DDP's bucket copy of the gradients."""
    reference: int = 0
    """A frozen DPO reference's parameters (and Liger's copy of its LM head)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient + self.reference


def model_shape(config: PretrainedConfig) -> ModelShape:
    """The shape of ``config``'s model, read from the config and a ``meta``-device build."""
    model = meta_model(config)
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    layer_params = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in layer_types]
    layers, heads, head_dim = attention_shape(config)
    num_experts, top_k = _experts_per_token(config)
    return ModelShape(
        layers=layers,
        hidden=config.hidden_size,
        q_dim=heads * head_dim,
        kv_dim=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
        intermediate=getattr(config, "intermediate_size", 0) or 0,
        vocab=config.vocab_size,
        heads=heads,
        qk_norm=any(name.endswith("q_norm") for name, _ in model.named_modules()),
        experts=num_experts,
        experts_per_token=top_k,
        expert_intermediate=getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0),
        shared_expert_intermediate=getattr(config, "shared_expert_intermediate_size", 0) or 0,
        layer_params=max(layer_params, default=0),
    )


def layer_activation_elements(shape: ModelShape, training: TrainingShape) -> float:
    """Elements one decoder layer saves per token for its backward.

    Attention: the two RMSNorms' inputs and outputs (4 hidden), rotated queries, attention output
    and its re-layout for the output projection (4 q), rotated keys and values (2 kv); q/k norms
    add their inputs and outputs (2 q + 2 kv); eager attention adds the softmaxed scores (heads x
    seq) and expanded keys. MLP: gate, up, activation and product (4 intermediate); an MoE layer
    does that per routed expert with the token's gathered input and weighted output (2 hidden)
    and keeps its router's logits, probabilities and choices (3 x experts).
    """
    s = shape
    attention = 4 * s.hidden + 4 * s.q_dim + 2 * s.kv_dim
    if s.qk_norm:
        attention += 2 * s.q_dim + 2 * s.kv_dim
    if training.attention == "eager":
        attention += s.heads * training.seq_len + s.q_dim
    if s.experts:
        mlp = s.experts_per_token * (4 * s.expert_intermediate + 2 * s.hidden) + 3 * s.experts
        mlp += 4 * s.shared_expert_intermediate
    else:
        mlp = 4 * s.intermediate
    # Tensor parallelism: each rank keeps its heads and its slice of the MLP width (MoE blocks stay
    # whole); the norms' 4 hidden only under sequence parallelism.
    tp = training.tensor_parallel
    if tp > 1:
        norms = 4 * s.hidden
        attention = (attention - norms) / tp + norms / (tp if training.sequence_parallel else 1)
        mlp = mlp if s.experts else mlp / tp
    return float(attention + mlp)


def activation_bytes(shape: ModelShape, training: TrainingShape, loss_head: bool = True) -> int:
    """Peak bytes of activations (and the loss's logits) over one forward and backward on one rank
    (``loss_head=False``: a pipeline stage without the final norm, LM head and loss).

    Checkpointed layers keep only their input (``hidden`` per token) and recompute the rest in
    backward, so the peak is the larger of "everything saved + the loss's logits" at the start of
    backward and "what earlier layers saved + one layer recomputed + its gradient flow" later.
    Under context parallelism a rank holds ``seq_len / cp`` tokens of each sequence.
    """
    tokens = training.micro_batch * -(-training.seq_len // training.context_parallel)
    per_layer = layer_activation_elements(shape, training) * training.activation_bytes
    every = {"none": 0, "full": 1, "selective": training.checkpoint_every}[training.checkpointing]
    checkpointed = [every > 0 and i % every == 0 for i in range(shape.layers)]
    saved = [shape.hidden * training.activation_bytes if c else per_layer for c in checkpointed]
    copies = LOSS_LOGIT_COPIES.get(training.loss, LOSS_LOGIT_COPIES["torch"])
    if training.loss == "liger_dpo":
        copies *= min(1.0, training.chunk_tokens / tokens)
    if training.loss == "chunked":
        copies = (copies + (HALF_CHUNK_COPIES if training.activation_bytes < 4 else 0.0)) * min(1.0, training.chunk_tokens / tokens)
    head = 3 * shape.hidden * training.activation_bytes + copies * shape.vocab / training.tensor_parallel * 4
    held = loss_gradient_bytes(shape, training)
    head = head + held / tokens if loss_head else 0.0
    candidates = [sum(saved) + head]
    recompute = per_layer + 2 * shape.hidden * training.activation_bytes
    candidates += [sum(saved[: i + 1]) + recompute for i, c in enumerate(checkpointed) if c]
    return int(max(candidates) * tokens)


def loss_gradient_bytes(shape: ModelShape, training: TrainingShape) -> int:
    """Bytes of LM-head gradients a loss forms in the forward and holds until the backward: the
    chunked loss (``grad_in_forward``) and Liger accumulate ``d weight`` (``[vocab, hidden]``; fp32
    for chunked, the weight's dtype for Liger) and ``d hidden`` (``[tokens, hidden]``). Found by
    measuring (tests/test_estimate_memory.py): at a large vocabulary the weight gradient is as
    large as the chunks the loss saves. Under context parallelism ``d hidden`` covers a rank's
    ``seq_len / cp`` tokens. Liger's fused DPO holds two ``d weight``: its accumulator and the one
    ``torch.func`` returns for the current chunk (benchmarks/dpo_memory.py measured it)."""
    tokens = training.micro_batch * -(-training.seq_len // training.context_parallel)
    if training.loss == "chunked" and training.loss_grad_in_forward:
        weight_bytes = 4
    elif training.loss in ("liger", "liger_dpo"):
        weight_bytes = training.param_bytes * (2 if training.loss == "liger_dpo" else 1)
    else:
        return 0
    return shape.vocab * shape.hidden * weight_bytes + tokens * shape.hidden * training.activation_bytes


def optimizer_state_bytes(optimizer: str, param_bytes: int) -> float:
    """Optimizer-state bytes per parameter (torch keeps Adam's moments in the parameter dtype)."""
    return {"adamw": 2.0 * param_bytes, "adam": 2.0 * param_bytes, "sgd": 0.0,
            "sgd_momentum": float(param_bytes), "adamw8bit": 2.0}[optimizer]  # fmt: skip


def optimizer_bytes(counts: ParameterCounts, training: TrainingShape) -> float:
    """Optimizer-state bytes of the trainable parameters; 8-bit AdamW keeps the states of tensors
    under 4096 elements in fp32 (``ParameterCounts.small_trainable``: most LoRA matrices of small models)."""
    if training.optimizer == "adamw8bit":
        return (counts.trainable - counts.small_trainable) * 2.0 + counts.small_trainable * 8.0
    return counts.trainable * optimizer_state_bytes(training.optimizer, training.param_bytes)


def estimate_memory(counts: ParameterCounts, shape: ModelShape, training: TrainingShape,
                    sharding: StateSharding, world_size: int) -> MemoryEstimate:  # fmt: skip
    """Per-rank bytes at a step's peak under ``sharding`` (divisors of params, grads, optimizer states).

    Transient: a sharded strategy gathers two decoder layers at a time (the current one and the
    prefetched next) and keeps the root's parameters (embeddings, final norm, LM head) gathered
    from forward to backward (without resharding after forward, every layer's: ``gathered``);
    sharded gradients exist in full twice for the unit being reduced (its
    gradients and the reduce-scatter buffer they are copied into), the largest unit being a layer
    or the root; replicated gradients on more than one rank also sit in DDP's buckets unless
    ``gradient_as_bucket_view``. Measured against FSDP2/FSDP1 on 2 ranks in
    tests/test_estimate_memory.py. Under pipeline parallelism: the largest stage's
    (``pipeline_stage_estimates``).
    """
    if training.pipeline_parallel > 1:
        return max(pipeline_stage_estimates(counts, shape, training, sharding), key=lambda e: e.total)
    full = (counts.total - counts.quantized) * training.param_bytes + counts.quantized_bytes
    stored = full / counts.total  # bytes per parameter: quantised base weights pack tighter
    trained = counts.trainable * training.param_bytes  # a frozen base has no gradients or optimizer states
    root = max(0, counts.total - shape.layers * shape.layer_params)
    gathered_layer = shape.layer_params
    if sharding.expert_parallel > 1:  # a layer gathers only this rank's experts, over their own FSDP ranks
        layer_experts = counts.experts / shape.layers
        gathered_layer -= layer_experts * (1 if sharding.expert_shards == 1 else 1 - 1 / sharding.expert_parallel)
    transient = 0
    if sharding.gathered is not None:  # every layer's gathered parameters, kept from forward to backward
        transient += -(-full // sharding.gathered)
    elif sharding.params > 1:
        layer_bytes = 1 if training.fp8_all_gather else stored
        transient += int(2 * gathered_layer * layer_bytes + root * stored)
    if sharding.grads > 1:
        transient += int(2 * max(gathered_layer, root) * training.param_bytes * counts.trainable / counts.total)
    elif world_size > 1 and not training.gradient_as_bucket_view:
        transient += trained
    return MemoryEstimate(
        params=int(-(-full // _state_divisor(sharding.params, sharding, counts))) + _fp8_shard_cast(shape, training, sharding),
        grads=int(-(-trained // _state_divisor(sharding.grads, sharding, counts))),
        optimizer=int(optimizer_bytes(counts, training) / _state_divisor(sharding.optimizer, sharding, counts)),
        activations=activation_bytes(shape, training) + context_parallel_bytes(shape, training)[0],
        transient=transient + context_parallel_bytes(shape, training)[1],
        reference=reference_bytes(shape, training, full, sharding.params),
    )


# --- pipeline parallelism -------------------------------------------------------------------------
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
LOSS_LOGIT_COPIES_KEPT = {"torch": 1.0}
"""fp32 ``[tokens, vocab]`` tensors a loss keeps from a micro-batch's forward to its backward (torch:
the log-softmax; the other backends keep chunks' gradients, ``loss_gradient_bytes``, or nothing)."""


def pipeline_stage_layers(counts: ParameterCounts, shape: ModelShape, training: TrainingShape) -> list[int]:
    """Decoder layers per pipeline stage, split as ``PipelineParallelStrategy`` splits them: at its
    ``split_points``, or balanced by parameter count (embeddings on the first stage, LM head on the last)."""
    from lit_ablate.strategies.pipeline_parallel import balanced_split_points, check_split_points

    stages = training.pipeline_parallel * training.pipeline_stages_per_rank
    points = list(training.split_points) if training.split_points is not None else balanced_split_points(
        [shape.layer_params] * shape.layers, stages, counts.embedding, shape.vocab * shape.hidden)  # fmt: skip
    check_split_points(points, shape.layers, stages)
    bounds = [0, *points, shape.layers]
    return [end - start for start, end in zip(bounds, bounds[1:], strict=False)]


def pipeline_stage_parameters(counts: ParameterCounts, shape: ModelShape, training: TrainingShape) -> list[int]:
    """Parameters each stage holds: its layers, plus the embeddings (first) or final norm and LM head (last)."""
    layers = pipeline_stage_layers(counts, shape, training)
    root = counts.total - shape.layers * shape.layer_params
    return [n * shape.layer_params + (counts.embedding if i == 0 else 0)
            + (root - counts.embedding if i == len(layers) - 1 else 0) for i, n in enumerate(layers)]  # fmt: skip


def pipeline_stage_estimates(counts: ParameterCounts, shape: ModelShape, training: TrainingShape,
                             sharding: StateSharding) -> list[MemoryEstimate]:  # fmt: skip
    """Bytes of each pipeline rank at its step's peak (``estimate_memory`` takes the largest).

    A rank holds its stages' parameters, gradients and optimizer states (``pipeline_stage_parameters``,
    divided by ``sharding``): one stage, or under ``interleaved_1f1b`` stages ``r, r + pp, ...``. A
    step runs ``microbatches`` pieces of ``micro_batch / microbatches`` rows; a rank keeps what
    autograd saved for each (stage, piece) whose forward ran and whose backward has not
    (``pipeline_pieces_held``), one of them at its backward's peak (``activation_bytes``); the last
    stage's pieces also keep the final norm's tensors and the loss's (``LOSS_LOGIT_COPIES_KEPT``,
    ``loss_gradient_bytes``). Transient: the receive buffers torch's schedule allocates once per piece
    and stage, the previous stage's hidden states (all stages but the first) and their gradients from
    the next (all but the last). FSDP-sharded stages (``sharding.gathered``: ``dp_shard`` without
    resharding after forward) also hold, through the step, their gathered parameters and their
    unsharded gradients (``PipelineStage`` defers FSDP's reduce-scatter to the last micro-batch) and,
    at that reduce-scatter, a copy of the largest unit's gradients (a decoder layer, or the stage's
    root: embeddings, or final norm and LM head). Measured on 2 ranks (and 4: pp=2 x dp_shard=2) in
    tests/test_pipeline_estimate.py.
    """
    from lit_ablate.errors import ConfigError

    if training.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ConfigError("trainer.strategy.init_args.schedule", training.pipeline_schedule,
                          f"the estimate models the {' and '.join(PIPELINE_SCHEDULES)} schedules")
    m = training.microbatches
    piece = replace(training, micro_batch=max(1, training.micro_batch // m), pipeline_parallel=1)
    tokens = piece.micro_batch * piece.seq_len
    boundary = tokens * shape.hidden * training.activation_bytes  # one piece's hidden states between stages
    full = (counts.total - counts.quantized) * training.param_bytes + counts.quantized_bytes
    stage_params = pipeline_stage_parameters(counts, shape, training)
    stage_layers = pipeline_stage_layers(counts, shape, training)
    last = len(stage_params) - 1

    def kept(stage: int) -> float:  # bytes per token one piece keeps on ``stage`` until its backward
        bytes_ = stage_layers[stage] * layer_activation_elements(shape, piece) * training.activation_bytes
        if stage == last:
            bytes_ += (3 * shape.hidden * training.activation_bytes
                       + LOSS_LOGIT_COPIES_KEPT.get(training.loss, 0.0) * shape.vocab / training.tensor_parallel * 4)
            bytes_ += loss_gradient_bytes(shape, piece) / tokens
        return bytes_

    estimates = []
    for rank in range(training.pipeline_parallel):
        own = range(rank, last + 1, training.pipeline_parallel)  # the rank's stages
        *held, at_backward = pipeline_pieces_held(rank, training)
        params = sum(stage_params[s] for s in own)
        gathered = 0
        if sharding.params > 1 and sharding.gathered is not None:
            largest_unit = max(max(shape.layer_params, stage_params[s] - stage_layers[s] * shape.layer_params) for s in own)
            gathered = (full * params // counts.total + counts.trainable * training.param_bytes * params // counts.total
                        + largest_unit * training.param_bytes)  # fmt: skip
        estimates.append(MemoryEstimate(  # each state's bytes in the rank's share of the parameters
            params=-(-(full * params // counts.total) // sharding.params),
            grads=-(-(counts.trainable * training.param_bytes * params // counts.total) // sharding.grads),
            optimizer=int(optimizer_bytes(counts, training)) * params // counts.total // sharding.optimizer,
            activations=int(sum(kept(s) for s in held) * tokens)
            + activation_bytes(replace(shape, layers=stage_layers[at_backward]), piece, loss_head=at_backward == last),
            transient=m * boundary * sum((s != 0) + (s != last) for s in own) + gathered,
        ))  # fmt: skip
    return estimates


def pipeline_pieces_held(rank: int, training: TrainingShape) -> list[int]:
    """The stage of each piece ``rank`` holds at its peak (forward run, backward not yet), the last
    one the piece at its backward.

    gpipe: all ``m`` pieces; 1f1b: ``min(m, pp - rank)`` (torch's warm-up of ``pp - rank - 1``
    forwards, then one forward before each backward). interleaved_1f1b (torch's
    ``ScheduleInterleaved1F1B``): a warm-up of ``W = (v - 1) p + 2 (pp - 1 - rank)`` forwards
    (``p`` micro-batches per round, at most ``m v``) walking the rank's stages ``p`` pieces at a
    time, then one more forward before the first backward, which is the rank's last stage's.
    """
    pp, v, m = training.pipeline_parallel, training.pipeline_stages_per_rank, training.microbatches
    own = [rank + i * pp for i in range(v)]
    if training.pipeline_schedule == "gpipe":
        return [rank] * m
    if training.pipeline_schedule == "1f1b":
        return [rank] * min(m, pp - rank)
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    forwards = [own[(k // per_round) % v] for k in range(min(warmup + 1, m * v))]
    forwards.remove(own[-1])  # the piece at its backward: the first one of the last stage
    return [*forwards, own[-1]]


def pipeline_time_share(counts: ParameterCounts, shape: ModelShape, training: TrainingShape, seq_len: float,
                        config: PretrainedConfig) -> float:  # fmt: skip
    """A pipeline step's time in units of the whole model's FLOPs on one rank: the busiest rank's share
    of the model FLOPs (its stages' matmuls and attention, the LM head on the last stage), stretched by
    the schedule's ideal idle share, ``(v m + pp - 1) / (v m)`` (``v`` stages per rank: 1 for gpipe and
    1f1b). 1 without a pipeline."""
    if training.pipeline_parallel == 1:
        return 1.0
    layers = pipeline_stage_layers(counts, shape, training)
    attention = 12.0 * attention_shape(config)[1] * attention_shape(config)[2] * seq_len  # per token and layer
    whole = flops_per_token(counts, config, seq_len)
    matmul = whole - shape.layers * attention
    root_matmul = counts.matmul - shape.layers * shape.layer_params  # the LM head and final norm
    stages = [(n * shape.layer_params + (root_matmul if i == len(layers) - 1 else 0)) / counts.matmul * matmul
              + n * attention for i, n in enumerate(layers)]  # fmt: skip
    m, pp, v = training.microbatches, training.pipeline_parallel, training.pipeline_stages_per_rank
    busiest = max(sum(stages[rank::pp]) for rank in range(pp))
    return busiest / whole * (v * m + pp - 1) / (v * m)


def _fp8_shard_cast(shape: ModelShape, training: TrainingShape, sharding: StateSharding) -> int:
    """Bytes of the 1-byte casts of this rank's shards that fp8 all-gather sends: two layers' at a
    time (the gathered one and the prefetched one), which a tensor tracker files with the parameters."""
    if not training.fp8_all_gather or sharding.params == 1:
        return 0
    return -(-2 * shape.layer_params // sharding.params)


def _state_divisor(divisor: int, sharding: StateSharding, counts: ParameterCounts) -> float:
    """``divisor`` for the dense state; the routed experts' share over ``expert_parallel x
    expert_shards`` ranks when the strategy divides them otherwise (tensor parallelism keeps them
    whole, expert parallelism splits them over ``ep``)."""
    if sharding.expert_shards is None or not counts.experts:
        return divisor
    experts = counts.experts / counts.total
    return 1 / ((1 - experts) / divisor + experts / (sharding.expert_parallel * sharding.expert_shards))


def reference_bytes(shape: ModelShape, training: TrainingShape, param_bytes: int, shards: int) -> int:
    """A frozen DPO reference: the parameters again (``param_bytes`` in all, sharded as the policy's),
    plus, under Liger's fused DPO, the copy of its initial LM head that Liger reads (sharded too).
    Its no-grad forward frees each layer's activations as it goes (not counted)."""
    if training.reference != "frozen":
        return 0
    head = shape.vocab * shape.hidden * training.param_bytes if training.loss == "liger_dpo" else 0
    return -(-(param_bytes + head) // shards)


def context_parallel_bytes(shape: ModelShape, training: TrainingShape) -> tuple[int, int]:
    """``(saved, exchange)``: bytes per rank that context parallelism adds besides its per-rank tokens.

    ``activation_bytes`` already counts a rank's ``seq_len / cp`` tokens. ``allgather`` keeps every
    layer's gathered K/V (the whole sequence) for backward (``saved``); its exchange holds one
    layer's gathered K/V and, in backward, their gradient before the reduce-scatter. The ring
    saves nothing more than SDPA; its exchange, one layer at a time, holds the K/V block in hand
    and the one arriving, with fp32 output and log-sum-exp accumulators in forward, and in backward
    fp32 dQ and three fp32 dK/dV blocks (this rank's contribution, the partial sum arriving, the
    one leaving). Measured against MemTracker on 2 ranks in tests/test_context_parallel_estimate.py.
    """
    cp = training.context_parallel
    if cp == 1:
        return 0, 0
    local = training.micro_batch * -(-training.seq_len // cp)
    whole = training.micro_batch * training.seq_len
    kv = 2 * shape.kv_dim * training.activation_bytes  # one token's K and V
    if training.context_parallel_impl == "allgather":
        return shape.layers * kv * (whole - local), 2 * kv * whole
    forward = 2 * kv * local + (shape.q_dim + shape.heads) * 4 * local
    backward = 2 * kv * local + 3 * 2 * shape.kv_dim * 4 * local + shape.q_dim * 4 * local
    return 0, max(forward, backward)


AGREEMENT_FACTORS: dict[str, float] = {"params": 1.05, "grads": 1.05, "optimizer": 1.1, "activations": 1.3,
                                        "transient": 2.0}
"""How far (either way) an estimated category may be from the measured one and still agree: the
state categories are exact byte counts (buffers and ZeRO-1's whole-tensor partitions make the
small difference); activations are a per-token model of what autograd saves; transient copies
depend on when a strategy frees its buffers. Checked on several shapes and strategies in
tests/test_estimate_memory.py; every study report marks the categories that disagree."""
NEGLIGIBLE_SHARE = 0.01
"""A category whose estimate and measurement differ by less than this share of the measured tensor
peak agrees whatever their ratio (a few KiB of batch tensors against an estimated 0)."""


def compare_with_measured(estimate: MemoryEstimate, breakdown: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per category: estimated and measured bytes, their ratio and whether it is within
    ``AGREEMENT_FACTORS`` (or apart by a ``NEGLIGIBLE_SHARE`` of the peak). ``breakdown`` is a run
    record's ``tensor_breakdown``: each state category's maximum over the step, and for
    ``activations`` the most activations and temporaries reach together during forward and
    backward (what ``activation_bytes`` models)."""
    measured = {**{c: int(breakdown["max"].get(c, 0)) for c in ("params", "grads", "optimizer", "transient")},
                "activations": int(breakdown["forward_backward_max"])}
    measured["params"] += int(breakdown["max"].get("frozen_params", 0))  # the estimate's params: trainable and frozen
    negligible = NEGLIGIBLE_SHARE * sum(breakdown["at_peak"].values())
    out = {}
    for category, factor in AGREEMENT_FACTORS.items():
        estimated, actual = getattr(estimate, category), measured[category]
        ratio = estimated / actual if actual else None
        agrees = abs(estimated - actual) <= negligible or (ratio is not None and 1 / factor <= ratio <= factor)
        out[category] = {"estimated": estimated, "measured": actual, "ratio": ratio, "agrees": agrees}
    return out


SHARDINGS = ("ddp", "zero1", "zero2", "fsdp2", "fsdp2_no_reshard", "hsdp")
"""The data-parallel layouts ``lit-ablate estimate`` compares: DDP, ZeRO-1/2, FSDP2 resharding after
forward (ZeRO-3), FSDP2 keeping gathered parameters to backward, and HSDP sharding within a node."""
OPTIMIZER_CLASSES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "AdamW8bit": "adamw8bit"}
HALF_PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def canonical_sharding(kind: str, world_size: int, gpus_per_node: int = 8) -> StateSharding:
    """The divisors of one of ``SHARDINGS`` on ``world_size`` ranks (HSDP shards within a node)."""
    import math

    from lit_ablate.strategies.state_sharding import StateSharding, deepspeed_sharding

    if kind == "fsdp2_no_reshard":
        return StateSharding(params=world_size, grads=world_size, optimizer=world_size, gathered=1)
    if kind == "hsdp":
        return deepspeed_sharding(3, math.gcd(world_size, gpus_per_node))
    return deepspeed_sharding({"ddp": 0, "zero1": 1, "zero2": 2, "fsdp2": 3}[kind], world_size)


def _required(config: dict, key: str, fix: str) -> object:
    from lit_ablate.errors import ConfigError

    value = get_dotted(config, key)
    if value is None:
        raise ConfigError(key, None, fix)
    return value


def training_shape_of(config: dict, optimizer: str | None = None, world_size: int | None = None) -> TrainingShape:
    """The ``TrainingShape`` a resolved ``fit`` config trains with (CausalLM + LMDataModule keys) on
    ``world_size`` ranks (default: the config's; a ``cp: -1`` strategy splits sequences over them)."""
    precision = str(get_dotted(config, "trainer.precision", "32-true"))
    dtype = str(get_dotted(config, "model.init_args.model.dtype", "float32"))
    half = precision in HALF_PRECISIONS
    strategy_args = get_dotted(config, "trainer.strategy.init_args", {}) or {}
    optimizer_class = str(get_dotted(config, "optimizer.class_path", "") or "").rsplit(".", 1)[-1]
    if optimizer is None:
        # CausalLM builds its optimizer itself (model.init_args.optimizer, default AdamW)
        optimizer = OPTIMIZER_CLASSES.get(optimizer_class, "adamw8bit" if "8bit" in str(
            get_dotted(config, "model.init_args.optimizer", "adamw")) else "adamw")  # fmt: skip
        if optimizer == "sgd" and get_dotted(config, "optimizer.init_args.momentum", 0):
            optimizer = "sgd_momentum"
    shape = TrainingShape(
        micro_batch=int(_required(config, "data.init_args.batch_size", "the estimate needs the micro-batch per rank")),
        seq_len=int(_required(config, "data.init_args.seq_len", "the estimate needs the sequence length")),
        param_bytes=2 if precision.endswith("-true") and half else DTYPE_BYTES.get(dtype, 4),
        activation_bytes=2 if half else DTYPE_BYTES.get(dtype, 4),
        optimizer=optimizer,
        checkpointing=strategy_args.get("activation_checkpointing", "none"),
        checkpoint_every=int(strategy_args.get("checkpoint_every", 2)),
        loss=str(get_dotted(config, "model.init_args.loss", "torch")),
        chunk_tokens=int(get_dotted(config, "model.init_args.loss_options.chunk_tokens", 1024)),
        loss_grad_in_forward=bool(get_dotted(config, "model.init_args.loss_options.grad_in_forward", True)),
        attention=str(get_dotted(config, "model.init_args.model.attn_implementation", "sdpa")),
        gradient_as_bucket_view=bool(strategy_args.get("gradient_as_bucket_view", False)),
        fp8_all_gather=bool(get_dotted(config, "model.init_args.model.fp8.fsdp_all_gather", False)),
        **dict(zip(("context_parallel", "context_parallel_impl"), context_parallel_of(config, world_size))),
        **dict(zip(("tensor_parallel", "sequence_parallel"), tensor_parallel_of(config, world_size))),
        **pipeline_of(config, world_size),
    )
    if str(get_dotted(config, "model.class_path", "")).endswith("DPO"):
        shape = replace(shape, **_preference_shape(config, shape.micro_batch, shape.seq_len))
    return shape


def _preference_shape(config: dict, batch_size: int, seq_len: int) -> dict[str, Any]:
    """DPO's ``TrainingShape`` fields: its rows (padded: 2 sequences per pair; packed across the data
    set: ``batch_size`` rows of ``max_tokens``), its log-prob backend and its reference."""
    collator = get_dotted(config, "data.init_args.collator") or {}
    collator = collator if isinstance(collator, dict) else {}
    options = collator.get("init_args") or {}
    if str(collator.get("class_path", "")).endswith("PreferencePackingCollator") and not options.get("within_batch"):
        rows = {"micro_batch": batch_size, "seq_len": int(options.get("max_tokens") or 2 * seq_len)}
    else:
        rows = {"micro_batch": 2 * batch_size, "seq_len": seq_len}
    backend = str(get_dotted(config, "model.init_args.logprobs", "torch"))
    logprobs_options = get_dotted(config, "model.init_args.logprobs_options") or {}
    if backend == "liger":
        loss = {"loss": "liger_dpo", "chunk_tokens": 2 * int(logprobs_options.get("chunk_pairs", 1)) * seq_len}
    else:  # the chunked log-probs keep only the log-sum-exp and recompute chunks in the backward
        loss = {"loss": backend, "chunk_tokens": int(logprobs_options.get("chunk_tokens", 1024)),
                "loss_grad_in_forward": False}
    return {**rows, **loss, "reference": str(get_dotted(config, "model.init_args.reference", "frozen"))}


def context_parallel_of(config: dict, world_size: int | None = None) -> tuple[int, str]:
    """``(cp ranks, cp_impl)`` of the config's strategy on ``world_size`` ranks (default: the
    config's; ``(1, "ring")`` for a strategy without context parallelism)."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.mesh import resolve_mesh_sizes

    strategy = get_dotted(config, "trainer.strategy", "auto")
    if not isinstance(strategy, dict):
        return 1, "ring"
    instance = instantiate_class((), strategy)
    sizes = getattr(instance, "requested_mesh_sizes", {})
    if sizes.get("cp", 1) == 1:
        return 1, "ring"
    return resolve_mesh_sizes(sizes, world_size or world_size_of(config))["cp"], instance.cp_impl


def tensor_parallel_of(config: dict, world_size: int | None = None) -> tuple[int, bool]:
    """``(tp ranks, sequence_parallel)`` of the config's strategy on ``world_size`` ranks (default:
    the config's; ``(1, False)`` for a strategy without tensor parallelism)."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.mesh import resolve_mesh_sizes

    strategy = get_dotted(config, "trainer.strategy", "auto")
    if not isinstance(strategy, dict):
        return 1, False
    instance = instantiate_class((), strategy)
    sizes = getattr(instance, "requested_mesh_sizes", {})
    if sizes.get("tp", 1) == 1:
        return 1, False
    tp = resolve_mesh_sizes(sizes, world_size or world_size_of(config))["tp"]
    return tp, bool(getattr(instance, "sequence_parallel", False)) and tp > 1


def pipeline_of(config: dict, world_size: int | None = None) -> dict[str, Any]:
    """The ``TrainingShape`` pipeline fields of the config's ``PipelineParallelStrategy`` on ``world_size``
    ranks (default: the config's; ``pp: -1`` takes them all); none for another strategy."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy

    strategy = get_dotted(config, "trainer.strategy", "auto")
    instance = instantiate_class((), strategy) if isinstance(strategy, dict) else strategy
    if not isinstance(instance, PipelineParallelStrategy):
        return {}
    from lit_ablate.errors import ConfigError

    if instance.dp_shard > 1 and instance.reshard_after_forward:
        raise ConfigError("trainer.strategy.init_args.reshard_after_forward", True,
                          "the estimate models FSDP stages that keep their layers gathered through the step (measured "
                          "agreement); with resharding per micro-batch it does not (estimate reshard_after_forward: false)")
    world_size = world_size or world_size_of(config)
    pp = instance.requested_pp if instance.requested_pp != -1 else world_size // instance.dp_replicate  # per replica
    if world_size % pp:
        raise ConfigError("trainer.strategy.init_args.pp", pp, f"use a divisor of the world size ({world_size})")
    points = None if instance.split_points is None else tuple(instance.split_points)
    return {"pipeline_parallel": pp, "pipeline_schedule": instance.schedule_name,
            "pipeline_stages_per_rank": instance.stages_per_rank, "microbatches": instance.microbatches,
            "split_points": points}


def world_size_of(config: dict) -> int:
    """Ranks of a resolved ``fit`` config: devices (an int or a list; "auto" counts as 1) x nodes."""
    devices = get_dotted(config, "trainer.devices", 1)
    devices = int(devices) if isinstance(devices, str) and devices.isdigit() else devices  # `--trainer.devices 2`
    devices = len(devices) if isinstance(devices, list) else devices if isinstance(devices, int) else 1
    return devices * int(get_dotted(config, "trainer.num_nodes", 1) or 1)


def configured_sharding(config: dict, world_size: int) -> StateSharding:
    """The sharding of the config's own ``trainer.strategy`` (a name or a class_path mapping)."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.state_sharding import state_sharding_of

    strategy = get_dotted(config, "trainer.strategy", "auto")
    if isinstance(strategy, dict):
        strategy = instantiate_class((), strategy)
    return state_sharding_of(strategy, world_size)


def model_of(config: dict) -> tuple[ParameterCounts, ModelShape]:
    """Counts and shape of the config's ``model.init_args.model`` (a ``ModelFactory``), built on meta."""
    from lit_ablate.models.factory import ModelFactory

    factory = ModelFactory(**_required(config, "model.init_args.model",
                                       "the estimate reads a CausalLM's model: preset/config/pretrained"))  # fmt: skip
    hf_config = factory.hf_config()
    if factory.adapter is None:
        return count_parameters_of_config(hf_config), model_shape(hf_config)
    from lit_ablate.models.adapters import apply_adapters

    model = meta_model(hf_config)
    with torch.device("meta"):
        if factory.moe is not None:  # expert adapters sit on lit-ablate's experts
            from lit_ablate.models.moe import apply_moe

            apply_moe(model, factory.moe)
        apply_adapters(model, factory.adapter)
    return count_parameters(model, hf_config, factory.quantization), model_shape(hf_config)


def estimate_for_config(config: dict, world_size: int | None = None) -> MemoryEstimate:
    """Per-rank memory of a resolved ``fit`` config under its own strategy (what the report shows)."""
    world_size = world_size or world_size_of(config)
    training = training_shape_of(config, world_size=world_size)
    counts, shape = model_of(config)
    return estimate_memory(counts, shape, training, configured_sharding(config, world_size), world_size)


def predicted_step_seconds(config: dict, ceiling_tflops: float, world_size: int | None = None) -> float:
    """One optimizer step of a resolved ``fit`` config if every model FLOP ran at ``ceiling_tflops``
    (the measured matmul ceiling, ``lit_ablate.matmul_ceiling``): a rank's FLOPs per step over it.

    The FLOPs are the ones ``MFUMonitor`` divides (``flops_per_token``; a rank's ``1 / cp`` and
    ``1 / tp`` share; under pipeline parallelism the largest stage's share, stretched by the
    schedule's ideal idle time: ``pipeline_time_share``), for ``micro_batch x seq_len x accumulate_grad_batches`` tokens at the full
    ``seq_len`` context: padded or packed data compute less, so for them the prediction is an upper
    bound. What a measured step takes beyond it is not matmul at the ceiling: communication,
    memory-bound kernels (norms, attention softmax, the optimizer), data and framework overhead.
    """
    from lit_ablate.errors import ConfigError
    from lit_ablate.models.factory import ModelFactory

    module = str(get_dotted(config, "model.class_path", ""))
    if not module.endswith("CausalLM"):
        raise ConfigError("model.class_path", module, "step time is predicted for CausalLM runs only")
    world_size = world_size or world_size_of(config)
    training = training_shape_of(config, world_size=world_size)
    counts, shape = model_of(config)
    hf_config = ModelFactory(**get_dotted(config, "model.init_args.model")).hf_config()
    accumulate = int(get_dotted(config, "trainer.accumulate_grad_batches", 1) or 1)
    share = pipeline_time_share(counts, shape, training, training.seq_len, hf_config) / (
        training.context_parallel * mesh_size_of(config, "tp", world_size))  # fmt: skip
    tokens = training.micro_batch * training.seq_len * accumulate
    return flops_per_token(counts, hf_config, training.seq_len) * tokens * share / (ceiling_tflops * 1e12)


def mesh_size_of(config: dict, dim: str, world_size: int) -> int:
    """The size of mesh dimension ``dim`` (``tp``, ``cp``, ...) of the config's strategy on
    ``world_size`` ranks; 1 for a strategy without a device mesh."""
    from lightning.pytorch.cli import instantiate_class

    from lit_ablate.strategies.mesh import resolve_mesh_sizes

    strategy = get_dotted(config, "trainer.strategy", "auto")
    sizes = getattr(instantiate_class((), strategy), "requested_mesh_sizes", {}) if isinstance(strategy, dict) else {}
    return resolve_mesh_sizes(sizes, world_size)[dim] if sizes.get(dim, 1) != 1 else 1


def smallest_world_size(fits: Callable[[int], bool], max_ranks: int) -> int | None:
    """The fewest ranks (1..max_ranks) for which ``fits`` holds, or None."""
    return next((n for n in range(1, max_ranks + 1) if fits(n)), None)


def estimate_main(argv: list[str]) -> int:
    """``lit-ablate estimate --config FIT.yaml [--gpu_memory_gib 80] [--json] [--dotted.key value ...]``.

    Prints the per-rank breakdown at the config's world size under its own strategy and each of
    ``SHARDINGS``, and the smallest number of GPUs of the given size that fits each; ``--json``
    prints the same numbers (exact counts and bytes) as one JSON object instead of the table.
    """
    import argparse

    from lit_ablate.errors import ConfigError

    parser = argparse.ArgumentParser(prog="lit-ablate estimate", description=estimate_main.__doc__.split("\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--config", required=True, help="a fit config (extra --dotted.key value pairs override it)")
    parser.add_argument("--gpu_memory_gib", type=float, default=80.0, help="memory of one GPU")
    parser.add_argument("--usable_fraction", type=float, default=0.9,
                        help="share of it training may use (CUDA context, allocator fragmentation take the rest)")
    parser.add_argument("--gpus_per_node", type=int, default=8, help="HSDP shards within a node of this many GPUs")
    parser.add_argument("--max_gpus", type=int, default=4096, help="search limit for the smallest fitting number")
    parser.add_argument("--world_size", type=int, help="ranks for the breakdown (default: devices x num_nodes)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the config's (CausalLM: adamw)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON (bytes, exact counts)")
    args, overrides = parser.parse_known_args(argv)
    from lit_ablate.cli import resolve_fit_config

    try:
        _check_estimate_arguments(args)
        config = resolve_fit_config(["--config", args.config, *overrides])
        world = args.world_size or world_size_of(config)
        if world < 1:
            raise ConfigError("trainer.devices", get_dotted(config, "trainer.devices"), "use a positive number of devices per node")
        training = training_shape_of(config, args.optimizer, world)
        counts, shape = model_of(config)
        configured_sharding(config, world)  # the configured mesh must lay out on the ranks asked for
        budget = args.gpu_memory_gib * args.usable_fraction * GIB

        def at(kind: str, n: int) -> MemoryEstimate | None:
            try:
                run = training
                if kind == "configured":
                    sharding = configured_sharding(config, n)
                    run = replace(training, context_parallel=context_parallel_of(config, n)[0],  # cp: -1 grows with n
                                  **pipeline_of(config, n))  # pp: -1 too
                else:
                    sharding = canonical_sharding(kind, n, args.gpus_per_node)
                    run = replace(training, pipeline_parallel=1)  # the data-parallel layouts, without stages
            except ConfigError:  # the configured mesh cannot be laid out on n ranks
                return None
            return estimate_memory(counts, shape, run, sharding, n)

        rows = []
        for kind in ("configured", *SHARDINGS):
            here = at(kind, world)
            fewest = smallest_world_size(lambda n, kind=kind: (e := at(kind, n)) is not None and e.total <= budget, args.max_gpus)
            rows.append((kind, here, fewest))
    except ConfigError as err:
        print(f"lit-ablate estimate: error: {err}", file=sys.stderr)
        return 2
    summary = _estimate_summary(config, counts, shape, training, world, rows, args)
    print(json.dumps(summary, indent=1) if args.json else _estimate_table(summary))
    return 0


def _check_estimate_arguments(args: Any) -> None:
    """Numbers ``estimate`` would otherwise turn into a table of nonsense (or silently replace:
    ``--world_size 0`` used to mean "the config's")."""
    from lit_ablate.errors import ConfigError

    for name in ("world_size", "gpus_per_node", "max_gpus"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name}", value, "use a positive number of GPUs")
    if not args.gpu_memory_gib > 0:
        raise ConfigError("--gpu_memory_gib", args.gpu_memory_gib, "give one GPU's memory in GiB, e.g. 80")
    if not 0 < args.usable_fraction <= 1:
        raise ConfigError("--usable_fraction", args.usable_fraction, "give a share in (0, 1], e.g. 0.9")


MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "transient", "reference", "total")
"""The per-rank byte counts of one sharding, in the table's column order."""


def _estimate_summary(config, counts, shape, training, world, rows, args) -> dict[str, Any]:  # noqa: ANN001 (estimate_main's locals)
    """Everything ``estimate`` reports, in exact numbers: what ``--json`` prints and the table renders."""
    strategy = get_dotted(config, "trainer.strategy", "auto")
    strategy = strategy.get("class_path", "?").rsplit(".", 1)[-1] if isinstance(strategy, dict) else strategy
    return {
        "model": {"parameters": counts.total, "active_parameters": counts.active, "trainable_parameters": counts.trainable,
                  "quantized_parameters": counts.quantized, "layers": shape.layers,
                  "hidden": shape.hidden, "vocab": shape.vocab},
        "run": asdict(training),
        "world_size": world, "strategy": strategy, "gpu_memory_gib": args.gpu_memory_gib,
        "usable_fraction": args.usable_fraction, "gpus_per_node": args.gpus_per_node, "max_gpus": args.max_gpus,
        "shardings": [{"sharding": kind, "bytes_per_rank": {k: getattr(e, k) for k in MEMORY_KINDS} if e else None,
                       "gpus_needed": fewest} for kind, e, fewest in rows],
    }  # fmt: skip


def _estimate_table(summary: dict[str, Any]) -> str:
    model, training, shardings = summary["model"], summary["run"], summary["shardings"]
    largest = max((s["bytes_per_rank"]["total"] for s in shardings if s["bytes_per_rank"]), default=0)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    lines = [
        f"Model: {_count(model['parameters'])} parameters ({model['parameters']:,}), "
        f"{_count(model['active_parameters'])} active ({model['active_parameters']:,}), "
        f"{_count(model['trainable_parameters'])} trainable, {_count(model['quantized_parameters'])} quantised, {model['layers']} layers, "
        f"hidden {model['hidden']}, vocab {model['vocab']}.",
        f"Run: micro-batch {training['micro_batch']} x {training['seq_len']} tokens per rank, "
        f"parameters {training['param_bytes']} B, activations {training['activation_bytes']} B, "
        f"optimizer {training['optimizer']}, checkpointing {training['checkpointing']}, "
        f"loss {training['loss']}, attention {training['attention']}."
        + (f" Pipeline: {training['pipeline_parallel']} ranks x {training['pipeline_stages_per_rank']} stage(s), "
           f"{training['pipeline_schedule']}, {training['microbatches']} micro-batches per step; the configured row "
           "is the largest rank's."
           if training["pipeline_parallel"] > 1 else ""),
        "",
        f"Per rank at {summary['world_size']} rank(s), {unit}; last column: smallest number of "
        f"{summary['gpu_memory_gib']:g} GiB GPUs that fit ({summary['usable_fraction']:.0%} usable, HSDP shards "
        f"within {summary['gpus_per_node']}).",
        "",
        "| sharding | " + " | ".join(MEMORY_KINDS) + " | GPUs needed |",
        "|---" * (len(MEMORY_KINDS) + 2) + "|",
    ]
    for row in shardings:
        name = f"configured ({summary['strategy']})" if row["sharding"] == "configured" else row["sharding"]
        memory = row["bytes_per_rank"]
        cells = [_memory_cell(memory[k], scale) for k in MEMORY_KINDS] if memory else ["—"] * len(MEMORY_KINDS)
        need = str(row["gpus_needed"]) if row["gpus_needed"] else f"none up to {summary['max_gpus']}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {need} |")
    lines += ["", "Activations are per rank and not divided by data parallelism: lower the micro-batch or "
              "checkpoint activations when they dominate. 'none': replicated state (or HSDP's node-sized "
              "shards) plus activations exceed a GPU at any count."]  # fmt: skip
    return "\n".join(lines)


def _memory_cell(num_bytes: int, scale: int) -> str:
    """A table cell: bytes in the table's unit (``scale`` bytes), 1 decimal, 2 significant digits below 0.1."""
    return f"{num_bytes / scale:.1f}" if num_bytes >= 0.1 * scale else f"{num_bytes / scale:.2g}"


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)

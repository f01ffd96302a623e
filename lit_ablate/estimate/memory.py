"""Per-rank memory: the bytes one rank holds at the peak of a training step.

Bytes one rank holds at the peak of a training step: parameters, gradients and optimizer states
(divided by the strategy's sharding), activations saved for backward (not divided by data
parallelism), and the transient copies a strategy makes (gathered layers, DDP's gradient buckets).
The activation model counts the tensors autograd saves per token; it was calibrated against
torch's MemTracker on CPU for Llama/Qwen3(-MoE) shapes with SDPA (tests/test_estimate_memory.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lit_ablate.estimate.flops import ParameterCounts
from lit_ablate.estimate.pipeline import (
    LOSS_LOGIT_COPIES_KEPT,
    PIPELINE_SCHEDULES,
    pipeline_pieces_held,
    pipeline_stage_layers,
    pipeline_stage_parameters,
    pipeline_stage_states,
)
from lit_ablate.estimate.shapes import HALF_CHUNK_COPIES, LOSS_LOGIT_COPIES, MemoryEstimate, ModelShape, TrainingShape

if TYPE_CHECKING:
    from lit_ablate.strategies.state_sharding import StateSharding


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
        copies = (copies + (HALF_CHUNK_COPIES if training.activation_bytes < 4 else 0.0)) * min(
            1.0, training.chunk_tokens / tokens
        )
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
    ``torch.func`` returns for the current chunk (benchmarks/dpo_memory.py measured it). Under
    tensor parallelism the chunked loss forms its gradients in the backward (its softmax needs the
    log-sum-exp all-reduced over tp), so it holds none."""
    tokens = training.micro_batch * -(-training.seq_len // training.context_parallel)
    if training.loss == "chunked" and training.loss_grad_in_forward and training.tensor_parallel == 1:
        weight_bytes = 4
    elif training.loss in ("liger", "liger_dpo"):
        weight_bytes = training.param_bytes * (2 if training.loss == "liger_dpo" else 1)
    else:
        return 0
    return shape.vocab * shape.hidden * weight_bytes + tokens * shape.hidden * training.activation_bytes


def root_gradient_bytes(counts: ParameterCounts, shape: ModelShape, training: TrainingShape) -> tuple[float, float]:
    """``(LM head, input embedding)``: bytes of the gradients an FSDP-sharded root unit (embeddings, final
    norm, LM head) forms unsharded in the backward and holds until its reduce-scatter, at the backward's
    end. The LM head's exists from the backward's start, beside every saved activation (``vocab / tp``
    rows; none for a loss that forms it in the forward: ``loss_gradient_bytes``); the embedding's comes
    last, when the activations are gone (the whole table, under tp too: DTensor's embedding backward has
    no vocabulary-sharded form). Tied embeddings: one table, from the start. A tensor tracker sees them as
    the backward's temporaries; they outweigh the activations of a wide model on few tokens (rank 0 of a
    Qwen3-8B-wide model on 64 simulated ranks, 128 tokens: 512 MiB of root gradients against 141 MiB of
    activations). A frozen base's share (adapters) forms none."""
    share = counts.trainable / counts.total
    embedding = counts.embedding * training.param_bytes * share
    if shape.tied_embeddings:  # the LM head is the table
        return embedding, 0.0
    if loss_gradient_bytes(shape, training):
        return 0.0, embedding
    return shape.vocab * shape.hidden / training.tensor_parallel * training.param_bytes * share, embedding


def optimizer_state_bytes(optimizer: str, param_bytes: int) -> float:
    """Optimizer-state bytes per parameter (torch keeps Adam's moments in the parameter dtype)."""
    return {
        "adamw": 2.0 * param_bytes,
        "adam": 2.0 * param_bytes,
        "sgd": 0.0,
        "sgd_momentum": float(param_bytes),
        "adamw8bit": 2.0,
    }[optimizer]


def optimizer_bytes(counts: ParameterCounts, training: TrainingShape) -> float:
    """Optimizer-state bytes of the trainable parameters; 8-bit AdamW keeps the states of tensors
    under 4096 elements in fp32 (``ParameterCounts.small_trainable``: most LoRA matrices of small models)."""
    if training.optimizer == "adamw8bit":
        return (counts.trainable - counts.small_trainable) * 2.0 + counts.small_trainable * 8.0
    return counts.trainable * optimizer_state_bytes(training.optimizer, training.param_bytes)


def estimate_memory(
    counts: ParameterCounts, shape: ModelShape, training: TrainingShape, sharding: StateSharding, world_size: int
) -> MemoryEstimate:
    """Per-rank bytes at a step's peak under ``sharding`` (divisors of params, grads, optimizer states).

    Transient: a sharded strategy gathers two decoder layers at a time (the current one and the
    prefetched next) and keeps the root's parameters (embeddings, final norm, LM head) gathered
    from forward to backward (without resharding after forward, every layer's: ``gathered``);
    sharded gradients exist in full twice for the unit being reduced (its
    gradients and the reduce-scatter buffer they are copied into), the largest unit being a layer
    or the root (both divided by tensor parallelism, whose shards FSDP gathers); replicated
    gradients on more than one rank (or under DDP on one) also sit in DDP's buckets unless
    ``gradient_as_bucket_view``. Measured against FSDP2/FSDP1 on 2 ranks in
    tests/test_estimate_memory.py. Activations: what the backward's peak holds beside the states,
    which under FSDP includes the root's unsharded gradients (``root_gradient_bytes``; measured on
    simulated ranks of 64 in tests/test_simulated_rank.py). Under pipeline parallelism: the largest
    stage's (``pipeline_stage_estimates``).
    """
    if training.pipeline_parallel > 1:
        return max(pipeline_stage_estimates(counts, shape, training, sharding), key=lambda e: e.total)
    weight_bytes = training.param_bytes  # weights and gradients; the optimizer's states stay in param_bytes
    if sharding.half_weights:  # a mixed run's half dtype (activation_bytes): DeepSpeed's cast module
        weight_bytes = min(weight_bytes, training.activation_bytes)
    full = (counts.total - counts.quantized) * weight_bytes + counts.quantized_bytes
    stored = full / counts.total  # bytes per parameter: quantised base weights pack tighter
    trained = counts.trainable * weight_bytes  # a frozen base has no gradients or optimizer states
    root = max(0, counts.total - shape.layers * shape.layer_params)
    gathered_layer = shape.layer_params
    if sharding.expert_parallel > 1:  # a layer gathers only this rank's experts, over their own FSDP ranks
        layer_experts = counts.experts / shape.layers
        gathered_layer -= layer_experts * (1 if sharding.expert_shards == 1 else 1 - 1 / sharding.expert_parallel)
    # FSDP gathers over its own ranks what tensor parallelism left of each unit: 1 / tp of it
    gathered_layer, root = gathered_layer / training.tensor_parallel, root / training.tensor_parallel
    transient = 0
    if sharding.gathered is not None:  # every layer's gathered parameters, kept from forward to backward
        transient += -(-full // sharding.gathered)
    elif sharding.params > 1 or sharding.fsdp_units:
        layer_bytes = 1 if training.fp8_all_gather else stored
        transient += int(2 * gathered_layer * layer_bytes + root * stored)
    if sharding.grads > 1 or sharding.fsdp_units:
        transient += int(2 * max(gathered_layer, root) * weight_bytes * counts.trainable / counts.total)
    elif (world_size > 1 or training.ddp) and not training.gradient_as_bucket_view:
        transient += trained
    activations = activation_bytes(shape, training) + context_parallel_bytes(shape, training)[0]
    if sharding.params > 1 or sharding.fsdp_units:  # the root's gradients wait, unsharded, for its reduce-scatter
        head, embedding = root_gradient_bytes(counts, shape, training)
        activations = int(head + max(activations, embedding))
    return MemoryEstimate(
        params=int(-(-full // _state_divisor(sharding.params, sharding, counts)))
        + _fp8_shard_cast(shape, training, sharding),
        grads=int(-(-trained // _state_divisor(sharding.grads, sharding, counts)))
        + sharding.gradient_bucket_elements * weight_bytes,
        optimizer=0
        if sharding.optimizer_on_host and not training.on_host
        else int(
            (optimizer_bytes(counts, training) + 4 * counts.trainable * sharding.master_copy)
            / _state_divisor(sharding.optimizer, sharding, counts)
        ),
        activations=activations,
        transient=transient + context_parallel_bytes(shape, training)[1],
        reference=reference_bytes(shape, training, full, sharding.params),
    )


def pipeline_stage_estimates(
    counts: ParameterCounts, shape: ModelShape, training: TrainingShape, sharding: StateSharding
) -> list[MemoryEstimate]:
    """Bytes of each pipeline rank at its step's peak (``estimate_memory`` takes the largest).

    A rank holds its stages' parameters, gradients and optimizer states, divided as the mesh strategy
    divides each stage (``pipeline_stage_states``: over ``tp`` and the FSDP dims ``dp_shard x ep x cp``,
    the norms replicated by ``tp``, the routed experts over ``ep``): one stage, or under
    ``interleaved_1f1b`` stages ``r, r + pp, ...``. A step runs ``microbatches`` pieces of
    ``micro_batch / microbatches`` rows (each rank ``seq_len / cp`` tokens of them); a rank keeps what
    autograd saved for each (stage, piece) whose forward ran and whose backward has not
    (``pipeline_pieces_held``), one of them at its backward's peak (``activation_bytes``; ``tp`` divides
    each layer's heads and MLP width and the loss's vocabulary). The last stage's pieces also keep the
    final norm's tensors and the loss's (``LOSS_LOGIT_COPIES_KEPT``, ``loss_gradient_bytes``). The first
    stage's backward ends in the embedding's: it forms the whole ``[vocab, hidden]`` weight gradient
    (under ``tp`` too: DTensor's embedding backward has no vocabulary-sharded form, so it computes the
    replicated gradient and keeps its shard), beside the gradient of the hidden states arriving; the
    last stage's, with the torch loss, starts with the LM head's: the logits' fp32 gradient and the
    head's weight gradient (``vocab / tp`` rows), which outweigh the loss's copies when a rank holds
    few tokens (``cp``).
    Context parallelism's all-gather keeps each piece's gathered K/V, and the piece at its backward
    the exchange of one layer (``context_parallel_bytes``; the tensor tracker sees both among the
    activations and temporaries). Transient: the receive buffers torch's schedule allocates once per
    piece and stage, the previous stage's hidden states (all stages but the first) and their
    gradients from the next (all but the last). FSDP-sharded stages (``sharding.gathered``:
    without resharding after forward) also hold, through the step, their gathered parameters and their
    unsharded gradients (``PipelineStage`` defers FSDP's reduce-scatter to the last micro-batch; both
    divided by ``tp``) and, at that reduce-scatter, a copy of the largest unit's gradients (a decoder
    layer, or the stage's root: embeddings, or final norm and LM head). Under ``accumulate_grad_batches``
    a stage FSDP does not shard holds its gradients twice (the step's earlier batches' beside the
    schedule's). Measured on 2 ranks (pp=2) and
    4 (pp=2 x dp_shard=2) in tests/test_pipeline_estimate.py, on 4 (pp=2 x tp=2, x cp=2, x ep=2) and 8
    (pp=2 x tp=2 x dp_shard=2) in tests/test_estimate_composition.py.
    """
    from lit_ablate.errors import ConfigError

    if training.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(
            "trainer.strategy.init_args.schedule",
            training.pipeline_schedule,
            f"the estimate models the {' and '.join(PIPELINE_SCHEDULES)} schedules",
        )
    m, tp = training.microbatches, training.tensor_parallel
    piece = replace(training, micro_batch=max(1, training.micro_batch // m), pipeline_parallel=1)
    tokens = piece.micro_batch * -(-piece.seq_len // piece.context_parallel)  # one piece's tokens on a rank
    boundary = tokens * shape.hidden * training.activation_bytes  # one piece's hidden states between stages
    per_parameter = ((counts.total - counts.quantized) * training.param_bytes + counts.quantized_bytes) / counts.total
    trained = training.param_bytes * counts.trainable / counts.total  # gradient bytes per parameter
    # Unsharded stages under accumulation: the step's earlier gradients wait beside the schedule's own
    # (an FSDP-sharded stage forms its own in the unsharded buffers counted as transient).
    gradient_copies = 2 if training.accumulate_grad_batches > 1 and sharding.gathered is None else 1
    states = pipeline_stage_states(counts, shape, training, sharding)
    stage_params = pipeline_stage_parameters(counts, shape, training)
    stage_layers = pipeline_stage_layers(counts, shape, training)
    last = len(stage_params) - 1

    def kept(stage: int) -> float:  # bytes one piece keeps on ``stage`` until its backward
        bytes_ = stage_layers[stage] * layer_activation_elements(shape, piece) * training.activation_bytes
        if stage == last:
            bytes_ += (
                3 * shape.hidden * training.activation_bytes
                + LOSS_LOGIT_COPIES_KEPT.get(training.loss, 0.0) * shape.vocab / tp * 4
            )
            bytes_ += loss_gradient_bytes(shape, piece) / tokens
        return bytes_ * tokens + context_parallel_bytes(replace(shape, layers=stage_layers[stage]), piece)[0]

    def at_backward(stage: int) -> float:  # the peak of one piece's backward on ``stage``
        stage_shape = replace(shape, layers=stage_layers[stage])
        saved, exchange = context_parallel_bytes(stage_shape, piece)  # a layer's exchange runs inside its backward
        peak = activation_bytes(stage_shape, piece, loss_head=stage == last) + saved + exchange
        if stage == 0:  # the embedding's weight gradient, whole, and the hidden states' arriving
            peak = max(peak, counts.embedding * training.param_bytes + boundary)
        if stage == last and training.loss == "torch":  # the LM head's backward: logits' and weight's gradients
            head = (3 * shape.hidden * training.activation_bytes + shape.vocab / tp * 4) * tokens
            peak = max(
                peak,
                activation_bytes(stage_shape, piece, loss_head=False)
                + head
                + shape.vocab * shape.hidden / tp * training.param_bytes,
            )
        return peak

    estimates = []
    for rank in range(training.pipeline_parallel):
        own = range(rank, last + 1, training.pipeline_parallel)  # the rank's stages
        *held, backward_stage = pipeline_pieces_held(rank, training)
        stored = sum(states[s].stored for s in own)
        gathered = 0
        if sharding.params > 1 and sharding.gathered is not None:
            units = [shape.layer_params, *(stage_params[s] - stage_layers[s] * shape.layer_params for s in own)]
            largest_unit = max(units) / tp  # a decoder layer or a stage's root, as this rank holds it gathered
            gathered = (
                sum(states[s].gathered for s in own) * (per_parameter + trained) + largest_unit * training.param_bytes
            )
        estimates.append(
            MemoryEstimate(  # each state's bytes in the rank's share of the parameters
                params=round(stored * per_parameter),
                grads=round(stored * trained * gradient_copies),
                optimizer=int(optimizer_bytes(counts, training) * stored / counts.total),
                activations=int(sum(kept(s) for s in held) + at_backward(backward_stage)),
                transient=int(m * boundary * sum((s != 0) + (s != last) for s in own) + gathered),
            )
        )
    return estimates


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

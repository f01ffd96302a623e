"""The shapes the memory and pipeline estimates read: a model's (from its config) and a training run's."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from lit_ablate.estimate.flops import _experts_per_token, attention_shape, meta_model

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
    tied_embeddings: bool
    """The LM head is the input embedding's matrix (one table; a pipeline holds it on its first and last stage)."""


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
        ddp: the model is wrapped in torch's DistributedDataParallel, which fills its gradient buckets
            even on one rank (a replicated strategy on several ranks is counted as DDP anyway).
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
        accumulate_grad_batches: batches per optimizer step. A pipeline stage that FSDP does not shard
            keeps the step's earlier batches' gradients beside the ones its schedule forms: one more
            gradient copy from a step's second batch on.
        on_host: the ranks compute on the host (CPU): what a strategy offloads to host memory stays with them.
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
    ddp: bool = False
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
    accumulate_grad_batches: int = 1
    on_host: bool = False

    def __post_init__(self) -> None:
        from lit_ablate.errors import ConfigError

        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("--optimizer", self.optimizer, f"choose one of {list(OPTIMIZERS)}")
        if self.checkpointing not in CHECKPOINTING:
            raise ConfigError(
                "trainer.strategy.init_args.activation_checkpointing",
                self.checkpointing,
                f"choose one of {list(CHECKPOINTING)}",
            )


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
        tied_embeddings=model.get_output_embeddings() is not None
        and model.get_output_embeddings().weight is model.get_input_embeddings().weight,
    )

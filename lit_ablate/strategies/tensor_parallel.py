"""The TP step of the mesh strategy: each weight matrix split over the mesh's ``tp`` ranks (``TensorParallelSteps``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from lit_ablate.errors import ConfigError, Refusal
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss, decoder_layers
from lit_ablate.models.fp8.conversion import is_fp8, precompute_fp8_scales
from lit_ablate.models.losses.cross_entropy import ChunkedCrossEntropy, TorchCrossEntropy
from lit_ablate.models.losses.loss_choice import LossChoice
from lit_ablate.models.losses.vocabulary_parallel_chunked import vocabulary_parallel_chunked_cross_entropy
from lit_ablate.strategies.fsdp2 import FullyShardSteps
from lit_ablate.strategies.mesh import STRATEGY_OPTIONS_KEY
from lit_ablate.strategies.state_sharding import StateSharding
from lit_ablate.strategies.tensor_parallel_plans import Plan, layer_plan_for, root_plan


class TensorParallelSteps(FullyShardSteps):
    """Tensor parallelism (Megatron's layout, DTensor's ``parallelize_module``), optionally sequence
    parallel, composed with FSDP2 over ``dp_shard`` (2-D: world = ``dp_shard x tp``, x ``dp_replicate``).

    Choose it when one layer's matrices or activations are too large for one device, or to ablate
    it against FSDP at the same world size: the ``tp`` ranks of a group read the same batch and each
    holds ``1 / tp`` of every attention and MLP matrix, of the embedding and of the LM head, and of the
    activations inside each block. The plan per model family is in ``tensor_parallel_plans``; a
    subclass overrides ``layer_plan``/``root_plan``. A tied LM head shares the split embedding's
    parameter (``tie_split_embeddings``). The loss is cross-entropy over the vocabulary-sharded
    logits, each rank forming only its vocabulary columns: the ``torch`` backend through torch's
    ``loss_parallel`` (without z-loss), ``chunked`` chunk by chunk with its log-sum-exp all-reduced
    (``VocabParallelChunkedCrossEntropy``; z-loss too); the fused kernels take a whole LM-head
    weight and are refused. Gradient clipping takes the global norm over the TP and
    FSDP meshes together (``MeshStrategy.clip_gradients_by_norm``: FSDP's strided shards of a TP shard
    included). The loss runs inside ``vocabulary_parallel_loss``, TP's part of ``step_context``.

    fp8 (tensorwise recipe): converted layers are split with torchao's float8 styles (``float8_styles``);
    with ``fp8.fsdp_all_gather`` the weights' fp8 scales are computed before the first step too (``on_train_start``).

    The step of ``MeshParallelStrategy`` that runs when ``tp > 1`` (``TensorParallelStrategy`` is its preset):
    ``tp`` must divide the attention heads, the key/value heads and the vocabulary.

    Args:
        sequence_parallel: also split the residual stream between blocks along the sequence (the
            norms run on ``1 / tp`` of the tokens). Needs every rank to see the whole sequence's
            ``position_ids`` (the strategy makes them explicit) and a length divisible by ``tp``.
            Padded and packed batches work: the decoder's mask is built for the whole sequence
            (``whole_sequence_masks``).
        **kwargs: the mesh sizes and the other steps' options (``MeshParallelStrategy``).
    """

    def __init__(self, sequence_parallel: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if sequence_parallel and self.requested_mesh_sizes.cp != 1:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.sequence_parallel",
                True,
                "context parallelism already splits the sequence over cp; use sequence_parallel: false",
            )
        self.sequence_parallel = sequence_parallel

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.device_mesh["tp"]

    # ---------------------------------------------------------------- the step
    def apply_tp(self, model: CausalLMWithLoss) -> None:
        """Split the decoder layers, embedding and LM head over ``tp``; the loss reads vocabulary shards.

        With ``compile_layers``, the first decoder layer gets a plain tensor: the split embedding
        returns its all-reduce (or reduce-scatter) as an ``AsyncCollectiveTensor`` not yet waited for,
        and a compiled layer given one returns a zero gradient to it (torch 2.13: the embedding stopped
        learning, silently). A copy waits for the collective inside autograd."""
        self.check_model(model)
        mesh = self.tp_mesh
        if is_fp8(model) and not self.float8_styles(model):
            rank_zero_warn(
                "fp8 with sequence parallelism on CPU: the converted layers are split with DTensor's plain "
                "styles (gloo cannot all-gather float8 tensors), so activations travel in high precision; "
                "the numbers are the same"
            )
        for layer in decoder_layers(model):
            _parallelize(layer, mesh, self.layer_plan(model, layer))
        _parallelize(model.lm, mesh, self.root_plan(model))
        tie_split_embeddings(model)
        model.loss_fn = split_vocabulary_loss(model.loss_fn, mesh)
        if self.sequence_parallel:
            model.lm.base_model.register_forward_pre_hook(whole_sequence_masks, with_kwargs=True)
        if self.compile_layers:
            model.lm.get_input_embeddings().register_forward_hook(_waited_collective)

    def state_sharding(self, world_size: int) -> StateSharding:
        """FSDP2's division over ``dp_shard x ep x cp x tp``, except for routed experts: the plan keeps
        MoE blocks whole, so ``tp`` does not divide them."""
        sharding = super().state_sharding(world_size)
        tp = self.requested_mesh_sizes.resolved(world_size).tp
        if tp == 1:
            return sharding
        return replace(sharding, expert_shards=sharding.params // (tp * sharding.expert_parallel))

    def layer_plan(self, model: CausalLMWithLoss, layer: nn.Module) -> Plan:
        """One decoder layer's plan: the model family's (``tensor_parallel_plans.LAYER_PLANS``)."""
        return layer_plan_for(model.lm.config.model_type)(layer, self.sequence_parallel, self.float8_styles(model))

    def float8_styles(self, model: CausalLMWithLoss) -> bool:
        """Whether the plan splits fp8-converted layers with torchao's float8 styles, which cast before
        communicating. Not under sequence parallelism on CPU: there the casts' all-gathers would carry
        float8 tensors, which gloo refuses ('Invalid scalar type'); the plain styles cast after them,
        same numbers."""
        return is_fp8(model) and not (self.sequence_parallel and self.tp_mesh.device_type == "cpu")

    def root_plan(self, model: CausalLMWithLoss) -> Plan:
        """Embedding, final norm and LM head."""
        return root_plan(self.sequence_parallel)

    def check_model(self, model: CausalLMWithLoss) -> None:
        """Refuse what this layout cannot split, naming the key: a dimension ``tp`` does not divide
        (``tensor_parallel_shape_refusal``), a loss backend that needs the whole LM-head weight."""
        refusal = tensor_parallel_shape_refusal(model.lm.config, self.mesh_sizes.tp)
        if refusal:
            raise refusal.error()
        LossChoice.of_backend(model.loss_fn).check_tensor_parallel()
        if model.lm.get_output_embeddings().bias is not None:
            raise ConfigError("model", type(model.lm).__name__, "an LM head with a bias is not split yet; use tp: 1")

    # ---------------------------------------------------------------- batches and steps
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.sequence_parallel and self.mesh_sizes.tp > 1:
            batch = self.sequence_parallel_batch(batch)
        return batch

    @property
    def sequence_multiple(self) -> int:
        """Sequence parallelism splits each row over the tp ranks: its length must be a multiple of tp."""
        return self.mesh_sizes.tp if self.sequence_parallel else 1

    def sequence_parallel_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with explicit ``position_ids`` and without an all-ones ``attention_mask``: under
        sequence parallelism the decoder sees only this rank's slice of the embeddings and would
        number the positions of the slice from 0. A packed batch brings its per-document
        ``position_ids`` (and ``cu_seqlens``), a padded one its padding mask; from either
        ``whole_sequence_masks`` builds the mask over the whole sequence."""
        tp = self.mesh_sizes.tp
        rows, length = batch["input_ids"].shape
        if length % tp:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.sequence_parallel",
                True,
                f"a batch has length {length}, not divisible by tp={tp}; pad to a multiple of {tp} "
                "(data.init_args.collator.init_args.pad_to_multiple_of) or set sequence_parallel: false",
            )
        mask = batch.get("attention_mask")
        if mask is not None and bool(mask.all()):  # all ones: the causal mask is the same without it
            batch = {key: value for key, value in batch.items() if key != "attention_mask"}
        if batch.get("position_ids") is None:
            batch = {**batch, "position_ids": torch.arange(length, device=batch["input_ids"].device).expand(rows, -1)}
        return batch

    @contextmanager
    def vocabulary_parallel_loss(self) -> Iterator[None]:
        """Within: cross-entropy on vocabulary-sharded logits reduces over ``tp`` (forward and backward;
        ``step_context`` enters it around Lightning's steps)."""
        if self.mesh_sizes is None or self.mesh_sizes.tp == 1:
            yield
            return
        with loss_parallel():
            yield

    # ---------------------------------------------------------------- fp8 all-gather scales
    def on_train_start(self) -> None:
        """fp8 all-gather's weight scales before the first step (nothing without ``fp8.fsdp_all_gather``).

        Without precomputed scales FSDP2 takes a weight's amax over its FSDP mesh only, i.e. per TP
        shard: each rank would scale its shard apart (measured: step-1 loss 3.6e-4 off at tp=2).
        ``FSDP2Strategy.optimizer_step`` refreshes them after every step; here, after a checkpoint
        is restored, before the first one (and before an evaluation, which may come first).
        """
        super().on_train_start()
        precompute_fp8_scales(self.lightning_module)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        precompute_fp8_scales(self.lightning_module)

    def on_test_start(self) -> None:
        super().on_test_start()
        precompute_fp8_scales(self.lightning_module)


def split_vocabulary_loss(loss: TorchCrossEntropy | ChunkedCrossEntropy, mesh: DeviceMesh) -> Any:
    """The loss backend's form for an LM head whose vocabulary rows are split over ``mesh``."""
    if isinstance(loss, ChunkedCrossEntropy):
        return VocabParallelChunkedCrossEntropy(loss, mesh)
    return VocabParallelCrossEntropy(loss, mesh)


@dataclass(frozen=True)
class VocabParallelCrossEntropy:
    """The ``torch`` loss backend on a vocabulary-sharded LM head: each rank multiplies the hidden
    states by its rows of the head and keeps its logit columns; ``loss_parallel`` combines the
    ranks' log-sum-exps and target logits (a few numbers per token), never the logits.

    Must run (forward and backward) inside ``TensorParallelSteps.vocabulary_parallel_loss``.
    """

    inner: TorchCrossEntropy
    mesh: DeviceMesh

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, self.mesh, [Replicate()], run_check=False)
        # A copy, not a view: FSDP2 warns that an in-place op on a view its root returns drops its hook.
        return self.inner(hidden, weight, labels, bias).to_local().clone()


@dataclass(frozen=True)
class VocabParallelChunkedCrossEntropy:
    """The ``chunked`` loss backend on a vocabulary-sharded LM head: each rank forms its logit
    columns chunk by chunk; the ranks all-reduce their partial log-sum-exps and target logits (a
    few numbers per token) and the hidden states' gradient
    (``lit_ablate.models.losses.vocabulary_parallel_chunked``). Needs no ``loss_parallel`` context."""

    inner: ChunkedCrossEntropy
    mesh: DeviceMesh

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        if isinstance(hidden, DTensor):  # replicated over tp: every rank holds every token's state
            hidden = hidden.to_local()
        shard = weight.to_local()  # this rank's vocabulary rows (Shard(0) over tp); its gradient stays Shard(0)
        return vocabulary_parallel_chunked_cross_entropy(
            hidden,
            shard,
            labels,
            self.mesh.get_local_rank() * shard.shape[0],
            self.mesh.get_group(),
            self.inner.chunk_tokens,
            self.inner.chunk_vocab,
            self.inner.z_loss_weight,
        )


def tie_split_embeddings(model: CausalLMWithLoss) -> None:
    """Make a tied LM head share the split embedding's parameter again (nothing for untied models).

    Both are split by vocabulary rows (``Shard(0)``), but ``parallelize_module`` turns each module's
    weight into its own DTensor parameter: untied, the embedding and the head would each take only
    their own gradient and drift apart (1.45e-1 in 3 steps, docs/platform.md). Tied, the lookup's and
    the head's gradients add into one ``Shard(0)`` gradient, as in one process. Runs before FSDP2,
    which then manages the one parameter on both modules and keeps them tied through ``to_empty``
    on meta-built ranks (checked: a second re-tie after materialising changed nothing). A pipeline
    stage holds one of the two (``pipeline_tied_embeddings`` keeps the stages' copies equal)."""
    lm = model.lm
    head, embedding = lm.get_output_embeddings(), lm.get_input_embeddings()
    if getattr(lm.config, "tie_word_embeddings", False) and head is not None and embedding is not None:
        head.weight = embedding.weight


def whole_sequence_masks(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """A forward pre-hook of the decoder (``base_model``) under sequence parallelism: its attention
    mask, built for the whole sequence.

    The decoder builds its mask from the embeddings' length, and under sequence parallelism the
    split embedding returns this rank's slice of the sequence, while attention sees the whole
    sequence (gathered before q/k/v). Unpadded and unpacked, the mask is plain causal and the
    attention kernel needs none (nothing changes); packed (the documents' block-diagonal mask from
    the per-document ``position_ids``) or padded (the ``[B, T]`` padding mask) it would come out for
    the slice's length. transformers passes a 4-D mask through as it is, so the same function
    builds it here from the whole ``input_ids``' shape. A sliding-window model would need a second
    mask: refused."""
    input_ids, position_ids, padding = kwargs.get("input_ids"), kwargs.get("position_ids"), kwargs.get("attention_mask")
    if (
        input_ids is None
        or position_ids is None
        or not (padding is None or (isinstance(padding, Tensor) and padding.ndim == 2))
    ):
        return None
    from transformers.masking_utils import create_causal_mask

    config = module.config
    dtype = module.get_input_embeddings().weight.dtype
    whole = torch.empty((*input_ids.shape, 0), dtype=dtype, device=input_ids.device)  # only its shape is read
    # The cache is the fourth argument, passed by position: transformers renamed it from
    # ``past_key_values`` (5.17, the GPU machines') to ``cache`` (5.24).
    mask = create_causal_mask(config, whole, padding, None, position_ids=position_ids)
    if mask is None:  # plain causal: the kernel's own causal flag sees the whole sequence
        return None
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types) or (
        not layer_types and getattr(config, "sliding_window", None)
    ):
        raise ConfigError(
            f"{STRATEGY_OPTIONS_KEY}.sequence_parallel",
            True,
            "packed or padded batches on a sliding-window model need a second whole-sequence mask, "
            "not built; use unpacked, unpadded batches or sequence_parallel: false",
        )
    return args, {**kwargs, "attention_mask": mask}


def _waited_collective(module: nn.Module, args: Any, output: Tensor) -> Tensor:
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def _parallelize(module: nn.Module, mesh: DeviceMesh, plan: Plan) -> None:
    """Apply ``plan``'s styles in order. Each rank only slices what it holds (``src_data_rank=None``):
    ranks other than 0 hold ``meta`` weights, and ``materialize`` copies rank 0's values afterwards.
    DTensor's ``SequenceParallel`` re-creates the weights it replicates as trainable ones: frozen
    weights (the norms beside LoRA adapters, DPO's reference model) are frozen again after."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    for name, styles in plan.items():
        for style in styles if isinstance(styles, tuple) else (styles,):
            parallelize_module(module, mesh, {name: style}, src_data_rank=None)
    for name, p in module.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


SPLIT_DIMENSIONS = ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size")
"""What the plan splits over ``tp`` ranks: the query and key/value heads, the embedding's and the LM head's
vocabulary, and the dense MLP's width (MoE blocks stay whole)."""


def tensor_parallel_shape_refusal(config: Any, tp: int) -> Refusal | None:
    """Why a model of Hugging Face ``config`` cannot be split over ``tp`` ranks (a ``SPLIT_DIMENSIONS`` entry
    ``tp`` does not divide), or None: what the strategy checks once the model is built, and a rule before
    any rank starts."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    every_layer_moe = (
        experts and not getattr(config, "mlp_only_layers", None) and getattr(config, "decoder_sparse_step", 1) == 1
    )
    for name in SPLIT_DIMENSIONS:
        value = None if name == "intermediate_size" and every_layer_moe else getattr(config, name, None)
        if isinstance(value, int) and value % tp:
            return Refusal(f"{STRATEGY_OPTIONS_KEY}.tp", tp, f"the model's {name} is {value}; use a tp that divides it")
    return None

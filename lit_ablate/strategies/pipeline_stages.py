"""What a pipeline stage is: its module (``StageModule``), the stand-in for layers other stages hold, this
rank's stages in the pipeline (``RankStages``), and the batch the stages take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lit_ablate.errors import ConfigError
from lit_ablate.models.moe.blocks import moe_blocks

if TYPE_CHECKING:
    from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss


class StageModule(nn.Module):
    """One stage's forward: token ids (first stage) or the previous stage's hidden states in, hidden states out.

    The decoder's own forward runs (masks, rotary positions); the pass-through layers and the
    identity norm make it compute only this stage's part. A rank holding several stages
    (interleaved schedules) gives each one its ``layers``: during the stage's forward the decoder
    runs those only, and its final norm only on the last stage (the decoder's modules are swapped
    for the call, so parameter names and the model's structure stay as built).

    Its submodules (``parts``) are the stage's own layers, embeddings (first) or final norm and LM
    head (last): what torch's ``PipelineStage`` and FSDP take as the stage, so that each of a rank's
    interleaved stages is its own FSDP root. The model is referenced, not registered.
    """

    def __init__(
        self, model: CausalLMWithLoss, first: bool, last: bool = True, layers: list[int] | None = None
    ) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)
        self.first, self.last = first, last
        decoder = model.lm.base_model
        held = [
            index
            for index, layer in enumerate(decoder.layers)
            if (index in layers if layers is not None else not isinstance(layer, PassThrough))
        ]
        ends = ([decoder.embed_tokens] if first else []) + ([decoder.norm, model.lm.lm_head] if last else [])
        self.parts = nn.ModuleList([decoder.layers[index] for index in held] + ends)
        self.aux_sums: dict[str, Tensor] = {}
        """Per auxiliary-loss name, its weighted sum over the step's micro-batches (``add_aux_gradient``)."""
        self._metadata_forward_pending = True
        # A plain list, not a ModuleList: the pass-throughs are no part of the stage.
        self._view = (
            None
            if layers is None
            else [layer if index in layers else PassThrough() for index, layer in enumerate(decoder.layers)]
        )

    def head_loss(self, hidden: Tensor, batch: dict[str, Any]) -> tuple[Tensor, ...]:
        """The model's outputs (``CausalLMWithLoss.head_outputs``: a token-loss sum and the useful
        tokens, or DPO's per-sequence log-probs and response tokens) from the last stage's hidden states
        (final norm applied) of ``batch``'s rows, through the LM head."""
        return self.model.head_outputs(hidden, batch)

    def forward(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        aux_weights: Tensor | None = None,
    ) -> Tensor:
        """``position_ids``: a packed micro-batch's positions (restarting at each document, from which the
        decoder keeps documents apart); ``attention_mask``: a padded one's (the padding's hidden states,
        which MoE routers see, are then one process's); every stage needs them, the schedule hands each
        stage its micro-batch's. ``aux_weights``: per row, the weight of the MoE auxiliary losses of this
        stage's layers in the step's objective (``add_aux_gradient``; None: not trained on, evaluation)."""
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        decoder = self.model.lm.base_model
        if self._view is None:
            hidden = decoder(**inputs, use_cache=False).last_hidden_state
        else:
            saved = decoder._modules["layers"], decoder._modules["norm"]
            decoder._modules["layers"] = nn.ModuleList(self._view)
            if not self.last:
                decoder._modules["norm"] = nn.Identity()
            try:
                hidden = decoder(**inputs, use_cache=False).last_hidden_state
            finally:
                decoder._modules["layers"], decoder._modules["norm"] = saved
        return self.add_aux_gradient(hidden, aux_weights)

    def add_aux_gradient(self, hidden: Tensor, aux_weights: Tensor | None) -> Tensor:
        """Make the backward through ``hidden`` also backpropagate this stage's MoE auxiliary losses.

        The schedule backpropagates only the last stage's loss; every stage's backward does run through
        its output, so the auxiliary losses of its layers enter there, each weighted by
        ``aux_weights.sum()`` (the micro-batch's useful tokens over the run constant and the model's
        MoE layer count: the one-process objective ``(loss_sum + units * mean_layers(aux)) / c``). The
        weighted values are kept (``aux_sums``) for the step's logged auxiliary losses."""
        losses: dict[str, Tensor] = {}
        for block in moe_blocks(self.parts):
            for name, loss in block.pop_aux_losses().items():
                losses[name] = losses.get(name, 0.0) + loss
        if not losses or aux_weights is None:
            return hidden
        if self._metadata_forward_pending:
            # torch's PipelineStage first runs one forward to infer its hand-off shapes (torch 2.13), on
            # placeholder hidden states for a later stage: neither trained on nor counted.
            self._metadata_forward_pending = False
            for block in moe_blocks(self.parts):
                block.pop_load()
            return hidden
        weight = aux_weights.sum()
        for name, loss in losses.items():
            self.aux_sums[name] = self.aux_sums.get(name, 0.0) + weight.detach() * loss.detach().float()
        return _AddAuxGradient.apply(hidden, sum(losses.values()), weight)


class _AddAuxGradient(torch.autograd.Function):
    """The identity on the hidden states, whose backward also gives ``aux`` the gradient ``weight``."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, aux: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(weight)
        ctx.aux_dtype = aux.dtype
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad, weight.to(ctx.aux_dtype), None


@dataclass(frozen=True)
class RankStages:
    """This rank's stages of the pipeline: their modules by stage index, and where they sit.

    ``pp`` ranks hold ``pp x stages_per_rank`` stages, looped: rank ``stage_index`` holds stages
    ``stage_index, stage_index + pp, ...``; ``group`` is the pipeline's (the ``pp`` dimension's)."""

    modules: dict[int, StageModule]
    pp: int
    stage_index: int
    stages_per_rank: int
    group: ProcessGroup
    device: torch.device

    @property
    def last(self) -> StageModule:
        """This rank's last stage (the model's last, with the LM head, on rank ``pp - 1``)."""
        return self.modules[max(self.modules)]

    def from_last_stage(self, tensors: tuple[Tensor, ...] | None) -> tuple[Tensor, ...]:
        """The last stage's ``tensors`` on every stage of the pipeline (their shapes only the last knows)."""
        carried = [None if tensors is None else [t.detach().cpu() for t in tensors]]
        dist.broadcast_object_list(carried, group=self.group, group_src=self.pp - 1)
        return tuple(t.to(self.device) for t in carried[0])

    def reshard(self) -> None:
        """Free FSDP's gathered parameters: a forward without backward leaves the layers kept gathered
        (``reshard_after_forward: false``) and the root, and a checkpoint saved now would hold them whole."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.modules.values():
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()


class PassThrough(nn.Module):
    """Stands in for a decoder layer another stage holds (the layer list keeps its length and names)."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states


def pipeline_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch the stages take: token ids, labels, a packed batch's ``position_ids`` (documents
    never cross rows, so each micro-batch of rows keeps whole documents) and a right-padded batch's
    ``attention_mask`` (as one process uses it: MoE routers see the padding too). A packed batch's
    ``cu_seqlens`` span the whole batch: left out (a varlen kernel finds a micro-batch's documents from
    its positions). A preference batch (padded: one sequence per row) keeps its ``num_pairs``,
    ``sequence_ids`` and the reference's ``reference_logps``."""
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ConfigError("data", "attention_mask", "pipeline parallelism takes right-padded batches only")
    taken = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    if mask is not None:
        taken["attention_mask"] = mask
    if batch.get("position_ids") is not None:
        taken["position_ids"] = batch["position_ids"]
    if batch.get("num_pairs") is not None:
        rows = batch["sequence_ids"]
        if "position_ids" in taken or not bool((rows == torch.arange(len(rows), device=rows.device)[:, None]).all()):
            raise ConfigError(
                "data.init_args.collator",
                "PreferencePackingCollator",
                "pipeline stages take preference pairs one sequence per row; use PreferencePaddingCollator",
            )
        taken.update(num_pairs=int(batch["num_pairs"]), sequence_ids=rows)
        if batch.get("reference_logps") is not None:
            taken["reference_logps"] = batch["reference_logps"]
    return taken


def pair_rows(num_pairs: int, microbatches: int, device: torch.device) -> Tensor:
    """The order of a padded preference batch's rows (chosen ``0..P-1``, rejected ``P..2P-1``) that gives
    each of ``microbatches`` equal chunks of rows whole pairs: its pairs' chosen rows, then their
    rejected rows (so a micro-batch is itself such a batch)."""
    if num_pairs % microbatches:
        raise ConfigError(
            "trainer.strategy.init_args.microbatches",
            microbatches,
            f"a batch of {num_pairs} preference pairs splits into whole pairs only: use a divisor of {num_pairs}",
        )
    pairs = torch.arange(num_pairs, device=device).view(microbatches, -1)
    return torch.cat([pairs, pairs + num_pairs], dim=1).reshape(-1)


def micro_batch(batch: dict[str, Any], rows: Tensor) -> dict[str, Any]:
    """The rows ``rows`` of a (reordered) pipeline batch, as the last stage's head and loss take them: a
    preference micro-batch numbers its sequences by row and counts its own pairs."""
    taken = {key: value[rows] for key, value in batch.items() if isinstance(value, Tensor) and key != "sequence_ids"}
    if "num_pairs" in batch:
        width = batch["labels"].shape[1]
        taken["sequence_ids"] = torch.arange(len(rows), device=rows.device)[:, None].expand(len(rows), width)
        taken["num_pairs"] = len(rows) // 2
    return taken

"""``PipelineSchedule``: one training step of this rank's pipeline stages under torch's schedule.

The step's batch is split into micro-batches that flow through the stages (``gpipe``: all forwards,
then all backwards; ``1f1b``: one forward, one backward in the steady state, so fewer micro-batches'
activations are alive at once; ``interleaved_1f1b``: 1F1B over several stages per rank), forward and
backward inside ``CausalLM.training_step``; the gradients wait until Lightning's backward hands them
over (``deliver_gradients``).

The step objective is the one process's (``StepObjective``): the last stage backpropagates each
micro-batch's token-loss *sum* divided by the run constant ``c``, and after the step every stage
multiplies its gradients by ``c / N`` (``N``: the step's useful tokens, which every rank counts
itself, since every rank reads the same batch). The step's loss sum is broadcast from the last
stage, so every rank logs and records the same loss.

What one process does beside the loss, the stages do together: under ``accumulate_grad_batches``
each batch's schedule gradients are added to the step's earlier ones, divided as Lightning divides a
loss; a packed batch's ``position_ids`` reach every stage with its micro-batch (the schedule chunks a
step's keyword inputs for each stage); and the MoE router losses of each stage's layers are
backpropagated by that stage (``StageModule.add_aux_gradient``: the schedule backpropagates only the
last stage's loss), weighted by their micro-batch's useful tokens as ``CausalLM`` weighs them; a tied
matrix's two copies (embedding on the first stage, LM head on the last) add each other's gradients
after each batch's schedule, beside the replicas' average, as one process's one matrix takes both.

DPO's loss is per pair: its padded batch is reordered so that each micro-batch holds whole pairs,
and the last stage turns each micro-batch's sequence log-probs into pair losses with ``DPO``'s
``unit_loss`` (the step's units are then pairs).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.models.moe.blocks import moe_blocks
from lit_ablate.strategies.interface import ObjectiveScale, UnitLoss
from lit_ablate.strategies.pipeline_chunk_timer import ChunkTimer
from lit_ablate.strategies.pipeline_stages import RankStages, micro_batch, pair_rows, pipeline_batch
from lit_ablate.strategies.pipeline_tied_embeddings import StageCopy

if TYPE_CHECKING:
    from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss


class PipelineSchedule:
    """torch's schedule over ``stages``, and the step around it.

    Args:
        stages: this rank's stages (``PipelineParallelStrategy.apply_pp``).
        schedule: ``gpipe``, ``1f1b`` or ``interleaved_1f1b``.
        microbatches: micro-batches per step.
        data_parallel_group: the ranks that agree on the run constant ``c`` (the gradient-mean group).
        replicas: the group and count of the pipeline replicas whose gradients one all-reduce
            averages after the schedule (``(None, 1)`` when FSDP reduces them: sharded stages).
        tied: this rank's copy of a tied matrix (first or last stage), whose gradients are summed with
            the other stage's copy after the schedule (``pipeline_tied_embeddings``).
    """

    def __init__(
        self,
        stages: RankStages,
        schedule: str,
        microbatches: int,
        data_parallel_group: ProcessGroup | None,
        replicas: tuple[ProcessGroup | None, int],
        tied: StageCopy | None = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.stages, self.microbatches = stages, microbatches
        self.data_parallel_group, self.replicas, self.tied = data_parallel_group, replicas, tied
        self.timer = ChunkTimer(stages.device)
        self.timing: tuple[float, float] | None = None
        """``(schedule seconds, this rank's compute seconds)`` of the last step."""
        pipeline_stages = []
        for s, module in stages.modules.items():
            stage = PipelineStage(module, s, stages.pp * stages.stages_per_rank, stages.device, group=stages.group)
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(stage, name, self.timer.timed(getattr(stage, name)))
            pipeline_stages.append(stage)
        # Every rank passes the loss (only the last computes it): without one, torch runs no backward.
        # scale_grads off: StepObjective divides by the step's tokens.
        if schedule == "interleaved_1f1b":
            self._schedule = ScheduleInterleaved1F1B(
                pipeline_stages, microbatches, loss_fn=self._last_stage_loss, scale_grads=False
            )
        else:
            schedule_class = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self._schedule = schedule_class(
                pipeline_stages[0], microbatches, loss_fn=self._last_stage_loss, scale_grads=False
            )
        self._shape: tuple[int, ...] | None = None  # the first training batch's: torch sizes the stages' buffers by it
        self._step_batch: dict[str, Any] | None = None
        self._unit_loss: UnitLoss | None = None
        self._unit_values: list[Tensor] = []
        self._loss_scale = 1.0
        self._pending_gradients: list[tuple[nn.Parameter, Tensor]] = []

    def forward_backward(
        self,
        model: CausalLMWithLoss,
        batch: dict[str, Any],
        objective: ObjectiveScale,
        unit_loss: UnitLoss | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Forward and backward of every micro-batch through the stages: ``(loss_sum, units)`` of the whole
        batch, the same on every rank (``PipelineParallelStrategy.forward_backward``)."""
        batch = pipeline_batch(batch)
        if batch["labels"].shape[0] % self.microbatches:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.microbatches",
                self.microbatches,
                f"the batch has {batch['labels'].shape[0]} rows; use a divisor of the batch size",
            )
        shape, first = tuple(batch["input_ids"].shape), self._shape
        if first is not None and shape != first:  # torch's stages size their hand-off buffers once
            raise ConfigError(
                "data.init_args.collator",
                f"a batch of {shape} after {first}",
                "pipeline stages take every training batch in one shape: pad to seq_len "
                "(static_length: true; packing: static_shape: true) and drop a smaller last batch",
            )
        self._shape = shape
        if "num_pairs" in batch:
            if unit_loss is None:
                raise RuntimeError("a preference batch's pair loss comes from its module: pass unit_loss")
            order = pair_rows(batch["num_pairs"], self.microbatches, batch["labels"].device)
            batch = {k: v[order] if isinstance(v, Tensor) else v for k, v in batch.items()}
            units = [torch.tensor(batch["num_pairs"] // self.microbatches, device=order.device)] * self.microbatches
        else:
            units = [(chunk != IGNORE_INDEX).sum() for chunk in batch["labels"].tensor_split(self.microbatches)]
        labels, stages = batch["labels"], self.stages
        self._step_batch, self._unit_loss, self._unit_values = batch, unit_loss, []
        if objective.scale is None:  # the stages of a replica read the same batch; replicas agree over dp
            objective.agree_scale(int(units[0]), labels.device, self.data_parallel_group)
        self._loss_scale = objective.scale
        # The gradients on the parameters now are the step's earlier batches' (accumulation: aside during
        # the schedule), or the previous step's, which Lightning would zero only after this training_step
        # (freed now: the schedule's own gradients take their memory).
        kept = [(p, p.grad) for p in model.parameters()] if objective.step_started else []
        for p in model.parameters():
            p.grad = None
        inputs = self._stage_inputs(batch, objective.scale)  # chunked per micro-batch, to every stage of this rank
        losses: list[Tensor] = []
        self.timer.reset()
        started = time.perf_counter()
        if stages.stage_index == 0:
            self._schedule.step(batch["input_ids"], return_outputs=False, **inputs)
        elif stages.stage_index == stages.pp - 1:
            rows = torch.arange(labels.shape[0], device=labels.device)  # each micro-batch's rows, for its loss
            self._schedule.step(target=rows, losses=losses, return_outputs=False, **inputs)
        else:
            self._schedule.step(return_outputs=False, **inputs)
        compute = self.timer.seconds()  # synchronises a GPU first
        self.timing = (time.perf_counter() - started, compute)
        average_over_replicas(model, *self.replicas)
        if self.tied is not None:  # the other stage's copy of the matrix: both take the two uses' gradients
            self.tied.sum_gradients()
        # Lightning zeroes gradients between training_step and backward: this batch's wait until then.
        self._pending_gradients = [(p, p.grad) for p in model.parameters() if p.grad is not None]
        for p, _ in self._pending_gradients:
            p.grad = None
        for p, grad in kept:
            p.grad = grad
        if unit_loss is not None:  # every entry unit_loss returned, summed (the loss sum first)
            # The last stage's micro-batches: the schedule's last calls (its first step's shape inference
            # calls the loss once before them, on placeholder hidden states).
            values = self._unit_values[-self.microbatches :]
            loss_sum = stages.from_last_stage((torch.stack(values).sum(0),) if values else None)[0]
        else:
            loss_sum = (
                (torch.stack([loss.detach() for loss in losses]).sum() * objective.scale).float()
                if losses
                else torch.zeros((), device=labels.device)
            )
            dist.broadcast(loss_sum, group=stages.group, group_src=stages.pp - 1)
        self._step_batch, self._unit_loss, self._unit_values = None, None, []
        if self._moe_layers:
            self._publish_aux_losses(objective.scale, torch.stack(units).sum())
        return loss_sum, torch.stack(units).sum()

    def deliver_gradients(self, accumulate_grad_batches: int = 1) -> None:
        """Add the gradients of the last ``forward_backward`` to the parameters' (the step's earlier
        batches' under accumulation), divided by ``accumulate_grad_batches`` as Lightning divides a
        backpropagated loss (``StepObjective`` multiplies it back with the step's token count)."""
        for p, grad in self._pending_gradients:
            if accumulate_grad_batches != 1:
                grad.div_(accumulate_grad_batches)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad += grad
        self._pending_gradients = []

    def _stage_inputs(self, batch: dict[str, Any], scale: float) -> dict[str, Tensor]:
        """What every stage's forward takes beside the hidden states, per row (the schedule chunks it
        with the rows): a packed batch's ``position_ids``, a padded one's ``attention_mask``, and with MoE
        layers the weight of each row's share of the auxiliary losses (its useful tokens, or half a pair,
        over ``c`` and the model's MoE layer count)."""
        inputs = {key: batch[key] for key in ("position_ids", "attention_mask") if key in batch}
        if self._moe_layers:  # a preference batch's unit is a pair: half of it on each of its two rows
            units = (
                torch.full(batch["labels"].shape[:1], 0.5, device=batch["labels"].device)
                if "num_pairs" in batch
                else (batch["labels"] != IGNORE_INDEX).sum(-1).float()
            )
            inputs["aux_weights"] = units / (scale * self._moe_layers)
        return inputs

    def _last_stage_loss(self, hidden: Tensor, rows: Tensor) -> Tensor:
        """One micro-batch's loss sum over the run constant ``c`` (the schedule backpropagates it): the
        model's token loss, or the step's ``unit_loss`` of the model's outputs (DPO's pair losses), whose
        other entries are summed for ``forward_backward``. ``rows``: the micro-batch's rows of the step's batch."""
        batch = micro_batch(self._step_batch, rows)
        outputs = self.stages.last.head_loss(hidden, batch)
        if self._unit_loss is None:
            return outputs[0] / self._loss_scale
        values = self._unit_loss(outputs, batch)
        self._unit_values.append(values.detach())
        return values[0] / self._loss_scale

    def _publish_aux_losses(self, scale: float, units: Tensor) -> None:
        """Leave the step's MoE auxiliary losses (already backpropagated by the stages) for the training
        step to log: each stage's weighted sums over its micro-batches, added over the stages, are the
        useful-token-weighted mean over the micro-batches of the mean over the model's MoE layers (one
        process's values when the batch is one micro-batch); every MoE layer of every rank holds them."""
        names = ("load_balance_loss", "z_loss")
        sums = torch.zeros(2 * len(names), device=self.stages.device)
        for module in self.stages.modules.values():
            for index, name in enumerate(names):
                if name in module.aux_sums:
                    sums[index] += module.aux_sums[name].to(sums.device)
                    sums[len(names) + index] = 1.0
            module.aux_sums = {}
        dist.all_reduce(sums, group=self.stages.group)
        present = sums[len(names) :].tolist()
        values = {name: sums[index] * scale / units.clamp(min=1) for index, name in enumerate(names) if present[index]}
        for module in self.stages.modules.values():
            for block in moe_blocks(module.parts):
                block.keep_aux_losses(values)

    @functools.cached_property
    def _moe_layers(self) -> int:
        """The whole model's MoE layers (every stage counts its own; the auxiliary losses are their mean)."""
        local = sum(len(moe_blocks(module.parts)) for module in self.stages.modules.values())
        count = torch.tensor([local], device=self.stages.device)
        dist.all_reduce(count, group=self.stages.group)
        return int(count.item())


def average_over_replicas(model: nn.Module, group: ProcessGroup | None, replicas: int) -> None:
    """Average each stage's gradients over the pipeline replicas (one flat all-reduce per stage: gloo
    has no averaging reduction, so a sum divided by the replicas). Sharded stages are averaged already:
    FSDP reduce-scattered them at the schedule's last backward (their ``group`` is None)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= replicas
    for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(chunk.view_as(grad))

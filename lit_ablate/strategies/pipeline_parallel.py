"""``PipelineParallelStrategy``: the decoder layers split into consecutive stages, one stage per rank.

Each rank keeps only its stage: the first stage the embeddings and the first layers, the last
stage the last layers, the final norm, the LM head and the loss. One training step runs the
batch's micro-batches through the stages under ``torch.distributed.pipelining``'s schedule, forward
*and* backward inside ``CausalLM.training_step`` (``pipeline_schedule.PipelineSchedule``: the step
objective, accumulation, packed batches, MoE router losses and DPO's pairs under the schedule); this
strategy's ``backward`` then only hands the gradients over. Evaluation runs each batch forward stage
by stage (``pipeline_evaluation``); resuming reads each stage's part of the sharded checkpoint
(``pipeline_checkpoint``); ``gradient_clip_val`` clips by the norm over every stage's gradients
(``MeshStrategy.clip_gradients_by_norm``).

Pipeline parallelism composes with every other dimension on one mesh, ``(pp, dp_replicate,
dp_shard, ep, cp, tp)``, ``pp`` outermost: this class is ``MeshParallelStrategy`` with the pipeline
split in front of its steps (torchtitan's order). ``apply_pp`` keeps this rank's stages; the mesh's
steps (``apply_steps``: TP, EP, CP, activation checkpointing, compile) then act on what is left as
on a whole model, over the stage's sub-mesh (every group but the schedule's holds one ``pp``
coordinate); with ``dp_shard``, ``ep``, ``cp`` or ``tp`` above 1 each stage module becomes an FSDP2
root (``StageSharding``, after EP's experts), whose reduction ``PipelineStage`` defers to the step's
last micro-batch; rank 0's whole model then fills every rank's slice; the schedule runs over the
stages. Ranks that differ in ``dp_replicate``, ``dp_shard`` or ``ep`` read different batches; a
stage's ``cp`` ranks hold slices of them and its ``tp`` ranks the same tokens. The step's useful
tokens are counted over ``dp_replicate x dp_shard x ep x cp`` (never over ``pp`` or ``tp`` peers,
which count the same tokens) and ``StepObjective`` undoes FSDP's division by their number once;
replicas of whole stages (``dp_replicate`` alone) average their gradients with one all-reduce after
the schedule. Throughput and MFU count a step's tokens once per ``pp x tp`` group
(``batch_replicas``). A tied matrix has a copy on the first and on the last stage, their gradients
summed (``pipeline_tied_embeddings``); sequence parallelism is not offered.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Trainer
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import Unpack

from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.losses.sequence_logprobs import SequenceLogProbs
from lit_ablate.strategies.context_parallel import ContextParallelSteps
from lit_ablate.strategies.expert_parallel import ExpertParallelSteps
from lit_ablate.strategies.interface import ObjectiveScale, UnitLoss
from lit_ablate.strategies.mesh import MeshStrategy, whole_tensors
from lit_ablate.strategies.mesh_parallel import MeshParallelStrategy
from lit_ablate.strategies.options import check_options, keyword_options, options_type
from lit_ablate.strategies.pipeline_checkpoint import load_stage_checkpoint
from lit_ablate.strategies.pipeline_evaluation import evaluate_stages
from lit_ablate.strategies.pipeline_schedule import PipelineSchedule
from lit_ablate.strategies.pipeline_split import holds, keep_stages
from lit_ablate.strategies.pipeline_stage_sharding import StageSharding
from lit_ablate.strategies.pipeline_stages import RankStages, StageModule
from lit_ablate.strategies.pipeline_tied_embeddings import StageCopy, TiedNames, stage_copy, tied_names
from lit_ablate.strategies.state_sharding import REPLICATED, StateSharding
from lit_ablate.strategies.tensor_parallel_plans import Plan

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
"""Families whose decoder takes ``inputs_embeds`` unchanged (Gemma, for one, rescales them)."""
PIPELINED_MODELS = (CausalLMWithLoss, SequenceLogProbs)
"""What the stages train: CausalLM's token loss and DPO's sequence log-probs (not Liger's fused DPO policy)."""
PipelineOptions = options_type(
    "PipelineOptions",
    keyword_options(ContextParallelSteps),
    keyword_options(ExpertParallelSteps),
    keyword_options(MeshStrategy, only=("process_group_backend", "timeout_s")),
)
"""The options a pipeline takes besides its own: context and expert parallelism's, and the process group's."""


class PipelineParallelStrategy(MeshParallelStrategy, StageSharding):
    """Pipeline parallelism over ``pp`` ranks: each holds one stage of consecutive decoder layers.

    Choose it to compare pipeline schedules and split points in a study, or to train a model whose
    layers do not fit one device. The stages of a pipeline read the same batch; the
    ``microbatches`` of a step flow through them under the schedule. ``dp_replicate`` copies of the
    pipeline read different batches (data parallelism: each stage's gradients are averaged over its
    replicas), and so do ``dp_shard`` copies, which shard each stage's parameters, gradients and
    optimizer states over themselves with FSDP2 (each of the stage's decoder layers, then the rest
    of the stage; HSDP with ``dp_replicate`` beside it). Built: world size = ``dp_replicate x
    dp_shard x ep x cp x tp x pp``: ``tp``, ``ep`` and ``cp`` act on each stage as in
    ``MeshParallelStrategy`` (this class is it with the pipeline step; see the module docstring),
    Llama, Qwen3 and Qwen3-MoE models (tied embeddings: a copy on the first and on the last stage, kept
    equal; every stage's router losses trained and logged as one process's), padded or packed batches
    (every stage gets its micro-batch's positions), gradient clipping by the norm over all stages,
    gradient accumulation over batches (each batch still split into ``microbatches``), ``CausalLM``
    and ``DPO`` (padded pairs, whole pairs per micro-batch, a precomputed or no reference); the rest
    is refused with the key to change.
    Every training batch must have the first one's shape (torch's stages size their buffers once).
    Validation and test run each batch forward through the stages (``pipeline_forward``).

    Args:
        pp: pipeline stages (ranks per pipeline); ``-1``: the world size over the other dimensions' sizes.
        schedule: ``gpipe``, ``1f1b``, or ``interleaved_1f1b`` (torch's looped 1F1B: each rank holds
            ``stages_per_rank`` stages, which shortens the bubble by that factor for more hand-offs).
        microbatches: micro-batches per step; must divide the batch size (and, for ``1f1b``,
            be at least ``pp``).
        split_points: the decoder-layer index at which each stage after the first starts
            (``pp x stages_per_rank - 1`` increasing indices); ``null``: balanced by parameter
            count, embeddings counted on the first stage and norm + LM head on the last.
        stages_per_rank: stages each rank holds (2 or more: ``interleaved_1f1b`` only).
        dp_replicate: pipeline replicas, each reading its own batches.
        dp_shard: ranks sharding each stage with FSDP2, each reading its own batches. The stage's
            gradients accumulate unsharded over the micro-batches (torch's ``PipelineStage``) and
            are reduced once per step.
        reshard_after_forward: with ``dp_shard``, free a layer's gathered parameters after each
            micro-batch's forward (two all-gathers per micro-batch: forward and backward) or keep
            them gathered until the step's last backward (the default, as torchtitan under pp: one
            all-gather per step, the stage's full parameters held during the step).
        tp, ep, cp: tensor-, expert- and context-parallel ranks inside each stage (``MeshParallelStrategy``);
            with any of them or ``dp_shard`` above 1 each stage is an FSDP2 root (``StageSharding``).
        **kwargs: context and expert parallelism's options (``cp_impl``, ``cp_layout``, ``cp_block_kernel``,
            ``dispatch``), ``process_group_backend`` and ``timeout_s`` (``MeshStrategy``). Checkpoints are
            sharded DCP folders (each stage writes its own weights and optimizer state).
    """

    def __init__(
        self,
        pp: int = -1,
        schedule: Schedule = "1f1b",
        microbatches: int = 2,
        split_points: list[int] | None = None,
        stages_per_rank: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = 1,
        reshard_after_forward: bool = False,
        tp: int = 1,
        ep: int = 1,
        cp: int = 1,
        **kwargs: Unpack[PipelineOptions],
    ) -> None:
        check_options(type(self).__name__, PipelineOptions, kwargs)
        super().__init__(
            pp=pp,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            ep=ep,
            cp=cp,
            tp=tp,
            reshard_after_forward=reshard_after_forward,
            save_distributed_checkpoint=True,  # a full file would hold stage 0 only
            **kwargs,
        )
        if schedule not in SCHEDULES:
            raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.schedule", schedule, f"choose one of {SCHEDULES}")
        interleaved = schedule == "interleaved_1f1b"
        if not isinstance(stages_per_rank, int) or stages_per_rank < 1 or (stages_per_rank > 1) != interleaved:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.stages_per_rank",
                stages_per_rank,
                "interleaved_1f1b needs 2 or more stages per rank; gpipe and 1f1b hold 1",
            )
        self.stages_per_rank = stages_per_rank
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.microbatches", microbatches, "use 1 or more micro-batches")
        if reshard_after_forward and dp_shard == 1:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.reshard_after_forward",
                True,
                "it frees FSDP-sharded stages' gathered layers: set dp_shard > 1, or leave it false",
            )
        self.dp_replicate = dp_replicate
        self.dp_shard = dp_shard
        self.requested_pp = pp
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.split_points = None if split_points is None else list(split_points)
        self.pp = 1
        self.stage_index = 0
        self.stage_layers: list[int] = []
        self._stages: RankStages | None = None
        self._schedule: PipelineSchedule | None = None
        self._pipelined: CausalLMWithLoss | None = None
        self._tied: TiedNames | None = None
        self._tied_copy: StageCopy | None = None

    # ---------------------------------------------------------------- the mesh
    def build_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """The mesh of every dimension, ``pp`` outermost (as torchtitan lays it out: a stage's other
        ranks are adjacent, so FSDP's, TP's and CP's collectives stay within a node and only the
        pipeline's point-to-point hand-offs cross nodes), then the schedule's checks against ``pp``."""
        mesh = super().build_mesh(device_type, world_size)
        pp = self.mesh_sizes["pp"]
        if self.schedule_name == "1f1b" and self.microbatches < pp:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.microbatches",
                self.microbatches,
                f"1f1b needs at least pp={pp} micro-batches to fill the pipeline; raise it or use gpipe",
            )
        rounds = max(1, self.microbatches // pp)
        if self.schedule_name == "interleaved_1f1b" and self.microbatches % rounds:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.microbatches",
                self.microbatches,
                f"interleaved_1f1b runs rounds of pp={pp} micro-batches: use a multiple of {pp}, or fewer than {pp}",
            )
        self.pp = pp
        self.stage_index = mesh.get_local_rank("pp")
        return mesh

    @property
    def shards_parameters(self) -> bool:
        """Whether each stage is an FSDP2 root (``StageSharding``): with ``dp_shard``, ``ep``, ``cp`` or
        ``tp`` above 1, whose DTensors or whose gradients' reduction (cp: a sum over the sequence's
        slices) need it. Replicas alone (``dp_replicate``) hold whole stages and average their
        gradients with one all-reduce after the schedule (``pipeline_schedule.average_over_replicas``)."""
        sizes = self.mesh_sizes or self.requested_mesh_sizes
        return any(sizes[dim] != 1 for dim in ("dp_shard", "ep", "cp", "tp"))

    def state_sharding(self, world_size: int) -> StateSharding:
        """Each stage's state as ``MeshParallelStrategy`` divides a whole model's (over ``dp_shard x ep x
        cp``, and ``tp``), kept gathered through the step unless ``reshard_after_forward`` (see
        ``estimate.pipeline_stage_estimates``); replicas of whole stages repeat it."""
        if not self.shards_parameters:
            return REPLICATED
        return super().state_sharding(world_size)

    def schedule_timing(self) -> tuple[float, float] | None:
        """``(schedule seconds, this stage's compute seconds)`` of the last step (``PipelineBubbleMonitor``)."""
        return self._schedule.timing if self._schedule is not None else None

    @property
    def schedule_bubble(self) -> float:
        """The schedule's idle share with equal stages and free communication: gpipe and 1f1b leave
        each rank idle for ``pp - 1`` of the ``m + pp - 1`` micro-batch slots of a step; with ``v``
        stages per rank the slots are ``v`` times shorter, ``(pp - 1) / (v m + pp - 1)``."""
        return (self.pp - 1) / (self.stages_per_rank * self.microbatches + self.pp - 1)

    # ---------------------------------------------------------------- Lightning hooks
    def setup(self, trainer: Trainer) -> None:
        if len(self.parallel_targets()) != 1:  # DPO's frozen reference: a second model
            raise ConfigError(
                "model.init_args.reference",
                "frozen",
                "the pipeline stages hold one model, and a frozen reference is a second one: use "
                "reference: precomputed (its log-probs computed once through the stages) or none",
            )
        super().setup(trainer)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran every micro-batch's backward inside ``training_step``: the
        gradients it computed are handed over here, with Lightning's hooks around."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.deliver_gradients(self.lightning_module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Each stage reads its own weights and optimizer state from the sharded folder (``load_stage_checkpoint``)."""
        return load_stage_checkpoint(Path(self.broadcast(checkpoint_path)), self.model, self.optimizers, weights_only)

    # ---------------------------------------------------------------- the stages
    def parallelize(self, model: CausalLMWithLoss) -> CausalLMWithLoss:
        """The split in front of the mesh's steps (torchtitan's order): keep this rank's stages of ``model``
        (``apply_pp``; parameter names unchanged), run the steps (``apply_steps``) on what is left, each
        stage module an FSDP2 root (``shards_parameters``), fill every rank's part from rank 0's whole
        model (``materialize``), pair a tied matrix's copies (``stage_copy``), build the schedule over the
        stages. Each step acts on the stage as it would on a whole model, over the stage's sub-mesh.
        """
        self.check_model(model)
        self._tied = tied_names(model)
        whole = whole_tensors(model)  # before any step replaces a parameter
        self.apply_pp(model)
        self.apply_steps(model)
        self.materialize(model, whole)
        self._tied_copy = stage_copy(model, self._tied, self.device_mesh) if self._tied and self.pp > 1 else None
        group, replicas = self.gradient_mean_group
        self._schedule = PipelineSchedule(
            self._stages,
            self.schedule_name,
            self.microbatches,
            group,
            (None, 1) if self.shards_parameters else (group, replicas),
            self._tied_copy,
        )
        self._pipelined = model
        model.forward = functools.partial(self.pipeline_forward, model)  # the stage alone would compute nonsense
        model.parallelized_by = type(self).__name__
        return model

    def apply_pp(self, model: CausalLMWithLoss) -> None:
        """Keep this rank's stages (``pipeline_split.keep_stages``): other stages' layers become
        pass-throughs, the embeddings stay on the first stage and the final norm and LM head on the
        last; one ``StageModule`` per stage, ``pp x stages_per_rank`` stages looped over the ranks."""
        self.stage_layers, modules = keep_stages(
            model, self.pp, self.stage_index, self.stages_per_rank, self.split_points
        )
        self._stages = RankStages(
            modules,
            self.pp,
            self.stage_index,
            self.stages_per_rank,
            self.device_mesh.get_group("pp"),
            self._mesh_device(),
        )

    def stage_modules(self) -> dict[int, StageModule]:
        return self._stages.modules

    def repeated_parameters(self) -> list[torch.nn.Parameter]:
        return self._tied_copy.repeated if self._tied_copy is not None else []  # the last stage's copy

    def root_plan(self, model: CausalLMWithLoss) -> Plan:
        """TP's plan for the ends this stage holds: the embeddings on the first, the LM head on the last."""
        return {name: style for name, style in super().root_plan(model).items() if holds(model.lm, name)}

    def check_model(self, model: CausalLMWithLoss) -> None:
        """Refuse what the stage split cannot hold (each with the key to change)."""
        if type(model) not in PIPELINED_MODELS:
            raise ConfigError(
                "model",
                type(model).__name__,
                "pipeline stages train CausalLM and DPO with logprobs torch or chunked (Liger's fused "
                "DPO reads the whole batch's hidden states at once); use logprobs: chunked",
            )
        config = model.lm.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                "model.init_args.model",
                config.model_type,
                f"pipeline stages are built for {', '.join(SUPPORTED_MODEL_TYPES)} models",
            )
        if config.num_hidden_layers < self.pp:
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.pp",
                self.pp,
                f"the model has {config.num_hidden_layers} decoder layers; use at most that many stages",
            )
        if self.requested_mesh_sizes["tp"] != 1 and model.lm.get_output_embeddings() is not None:
            super().check_model(
                model
            )  # TP's (heads, vocabulary, loss backend); stages without the LM head ran it whole

    def materialize(
        self,
        model: CausalLMWithLoss,
        source: Mapping[str, Tensor],
        copies: Mapping[str, str] | None = None,
        every_tensor_held: bool = False,
    ) -> None:
        """``MeshStrategy.materialize`` for a stage: each rank keeps the tensors of its stage (its own slice
        of them: FSDP's shard over ``dp_shard x ep x cp``, TP's over ``tp``, EP's experts), a tied matrix's
        values in the embedding's copy (first stage) and the LM head's (last)."""
        if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            model.to(self._mesh_device())  # rank 0 built it in host memory
        tied = {self._tied.embedding: self._tied.head} if self._tied is not None else {}
        super().materialize(model, source, {**tied, **(copies or {})}, every_tensor_held)

    # ---------------------------------------------------------------- one step
    @property
    def runs_forward_backward(self) -> bool:
        return True

    def forward_backward(
        self,
        model: CausalLMWithLoss,
        batch: dict[str, Any],
        objective: ObjectiveScale,
        unit_loss: UnitLoss | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Forward and backward of every micro-batch through the stages; ``(loss_sum, units)`` of the
        whole batch, the same on every rank (``CausalLM.training_step`` calls it: useful tokens). A
        preference batch (``DPO.training_step``, with its ``unit_loss``) is reordered so that every
        micro-batch holds whole pairs; its units are pairs, and ``loss_sum`` is the sum over the
        micro-batches of everything ``unit_loss`` returned (the loss sum first): ``PipelineSchedule``."""
        if model is not self._pipelined:
            raise RuntimeError("the pipeline was built for another model")
        return self._schedule.forward_backward(model, batch, objective, unit_loss)

    def deliver_gradients(self, accumulate_grad_batches: int = 1) -> None:
        """Hand the last ``forward_backward``'s gradients to the parameters (``PipelineSchedule.deliver_gradients``)."""
        self._schedule.deliver_gradients(accumulate_grad_batches)

    @torch.no_grad()
    def pipeline_forward(self, model: CausalLMWithLoss, batch: dict[str, Any]) -> tuple[Tensor, ...]:
        """What the model returns for the batch, forward only, the same on every stage: what the pipelined
        model returns when called (evaluation: ``CausalLM.validation_step`` and ``test_step``, DPO's
        evaluation and its precomputed reference), stage by stage (``evaluate_stages``)."""
        if model is not self._pipelined:
            raise RuntimeError("the pipeline was built for another model")
        return evaluate_stages(self._stages, model, batch)

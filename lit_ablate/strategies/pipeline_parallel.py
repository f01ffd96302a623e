"""``PipelineParallelStrategy``: the decoder layers split into consecutive stages, one stage per rank.

Each rank keeps only its stage: the first stage the embeddings and the first layers, the last
stage the last layers, the final norm, the LM head and the loss. One training step splits the
batch into micro-batches and runs them through ``torch.distributed.pipelining``'s schedule
(``gpipe``: all forwards, then all backwards; ``1f1b``: one forward, one backward in the steady
state, so fewer micro-batches' activations are alive at once). The schedule runs forward *and*
backward inside ``CausalLM.training_step``; this strategy's ``backward`` then has nothing left to do.

The step objective is the one process's (``StepObjective``): the last stage backpropagates each
micro-batch's token-loss *sum* divided by the run constant ``c``, and after the step every stage
multiplies its gradients by ``c / N`` (``N``: the step's useful tokens, which every rank counts
itself, since every rank reads the same batch). The step's loss sum is broadcast from the last
stage, so every rank logs and records the same loss.

Pipeline parallelism composes with every other dimension on one mesh, ``(pp, dp_replicate,
dp_shard, ep, cp, tp)``, ``pp`` outermost: this class is ``MeshParallelStrategy`` with the pipeline
step first (torchtitan's order). ``apply_pp`` keeps this rank's stages; TP, EP, CP, activation
checkpointing and compile then act on what is left as on a whole model, over the stage's sub-mesh
(every group but the schedule's holds one ``pp`` coordinate); with ``dp_shard``, ``ep``, ``cp`` or
``tp`` above 1 each stage module becomes an FSDP2 root (``StageSharding``, after EP's experts), whose
reduction ``PipelineStage`` defers to the step's last micro-batch; rank 0's whole model then fills
every rank's slice; the schedule runs over the stages. Ranks that differ in ``dp_replicate``,
``dp_shard`` or ``ep`` read different batches; a stage's ``cp`` ranks hold slices of them and its
``tp`` ranks the same tokens. ``N`` is counted over ``dp_replicate x dp_shard x ep x cp`` (never over
``pp`` or ``tp`` peers, which count the same tokens) and ``StepObjective`` undoes FSDP's division by
their number once; replicas of whole stages (``dp_replicate`` alone) average their gradients with one
all-reduce after the schedule. Throughput and MFU count a step's tokens once per ``pp x tp`` group
(``batch_replicas``). Tied embeddings cannot be split across stages and are refused before any rank
starts (``compatibility.pipeline_stages_split_the_model``); sequence parallelism is not offered.

What one process does beside the loss, the stages do together: ``gradient_clip_val`` clips by the
norm over every stage's gradients (``clip_grad_norm_over_stages``); under ``accumulate_grad_batches``
each batch's schedule gradients are added to the step's earlier ones, divided as Lightning divides a
loss; a packed batch's ``position_ids`` reach every stage with its micro-batch (the schedule chunks a
step's keyword inputs for each stage); and the MoE router losses of each stage's layers are
backpropagated by that stage (``StageModule.add_aux_gradient``: the schedule backpropagates only the
last stage's loss), weighted by their micro-batch's useful tokens as ``CausalLM`` weighs them.

DPO's loss is per pair: its padded batch is reordered so that each micro-batch holds whole pairs,
and the last stage turns each micro-batch's sequence log-probs into pair losses with ``DPO``'s
``unit_loss`` (the step's units are then pairs).
"""

from __future__ import annotations

import functools
import itertools
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_ablate.errors import ConfigError
from lit_ablate.models.attention.block_kernels import BlockKernelName
from lit_ablate.models.attention.sequence_layout import LayoutName
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss, decoder_layers
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.models.losses.sequence_logprobs import SequenceLogProbs
from lit_ablate.models.moe.blocks import moe_blocks
from lit_ablate.strategies.context_parallel import ContextParallelImpl
from lit_ablate.strategies.expert_parallel import DispatchMode
from lit_ablate.strategies.interface import ObjectiveScale, UnitLoss
from lit_ablate.strategies.mesh import STRATEGY_KEY
from lit_ablate.strategies.mesh_parallel import MeshParallelStrategy
from lit_ablate.strategies.pipeline_chunk_timer import ChunkTimer
from lit_ablate.strategies.pipeline_clipping import clip_grad_norm_over_stages
from lit_ablate.strategies.pipeline_split import balanced_split_points, check_split_points
from lit_ablate.strategies.pipeline_stage_sharding import StageSharding
from lit_ablate.strategies.pipeline_stages import PassThrough, StageModule, micro_batch, pair_rows, pipeline_batch
from lit_ablate.strategies.state_sharding import REPLICATED, StateSharding
from lit_ablate.strategies.tensor_parallel_plans import Plan

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
"""Families whose decoder takes ``inputs_embeds`` unchanged (Gemma, for one, rescales them)."""
PIPELINED_MODELS = (CausalLMWithLoss, SequenceLogProbs)
"""What the stages train: CausalLM's token loss and DPO's sequence log-probs (not Liger's fused DPO policy)."""


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
    Llama, Qwen3 and Qwen3-MoE models without tied embeddings (every stage's router losses trained
    and logged as one process's), padded or packed batches (every stage gets its micro-batch's
    positions), gradient clipping by the norm over all stages, gradient accumulation over batches
    (each batch still split into ``microbatches``), ``CausalLM`` and ``DPO`` (padded pairs, whole pairs
    per micro-batch, a precomputed or no reference); the rest is refused with the key to change.
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
        cp_impl, cp_layout, cp_block_kernel, dispatch: context and expert parallelism's options.
        process_group_backend, timeout_s: see ``MeshStrategy``. Checkpoints are sharded DCP folders
            (each stage writes its own weights and optimizer state).
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
        cp_impl: ContextParallelImpl = "ring",
        cp_layout: LayoutName = "zigzag",
        cp_block_kernel: BlockKernelName = "sdpa",
        dispatch: DispatchMode = "all_to_all",
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        super().__init__(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, cp=cp, tp=tp, cp_impl=cp_impl,
                         cp_layout=cp_layout, cp_block_kernel=cp_block_kernel, dispatch=dispatch,
                         reshard_after_forward=reshard_after_forward,
                         save_distributed_checkpoint=True,  # a full file would hold stage 0 only
                         process_group_backend=process_group_backend, timeout_s=timeout_s)
        if schedule not in SCHEDULES:
            raise ConfigError(f"{STRATEGY_KEY}.schedule", schedule, f"choose one of {SCHEDULES}")
        interleaved = schedule == "interleaved_1f1b"
        if not isinstance(stages_per_rank, int) or stages_per_rank < 1 or (stages_per_rank > 1) != interleaved:
            raise ConfigError(f"{STRATEGY_KEY}.stages_per_rank", stages_per_rank,
                              "interleaved_1f1b needs 2 or more stages per rank; gpipe and 1f1b hold 1")
        self.stages_per_rank = stages_per_rank
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ConfigError(f"{STRATEGY_KEY}.microbatches", microbatches, "use 1 or more micro-batches")
        if reshard_after_forward and dp_shard == 1:
            raise ConfigError(f"{STRATEGY_KEY}.reshard_after_forward", True,
                              "it frees FSDP-sharded stages' gathered layers: set dp_shard > 1, or leave it false")
        self.dp_replicate = dp_replicate
        self.dp_shard = dp_shard
        self.requested_pp = pp
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.split_points = None if split_points is None else list(split_points)
        self.pp = 1
        self.stage_index = 0
        self.stage_layers: list[int] = []
        self._schedule = None
        self._pipelined: CausalLMWithLoss | None = None
        self._stage_modules: dict[int, StageModule] = {}
        self._last_module: StageModule | None = None
        self._loss_scale = 1.0
        self._pending_gradients: list[tuple[nn.Parameter, Tensor]] = []
        self._compute_timer: ChunkTimer | None = None
        self._schedule_timing: tuple[float, float] | None = None
        self._schedule_shape: tuple[int, ...] | None = None  # the first training batch's: torch sizes the stages' buffers by it

    # ---------------------------------------------------------------- the mesh
    def build_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """The mesh of every dimension, ``pp`` outermost (as torchtitan lays it out: a stage's other
        ranks are adjacent, so FSDP's, TP's and CP's collectives stay within a node and only the
        pipeline's point-to-point hand-offs cross nodes), then the schedule's checks against ``pp``."""
        mesh = super().build_mesh(device_type, world_size)
        pp = self.mesh_sizes["pp"]
        if self.schedule_name == "1f1b" and self.microbatches < pp:
            raise ConfigError(f"{STRATEGY_KEY}.microbatches", self.microbatches,
                              f"1f1b needs at least pp={pp} micro-batches to fill the pipeline; raise it or use gpipe")
        rounds = max(1, self.microbatches // pp)
        if self.schedule_name == "interleaved_1f1b" and self.microbatches % rounds:
            raise ConfigError(f"{STRATEGY_KEY}.microbatches", self.microbatches,
                              f"interleaved_1f1b runs rounds of pp={pp} micro-batches: use a multiple of {pp}, "
                              f"or fewer than {pp}")
        self.pp = pp
        self.stage_index = mesh.get_local_rank("pp")
        return mesh

    @property
    def shards_stages(self) -> bool:
        """Whether each stage is an FSDP2 root (``StageSharding``): with ``dp_shard``, ``ep``, ``cp`` or
        ``tp`` above 1, whose DTensors or whose gradients' reduction (cp: a sum over the sequence's
        slices) need it. Replicas alone (``dp_replicate``) hold whole stages and average their
        gradients with one all-reduce (``average_over_replicas``)."""
        sizes = self.mesh_sizes or self.requested_mesh_sizes
        return any(sizes[dim] != 1 for dim in ("dp_shard", "ep", "cp", "tp"))

    def state_sharding(self, world_size: int) -> StateSharding:
        """Each stage's state as ``MeshParallelStrategy`` divides a whole model's (over ``dp_shard x ep x
        cp``, and ``tp``), kept gathered through the step unless ``reshard_after_forward`` (see
        ``estimate.pipeline_stage_estimates``); replicas of whole stages repeat it."""
        if not self.shards_stages:
            return REPLICATED
        return super().state_sharding(world_size)

    def schedule_timing(self) -> tuple[float, float] | None:
        """``(schedule seconds, this stage's compute seconds)`` of the last step (``PipelineBubbleMonitor``)."""
        return self._schedule_timing

    @property
    def schedule_bubble(self) -> float:
        """The schedule's idle share with equal stages and free communication: gpipe and 1f1b leave
        each rank idle for ``pp - 1`` of the ``m + pp - 1`` micro-batch slots of a step; with ``v``
        stages per rank the slots are ``v`` times shorter, ``(pp - 1) / (v m + pp - 1)``."""
        return (self.pp - 1) / (self.stages_per_rank * self.microbatches + self.pp - 1)

    # ---------------------------------------------------------------- Lightning hooks
    def setup(self, trainer: Trainer) -> None:
        if len(self.parallel_targets()) != 1:  # DPO's frozen reference: a second model
            raise ConfigError("model.init_args.reference", "frozen",
                              "the pipeline stages hold one model, and a frozen reference is a second one: use "
                              "reference: precomputed (its log-probs computed once through the stages) or none")
        super().setup(trainer)
        # Lightning clips each rank's parameters by their own norm: one stage's, not the model's.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """``gradient_clip_val`` by the norm over every stage's gradients (``clip_grad_norm_over_stages``)."""
        params = (p for group in optimizer.param_groups for p in group["params"])
        clip_grad_norm_over_stages(params, clip_val, self.device_mesh.get_group("pp"))

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
        """Each stage reads its own weights and optimizer state from the sharded folder.

        Lightning's loader looks for a module with DTensor parameters; a stage's are plain tensors
        (or, under ``dp_shard``, FSDP's DTensor shards, which DCP reads the same way).
        """
        from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if not (path / _METADATA_FILENAME).is_file():
            raise ConfigError("ckpt_path", str(path), "a pipeline-parallel run resumes from the sharded checkpoint "
                              "folder such a run saves")
        optimizers = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(self.optimizers)}
        templates = {key: get_optimizer_state_dict(self.model, optimizer) for key, optimizer in optimizers.items()}
        state = {"state_dict": get_model_state_dict(self.model),
                 **{key: {"state": t["state"], "param_groups": t["param_groups"]} for key, t in templates.items()}}
        load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["state_dict"])
        for key, optimizer in optimizers.items():
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict={
                "state": state[key]["state"], "param_groups": templates[key]["param_groups"]})
            # DCP keeps one copy of an object every rank saves under the same key (the param groups,
            # which list one stage's parameters): take only their hyperparameters (lr, betas, ...).
            for group, saved in zip(optimizer.param_groups, state[key]["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    # ---------------------------------------------------------------- the stages
    def parallelize(self, model: CausalLMWithLoss) -> CausalLMWithLoss:
        """torchtitan's order: keep this rank's stages of ``model`` (``apply_pp``; parameter names
        unchanged), apply TP -> EP -> CP -> activation checkpointing -> compile to what is left, shard
        each stage module with FSDP2 (``shards_stages``), fill every rank's part from rank 0, build the
        schedule over the stages. Each step acts on the stage as it would on a whole model, over the
        stage's sub-mesh: the ``pp`` coordinate is fixed in every group but the schedule's.
        """
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.check_model(model)
        # Rank 0's whole model, before any step replaces a parameter: what every rank's part is filled from.
        everything = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
        everything = {name: (t.shape, t.dtype, t if not t.is_meta else None) for name, t in everything.items()}
        self.apply_pp(model)
        self.apply_tp(model)
        self.apply_ep(model)
        self.apply_cp(model)
        self.apply_activation_checkpointing(model)
        self.apply_compile(model)
        if self.shards_stages:
            self.apply_fsdp(model)  # StageSharding's: each stage module a root
        self._fill_from_rank0(model, everything)
        self._compute_timer = ChunkTimer(self._mesh_device())
        pipeline_stages = []
        for s, module in self._stage_modules.items():
            stage = PipelineStage(module, s, self.pp * self.stages_per_rank, self._mesh_device(),
                                  group=self.device_mesh.get_group("pp"))
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(stage, name, self._compute_timer.timed(getattr(stage, name)))
            pipeline_stages.append(stage)
        # Every rank passes the loss (only the last computes it): without one, torch runs no backward.
        # scale_grads off: StepObjective divides by the step's tokens.
        if self.schedule_name == "interleaved_1f1b":
            self._schedule = ScheduleInterleaved1F1B(pipeline_stages, self.microbatches, loss_fn=self._last_stage_loss,
                                                     scale_grads=False)
        else:
            schedule_class = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            self._schedule = schedule_class(pipeline_stages[0], self.microbatches, loss_fn=self._last_stage_loss,
                                            scale_grads=False)
        self._pipelined = model
        model.forward = functools.partial(self.pipeline_forward, model)  # the stage alone would compute nonsense
        model.parallelized_by = type(self).__name__
        return model

    def apply_pp(self, model: CausalLMWithLoss) -> None:
        """Keep this rank's stages: other stages' layers become pass-throughs, the embeddings stay on
        the first stage and the final norm and LM head on the last; one ``StageModule`` per stage.

        With ``stages_per_rank = v`` there are ``pp x v`` stages, looped over the ranks: rank ``r``
        holds stages ``r, r + pp, r + 2 pp, ...``, so the first stage (embeddings) is on rank 0
        and the last (norm, LM head, loss) on rank ``pp - 1``, as without interleaving.
        """
        layers = decoder_layers(model)
        stages = self.pp * self.stages_per_rank
        points = self.split_points if self.split_points is not None else balanced_split_points(
            [_numel(layer) for layer in layers], stages,
            _numel(model.lm.get_input_embeddings()), _numel(model.lm.get_output_embeddings()))
        check_split_points(points, len(layers), stages)
        bounds = [0, *points, len(layers)]
        own = range(self.stage_index, stages, self.pp)
        stage_layers = {s: list(range(bounds[s], bounds[s + 1])) for s in own}
        self.stage_layers = [index for s in own for index in stage_layers[s]]
        self._keep_stage(model, layers)
        modules = {s: StageModule(model, first=s == 0, last=s == stages - 1,
                                  layers=None if self.stages_per_rank == 1 else stage_layers[s]) for s in own}
        self._stage_modules, self._last_module = modules, modules[max(own)]

    def stage_modules(self) -> dict[int, StageModule]:
        return self._stage_modules

    def root_plan(self, model: CausalLMWithLoss) -> Plan:
        """TP's plan for the ends this stage holds: the embeddings on the first, the LM head on the last."""
        return {name: style for name, style in super().root_plan(model).items() if _holds(model.lm, name)}

    def check_model(self, model: CausalLMWithLoss) -> None:
        """Refuse what the stage split cannot hold (each with the key to change)."""
        if type(model) not in PIPELINED_MODELS:
            raise ConfigError("model", type(model).__name__,
                              "pipeline stages train CausalLM and DPO with logprobs torch or chunked (Liger's fused "
                              "DPO reads the whole batch's hidden states at once); use logprobs: chunked")
        config = model.lm.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError("model.init_args.model", config.model_type,
                              f"pipeline stages are built for {', '.join(SUPPORTED_MODEL_TYPES)} models")
        if getattr(config, "tie_word_embeddings", False):
            raise ConfigError("model.init_args.model.config.tie_word_embeddings", True,
                              "the embeddings (first stage) and LM head (last stage) cannot share one matrix; "
                              "use false")
        if config.num_hidden_layers < self.pp:
            raise ConfigError(f"{STRATEGY_KEY}.pp", self.pp,
                              f"the model has {config.num_hidden_layers} decoder layers; use at most that many stages")
        if self.requested_mesh_sizes["tp"] != 1 and model.lm.get_output_embeddings() is not None:
            super().check_model(model)  # TP's (heads, vocabulary, loss backend); stages without the LM head ran it whole

    def _keep_stage(self, model: CausalLMWithLoss, layers: list[nn.Module]) -> None:
        """Replace other stages' layers by pass-throughs (indices and names stay), drop the ends not here."""
        decoder = model.lm.base_model
        for index in range(len(layers)):
            if index not in self.stage_layers:
                decoder.layers[index] = PassThrough()
        if self.stage_index != 0:
            decoder.embed_tokens = None
        if self.stage_index != self.pp - 1:
            decoder.norm = nn.Identity()
            model.lm.lm_head = None

    def _fill_from_rank0(self, model: CausalLMWithLoss, everything: dict[str, tuple]) -> None:
        """Rank 0 built the whole model: broadcast every tensor, each rank keeps those of its stage
        (its own slice of them: FSDP's shard over ``dp_shard x ep x cp``, TP's over ``tp``, EP's experts)."""
        device = self._mesh_device()
        if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            model.to_empty(device=device)
        else:  # rank 0 built it in host memory
            model.to(device)
        local = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
        for name, (shape, dtype, full) in everything.items():
            value = full.detach().to(device) if full is not None else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(value, src=0)
            if name in local:
                target = local[name]
                if isinstance(target, DTensor):  # this rank's piece of the full value, no communication
                    value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                with torch.no_grad():
                    target.copy_(value)

    def _last_stage_loss(self, hidden: Tensor, rows: Tensor) -> Tensor:
        """One micro-batch's loss sum over the run constant ``c`` (the schedule backpropagates it): the
        model's token loss, or the step's ``unit_loss`` of the model's outputs (DPO's pair losses), whose
        other entries are summed for ``forward_backward``. ``rows``: the micro-batch's rows of the step's batch."""
        batch = micro_batch(self._step_batch, rows)
        outputs = self._last_module.head_loss(hidden, batch)
        if self._unit_loss is None:
            return outputs[0] / self._loss_scale
        values = self._unit_loss(outputs, batch)
        self._unit_values.append(values.detach())
        return values[0] / self._loss_scale

    # ---------------------------------------------------------------- one step
    @property
    def runs_forward_backward(self) -> bool:
        return True

    def forward_backward(self, model: CausalLMWithLoss, batch: dict[str, Any], objective: ObjectiveScale,
                         unit_loss: UnitLoss | None = None) -> tuple[Tensor, Tensor]:
        """Forward and backward of every micro-batch through the stages; ``(loss_sum, units)`` of the
        whole batch, the same on every rank (``CausalLM.training_step`` calls it: useful tokens). A
        preference batch (``DPO.training_step``, with its ``unit_loss``) is reordered so that every
        micro-batch holds whole pairs; its units are pairs, and ``loss_sum`` is the sum over the
        micro-batches of everything ``unit_loss`` returned (the loss sum first)."""
        if model is not self._pipelined:
            raise RuntimeError("the pipeline was built for another model")
        batch = pipeline_batch(batch)
        if batch["labels"].shape[0] % self.microbatches:
            raise ConfigError(f"{STRATEGY_KEY}.microbatches", self.microbatches,
                              f"the batch has {batch['labels'].shape[0]} rows; use a divisor of the batch size")
        shape, first = tuple(batch["input_ids"].shape), self._schedule_shape
        if first is not None and shape != first:  # torch's stages size their hand-off buffers once
            raise ConfigError("data.init_args.collator", f"a batch of {shape} after {first}",
                              "pipeline stages take every training batch in one shape: pad to seq_len "
                              "(static_length: true; packing: static_shape: true) and drop a smaller last batch")
        self._schedule_shape = shape
        if "num_pairs" in batch:
            if unit_loss is None:
                raise RuntimeError("a preference batch's pair loss comes from its module: pass unit_loss")
            order = pair_rows(batch["num_pairs"], self.microbatches, batch["labels"].device)
            batch = {k: v[order] if isinstance(v, Tensor) else v for k, v in batch.items()}
            units = [torch.tensor(batch["num_pairs"] // self.microbatches, device=order.device)] * self.microbatches
        else:
            units = [(chunk != IGNORE_INDEX).sum() for chunk in batch["labels"].tensor_split(self.microbatches)]
        labels = batch["labels"]
        self._step_batch, self._unit_loss, self._unit_values = batch, unit_loss, []
        if objective.scale is None:  # the stages of a replica read the same batch; replicas agree over dp
            objective.agree_scale(int(units[0]), labels.device, self.gradient_mean_group[0])
        self._loss_scale = objective.scale
        # The gradients on the parameters now are the step's earlier batches' (accumulation: aside during
        # the schedule), or the previous step's, which Lightning would zero only after this training_step
        # (freed now: the schedule's own gradients take their memory).
        kept = [(p, p.grad) for p in model.parameters()] if objective.step_started else []
        for p in model.parameters():
            p.grad = None
        inputs = self._stage_inputs(batch, objective.scale)  # chunked per micro-batch, to every stage of this rank
        losses: list[Tensor] = []
        self._compute_timer.reset()
        started = time.perf_counter()
        if self.stage_index == 0:
            self._schedule.step(batch["input_ids"], return_outputs=False, **inputs)
        elif self.stage_index == self.pp - 1:
            rows = torch.arange(labels.shape[0], device=labels.device)  # each micro-batch's rows, for its loss
            self._schedule.step(target=rows, losses=losses, return_outputs=False, **inputs)
        else:
            self._schedule.step(return_outputs=False, **inputs)
        compute = self._compute_timer.seconds()  # synchronises a GPU first
        self._schedule_timing = (time.perf_counter() - started, compute)
        self.average_over_replicas(model)
        # Lightning zeroes gradients between training_step and backward: this batch's wait until then.
        self._pending_gradients = [(p, p.grad) for p in model.parameters() if p.grad is not None]
        for p, _ in self._pending_gradients:
            p.grad = None
        for p, grad in kept:
            p.grad = grad
        if unit_loss is not None:  # every entry unit_loss returned, summed (the loss sum first)
            # The last stage's micro-batches: the schedule's last calls (its first step's shape inference
            # calls the loss once before them, on placeholder hidden states).
            values = self._unit_values[-self.microbatches:]
            loss_sum = self._from_last_stage((torch.stack(values).sum(0),) if values else None)[0]
        else:
            loss_sum = ((torch.stack([loss.detach() for loss in losses]).sum() * objective.scale).float() if losses
                        else torch.zeros((), device=labels.device))
            dist.broadcast(loss_sum, group=self.device_mesh.get_group("pp"), group_src=self.pp - 1)
        self._step_batch, self._unit_loss, self._unit_values = None, None, []
        if self._moe_layers:
            self._publish_aux_losses(objective.scale, torch.stack(units).sum())
        return loss_sum, torch.stack(units).sum()

    def _stage_inputs(self, batch: dict[str, Any], scale: float) -> dict[str, Tensor]:
        """What every stage's forward takes beside the hidden states, per row (the schedule chunks it
        with the rows): a packed batch's ``position_ids``, a padded one's ``attention_mask``, and with MoE
        layers the weight of each row's share of the auxiliary losses (its useful tokens, or half a pair,
        over ``c`` and the model's MoE layer count)."""
        inputs = {key: batch[key] for key in ("position_ids", "attention_mask") if key in batch}
        if self._moe_layers:  # a preference batch's unit is a pair: half of it on each of its two rows
            units = (torch.full(batch["labels"].shape[:1], 0.5, device=batch["labels"].device) if "num_pairs" in batch
                     else (batch["labels"] != IGNORE_INDEX).sum(-1).float())
            inputs["aux_weights"] = units / (scale * self._moe_layers)
        return inputs

    def _publish_aux_losses(self, scale: float, units: Tensor) -> None:
        """Leave the step's MoE auxiliary losses (already backpropagated by the stages) for the training
        step to log: each stage's weighted sums over its micro-batches, added over the stages, are the
        useful-token-weighted mean over the micro-batches of the mean over the model's MoE layers (one
        process's values when the batch is one micro-batch); every MoE layer of every rank holds them."""
        names = ("load_balance_loss", "z_loss")
        sums = torch.zeros(2 * len(names), device=self._mesh_device())
        for module in self._stage_modules.values():
            for index, name in enumerate(names):
                if name in module.aux_sums:
                    sums[index] += module.aux_sums[name].to(sums.device)
                    sums[len(names) + index] = 1.0
            module.aux_sums = {}
        dist.all_reduce(sums, group=self.device_mesh.get_group("pp"))
        present = sums[len(names):].tolist()
        values = {name: sums[index] * scale / units.clamp(min=1)
                  for index, name in enumerate(names) if present[index]}
        for module in self._stage_modules.values():
            for block in moe_blocks(module.parts):
                block.keep_aux_losses(values)

    @functools.cached_property
    def _moe_layers(self) -> int:
        """The whole model's MoE layers (every stage counts its own; the auxiliary losses are their mean)."""
        local = sum(len(moe_blocks(module.parts)) for module in self._stage_modules.values())
        count = torch.tensor([local], device=self._mesh_device())
        dist.all_reduce(count, group=self.device_mesh.get_group("pp"))
        return int(count.item())

    @torch.no_grad()
    def pipeline_forward(self, model: CausalLMWithLoss, batch: dict[str, Any]) -> tuple[Tensor, ...]:
        """What the model returns for the batch (``(loss_sum, useful_tokens)``; DPO's policy: per-sequence
        log-probs and response tokens), forward only, the same on every stage: what the pipelined model
        returns when called (evaluation: ``CausalLM.validation_step`` and ``test_step``, DPO's evaluation
        and its precomputed reference).

        The whole batch goes stage by stage, hidden states sent to the next stage's rank. By hand, not
        the schedule's ``eval``: that keeps the buffers sized by the first evaluation batch after a
        switch from training (a smaller last batch then fails: checked with torch 2.13), needs
        ``microbatches`` to divide every batch, and reruns its shape inference at each switch between
        training and evaluation (a forward, and a backward on the way back).
        """
        if torch.is_grad_enabled():
            raise RuntimeError("a pipelined model is called for evaluation only; training runs forward_backward")
        if model is not self._pipelined:
            raise RuntimeError("the pipeline was built for another model")
        batch = pipeline_batch(batch)
        labels, hidden = batch["labels"], batch["input_ids"]
        group, stages = self.device_mesh.get_group("pp"), self.pp * self.stages_per_rank
        shape = (*hidden.shape, model.lm.config.hidden_size)
        dtype = next(model.parameters()).dtype
        outputs = None
        for s in range(stages):
            here, before, after = s % self.pp, (s - 1) % self.pp, (s + 1) % self.pp
            if here != self.stage_index:
                continue
            if s > 0 and before != here:
                hidden = torch.empty(shape, dtype=dtype, device=labels.device)
                dist.recv(hidden, group=group, group_src=before)
            hidden = self._stage_modules[s](hidden, position_ids=batch.get("position_ids"),
                                            attention_mask=batch.get("attention_mask"))
            if s == stages - 1:
                outputs = self._last_module.head_loss(hidden, batch)
            elif after != here:
                dist.send(hidden.contiguous(), group=group, group_dst=after)
        outputs = self._from_last_stage(outputs)
        self._reshard()
        return outputs

    def _from_last_stage(self, tensors: tuple[Tensor, ...] | None) -> tuple[Tensor, ...]:
        """The last stage's ``tensors`` on every stage of the pipeline (their shapes only the last knows)."""
        carried = [None if tensors is None else [t.detach().cpu() for t in tensors]]
        dist.broadcast_object_list(carried, group=self.device_mesh.get_group("pp"), group_src=self.pp - 1)
        return tuple(t.to(self._mesh_device()) for t in carried[0])

    def _reshard(self) -> None:
        """Free FSDP's gathered parameters: a forward without backward leaves the layers kept gathered
        (``reshard_after_forward: false``) and the root, and a checkpoint saved now would hold them whole."""
        from torch.distributed.fsdp import FSDPModule

        for module in self._stage_modules.values():
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()

    def average_over_replicas(self, model: CausalLMWithLoss) -> None:
        """Average each stage's gradients over the pipeline replicas (one flat all-reduce per stage:
        gloo has no averaging reduction, so a sum divided by the replicas). Sharded stages are
        averaged already: FSDP reduce-scattered them at the schedule's last backward."""
        group, replicas = self.gradient_mean_group
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if group is None or self.shards_stages or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= replicas
        for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(chunk.view_as(grad))

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


def _holds(lm: nn.Module, name: str) -> bool:
    """Whether the stage holds submodule ``name`` of ``lm`` (``_keep_stage`` sets the ends it drops to
    None, or the final norm to an identity)."""
    module = lm
    for part in name.split("."):
        module = getattr(module, part, None)
    return isinstance(module, nn.Module) and not isinstance(module, nn.Identity)


def _numel(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0

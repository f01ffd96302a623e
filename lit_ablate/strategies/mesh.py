"""One named N-D device mesh, and the ordered pipeline that applies parallelism to a built model.

Every lit-ablate parallel strategy stands on one mesh with six named dimensions, outermost
(slowest links) first::

    pp            pipeline stages: ranks holding different consecutive decoder layers (only the
                  stages' point-to-point hand-offs cross it, so it is outermost, as in torchtitan)
    dp_replicate  groups holding full replicas of each shard (HSDP's replicate dimension)
    dp_shard      ranks sharding parameters, gradients and optimizer states (FSDP)
    ep            ranks holding different experts; they read different batches
    cp            ranks holding different slices of the same sequences
    tp            ranks holding different slices of each matrix (innermost: fastest links)

The sizes, one ``MeshSizes`` value, multiply to the world size; one of them may be ``-1`` (the
rest). Ranks that differ in ``dp_replicate``, ``dp_shard`` or ``ep`` read different batches (the
data-parallel group the sampler sees); ``pp``, ``cp`` and ``tp`` peers read the same batch.
Gradients of dense parameters are reduced over ``dp_replicate x dp_shard x ep x cp`` (within one
stage), so FSDP shards over ``dp_shard x ep x cp`` and replicates over ``dp_replicate``.

Parallelism is applied to a model that knows nothing of it, in one ordered list of steps
(``MeshStrategy.apply_steps``, torchtitan's order): TP -> EP -> CP -> activation checkpointing ->
compile -> the experts' FSDP -> FSDP (each decoder layer, then the root, or each stage's module under
a pipeline), each step run when its dimension is on. A pipeline (``PipelineParallelStrategy``) puts
its split in front: it keeps this rank's stages, then runs the same list on them. Each step is one
method; overriding one is the research-code extension point (``examples/custom_strategy.py``), and
every other step stays. The same holds around a step: what a dimension needs while a training,
validation, test or predict step runs (forward and backward) is one context (``step_context``),
and gradient clipping is one method that knows every dimension (``clip_gradients_by_norm``).
"""

from __future__ import annotations

import itertools
import math
import shutil
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import MESH_DIMS, STRATEGY_OPTIONS_KEY, MeshSizes
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss, decoder_layers
from lit_ablate.models.compiled_layers import compile_decoder_layers
from lit_ablate.simulated_rank import current_simulation
from lit_ablate.strategies.gradient_clipping import clip_grad_norm_across_meshes
from lit_ablate.strategies.interface import StrategyInterface
from lit_ablate.strategies.simulation import fill_shards

DATA_PARALLEL_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "ep")
"""Ranks that differ in these dimensions read different batches."""
FSDP_SHARD_DIMS: tuple[str, ...] = ("dp_shard", "ep", "cp")
"""Dense parameters are sharded (and their gradients reduce-scattered) over these, flattened."""
GRADIENT_MEAN_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "ep", "cp")
"""A parameter's gradient is the mean over these ranks: every dimension but its stage (``pp``) and
its tensor-parallel slice (``tp``), whose ranks hold other parameters or other slices of them."""

ActivationCheckpointing = Literal["none", "full", "selective"]
MESH_LAYOUT_KEY = "mesh_sizes"
"""Checkpoint entry: the mesh sizes that wrote it (a quantised base resumes only on the same mesh)."""


class MeshStrategy(ModelParallelStrategy, StrategyInterface):
    """Base of the mesh strategies: the named mesh, the data-parallel sampler, the ordered list of steps.

    Not selected on its own: it leaves ``apply_fsdp`` to a subclass (``FSDP2Strategy`` shards
    with ``fully_shard``). Pipeline, tensor, expert and context parallelism are steps a subclass
    fills in (``apply_pp``, ``apply_tp``, ``apply_ep`` with ``apply_expert_fsdp``, ``apply_cp``, and
    their step contexts); here a size above 1 for them is refused.

    The strategy parallelises every ``CausalLMWithLoss`` that the LightningModule builds in
    ``configure_model``. Initialisation: with more than one rank, only rank 0 builds real weights
    (in host memory, drawing exactly what one process draws from the seeded RNG); the other ranks
    build on the ``meta`` device. After the steps, every rank allocates only its shards and
    receives their values from rank 0 (one tensor at a time). So no accelerator ever holds more
    than its shard, and an N-rank run starts from bit-identical weights to a 1-process run, which
    the equivalence tests and the studies' ``expect_equal_loss`` rely on. (A seeded per-shard init
    on each rank would avoid rank 0's host copy, but would not reproduce the 1-process draws.)

    Args:
        pp: pipeline stages (a subclass must implement ``apply_pp``: ``PipelineParallelStrategy``).
        dp_replicate: replica groups (HSDP's replicate dimension).
        dp_shard: ranks sharding each replica's parameters, gradients and optimizer states.
        cp: context-parallel ranks (a subclass must implement ``apply_cp``).
        tp: tensor-parallel ranks (a subclass must implement ``apply_tp``).
        ep: expert-parallel ranks (a subclass must implement ``apply_ep``).
        activation_checkpointing: ``none``; ``full`` (every decoder layer recomputes its forward
            in backward); ``selective`` (layers 0, k, 2k, ... with k = ``checkpoint_every``).
        checkpoint_every: k for ``selective`` checkpointing.
        compile_layers: ``torch.compile`` each decoder layer (before sharding, as torchtitan does).
        compile_backend: the ``torch.compile`` backend of ``compile_layers`` (default ``inductor``,
            what a run is measured with). ``aot_eager`` traces the same graphs (dynamo and
            AOTAutograd, graph breaks included) but runs them with eager kernels and generates no
            code: it tells a bug of the tracing from one of inductor's kernels, and compiles in a
            fraction of the time (on a CPU, inductor's C++ build takes most of a cold compile).
        save_distributed_checkpoint: ``True`` writes a sharded DCP folder (each rank its shards);
            ``False`` gathers one full file on rank 0.
        process_group_backend: ``gloo``/``nccl``; by default the device's.
        timeout_s: collective timeout.
    """

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        pp: int = 1,
        activation_checkpointing: ActivationCheckpointing = "none",
        checkpoint_every: int = 2,
        compile_layers: bool = False,
        compile_backend: str | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        self.requested_mesh_sizes = MeshSizes(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, cp=cp, tp=tp)
        self._check_steps_implemented(self.requested_mesh_sizes)
        if activation_checkpointing not in ("none", "full", "selective"):
            raise ConfigError(
                f"{STRATEGY_OPTIONS_KEY}.activation_checkpointing",
                activation_checkpointing,
                "choose none, full or selective",
            )
        if checkpoint_every < 1:
            raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.checkpoint_every", checkpoint_every, "use 1 or more")
        self.activation_checkpointing = activation_checkpointing
        self.checkpoint_every = checkpoint_every
        self.compile_layers = compile_layers
        self.compile_backend = _compile_backend(compile_backend)
        self.mesh_sizes: MeshSizes | None = None
        """``requested_mesh_sizes`` resolved against the world size, once the mesh is built."""
        self._fsdp_mesh: DeviceMesh | None = None
        self._gradient_mean_mesh: DeviceMesh | None = None

    # ---------------------------------------------------------------- the mesh
    def build_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """Resolve the sizes against ``world_size`` and build the named mesh (all ranks call it)."""
        self.mesh_sizes = self.requested_mesh_sizes.resolved(world_size)
        self._check_steps_implemented(self.mesh_sizes)
        self._device_mesh = init_device_mesh(device_type, tuple(self.mesh_sizes.values()), mesh_dim_names=MESH_DIMS)
        self._fsdp_mesh = self.sharding_mesh(FSDP_SHARD_DIMS)
        if self.mesh_sizes.tp > 1 or self.mesh_sizes.pp > 1:  # all ranks create the flattened group together
            self._gradient_mean_mesh = self._device_mesh[GRADIENT_MEAN_DIMS]._flatten("dp_cp")
        return self._device_mesh

    def sharding_mesh(self, shard_dims: tuple[str, ...]) -> DeviceMesh:
        """The mesh ``fully_shard`` takes to shard over ``shard_dims`` and replicate over ``dp_replicate``.

        Size-1 dimensions are dropped and the rest flattened into one shard dimension; the result
        is 1-D (FSDP) or, with ``dp_replicate > 1``, 2-D ``(dp_replicate, shard)`` (HSDP).
        """
        mesh = self.device_mesh
        dims = tuple(d for d in shard_dims if self.mesh_sizes[d] > 1) or shard_dims[:1]
        replicate = self.mesh_sizes.dp_replicate > 1
        if len(dims) == 1:
            return mesh["dp_replicate", dims[0]] if replicate else mesh[dims[0]]
        shard = mesh[dims]._flatten("_".join(dims))
        # torch's bookkeeping for a flattened dim next to another dim (private in torch 2.x).
        return DeviceMesh._concatenate([mesh["dp_replicate"], shard]) if replicate else shard

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """1-D (shard) or 2-D (replicate, shard) mesh for ``fully_shard``: FSDP when 1-D, HSDP when 2-D."""
        if self._fsdp_mesh is None:
            raise RuntimeError("the mesh is built in setup_environment (or build_mesh); it does not exist yet")
        return self._fsdp_mesh

    @property
    def data_parallel_size(self) -> int:
        return math.prod(self.mesh_sizes[d] for d in DATA_PARALLEL_DIMS)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the ranks that read different batches."""
        coordinate = dict(zip(MESH_DIMS, self.device_mesh.get_coordinate()))
        rank = 0
        for dim in DATA_PARALLEL_DIMS:
            rank = rank * self.mesh_sizes[dim] + coordinate[dim]
        return rank

    @property
    def batch_replicas(self) -> int:
        """Ranks that process the very same tokens (tensor-parallel peers and the stages of one
        pipeline): throughput and MFU count their tokens once, so the model's FLOPs are counted once.
        Context-parallel ranks hold different slices, so they add up."""
        return self.mesh_sizes.tp * self.mesh_sizes.pp

    @property
    def gradient_mean_group(self) -> tuple[dist.ProcessGroup | None, int]:
        """The ranks whose gradients are averaged (``GRADIENT_MEAN_DIMS``: every one but tensor-parallel
        peers and other stages), and how many: ``StepObjective`` sums each step's useful tokens over
        them. Dense and expert gradients alike are divided by this size (``ExpertParallelStrategy``
        sets its experts' divide factor to it), including context-parallel ranks, whose shards of one
        sequence would otherwise be averaged instead of summed."""
        size = math.prod(self.mesh_sizes[d] for d in GRADIENT_MEAN_DIMS)  # also before a Trainer sets world_size
        if size == 1:
            return None, 1
        if self.mesh_sizes.tp == 1 and self.mesh_sizes.pp == 1:
            return dist.group.WORLD, size
        return self._gradient_mean_mesh.get_group(), size

    @property
    def has_compile_step(self) -> bool:
        """The pipeline compiles decoder layers itself (``compile_layers``), after activation checkpointing."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """What ``DistributedSampler`` needs: tensor- and context-parallel peers read the same batch."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def _check_steps_implemented(self, sizes: MeshSizes) -> None:
        for dim, step in (("pp", "apply_pp"), ("tp", "apply_tp"), ("ep", "apply_ep"), ("cp", "apply_cp")):
            if sizes[dim] > 1 and getattr(type(self), step) is getattr(MeshStrategy, step):
                other = (
                    "class_path lit_ablate.strategies.PipelineParallelStrategy (pipeline stages with every other "
                    "dimension)"
                    if dim == "pp"
                    else "a strategy that implements it"
                )
                raise ConfigError(
                    f"{STRATEGY_OPTIONS_KEY}.{dim}",
                    sizes[dim],
                    f"{type(self).__name__} does not implement {step}; use {dim}: 1, or {other}",
                )

    # ---------------------------------------------------------------- Lightning hooks
    def setup_environment(self) -> None:
        self._setup_distributed()  # Lightning's: seed reset, ranks, process group (gloo on CPU, nccl on GPU)
        self.build_mesh(self.root_device.type, self.world_size)
        self.lightning_module._device_mesh = self.device_mesh

    def model_sharded_context(self):
        """Where ``configure_model`` runs: on ranks other than 0 the model is built on ``meta``, and on a
        simulated rank (``lit_ablate.strategies.simulation``), which has no rank 0 to receive from."""
        if self.world_size > 1 and (self.global_rank != 0 or self.simulated):
            return torch.device("meta")
        return super().model_sharded_context()

    @property
    def simulated(self) -> bool:
        """Whether this process plays one rank of a larger job over a fake process group: it draws its own
        shards (``fill_shards``) and is its own source of every broadcast object."""
        return current_simulation() is not None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's object broadcast; a simulated rank's own object (a fake receive would read the length
        of an object no rank sent)."""
        return obj if self.simulated else super().broadcast(obj, src)

    def setup(self, trainer: Trainer) -> None:
        for model in self.parallel_targets():
            if not getattr(model, "parallelized_by", None):
                self.parallelize(model)
                if self.simulated:  # nothing came from rank 0: this rank draws its shards
                    fill_shards(model, self._mesh_device())
        super().setup(trainer)
        self.precision_plugin.clip_grad_by_norm = self.clip_gradients_by_norm  # gradient_clip_val by norm

    def parallel_targets(self) -> list[CausalLMWithLoss]:
        """The modules the steps apply to: every ``CausalLMWithLoss`` of the LightningModule."""
        targets = [m for m in self.lightning_module.modules() if isinstance(m, CausalLMWithLoss)]
        if not targets:
            raise ConfigError(
                "model",
                type(self.lightning_module).__name__,
                f"{type(self).__name__} parallelises the CausalLMWithLoss a LightningModule builds in configure_model; "
                "this module has none",
            )
        return targets

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's sharded (DCP) or full save, with the mesh sizes that wrote it (``MESH_LAYOUT_KEY``).

        A DCP folder names every tensor and records where each shard of it lies, so any other mesh, or one
        process, reads it back resharded (``whole_checkpoint``); the sizes are kept only for what cannot
        reshard (``checkpoint_layout``)."""
        checkpoint[MESH_LAYOUT_KEY] = dict(self.mesh_sizes)
        path = Path(self.broadcast(filepath))
        # The run's own earlier save under this name (last.ckpt at each save) is written anew, not over: DCP
        # would warn on every rank of "an existing checkpoint" and leave a former save's extra shards. Rank 0
        # decides for all: another rank could see the folder a faster rank already began to write.
        if self._save_distributed_checkpoint and self.broadcast(path.is_dir()):
            if self.global_rank == 0:
                shutil.rmtree(path)
            self.barrier("replace_checkpoint")
        super().save_checkpoint(checkpoint, path, storage_options)

    # ---------------------------------------------------------------- the steps
    def parallelize(self, model: CausalLMWithLoss) -> CausalLMWithLoss:
        """Apply the steps (``apply_steps``), then materialise the shards from rank 0's weights."""
        source = whole_tensors(model)
        self.apply_steps(model)
        self.materialize(model, source)
        model.parallelized_by = type(self).__name__
        return model

    def apply_steps(self, model: CausalLMWithLoss) -> None:
        """The one ordered list (torchtitan's): each mesh dimension's step runs when its size is above 1;
        activation checkpointing and compile read their options themselves, so that a subclass's own
        step runs whatever they say. The experts are sharded before the rest: FSDP's unit above them
        takes every parameter no inner unit holds."""
        sizes = self.mesh_sizes
        if sizes.tp > 1:
            self.apply_tp(model)
        if sizes.ep > 1:
            self.apply_ep(model)
        if sizes.cp > 1:
            self.apply_cp(model)
        self.apply_activation_checkpointing(model)
        self.apply_compile(model)
        if sizes.ep > 1:
            self.apply_expert_fsdp(model)
        if self.shards_parameters:
            self.apply_fsdp(model)

    @property
    def shards_parameters(self) -> bool:
        """Whether the FSDP step runs: always on a whole model (one rank too: one code path at any size)."""
        return True

    def apply_pp(self, model: CausalLMWithLoss) -> None:
        """Keep this rank's pipeline stages over ``device_mesh["pp"]`` (a subclass's step, in front of
        the list: ``PipelineParallelStrategy.parallelize``, whose stage schedule replaces the module's
        step; refused here when pp > 1)."""

    def apply_tp(self, model: CausalLMWithLoss) -> None:
        """Tensor parallelism over ``device_mesh["tp"]`` (a subclass's step; refused here when tp > 1)."""

    def apply_ep(self, model: CausalLMWithLoss) -> None:
        """Expert parallelism over ``device_mesh["ep"]`` (a subclass's step; refused here when ep > 1)."""

    def apply_expert_fsdp(self, model: CausalLMWithLoss) -> None:
        """FSDP of the experts ``apply_ep`` kept, over the data-parallel ranks that hold the same ones (a
        subclass's step, with ``apply_ep``)."""

    def apply_cp(self, model: CausalLMWithLoss) -> None:
        """Context parallelism over ``device_mesh["cp"]`` (a subclass's step; refused here when cp > 1)."""

    def apply_activation_checkpointing(self, model: CausalLMWithLoss) -> None:
        """Recompute checkpointed layers' activations in backward (torch's composable ``checkpoint``).

        The composable form adds hooks instead of wrapping the layer, so parameter names (and
        therefore checkpoints and the HF export) do not change.
        """
        if self.activation_checkpointing == "none":
            return
        from torch.distributed._composable import checkpoint

        every = 1 if self.activation_checkpointing == "full" else self.checkpoint_every
        for index, layer in enumerate(decoder_layers(model)):
            if index % every == 0:
                checkpoint(layer)

    def apply_compile(self, model: CausalLMWithLoss) -> None:
        """``torch.compile`` each decoder layer in place (the same graph for every layer compiles once)."""
        if self.compile_layers:
            compile_decoder_layers(decoder_layers(model), model.lm.base_model, self.compile_backend)

    def apply_fsdp(self, model: CausalLMWithLoss) -> None:
        """Shard each decoder layer, then the root, over ``fsdp_mesh`` (a subclass's step)."""
        raise NotImplementedError(f"{type(self).__name__} must implement apply_fsdp (FSDP2Strategy does)")

    def materialize(
        self,
        model: CausalLMWithLoss,
        source: Mapping[str, torch.Tensor],
        copies: Mapping[str, str] | None = None,
        every_tensor_held: bool = True,
    ) -> None:
        """Allocate meta shards on the device, then give every rank its piece of rank 0's tensors.

        ``source`` (``whole_tensors``, taken before the steps) holds rank 0's values and every other rank's
        shapes: each tensor is broadcast whole, and each rank keeps its own slice of it (``distribute_tensor``
        with no source rank: no more communication), buffers too (rotary frequencies, which state dicts leave
        out). ``copies`` names a second tensor that takes a tensor's values (a tied matrix's copy on another
        pipeline stage); with ``every_tensor_held`` a tensor no rank-local name takes is an error (a step
        renamed a module), where pipeline stages hold only theirs. (``set_model_state_dict`` did this before,
        planning a redistribution per tensor: a fifth of a rank's time in the mesh equivalence tests.)
        """
        device = self._mesh_device()
        if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            model.to_empty(device=device)
        if not (dist.is_initialized() and dist.get_world_size() > 1) or self.simulated:
            return
        local = dict(_named_tensors(model))
        copies = copies or {}
        for name, full in source.items():
            value = (
                torch.empty(full.shape, dtype=full.dtype, device=device) if full.is_meta else full.detach().to(device)
            )
            dist.broadcast(value, src=0)
            targets = [local[held] for held in (name, copies.get(name)) if held in local]
            if every_tensor_held and not targets:
                raise RuntimeError(f"{type(self).__name__}: no parameter or buffer {name!r} after the steps")
            for target in targets:
                with torch.no_grad():
                    if isinstance(target, DTensor):  # local to local: DTensor's copy_ would plan a sharding per tensor
                        piece = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                        target.to_local().copy_(piece.to_local())
                    else:
                        target.copy_(value)

    # ---------------------------------------------------------------- around a step
    def step_context(self) -> ExitStack:
        """Every active dimension's context, entered around each step Lightning runs (forward and
        backward: the entry points below): TP's vocabulary-parallel loss, CP's attention over slices."""
        stack = ExitStack()
        if self.mesh_sizes.tp > 1:
            stack.enter_context(self.vocabulary_parallel_loss())
        if self.mesh_sizes.cp > 1:
            stack.enter_context(self.context_parallel_attention())
        return stack

    def vocabulary_parallel_loss(self) -> AbstractContextManager:
        """TP's step context (a subclass's: ``TensorParallelSteps``; nothing here)."""
        return nullcontext()

    def context_parallel_attention(self) -> AbstractContextManager:
        """CP's step context (a subclass's: ``ContextParallelSteps``; nothing here)."""
        return nullcontext()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context():
            return super().training_step(*args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        # loss_parallel's backward runs inside it too; activation checkpointing recomputes layers here,
        # and they must attend as in the forward.
        with self.step_context():
            return super().backward(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context():
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context():
            return super().predict_step(*args, **kwargs)

    def clip_gradients_by_norm(self, optimizer: Optimizer, clip_val: float) -> torch.Tensor:
        """``gradient_clip_val`` by the norm of the whole model's gradient (``clip_grad_norm_across_meshes``):
        over every mesh its DTensors are sharded on (tensor-parallel slices, FSDP shards, experts) and,
        with ``pp > 1``, over the pipeline stages, a matrix two stages hold counted once
        (``repeated_parameters``). Lightning's precision plugin calls it (``setup``): torch's
        ``clip_grad_norm_`` cannot combine DTensors on different meshes and would clip each stage by its
        own norm. Returns the pre-clip norm."""
        params = (p for group in optimizer.param_groups for p in group["params"])
        stages = self.device_mesh.get_group("pp") if self.mesh_sizes.pp > 1 else None
        return clip_grad_norm_across_meshes(params, clip_val, stages, self.repeated_parameters())

    def repeated_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters of this rank whose matrix another pipeline stage holds too and counts in the
        gradient norm (a pipeline's tied embeddings: ``PipelineParallelStrategy``); none here."""
        return []

    def _mesh_device(self) -> torch.device:
        if self.device_mesh.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(
            self.device_mesh.device_type, torch.get_device_module(self.device_mesh.device_type).current_device()
        )


def whole_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, before a strategy's steps replace them: rank 0's values (it built
    the whole model), every other rank's shapes on ``meta`` (what ``materialize`` broadcasts into)."""
    return {
        name: torch.empty(t.shape, dtype=t.dtype, device="meta") if t.is_meta else t
        for name, t in _named_tensors(model)
    }


def _named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and buffers under every name they have: a tied matrix under each of its names, so that
    a tie a step broke still gets both copies' values."""
    return itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _compile_backend(backend: str | None) -> str:
    """``backend`` (``inductor`` when not given), refused when torch has no backend of that name."""
    if backend is None:
        return "inductor"
    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise ConfigError(
            f"{STRATEGY_OPTIONS_KEY}.compile_backend",
            backend,
            "use inductor (what runs are measured with), aot_eager (the same tracing, eager kernels) or "
            "eager; torch._dynamo.list_backends(exclude_tags=()) lists every backend",
        )
    return backend
